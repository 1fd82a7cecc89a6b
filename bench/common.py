"""What every benchmark needs: a nats-server, keyed traffic, member processes, timing,
what the recording handlers wrote, and CPU and memory read from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from bench import revision
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, GroupConfig, PartitioningFilter
from cgroupd.core.partitions import moved_partitions, owners
from cgroupd.nats.jetstream import JetStream
from tests.support.natsserver import NatsServer, client_options, find_free_port
from tests.support.polling import eventually, within

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    version = subprocess.run([_server_binary(), "--version"], capture_output=True,
                             text=True, check=False).stdout.strip()
    return {"cores": os.cpu_count(), "python": platform.python_version(),
            "nats_server": version, "load_average_1_5_15_min": load_average()}


def _server_binary() -> str:
    from tests.support.natsserver import find_nats_server_binary
    return find_nats_server_binary()


@contextlib.contextmanager
def server() -> Iterator[NatsServer]:
    """A fresh single-node JetStream server in a temp dir, stopped afterwards."""
    with tempfile.TemporaryDirectory(prefix="cgroupd-bench-") as tmp:
        srv = NatsServer(workdir=Path(tmp))
        srv.start()
        try:
            srv.wait_ready()
            yield srv
        finally:
            srv.close()


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[JetStream]:
    nc = await nats.connect(servers=[url], **client_options())
    try:
        yield JetStream(nc, timeout=10)
    finally:
        await nc.close()


async def origin_stream(js: JetStream, name: str = "BENCH") -> None:
    await js.add_stream(api.StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))


async def keyed_group(js: JetStream, name: str, partitions: int,
                      members: tuple[str, ...] = ()) -> None:
    """An elastic group on the origin stream ``BENCH``, keyed on ``bench.<key>``."""
    await admin.create_elastic_group(js, "BENCH", name, ElasticGroupConfig(
        max_members=partitions, members=members,
        partitioning_filters=(PartitioningFilter("bench.*", (1,)),)))


async def publish(js: JetStream, count: int, keys: int = 64, stream: str = "BENCH",
                  start: int = 0) -> None:
    """Publish ``count`` messages over ``keys`` keys as fast as acks allow (windowed)."""
    window = 500
    pending: list[asyncio.Future[Any]] = []
    for i in range(start, start + count):
        pending.append(asyncio.ensure_future(js.js.publish(
            f"{stream.lower()}.k{i % keys}", json.dumps({"n": i}).encode())))
        if len(pending) >= window:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)


async def stream_messages(js: JetStream, name: str) -> int:
    info = await js.stream_info(name)
    return int(info.state.messages) if info else -1


#: Poll until truthy, with a deadline (the tests' helper; it raises AssertionError).
wait_for = eventually


class Members:
    """``cgroupd join`` processes, one per (member, instance); all stopped on exit.

    By default each process serves /metrics and /readyz on a port of its own and logs only
    warnings, to nowhere. With ``logs`` a directory, each process logs at the default
    level (info) to a file of its own there, so its state changes ("joined", "became
    active", "stepped down") can be read without a metrics server; ``metrics=False`` runs
    the processes as a user would with defaults (no HTTP server). With ``records`` a
    directory, each process gets a record file of its own there (``BENCH_RECORD``).
    With ``code`` a directory holding a ``cgroupd/`` package (another revision, or the
    current tree), the processes import ``cgroupd`` from there (:mod:`bench.revision`)
    and :meth:`imported` says which file they imported; it needs ``logs`` or ``records``
    (where each process writes that).
    """

    def __init__(self, url: str, stream: str, group: str, handler: str = "bench.handlers:ack",
                 extra: tuple[str, ...] = (), record: Path | None = None, *,
                 records: Path | None = None, logs: Path | None = None,
                 metrics: bool = True, env: dict[str, str] | None = None,
                 code: Path | None = None) -> None:
        self.url, self.stream, self.group = url, stream, group
        self.handler, self.extra, self.record = handler, extra, record
        self.records, self.logs, self.metrics, self.env = records, logs, metrics, env or {}
        if code is not None and logs is None and records is None:
            raise ValueError("Members(code=...) needs logs or records: where each process "
                             "says which cgroupd it imported")
        self.code = code
        self.markers: dict[int, Path] = {}
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.ports: dict[int, int] = {}
        self.log_paths: dict[int, Path] = {}
        self.record_paths: dict[int, Path] = {}
        self._files: list[Any] = []

    def start(self, member: str, *extra: str, netns: str | None = None,
              launcher: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        """Start one instance of ``member`` (inside network namespace ``netns`` if given;
        ``ip netns exec`` execs in place, so the pid is the member process itself).
        ``launcher``: what runs the cgroupd command line (e.g. ``bench.cprofiled``;
        by default ``-m cgroupd``, or :mod:`bench.revision` with ``code``)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self.env)
        env.pop("CGROUPD_LOG_LEVEL", None)
        if self.logs is None:
            env["CGROUPD_LOG_LEVEL"] = "warning"
        label = f"{member}-{len(self.procs)}"
        marker = None
        if self.code is not None:
            if launcher is not None:
                raise ValueError("Members(code=...) runs its own launcher (bench.revision)")
            launcher = revision.launcher(self.code)
            where = self.logs if self.logs is not None else self.records
            assert where is not None
            where.mkdir(parents=True, exist_ok=True)
            marker = where / f"{label}.cgroupd"
            env[revision.MARKER_ENV] = str(marker)
        if launcher is None:
            launcher = ("-m", "cgroupd")
        if self.record is not None:
            env["BENCH_RECORD"] = str(self.record)
        if self.records is not None:
            self.records.mkdir(parents=True, exist_ok=True)
            env["BENCH_RECORD"] = str(self.records / f"{label}.jsonl")
            (self.records / f"{label}.jsonl").touch()
        cmd = [sys.executable, *launcher, "--server", self.url, "join", "--stream",
               self.stream, "--group", self.group, "--member", member, "--handler",
               self.handler, *self.extra, *extra]
        port = 0
        if self.metrics:
            port = find_free_port()
            cmd += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        out: Any = subprocess.DEVNULL
        log = None
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            log = self.logs / f"{label}.log"
            out = open(log, "wb")  # noqa: SIM115 - closed in close()
            self._files.append(out)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out)
        self.procs.append((member, proc))
        self.ports[proc.pid] = port
        if log is not None:
            self.log_paths[proc.pid] = log
        if self.records is not None:
            self.record_paths[proc.pid] = self.records / f"{label}.jsonl"
        if marker is not None:
            self.markers[proc.pid] = marker
        return proc

    def imported(self) -> list[str]:
        """The ``cgroupd/__init__.py`` files the processes started with ``code`` imported
        (each distinct one once; a process that has not got that far yet adds none)."""
        found = set()
        for marker in self.markers.values():
            with contextlib.suppress(FileNotFoundError):
                text = marker.read_text().strip()
                if text:
                    found.add(text)
        return sorted(found)

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [proc for _, proc in self.procs if proc.poll() is None]

    def member_of(self, pid: int) -> str:
        return next(member for member, proc in self.procs if proc.pid == pid)

    def probe(self, proc: subprocess.Popen[bytes], path: str = "/readyz") -> bool:
        """True when the process answers 200 on its health port."""
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.ports[proc.pid]}{path}", timeout=0.5) as resp:
                return bool(resp.status == 200)
        except (OSError, ValueError):
            return False

    def events(self, proc: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
        """The JSON log lines of a process started with ``logs`` (a cut line is skipped)."""
        return read_records(self.log_paths[proc.pid])

    def logged(self, proc: subprocess.Popen[bytes], event: str) -> int:
        """How many times the process logged ``event``."""
        return sum(e.get("event") == event for e in self.events(proc))

    def joined(self, proc: subprocess.Popen[bytes]) -> bool:
        """The process has joined (standby or active)."""
        if proc.pid in self.log_paths:
            return self.logged(proc, "joined") > 0
        return self.probe(proc)

    def ready(self) -> bool:
        """Every process has joined (standby or active)."""
        return all(self.joined(proc) for _, proc in self.procs)

    def close(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self._files:
            f.close()
        self._files.clear()

    def __enter__(self) -> Members:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """p50, p99 (nearest rank) and max of some seconds, rounded to the millisecond."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p99": None, "max": None}
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 3), "p99": round(p99, 3),
            "max": round(ordered[-1], 3)}


class Reowned:
    """When each partition that a config change moved was first served by its new owner.

    A partition counts as re-owned at the first completion, after ``t0`` (the moment of
    the change), by an instance of the member that owns it in ``after``; with
    ``first_n``, only of a message numbered ``first_n`` or later (published after the
    change), so a backlog drained early does not count. ``member_of`` names the member of
    a record's event. Feed it the events as they are read (:meth:`see`)."""

    def __init__(self, before: GroupConfig, after: GroupConfig, t0: float,
                 member_of: Callable[[dict[str, Any]], str | None], first_n: int = 0) -> None:
        self.new_owner = owners(after)
        self.moved = {p for p in moved_partitions(before, after) if p in self.new_owner}
        self.t0, self.member_of, self.first_n = t0, member_of, first_n
        self.firsts: dict[int, float] = {}

    def see(self, events: Iterable[dict[str, Any]]) -> bool:
        """Take new events in; whether every moved partition was re-owned."""
        for e in events:
            p = e.get("partition")
            if (e["event"] == "end" and e["t"] > self.t0 and p in self.moved
                    and p not in self.firsts and e.get("n", 0) >= self.first_n
                    and self.member_of(e) == self.new_owner[p]):
                self.firsts[p] = e["t"]
        return len(self.firsts) == len(self.moved)

    def seconds(self) -> list[float]:
        """Per re-owned partition, seconds from the change to its first completion."""
        return [t - self.t0 for t in self.firsts.values()]


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result, indent=2, sort_keys=True))


