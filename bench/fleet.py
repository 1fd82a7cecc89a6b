"""Fleet: many member instances on one server, started at once (issue 27).

A 2-core machine cannot hold a thousand ``cgroupd join`` processes, but the server cannot
tell processes from connections: each instance here is a library :class:`cgroupd.Member`
with its own NATS connection, many to a worker process (``--processes`` of them), so the
server sees one client per instance, as it would in production.

The driver starts one nats-server, an origin stream and a group of ``--members`` partitions
(one each) with every member listed, then every worker at once (each starts all its
instances at once: a mass start). It reports

- ``all_active_s``: from the start until every member has an active instance;
- ``died``: instances whose start failed or whose runtime stopped by itself (connect
  failures apart, as ``connect_failed``; timed-out connects are retried as ``cgroupd join``
  retries them: ``connect_retries``), and workers that exited;
- at rest, over ``--idle`` seconds: the server's CPU (% of one core), its JetStream API
  requests per second (``/jsz``), and the workers' CPU per instance (% of one core);
- ``first_round_served_s``: one message to each of 8 keys per member (every partition
  gets some), from the first publish until all were processed;
- with ``--restart``: the server restarted under the fleet (same port and store), the time
  until such a round published meanwhile was processed (``after_restart_served_s``), and
  who died; ``processed_twice``: messages run more than once.

Run: ``python -m bench.fleet --members 50 --copies 2 --processes 2 [--idle 20] [--restart]``.
A worker alone: ``python -m bench.fleet worker URL STATUS_FILE m1,m2 COPIES``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import CpuMeter, emit, machine, server
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.errors import CgroupdError, ServerBusy
from cgroupd.core.retrying import retry_delay
from cgroupd.core.settings import MemberSettings
from cgroupd.member import Member, MemberState
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream
from tests.support.natsserver import NatsServer

STREAM = "FLEET"
GROUP = "g"
#: How often a worker writes what its instances are doing.
STATUS_EVERY = 0.5


# -- the worker: many instances in one process ------------------------------------------
#: Payloads of the messages this worker's instances processed (ids: once each, unless
#: something ran twice).
_processed: list[str] = []


async def _record(msg: Any) -> None:
    _processed.append(msg.data.decode())


@dataclass
class _Instance:
    member: str
    name: str
    runtime: Member | None = None
    error: str | None = None
    connect_failed: bool = False
    connect_retries: int = 0
    nc: Any = None


async def _start_one(url: str, inst: _Instance) -> None:
    """Connect as ``cgroupd join`` does (a connect that timed out is retried, a refused
    one is not), then start the member."""
    options = ConnectionOptions(servers=(url,), name=f"fleet-{inst.name}")
    while inst.nc is None:
        try:
            inst.nc = await connect(options)
        except ServerBusy:
            await asyncio.sleep(retry_delay(inst.connect_retries, 1.0))
            inst.connect_retries += 1
        except CgroupdError as exc:
            inst.connect_failed, inst.error = True, str(exc)
            return
    member = Member(JetStream(inst.nc), STREAM, GROUP, inst.member, _record, MemberSettings(),
                    instance_id=inst.name)
    try:
        await member.start()
    except Exception as exc:  # noqa: BLE001 - a start that failed is what we count
        inst.error = f"start failed: {exc!r}"
        return
    inst.runtime = member


def _status(instances: list[_Instance]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for inst in instances:
        m = inst.runtime
        if m is None:
            state = "connect-failed" if inst.connect_failed else (
                "failed" if inst.error else "starting")
        elif m.state is MemberState.STOPPED:
            state = "died"
            inst.error = inst.error or f"stopped: {m.stop_reason}"
        else:
            state = m.state.value
        out[inst.name] = {"member": inst.member, "state": state, "error": inst.error,
                          "connect_retries": inst.connect_retries}
    return out


def _write_status(path: Path, instances: list[_Instance]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "instances": _status(instances),
                               "processed": _processed}))
    tmp.replace(path)


async def run_worker(url: str, status: Path, members: list[str], copies: int) -> None:
    """Start ``copies`` instances of each member at once, report their states to
    ``status`` until SIGTERM, then stop them all."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    instances = [_Instance(m, f"{m}-{i}") for m in members for i in range(copies)]
    starting = asyncio.gather(*(_start_one(url, inst) for inst in instances))
    while not stop.is_set():
        _write_status(status, instances)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STATUS_EVERY):
                await stop.wait()
    await starting
    await asyncio.gather(*(i.runtime.stop() for i in instances if i.runtime is not None),
                         return_exceptions=True)
    await asyncio.gather(*(i.nc.close() for i in instances if i.nc is not None),
                         return_exceptions=True)


