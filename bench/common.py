"""What every benchmark needs: a nats-server, keyed traffic, member processes, timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
from nats.js import api

from cgroupd import admin
from cgroupd.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.jetstream import JetStream
from tests.groups import eventually
from tests.natsserver import NatsServer, client_options, find_free_port

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    version = subprocess.run([_server_binary(), "--version"], capture_output=True,
                             text=True, check=False).stdout.strip()
    return {"cores": os.cpu_count(), "python": platform.python_version(),
            "nats_server": version}


def _server_binary() -> str:
    from tests.natsserver import find_nats_server_binary
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
    """``cgroupd join`` processes, one per (member, instance); all killed on exit."""

    def __init__(self, url: str, stream: str, group: str, handler: str = "bench.handlers:ack",
                 extra: tuple[str, ...] = (), record: Path | None = None) -> None:
        self.url, self.stream, self.group = url, stream, group
        self.handler, self.extra, self.record = handler, extra, record
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.ports: dict[int, int] = {}

    def start(self, member: str, *extra: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), CGROUPD_LOG_LEVEL="warning")
        if self.record is not None:
            env["BENCH_RECORD"] = str(self.record)
        port = find_free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "cgroupd", "--server", self.url, "join", "--stream",
             self.stream, "--group", self.group, "--member", member, "--handler", self.handler,
             "--metrics-port", str(port), "--metrics-host", "127.0.0.1", *self.extra, *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append((member, proc))
        self.ports[proc.pid] = port
        return proc

    def probe(self, proc: subprocess.Popen[bytes], path: str = "/readyz") -> bool:
        """True when the process answers 200 on its health port."""
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.ports[proc.pid]}{path}", timeout=0.5) as resp:
                return bool(resp.status == 200)
        except (OSError, ValueError):
            return False

    def ready(self) -> bool:
        """Every process has joined (standby or active)."""
        return all(self.probe(proc) for _, proc in self.procs)

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