def metric(members: Members, proc: subprocess.Popen[bytes], name: str) -> float | None:
    """Value of one unlabelled-by-us metric of a member process (first sample)."""
    try:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{members.ports[proc.pid]}/metrics", timeout=1) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """Lines written by ``bench.handlers:record`` (a line cut by SIGKILL is skipped)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


async def steady_traffic(js: JetStream, rate: float, stop: asyncio.Event, keys: int = 64,
                         stream: str = "BENCH") -> int:
    """Publish at ``rate`` msg/s until ``stop``; the number published."""
    n = 0
    start = time.monotonic()
    while not stop.is_set():
        await js.js.publish(f"{stream.lower()}.k{n % keys}", json.dumps({"n": n}).encode())
        n += 1
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    return n


# -- keyed traffic ---------------------------------------------------------------------
def keyed_payload(subject: str, n: int, **fields: Any) -> bytes:
    """The payload every recording handler reads: ``{"key": subject, "n": n, ...}``."""
    return json.dumps({"key": subject, "n": n, **fields}).encode()


class Publisher:
    """JetStream publishes acknowledged through one inbox subscription, at most ``window``
    unacknowledged: much faster than awaiting each ``js.publish``, so the publisher is not
    what a throughput benchmark measures, and still never more in flight than the server
    takes (a core publish without acks can be dropped by a busy server)."""

    def __init__(self, nc: Client, window: int = 2000) -> None:
        self.nc = nc
        self.window = window
        self.sent = 0
        self.acked = 0
        self.errors: list[bytes] = []
        self._inbox = nc.new_inbox()
        self._progress = asyncio.Event()
        self._sub: Any = None

    async def __aenter__(self) -> Publisher:
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_ack,
                                            pending_msgs_limit=1_000_000)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_ack(self, msg: Msg) -> None:
        if msg.data.startswith(b'{"error"') or b'"error":' in msg.data:
            self.errors.append(msg.data)
        self.acked += 1
        self._progress.set()

    async def send(self, subject: str, payload: bytes, timeout: float = 30.0) -> None:
        while self.sent - self.acked >= self.window:
            self._progress.clear()
            await within(self._progress.wait(), timeout, "a PubAck")
        self.sent += 1
        await self.nc.publish(subject, payload, reply=f"{self._inbox}.{self.sent}")

    async def settle(self, timeout: float = 60.0) -> None:
        """Wait until every publish was acknowledged; RuntimeError if any was refused."""
        deadline = time.monotonic() + timeout
        while self.acked < self.sent:
            self._progress.clear()
            await within(self._progress.wait(), max(0.01, deadline - time.monotonic()),
                         f"{self.sent - self.acked} PubAcks")
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} publishes refused, e.g. {self.errors[0]!r}")


