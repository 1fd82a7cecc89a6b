"""Pods of rendered manifests run as local processes: the kubelet's part, without a cluster.

For a pod of a rendered StatefulSet or Job, :func:`resolve_container` computes what the
kubelet would run: the image's ENTRYPOINT/CMD (read from the Dockerfile) or the container's
command/args with ``$(VAR)`` expanded, and the environment from the image ENV, ``envFrom``
and ``env`` (ConfigMap and Secret references resolved from the rendered objects and the
Secrets a test provides, ``fieldRef`` from the pod), with ``HOSTNAME`` = the pod name as
the container runtime sets it. :class:`LocalPod` then runs it:

* ``cgroupd`` (the entrypoint) becomes ``python -m cgroupd``; a ``sh -c`` script finds a
  ``cgroupd`` shim on PATH that does the same.
* Pods share this machine's network, so each container port gets a free local port; the
  env var that sets it (``CGROUPD_METRICS_PORT``) must equal the declared containerPort
  and is rewritten, and probes go to the local port.
* Volumes become directories (Secret/ConfigMap keys written as files, emptyDirs empty);
  env values and arguments naming a mount path are rewritten to the directory.
* Init containers run to completion in order first; native sidecars (init containers with
  ``restartPolicy: Always``) and containers of other images are "stand-ins": the test
  provides them (e.g. one local webhook server for every pod's handler sidecar).
* :meth:`LocalPod.delete` is the kubelet's graceful deletion: preStop, SIGTERM, then
  SIGKILL after ``terminationGracePeriodSeconds``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.k8s_tools import ROOT, Stage
from tests.support.natsserver import find_free_port

#: Env vars that set the port a container listens on, by port name.
PORT_ENV = {"metrics": "CGROUPD_METRICS_PORT"}
#: Set next to a remapped port: listen on loopback only.
HOST_ENV = {"CGROUPD_METRICS_PORT": "CGROUPD_METRICS_HOST"}


@dataclass(frozen=True)
class Image:
    """What the kubelet takes from the image: the runtime stage of the Dockerfile."""

    reference: str  # the image the manifests name for cgroupd, e.g. cgroupd:0.1.0
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str

    @classmethod
    def from_stage(cls, reference: str, stage: Stage) -> Image:
        env = {k: v for k, v in stage.env().items() if k != "PATH"}  # PATH is the image's
        return cls(reference, stage.json_form("ENTRYPOINT") or [], stage.json_form("CMD") or [],
                   env, stage.last("WORKDIR") or "/")


@dataclass
class Objects:
    """What a pod can refer to: the rendered objects, plus Secrets the test provides (the
    manifests only reference Secrets)."""

    rendered: list[dict[str, Any]]
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)

    def configmap(self, name: str) -> dict[str, str] | None:
        for obj in self.rendered:
            if obj.get("kind") == "ConfigMap" and obj["metadata"]["name"] == name:
                return {k: str(v) for k, v in (obj.get("data") or {}).items()}
        return None

    def secret(self, name: str) -> dict[str, str] | None:
        if name in self.secrets:
            return dict(self.secrets[name])
        for obj in self.rendered:
            if obj.get("kind") == "Secret" and obj["metadata"]["name"] == name:
                data = {k: base64.b64decode(v).decode() for k, v in
                        (obj.get("data") or {}).items()}
                data.update(obj.get("stringData") or {})
                return data
        return None


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined vars replaced, ``$$`` → ``$``, the rest
    left as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


@dataclass
class Resolved:
    """One container, as the kubelet would start it (before local translation)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    workdir: str
    mounts: dict[str, str]  # mountPath → volume name
    ports: dict[str, int]  # port name → containerPort
    spec: dict[str, Any]


def _ref(objects: Objects, kind: str, name: str, optional: bool) -> dict[str, str] | None:
    data = objects.configmap(name) if kind == "configMap" else objects.secret(name)
    if data is None and not optional:
        raise AssertionError(f"{kind} {name!r} is referenced but does not exist")
    return data


