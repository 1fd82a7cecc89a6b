{{/* Names ---------------------------------------------------------------------------- */}}
{{- define "cgroupd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Pod names are <fullname>-<ordinal>: keep room for the ordinal within a DNS label. */}}
{{- define "cgroupd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cgroupd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cgroupd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector of the member pods (the StatefulSet, its Services, the PDB). */}}
{{- define "cgroupd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cgroupd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: member
{{- end -}}

{{- define "cgroupd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Sizes ---------------------------------------------------------------------------- */}}
{{- define "cgroupd.replicas" -}}
{{- mul (int .Values.members) (add 1 (int .Values.standbysPerMember)) -}}
{{- end -}}

{{/* The member names the group is created with: the names pods derive from ordinals. */}}
{{- define "cgroupd.memberNames" -}}
{{- $out := list -}}
{{- range $i := until (int .Values.members) -}}
{{- $out = append $out (printf "%s%d" $.Values.memberPrefix $i) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* Seconds the sidecar keeps serving while cgroupd drains (non-native sidecar only). */}}
{{- define "cgroupd.sidecarPreStop" -}}
{{- add (int (ceil .Values.consume.drainTimeout)) 2 -}}
{{- end -}}

{{- define "cgroupd.terminationGrace" -}}
{{- $drain := int (ceil .Values.consume.drainTimeout) -}}
{{- $grace := .Values.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $grace -}}
{{- $grace = add $drain 20 -}}
{{- end -}}
{{- $floor := $drain -}}
{{- if and (eq (include "cgroupd.sidecar" .) "true") (not .Values.handler.webhook.sidecar.native) -}}
{{- $floor = int (include "cgroupd.sidecarPreStop" .) -}}
{{- end -}}
{{- if le (int $grace) $floor -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed the drain timeout and any preStop pause (%d s)" (int $grace) $floor) -}}
{{- end -}}
{{- int $grace -}}
{{- end -}}

{{/* Handler ---------------------------------------------------------------------------- */}}
{{- define "cgroupd.sidecar" -}}
{{- and (eq .Values.handler.type "webhook") (not .Values.handler.webhook.url) -}}
{{- end -}}

{{- define "cgroupd.webhookURL" -}}
{{- if .Values.handler.webhook.url -}}
{{- .Values.handler.webhook.url -}}
{{- else -}}
{{- $path := .Values.handler.webhook.sidecar.path | default "/" -}}
{{- printf "http://127.0.0.1:%d%s" (int .Values.handler.webhook.sidecar.port) (ternary $path (printf "/%s" $path) (hasPrefix "/" $path)) -}}
{{- end -}}
{{- end -}}

{{/* Checks that need more than one value (values.schema.json checks the rest). */}}
{{- define "cgroupd.validate" -}}
{{- if gt (int .Values.members) (int .Values.group.partitions) -}}
{{- fail (printf "members (%d) exceeds group.partitions (%d): the extra members would never consume" (int .Values.members) (int .Values.group.partitions)) -}}
{{- end -}}
{{- if and (eq .Values.handler.type "module") (not .Values.handler.module) -}}
{{- fail "handler.type module needs handler.module (pkg.module:function)" -}}
{{- end -}}
{{- if and (eq .Values.handler.type "webhook") (lt (float64 .Values.consume.drainTimeout) (float64 .Values.handler.webhook.timeout)) -}}
{{- fail (printf "consume.drainTimeout (%v) must be at least handler.webhook.timeout (%v): a webhook still running when a stopping instance gives up waiting may go on while the next owner runs the same key" .Values.consume.drainTimeout .Values.handler.webhook.timeout) -}}
{{- end -}}
{{- if and .Values.nats.tls.enabled (not .Values.nats.tls.secretName) -}}
{{- fail "nats.tls.enabled needs nats.tls.secretName" -}}
{{- end -}}
{{- if ne (empty .Values.nats.tls.certKey) (empty .Values.nats.tls.keyKey) -}}
{{- fail "give both nats.tls.certKey and nats.tls.keyKey, or neither" -}}
{{- end -}}
{{- if not .Values.group.static -}}
{{- if not .Values.group.filters -}}
{{- fail "an elastic group needs at least one group.filters entry" -}}
{{- end -}}
{{- else -}}
{{- range .Values.group.filters -}}
{{- if .wildcards -}}
{{- fail "group.filters[].wildcards apply to elastic groups only (group.static is true)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* NATS connection: credentials and TLS -------------------------------------------------
Each helper takes a dict: "root" (the chart's context) and "c" (a credentials block:
nats.credentials for the member pods, group.create.credentials for the admin Job). A pod
mounts only its own Secret: the admin's never reaches a member pod. */}}
{{- define "cgroupd.natsEnv" -}}
{{- $c := .c -}}
{{- if $c.secretName }}
{{- if eq $c.type "creds" }}
- name: CGROUPD_CREDS
  value: /etc/cgroupd/nats/{{ $c.credsKey }}
{{- else if eq $c.type "nkey" }}
- name: CGROUPD_NKEY
  value: /etc/cgroupd/nats/{{ $c.nkeyKey }}
{{- else if eq $c.type "token" }}
- name: CGROUPD_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ $c.secretName | quote }}, key: {{ $c.tokenKey | quote }}}
{{- else if eq $c.type "userPassword" }}
- name: CGROUPD_USER
  valueFrom:
    secretKeyRef: {name: {{ $c.secretName | quote }}, key: {{ $c.userKey | quote }}}
- name: CGROUPD_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $c.secretName | quote }}, key: {{ $c.passwordKey | quote }}}
{{- end }}
{{- end }}
{{- $t := .root.Values.nats.tls -}}
{{- if $t.enabled }}
{{- if $t.caKey }}
- name: CGROUPD_TLS_CA
  value: /etc/cgroupd/tls/{{ $t.caKey }}
{{- end }}
{{- if $t.certKey }}
- name: CGROUPD_TLS_CERT
  value: /etc/cgroupd/tls/{{ $t.certKey }}
- name: CGROUPD_TLS_KEY
  value: /etc/cgroupd/tls/{{ $t.keyKey }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "cgroupd.natsFileCredentials" -}}
{{- $c := .c -}}
{{- and $c.secretName (has $c.type (list "creds" "nkey")) -}}
{{- end -}}

{{- define "cgroupd.natsVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if eq (include "cgroupd.natsFileCredentials" .) "true" }}
- name: nats-credentials
  mountPath: /etc/cgroupd/nats
  readOnly: true
{{- end }}
{{- if .root.Values.nats.tls.enabled }}
- name: nats-tls
  mountPath: /etc/cgroupd/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "cgroupd.natsVolumes" -}}
- name: tmp
  emptyDir: {sizeLimit: 16Mi}
{{- if eq (include "cgroupd.natsFileCredentials" .) "true" }}
- name: nats-credentials
  secret:
    secretName: {{ .c.secretName | quote }}
    defaultMode: 0440
{{- end }}
{{- if .root.Values.nats.tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ .root.Values.nats.tls.secretName | quote }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Arguments of `cgroupd group create` (stream and group come from the ConfigMap). */}}
{{- define "cgroupd.groupCreateArgs" -}}
- group
- create
- $(CGROUPD_STREAM)
- $(CGROUPD_GROUP)
- --partitions
- {{ int .Values.group.partitions | quote }}
{{- range .Values.group.filters }}
- --filter
- {{ .subject | quote }}
{{- if .wildcards }}
- --wildcards
- {{ join "," .wildcards | quote }}
{{- end }}
{{- end }}
{{- range splitList "," (include "cgroupd.memberNames" .) }}
- --member
- {{ . | quote }}
{{- end }}
{{- if .Values.group.static }}
- --static
{{- else }}
{{- if .Values.group.maxBufferedMsgs }}
- --max-buffered-msgs
- {{ int64 .Values.group.maxBufferedMsgs | quote }}
{{- end }}
{{- if .Values.group.maxBufferedBytes }}
- --max-buffered-bytes
- {{ int64 .Values.group.maxBufferedBytes | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The webhook handler container (native sidecar or plain second container). */}}
{{- define "cgroupd.handlerContainer" -}}
{{- $sc := .Values.handler.webhook.sidecar -}}
- name: handler
  image: {{ printf "%s:%s" $sc.image.repository $sc.image.tag }}
  imagePullPolicy: {{ $sc.image.pullPolicy }}
  {{- with $sc.command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $sc.args }}
  args:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $sc.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - name: handler
      containerPort: {{ int $sc.port }}
      protocol: TCP
  {{- if $sc.probePath }}
  startupProbe:
    httpGet: {path: {{ $sc.probePath | quote }}, port: handler}
    periodSeconds: 1
    failureThreshold: 120
  readinessProbe:
    httpGet: {path: {{ $sc.probePath | quote }}, port: handler}
    periodSeconds: 5
  {{- else }}
  startupProbe:
    tcpSocket: {port: handler}
    periodSeconds: 1
    failureThreshold: 120
  readinessProbe:
    tcpSocket: {port: handler}
    periodSeconds: 5
  {{- end }}
  resources:
    {{- toYaml $sc.resources | nindent 4 }}
  securityContext:
    {{- toYaml $sc.securityContext | nindent 4 }}
{{- end -}}