# -- the driver ----------------------------------------------------------------------------
@dataclass
class Fleet:
    """Worker processes of one fleet, and what they last reported."""

    url: str
    workdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)

    def start(self, members: list[str], copies: int, processes: int) -> None:
        shares = [members[i::processes] for i in range(processes)]
        for n, share in enumerate(s for s in shares if s):
            status = self.workdir / f"worker-{n}.json"
            log = open(self.workdir / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed in stop()
            self.logs.append(log)
            self.files.append(status)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.fleet", "worker", self.url, str(status),
                 ",".join(share), str(copies)], stdout=log, stderr=subprocess.STDOUT))

    def states(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for path in self.files:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                out.update(json.loads(path.read_text())["instances"])
        return out

    def processed(self) -> list[str]:
        out: list[str] = []
        for path in self.files:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                out += json.loads(path.read_text())["processed"]
        return out

    def exited(self) -> list[int]:
        return [p.returncode for p in self.procs if p.poll() is not None]

    def state_counts(self) -> dict[str, int]:
        """How many instances are in each state (a stuck mass start shows where)."""
        counts: dict[str, int] = {}
        for s in self.states().values():
            counts[s["state"]] = counts.get(s["state"], 0) + 1
        return dict(sorted(counts.items()))

    def active_members(self) -> set[str]:
        return {s["member"] for s in self.states().values() if s["state"] == "active"}

    def died(self) -> dict[str, str]:
        return {name: s["error"] or s["state"] for name, s in self.states().items()
                if s["state"] in ("died", "failed")}

    def connect_retries(self) -> int:
        return sum(s["connect_retries"] for s in self.states().values())

    def connect_failed(self) -> int:
        return sum(s["state"] == "connect-failed" for s in self.states().values())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()


async def wait_all_active(fleet: Fleet, members: int, timeout: float) -> float | None:
    """Seconds until every member has an active instance; None if not within ``timeout``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if len(fleet.active_members()) == members:
            return time.monotonic() - began
        await asyncio.sleep(0.2)  # polling files the workers rewrite
    return None


async def create_group(url: str, members: list[str]) -> None:
    nc = await connect(ConnectionOptions(servers=(url,)))
    try:
        js = JetStream(nc, timeout=30)
        await nc.jetstream().add_stream(name=STREAM, subjects=[f"{STREAM.lower()}.>"])
        await admin.create_elastic_group(js, STREAM, GROUP, ElasticGroupConfig(
            max_members=len(members), members=tuple(members),
            partitioning_filters=(PartitioningFilter(f"{STREAM.lower()}.*", (1,)),)))
    finally:
        await nc.close()


async def served(url: str, fleet: Fleet, round_: str, keys: int, timeout: float
                 ) -> float | None:
    """Publish one message to each of ``keys`` keys (every partition gets some) and wait
    until the fleet processed them all: seconds from the first publish, None if not
    within ``timeout``. Publishes are retried while the server is away (a restart)."""
    began = time.monotonic()
    want = {f"{round_}-{i}" for i in range(keys)}
    nc = await connect(ConnectionOptions(servers=(url,), connect_timeout=timeout))
    try:
        js = nc.jetstream()
        for i in range(keys):
            while True:
                try:
                    await js.publish(f"{STREAM.lower()}.k{i}", f"{round_}-{i}".encode(),
                                     timeout=2)
                    break
                except Exception:  # noqa: BLE001 - the server is still coming back
                    if time.monotonic() - began > timeout:
                        return None
                    await asyncio.sleep(0.2)
    finally:
        await nc.close()
    while time.monotonic() - began < timeout:
        if want <= set(fleet.processed()):
            return time.monotonic() - began
        await asyncio.sleep(0.2)  # polling files the workers rewrite
    return None


def api_requests(srv: NatsServer) -> int:
    return int(srv.monitor("/jsz")["api"]["total"])


async def measure(srv: NatsServer, fleet: Fleet, members: int, instances: int,
                  idle: float, restart: bool, timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = {"members": members, "instances": instances,
                              "processes": len(fleet.procs)}
    result["all_active_s"] = await wait_all_active(fleet, members, timeout)
    result["active_members"] = len(fleet.active_members())
    result["states"] = fleet.state_counts()
    keys = 8 * members
    result["first_round_served_s"] = await served(srv.url, fleet, "start", keys, timeout)
    if idle > 0:
        assert srv.pid is not None
        meter = CpuMeter([srv.pid, *(p.pid for p in fleet.procs)]).start()
        api = api_requests(srv)
        await asyncio.sleep(idle)  # the idle window being measured
        used = meter.stop()
        api = api_requests(srv) - api
        result["idle_server_cpu_pct"] = round(100 * used[srv.pid] / meter.wall, 2)
        result["idle_api_per_s"] = round(api / meter.wall, 1)
        workers = sum(v for pid, v in used.items() if pid != srv.pid)
        result["idle_cpu_per_instance_pct"] = round(100 * workers / meter.wall / instances, 4)
    if restart:
        srv.restart()
        result["after_restart_served_s"] = await served(srv.url, fleet, "restart", keys,
                                                        timeout)
    done = fleet.processed()
    result["processed"] = len(done)
    result["processed_twice"] = len(done) - len(set(done))
    result["died"] = len(fleet.died())
    result["died_examples"] = sorted(set(fleet.died().values()))[:5]
    result["connect_failed"] = fleet.connect_failed()
    result["connect_retries"] = fleet.connect_retries()
    result["workers_exited"] = len(fleet.exited())
    return result


@contextlib.contextmanager
def fleet_on(srv: NatsServer, workdir: Path) -> Iterator[Fleet]:
    fleet = Fleet(srv.url, workdir)
    try:
        yield fleet
    finally:
        fleet.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [f"m{i}" for i in range(args.members)]
    with server() as srv:
        await create_group(srv.url, names)
        with fleet_on(srv, srv.workdir) as fleet:
            fleet.start(names, args.copies, args.processes)
            result = await measure(srv, fleet, args.members, args.members * args.copies,
                                   args.idle, args.restart, args.timeout)
    return {"bench": "fleet", "machine": machine(), **result}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        url, status, members, copies = sys.argv[2:6]
        asyncio.run(run_worker(url, Path(status), members.split(","), int(copies)))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=50)
    p.add_argument("--copies", type=int, default=2, help="instances per member")
    p.add_argument("--processes", type=int, default=2, help="worker processes")
    p.add_argument("--idle", type=float, default=20.0, help="seconds at rest measured")
    p.add_argument("--restart", action="store_true", help="restart the server under it")
    p.add_argument("--timeout", type=float, default=120.0)
    emit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