async def publish_keyed(nc: Client, prefix: str, count: int, keys: int = 64,
                        start: int = 0) -> list[tuple[str, int]]:
    """Publish ``count`` messages ``prefix.k<i % keys>`` (``n`` from ``start``) as fast as
    the server acknowledges them; ``(subject, n)`` in publish order (what
    :func:`tests.support.groups.check` wants)."""
    sent = [(f"{prefix}.k{n % keys}", n) for n in range(start, start + count)]
    payloads = [keyed_payload(subject, n) for subject, n in sent]  # encoded before timing
    async with Publisher(nc) as pub:
        for (subject, _), payload in zip(sent, payloads, strict=True):
            await pub.send(subject, payload)
        await pub.settle()
    return sent


class KeyedTraffic:
    """Steady keyed traffic at ``rate`` msg/s from a :mod:`bench.traffic` process, until
    :meth:`stop`. :meth:`mark` adds fields to a coming message (e.g. ``block``: the
    recording handler then blocks its event loop that long, once) and returns its ``n``.
    With ``stamp`` each payload carries its publish time (``pt``)."""

    def __init__(self, url: str, prefix: str, rate: float, keys: int = 64,
                 stamp: bool = False) -> None:
        self.url, self.prefix, self.rate, self.keys = url, prefix, rate, keys
        self.stamp = stamp
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> KeyedTraffic:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.traffic", self.url, self.prefix, str(self.rate),
            str(self.keys), *(["stamp"] if self.stamp else []), cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if (await self._answer()).get("ready") is not True:
            raise RuntimeError("the traffic process did not start")
        return self

    async def _answer(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        line = await within(self._proc.stdout.readline(), timeout,
                            "the traffic process's answer")
        if not line:
            raise RuntimeError(f"the traffic process exited ({await self._proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    async def _command(self, **command: Any) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command).encode() + b"\n")
        await self._proc.stdin.drain()
        return await self._answer()

    async def mark(self, **fields: Any) -> int:
        return int((await self._command(mark=fields))["n"])

    async def stop(self) -> list[tuple[str, int]]:
        """Stop publishing; what was published (all acknowledged), in order."""
        if self._proc is None:
            return []
        try:
            sent = int((await self._command(stop=True))["sent"])
            await within(self._proc.wait(), 30, "the traffic process to exit")
        finally:
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
        return [(f"{self.prefix}.k{n % self.keys}", n) for n in range(sent)]


# -- what recording handlers wrote -----------------------------------------------------
class Records:
    """Start and end events (:class:`tests.support.groups.Record` format) appended by recording
    handlers, one JSON-lines file per process in ``directory`` (or the files given),
    read incrementally: polling costs only what was written since the last poll."""

    def __init__(self, directory: Path | None = None, files: Iterable[Path] = ()) -> None:
        self.directory = directory
        self.files = list(files)
        self.events: list[dict[str, Any]] = []
        self._offsets: dict[Path, int] = {}
        self._counted_to: dict[Path, int] = {}
        self._ends_counted = 0

    def _paths(self) -> list[Path]:
        paths = list(self.files)
        if self.directory is not None and self.directory.exists():
            paths += sorted(self.directory.glob("*.jsonl"))
        return paths

    def count_ends(self) -> int:
        """Cheap progress: end events written so far, counted without parsing."""
        for path in self._paths():
            offset = self._counted_to.get(path, 0)
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
                done = chunk.rfind(b"\n") + 1
                self._counted_to[path] = offset + done
                self._ends_counted += chunk[:done].count(b'"event": "end"')
        return self._ends_counted

    def poll(self) -> list[dict[str, Any]]:
        """Events written since the last poll (a line still being written waits)."""
        new: list[dict[str, Any]] = []
        for path in self._paths():
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            done = chunk.rfind(b"\n") + 1
            self._offsets[path] = offset + done
            for line in chunk[:done].splitlines():
                with contextlib.suppress(ValueError):
                    new.append(json.loads(line))
        self.events += new
        return new

    def ends(self, instance: str | None = None, after: float = float("-inf")
             ) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "end" and e["t"] > after
                and (instance is None or e["instance"] == instance)]

    def starts(self, instance: str | None = None, after: float = float("-inf")
               ) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "start" and e["t"] > after
                and (instance is None or e["instance"] == instance)]

    def latest_instance(self) -> str | None:
        """Who completed the most recent message."""
        ends = [e for e in self.events[-200:] if e["event"] == "end"]
        return max(ends, key=lambda e: e["t"])["instance"] if ends else None

    def as_record(self) -> Any:
        """A :class:`tests.support.groups.Record` of everything read (for its checkers)."""
        from tests.support.groups import Record
        return Record(sorted(self.events, key=lambda e: e["t"]))