def resolve_container(pod_name: str, container: dict[str, Any], objects: Objects,
                      image: Image, namespace: str = "default") -> Resolved:
    """argv and environment of ``container`` in pod ``pod_name``, references resolved."""
    if container.get("image") != image.reference:
        raise AssertionError(f"container {container['name']} runs {container.get('image')}, "
                             f"not the cgroupd image {image.reference}")
    env: dict[str, str] = dict(image.env)
    env["HOSTNAME"] = pod_name
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind in ("configMap", "secret"):
            ref = source.get(f"{kind}Ref")
            if ref is not None:
                data = _ref(objects, kind, ref["name"], bool(ref.get("optional")))
                env.update({prefix + k: v for k, v in (data or {}).items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        source = item["valueFrom"]
        if "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configMap" if "configMapKeyRef" in source else "secret"
            ref = source[f"{kind}KeyRef"]
            data = _ref(objects, kind, ref["name"], bool(ref.get("optional")))
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise AssertionError(f"{kind} {ref['name']!r} has no key {ref['key']!r}")
            env[name] = data[ref["key"]]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {"metadata.name": pod_name, "metadata.namespace": namespace,
                      "spec.nodeName": "local-node", "status.podIP": "127.0.0.1"}
            assert path in fields, f"fieldRef {path} is not supported here"
            env[name] = fields[path]
        else:
            raise AssertionError(f"env {name}: unsupported valueFrom {source}")
    if "command" in container:
        argv = list(container["command"]) + list(container.get("args") or [])
    else:
        argv = image.entrypoint + list(container.get("args", image.cmd))
    argv = [expand(str(a), env) for a in argv]
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []}
    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or []
             if "name" in p}
    return Resolved(container["name"], argv, env, container.get("workingDir") or image.workdir,
                    mounts, ports, container)


# -- running ---------------------------------------------------------------------------
def _shim_dir(base: Path) -> Path:
    """A PATH directory whose ``cgroupd`` runs ``python -m cgroupd`` (for ``sh -c``)."""
    shim = base / "bin"
    shim.mkdir(parents=True, exist_ok=True)
    script = shim / "cgroupd"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m cgroupd \"$@\"\n")
    script.chmod(0o755)
    return shim