def done_ns(records: Records, want: set[int]) -> bool:
    """Every ``n`` of ``want`` completed at least once (polls ``records``)."""
    records.poll()
    return want <= {e["n"] for e in records.events if e["event"] == "end"}


async def wait_processed(records: Records, want: set[int], timeout: float,
                         what: str = "messages processed") -> None:
    """Poll until every ``n`` in ``want`` was completed; only counts ends until enough
    were written, so a fast run is not slowed by parsing its own records."""
    deadline = time.monotonic() + timeout
    while records.count_ends() < len(want):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    await wait_for(lambda: done_ns(records, want), max(1.0, deadline - time.monotonic()),
                   0.05, what)


# -- CPU and memory, from /proc --------------------------------------------------------
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class CpuMeter:
    """CPU seconds each of some processes used between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.began: dict[int, float] = {}
        self.wall = 0.0

    def start(self) -> CpuMeter:
        self.began = {pid: cpu_seconds(pid) for pid in self.pids}
        self.wall = time.monotonic()
        return self

    def stop(self) -> dict[int, float]:
        """CPU seconds per pid; ``self.wall`` becomes the elapsed wall time."""
        used = {pid: cpu_seconds(pid) - self.began[pid] for pid in self.pids}
        self.wall = time.monotonic() - self.wall
        return used


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