def host_env() -> dict[str, str]:
    """This machine's environment without stray cgroupd settings, cgroupd importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CGROUPD_") and k not in ("NATS_URL", "HOSTNAME")}
    env["PYTHONPATH"] = str(ROOT)
    return env


class LocalContainer:
    """One container's process, with its log and its local ports."""

    def __init__(self, pod: LocalPod, resolved: Resolved) -> None:
        self.pod = pod
        self.resolved = resolved
        self.name = resolved.name
        self.local_ports: dict[str, int] = {}
        env = dict(resolved.env)
        for port_name, container_port in resolved.ports.items():
            var = PORT_ENV.get(port_name)
            if var is None:
                continue
            assert env.get(var) == str(container_port), (
                f"{pod.name}/{self.name}: port {port_name} is {container_port} but "
                f"{var}={env.get(var)!r}: the process would listen elsewhere")
            self.local_ports[port_name] = find_free_port()
            env[var] = str(self.local_ports[port_name])
            env[HOST_ENV[var]] = "127.0.0.1"
        argv = list(resolved.argv)
        for mount_path, volume in sorted(resolved.mounts.items(), key=lambda m: -len(m[0])):
            local = str(pod.volume_dir(volume))
            env = {k: v.replace(mount_path, local) if v.startswith(mount_path) else v
                   for k, v in env.items()}
            argv = [a.replace(mount_path, local) if a.startswith(mount_path) else a
                    for a in argv]
        proc_env = host_env()
        proc_env.update(env)
        if argv[0] == "cgroupd":
            argv = [sys.executable, "-m", "cgroupd", *argv[1:]]
        elif argv[0] in ("sh", "/bin/sh"):
            argv = ["/bin/sh", *argv[1:]]
            proc_env["PATH"] = f"{_shim_dir(pod.workdir)}{os.pathsep}{proc_env.get('PATH', '')}"
        else:
            raise AssertionError(f"{pod.name}/{self.name}: cannot run {argv[0]!r} locally")
        self.argv = argv
        self.env = env
        self.log_path = pod.workdir / f"{self.name}.log"
        self._log = open(self.log_path, "ab")  # closed in close()
        # The image's WORKDIR (/app) is where handler modules live; here: the repository.
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=proc_env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    async def wait(self, timeout: float) -> int | None:
        """Exit code, or None if still running at the deadline."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log.close()


@dataclass
class Deletion:
    """How a graceful deletion went, per container."""

    exit_codes: dict[str, int]
    killed: list[str]  # containers still running at the grace deadline (SIGKILLed)
    seconds: float


StandIn = Callable[["LocalPod", dict[str, Any]], None]


class LocalPod:
    """A pod of a rendered pod template, run as local processes."""

    def __init__(self, name: str, template: dict[str, Any], objects: Objects, image: Image,
                 workdir: Path, stand_ins: Mapping[str, StandIn] | None = None) -> None:
        self.name = name
        self.spec: dict[str, Any] = template["spec"]
        self.labels: dict[str, str] = (template.get("metadata") or {}).get("labels") or {}
        self.objects = objects
        self.image = image
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stand_ins = dict(stand_ins or {})
        self.init_done: list[LocalContainer] = []
        self.containers: dict[str, LocalContainer] = {}
        self._volumes = {v["name"]: v for v in self.spec.get("volumes") or []}

    # -- volumes ------------------------------------------------------------------
    def volume_dir(self, volume: str) -> Path:
        spec = self._volumes.get(volume)
        assert spec is not None, f"{self.name}: volume {volume!r} is mounted but not declared"
        path = self.workdir / "volumes" / volume
        if path.exists():
            return path
        path.mkdir(parents=True)
        for kind, key in (("secret", "secretName"), ("configMap", "name")):
            if kind in spec:
                src = spec[kind]
                data = _ref(self.objects, kind, src[key], bool(src.get("optional")))
                items = src.get("items") or [{"key": k, "path": k} for k in (data or {})]
                for item in items:
                    (path / item["path"]).write_text((data or {})[item["key"]])
        return path

    # -- lifecycle ----------------------------------------------------------------
    def _stand_in(self, container: dict[str, Any]) -> bool:
        if container.get("image") == self.image.reference:
            return False
        stand_in = self.stand_ins.get(container["name"])
        assert stand_in is not None, (f"{self.name}: container {container['name']} runs "
                                      f"{container.get('image')}; the test has no stand-in")
        stand_in(self, container)
        return True

    def resolve(self, container: dict[str, Any]) -> Resolved:
        return resolve_container(self.name, container, self.objects, self.image)

    def _start(self, container: dict[str, Any]) -> LocalContainer:
        return LocalContainer(self, self.resolve(container))

    async def start(self, init_timeout: float = 60.0) -> None:
        """Init containers in order (each to exit 0), then the containers."""
        for container in self.spec.get("initContainers") or []:
            if container.get("restartPolicy") == "Always":  # native sidecar
                if not self._stand_in(container):
                    self.containers[container["name"]] = self._start(container)
                continue
            if self._stand_in(container):
                continue
            run = self._start(container)
            self.init_done.append(run)
            code = await run.wait(init_timeout)
            if code != 0:
                raise AssertionError(f"{self.name}: init container {run.name} "
                                     f"{'did not finish' if code is None else f'exited {code}'}"
                                     f":\n{run.log_text()[-3000:]}")
        for container in self.spec["containers"]:
            if not self._stand_in(container):
                self.containers[container["name"]] = self._start(container)

    async def run_to_completion(self, timeout: float = 60.0) -> dict[str, int]:
        """A Job's pod: start it and wait for every container to exit."""
        await self.start()
        codes = {}
        for name, run in self.containers.items():
            code = await run.wait(timeout)
            if code is None:
                raise AssertionError(f"{self.name}/{name} still runs after {timeout}s:\n"
                                     f"{run.log_text()[-3000:]}")
            codes[name] = code
        return codes

    def exec(self, container: str, argv: Sequence[str], timeout: float = 60.0
             ) -> subprocess.CompletedProcess[str]:
        """``kubectl exec``: a command in the container's environment."""
        run = self.containers[container]
        cmd = list(argv)
        if cmd[0] == "cgroupd":
            cmd = [sys.executable, "-m", "cgroupd", *cmd[1:]]
        env = host_env()
        env.update(run.env)
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    # -- probes ---------------------------------------------------------------------
    def _probe_port(self, run: LocalContainer, port: int | str) -> int:
        if isinstance(port, str):
            assert port in run.local_ports, f"{self.name}/{run.name}: no port named {port}"
            return run.local_ports[port]
        name = next((n for n, p in run.resolved.ports.items() if p == port), None)
        assert name is not None and name in run.local_ports, f"port {port} is not declared"
        return run.local_ports[name]

    async def http_get(self, container: str, port: int | str, path: str,
                       session: aiohttp.ClientSession) -> tuple[int, str]:
        run = self.containers[container]
        url = f"http://127.0.0.1:{self._probe_port(run, port)}{path}"
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, repr(exc)

    async def probe(self, container: str, kind: str, session: aiohttp.ClientSession) -> bool:
        """Run the container's ``startupProbe``/``livenessProbe``/``readinessProbe`` once."""
        spec = self.containers[container].resolved.spec.get(kind)
        assert spec is not None, f"{self.name}/{container} has no {kind}"
        if "httpGet" in spec:
            status, _ = await self.http_get(container, spec["httpGet"]["port"],
                                            spec["httpGet"].get("path", "/"), session)
            return 200 <= status < 400
        if "tcpSocket" in spec:
            port = self._probe_port(self.containers[container], spec["tcpSocket"]["port"])
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True
        raise AssertionError(f"{kind} of {container}: unsupported {spec}")

    # -- deletion -----------------------------------------------------------------------
    async def delete(self) -> Deletion:
        """Graceful deletion as the kubelet does it: preStop hooks, SIGTERM to every
        container, SIGKILL to what still runs after terminationGracePeriodSeconds."""
        grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        start = time.monotonic()
        for run in self.containers.values():
            hook = ((run.resolved.spec.get("lifecycle") or {}).get("preStop") or {})
            assert not hook or set(hook) == {"sleep"}, f"unsupported preStop {hook}"
            # A sleep hook only delays this container's SIGTERM; cgroupd has none.
        for run in self.containers.values():
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
        codes: dict[str, int] = {}
        killed: list[str] = []
        for name, run in self.containers.items():
            left = max(0.0, grace - (time.monotonic() - start))
            code = await run.wait(left)
            if code is None:
                killed.append(name)
                run.proc.kill()
                code = await run.wait(10)
            codes[name] = code if code is not None else -9
        return Deletion(codes, killed, time.monotonic() - start)

    def log(self, container: str = "cgroupd") -> str:
        run = self.containers.get(container)
        return run.log_text() if run is not None else ""

    def close(self) -> None:
        """Never leave a process behind."""
        for run in [*self.init_done, *self.containers.values()]:
            run.close()


def pod_names(statefulset: dict[str, Any]) -> list[str]:
    name = statefulset["metadata"]["name"]
    return [f"{name}-{i}" for i in range(int(statefulset["spec"]["replicas"]))]
