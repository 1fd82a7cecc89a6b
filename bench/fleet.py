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
- at rest, over ``--idle`` seconds, once every instance is active or standby
  (``all_settled_s`` from the start): the server's CPU (% of one core), its JetStream API
  requests per second (``/jsz``), and the workers' CPU per instance (% of one core);
- ``first_round_served_s``: one message to each of 8 keys per member (every partition
  gets some), from the first publish until all were processed;
- with ``--add N`` or ``--kill K``, under ``--rate`` msg/s of keyed traffic (``fleet.k<i>``
  over 32 keys per partition, from a :mod:`bench.traffic` process):

  - ``--add N``: N more members (``--copies`` instances each, in one extra worker), started
    as non-members, then added to the group config in one write (the group has
    ``members + N`` partitions from the start, one per member at the end). For every
    partition that changed owner, the seconds from the config change until its new owner
    processed one of its messages published after the change (``reowned_s_p50``,
    ``reowned_s_max``; ``reowned`` of ``moved_partitions``). It includes the wait for the
    partition's next message: ``traffic_partition_interval_s`` (partitions / rate) apart
    on average. Apart from that wait (each payload carries its publish time): the
    publish-to-processed seconds of the moved partitions' messages published between the
    change and their partition's re-ownership (``moved_latency_s_p50``, ``_max``), and of
    the other partitions' from the change to the last re-ownership, the baseline
    (``unmoved_latency_s_*``).
  - ``--kill K``: one instance of each of the last K members runs in a worker of its own,
    started (and active) before the rest; under traffic that worker gets SIGKILL. Per
    victim member, the seconds from the kill until another instance of it processed a
    message (``failover_s_p50``, ``failover_s_max``; ``failed_over`` of ``kill_victims``),
    and the publish-to-processed seconds of the victims' partitions' messages published
    from the kill to their member's failover (``victim_latency_s_p50``, ``_max``).
  - while the traffic runs: ``traffic_server_cpu_pct``, ``traffic_workers_cpu_pct`` (the
    workers started first, the killed one apart, together) and
    ``traffic_load_average_1min`` (before, after): a machine that did not keep up shows
    in every wait above;
  - over the whole traffic: ``traffic_published``, ``traffic_lost``,
    ``traffic_processed_twice`` (of them ``traffic_processed_twice_before_kill``: the
    add's), ``traffic_order_violations`` (per key; a kill's redone tail allowed);
- with ``--restart``: the server restarted under the fleet (same port and store), the time
  until such a round published meanwhile was processed (``after_restart_served_s``), and
  who died; ``processed_twice``: messages of the rounds run more than once.

Run: ``python -m bench.fleet --members 50 --copies 2 --processes 2 [--idle 20] [--restart]
[--add 5] [--kill 2] [--rate 1000]``. A worker alone: ``python -m bench.fleet worker URL
STATUS_FILE RECORDS_FILE m1-0,m1-1,m2-0`` (instances named member-index).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    CpuMeter,
    KeyedTraffic,
    Records,
    Reowned,
    connected,
    emit,
    machine,
    percentiles,
    server,
    wait_for,
)
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.errors import CgroupdError, ServerBusy
from cgroupd.core.partitions import owners
from cgroupd.core.retrying import retry_delay
from cgroupd.core.settings import MemberSettings
from cgroupd.member import Member, MemberState
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream
from tests.support.groups import check
from tests.support.natsserver import NatsServer

STREAM = "FLEET"
GROUP = "g"
#: How often a worker writes what its instances are doing.
STATUS_EVERY = 0.5


#: Publishes of a round awaited at once: one after the other, the 4,000 of 500 members
#: took most of the 20-30 s a round was measured at (the publisher's time, not the fleet's).
PUBLISHES_IN_FLIGHT = 256

#: Keys of the traffic per partition: enough that every partition gets some (with 32 a
#: partition has none with odds of about partitions x e^-32).
KEYS_PER_PARTITION = 32


# -- the worker: many instances in one process ------------------------------------------
#: Payloads of the round messages this worker's instances processed (ids: once each,
#: unless something ran twice).
_processed: list[str] = []


class _Events:
    """The worker's record of keyed traffic (``{"key", "n"}`` payloads), one line per
    completion, written before the handler returns (so before the ack): what a SIGKILL
    leaves is what was processed."""

    file: Any = None


def _handler(member: str, instance: str) -> Callable[[Any], Awaitable[None]]:
    async def handle(msg: Any) -> None:
        if msg.data[:1] != b"{":
            _processed.append(msg.data.decode())
            return
        body = json.loads(msg.data)
        _Events.file.write(json.dumps({
            "event": "end", "instance": instance, "member": member, "t": time.time(),
            "subject": body["key"], "n": body["n"], "partition": msg.partition,
            "seq": msg.stream_sequence, "pt": body.get("pt")}) + "\n")
    return handle


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
    member = Member(JetStream(inst.nc), STREAM, GROUP, inst.member,
                    _handler(inst.member, inst.name), MemberSettings(), instance_id=inst.name)
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


def member_of_instance(name: str) -> str:
    """``m3-1`` is instance 1 of member ``m3``."""
    return name.rsplit("-", 1)[0]


async def run_worker(url: str, status: Path, names: list[str]) -> None:
    """Start the named instances at once, report their states to ``status`` until
    SIGTERM, then stop them all."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    instances = [_Instance(member_of_instance(n), n) for n in names]
    starting = asyncio.gather(*(_start_one(url, inst) for inst in instances))
    while not stop.is_set():
        _write_status(status, instances)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STATUS_EVERY):
                await stop.wait()
    # A start still retrying (its server gone, say) must not keep the worker alive.
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
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
    #: Workers killed on purpose (``--kill``): neither their exit nor the states they
    #: last wrote count.
    killed: set[int] = field(default_factory=set)
    #: A worker's command line is ``command URL STATUS RECORDS NAMES *extra``: by default
    #: this module's worker (cgroupd); :mod:`bench.fleet_peer` runs the reference's host.
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "bench.fleet",
                                                        "worker"])
    extra: list[str] = field(default_factory=list)
    #: How ``--add`` writes the new members into the config (default: cgroupd's admin);
    #: the reference's side writes with the reference.
    add_members: Callable[[list[str]], Awaitable[Any]] | None = None

    @property
    def records_dir(self) -> Path:
        return self.workdir / "records"

    def start(self, names: list[str], processes: int) -> None:
        """Spread the named instances (``member-index``) over ``processes`` workers."""
        for share in (names[i::processes] for i in range(processes)):
            if share:
                self.start_worker(share)

    def start_worker(self, names: list[str]) -> int:
        """One worker process with the named instances; its index."""
        n = len(self.procs)
        status = self.workdir / f"worker-{n}.json"
        self.records_dir.mkdir(exist_ok=True)
        log = open(self.workdir / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.logs.append(log)
        self.files.append(status)
        self.procs.append(subprocess.Popen(
            [*self.command, self.url, str(status),
             str(self.records_dir / f"worker-{n}.jsonl"), ",".join(names), *self.extra],
            stdout=log, stderr=subprocess.STDOUT))
        return n

    def kill(self, worker: int) -> None:
        """SIGKILL one worker (every instance in it at once, as kill -9 of a process)."""
        self.killed.add(worker)
        self.procs[worker].kill()
        self.procs[worker].wait()

    def states(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for n, path in enumerate(self.files):
            if n in self.killed:
                continue
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
        return [p.returncode for n, p in enumerate(self.procs)
                if n not in self.killed and p.poll() is not None]

    def state_counts(self) -> dict[str, int]:
        """How many instances are in each state (a stuck mass start shows where)."""
        counts: dict[str, int] = {}
        for s in self.states().values():
            counts[s["state"]] = counts.get(s["state"], 0) + 1
        return dict(sorted(counts.items()))

    def settled(self, instances: int) -> bool:
        """Whether all ``instances`` report, each active or standby (none still
        starting)."""
        now = self.states()
        return len(now) == instances and all(
            s["state"] in ("active", "standby") for s in now.values())

    def active_members(self) -> set[str]:
        return {s["member"] for s in self.states().values() if s["state"] == "active"}

    def in_state(self, names: list[str], *states: str) -> bool:
        """Whether every named instance is in one of ``states``."""
        now = self.states()
        return all(now.get(n, {}).get("state") in states for n in names)

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


async def create_group(url: str, members: list[str], partitions: int) -> None:
    nc = await connect(ConnectionOptions(servers=(url,)))
    try:
        js = JetStream(nc, timeout=30)
        await nc.jetstream().add_stream(name=STREAM, subjects=[f"{STREAM.lower()}.>"])
        await admin.create_elastic_group(js, STREAM, GROUP, ElasticGroupConfig(
            max_members=partitions, members=tuple(members),
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
    room = asyncio.Semaphore(PUBLISHES_IN_FLIGHT)

    async def publish(i: int) -> bool:
        async with room:
            while True:
                try:
                    # With an id: a retry of a publish stored without its ack reaching
                    # us is dropped as a duplicate, not counted as "processed twice".
                    await js.publish(f"{STREAM.lower()}.k{i}", f"{round_}-{i}".encode(),
                                     timeout=2, headers={"Nats-Msg-Id": f"{round_}-{i}"})
                    return True
                except Exception:  # noqa: BLE001 - the server is still coming back
                    if time.monotonic() - began > timeout:
                        return False
                    await asyncio.sleep(0.2)

    try:
        js = nc.jetstream()
        if not all(await asyncio.gather(*(publish(i) for i in range(keys)))):
            return None
    finally:
        await nc.close()
    while time.monotonic() - began < timeout:
        if want <= set(fleet.processed()):
            return time.monotonic() - began
        await asyncio.sleep(0.2)  # polling files the workers rewrite
    return None


def api_requests(srv: NatsServer) -> int:
    return int(srv.monitor("/jsz")["api"]["total"])


def messages(srv: NatsServer) -> tuple[int, int]:
    """Messages the server received and sent so far (``/varz``)."""
    varz = srv.monitor("/varz")
    return int(varz["in_msgs"]), int(varz["out_msgs"])


@dataclass(frozen=True)
class Plan:
    """What to measure after the mass start, from the command line."""

    members: int
    copies: int
    idle: float = 0.0
    restart: bool = False
    timeout: float = 120.0
    #: Members added under traffic (``--add``).
    add: int = 0
    #: Members whose active instance is killed (``--kill``), in a worker of their own.
    kill: int = 0
    rate: float = 1000.0
    #: Seconds of traffic after each change, before the next step.
    window: float = 1.0

    @property
    def partitions(self) -> int:
        return self.members + self.add

    def names(self) -> list[str]:
        return [f"m{i}" for i in range(self.members)]

    def added(self) -> list[str]:
        return [f"m{i}" for i in range(self.members, self.members + self.add)]

    def victims(self) -> list[str]:
        """The victims' instances: the last copy of each of the last ``kill`` members."""
        return [f"{m}-{self.copies - 1}" for m in self.names()[self.members - self.kill:]]


async def measure(srv: NatsServer, fleet: Fleet, plan: Plan,
                  victim_worker: int | None = None) -> dict[str, Any]:
    members, instances = plan.members, plan.members * plan.copies
    result: dict[str, Any] = {"members": members, "instances": instances,
                              "processes": len(fleet.procs)}
    began = time.monotonic()
    result["all_active_s"] = await wait_all_active(fleet, members, plan.timeout)
    result["active_members"] = len(fleet.active_members())
    result["states"] = fleet.state_counts()
    if plan.idle > 0:  # at rest means every standby started too, not only the actives
        settled = await _quietly(lambda: fleet.settled(instances), plan.timeout)
        result["all_settled_s"] = round(time.monotonic() - began, 3) if settled else None
        result["states_settled"] = fleet.state_counts()
    keys = 8 * members
    result["first_round_served_s"] = await served(srv.url, fleet, "start", keys, plan.timeout)
    if plan.idle > 0:
        assert srv.pid is not None
        meter = CpuMeter([srv.pid, *(p.pid for p in fleet.procs)]).start()
        api, routed = api_requests(srv), messages(srv)
        await asyncio.sleep(plan.idle)  # the idle window being measured
        used = meter.stop()
        api = api_requests(srv) - api
        result["idle_server_cpu_pct"] = round(100 * used[srv.pid] / meter.wall, 2)
        result["idle_api_per_s"] = round(api / meter.wall, 1)
        # Pull requests, heartbeats, acks: server work that is not a JetStream API call.
        result["idle_msgs_in_out_per_s"] = [round((b - a) / meter.wall, 1)
                                            for a, b in zip(routed, messages(srv), strict=True)]
        workers = sum(v for pid, v in used.items() if pid != srv.pid)
        result["idle_cpu_per_instance_pct"] = round(100 * workers / meter.wall / instances, 4)
    if plan.add or plan.kill:
        try:
            result.update(await under_traffic(srv, fleet, plan, victim_worker))
        except (AssertionError, TimeoutError) as exc:  # a wait that ran out: the rest is
            result["traffic_error"] = f"{type(exc).__name__}: {exc}"  # still worth printing
    if plan.restart:
        srv.restart()
        result["after_restart_served_s"] = await served(srv.url, fleet, "restart", keys,
                                                        plan.timeout)
    done = fleet.processed()
    result["processed"] = len(done)
    result["processed_twice"] = len(done) - len(set(done))
    result["died"] = len(fleet.died())
    result["died_examples"] = sorted(set(fleet.died().values()))[:5]
    result["connect_failed"] = fleet.connect_failed()
    result["connect_retries"] = fleet.connect_retries()
    result["workers_exited"] = len(fleet.exited())
    return result


async def _quietly(check_: Callable[[], bool], timeout: float) -> bool:
    """Poll ``check_`` until true or ``timeout``: whether it became true (a measure that
    stays short is reported, not raised)."""
    try:
        await wait_for(check_, timeout, 0.1)
    except AssertionError:
        return False
    return True


def _seconds(result: dict[str, Any], prefix: str, values: list[float]) -> None:
    spread = percentiles(values)
    result[f"{prefix}_s_p50"], result[f"{prefix}_s_max"] = spread["p50"], spread["max"]


async def under_traffic(srv: NatsServer, fleet: Fleet, plan: Plan,
                        victim_worker: int | None) -> dict[str, Any]:
    """Keyed traffic at ``plan.rate``; under it, members added (re-ownership), then the
    victims' worker killed (failover); then what was lost or run twice."""
    keys = KEYS_PER_PARTITION * plan.partitions
    # Mean time between two messages of one partition: part of every wait below.
    result: dict[str, Any] = {"traffic_rate": plan.rate, "traffic_keys": keys,
                              "traffic_partition_interval_s": round(
                                  plan.partitions / plan.rate, 4)}
    records = Records(fleet.records_dir)
    traffic = await KeyedTraffic(srv.url, STREAM.lower(), plan.rate, keys=keys,
                                 stamp=True).start()
    t_kill = None
    #: Per measure, per partition: the publish times whose messages waited on a change.
    windows: dict[str, Windows] = {}
    # Whether the machine kept up: a saturated one shows in every wait below.
    assert srv.pid is not None
    workers = [p.pid for n, p in enumerate(fleet.procs) if n != victim_worker]
    meter = CpuMeter([srv.pid, *workers]).start()
    load_before = os.getloadavg()[0]
    try:
        await wait_for(lambda: bool(records.poll() or True) and len(records.ends())
                       >= plan.rate / 4, plan.timeout, 0.1, "traffic to flow")
        if plan.add:
            windows["moved"], windows["unmoved"] = await _add(srv, fleet, plan, traffic,
                                                              records, result)
        if plan.kill:
            assert victim_worker is not None
            if plan.add:
                await asyncio.sleep(plan.window)  # the add settles: the kill comes apart
            t_kill, windows["victim"] = await _kill(srv, fleet, plan, victim_worker,
                                                    records, result)
        await asyncio.sleep(plan.window)  # traffic after the last change
    finally:
        sent = await traffic.stop()
    used = meter.stop()
    result["traffic_seconds"] = round(meter.wall, 1)
    result["traffic_server_cpu_pct"] = round(100 * used[srv.pid] / meter.wall, 1)
    # The fleet's workers from the start (not the added or the killed one), together.
    result["traffic_workers_cpu_pct"] = round(
        100 * sum(used[pid] for pid in workers) / meter.wall, 1)
    result["traffic_load_average_1min"] = [round(load_before, 2),
                                           round(os.getloadavg()[0], 2)]
    want = {n for _, n in sent}
    await _quietly(lambda: bool(records.poll() or True)
                   and want <= {e["n"] for e in records.ends()}, plan.timeout)
    verdict = check(records.as_record(), sent, rewinds=plan.kill > 0)
    result["traffic_published"] = len(sent)
    result["traffic_lost"] = len(verdict.lost)
    result["traffic_processed_twice"] = verdict.duplicates
    if t_kill is not None:
        before = [e["n"] for e in records.ends() if e["t"] < t_kill]
        result["traffic_processed_twice_before_kill"] = len(before) - len(set(before))
    result["traffic_order_violations"] = len(verdict.order_violations)
    for name, chosen in windows.items():
        _seconds(result, f"{name}_latency", waited(records.ends(), chosen))
    return result


#: Partition -> (from, to): publish times of interest.
Windows = dict[int, tuple[float, float]]


def waited(ends: list[dict[str, Any]], windows: Windows) -> list[float]:
    """Publish-to-processed seconds of every message of the windows' partitions published
    within its partition's window (its first completion): what a change made messages
    wait, apart from the wait for traffic."""
    first: dict[int, dict[str, Any]] = {}
    for e in sorted(ends, key=lambda e: e["t"]):
        window, pt = windows.get(e["partition"]), e.get("pt")
        if window is not None and pt is not None and window[0] <= pt <= window[1]:
            first.setdefault(e["n"], e)
    return [e["t"] - e["pt"] for e in first.values()]


async def _add(srv: NatsServer, fleet: Fleet, plan: Plan, traffic: KeyedTraffic,
               records: Records, result: dict[str, Any]) -> tuple[Windows, Windows]:
    """Start the added members' instances (as non-members, standby), then add them to
    the config in one write; how long each moved partition took to be served again.
    Returns the windows of the moved partitions (from the change to their re-ownership)
    and of the others (from the change to the last re-ownership: the baseline)."""
    added = [f"{m}-{i}" for m in plan.added() for i in range(plan.copies)]
    fleet.start_worker(added)
    await wait_for(lambda: fleet.in_state(added, "standby", "active"), plan.timeout, 0.2,
                   "the added members' instances to join")
    async with connected(srv.url) as js:
        before = (await admin.get_group(js, STREAM, GROUP)).config
        first_n = await traffic.mark(change=True)  # published from the change on
        t0 = time.time()
        if fleet.add_members is None:
            after = await admin.add_members(js, STREAM, GROUP, plan.added())
        else:
            await fleet.add_members(plan.added())
            after = (await admin.get_group(js, STREAM, GROUP)).config
    records.poll()  # what was written before the change is not wanted
    reowned = Reowned(before, after, t0, lambda e: e["member"], first_n)
    reowned.see(e for e in records.events if e["t"] > t0)
    await _quietly(lambda: reowned.see(records.poll()), plan.timeout)
    result["add_members"] = plan.add
    result["moved_partitions"] = len(reowned.moved)
    result["reowned"] = len(reowned.firsts)
    _seconds(result, "reowned", reowned.seconds())
    await _quietly(lambda: len(fleet.active_members()) == plan.partitions, plan.timeout)
    result["active_members_after_add"] = len(fleet.active_members())
    last = max(reowned.firsts.values(), default=t0)
    moved = {p: (t0, reowned.firsts.get(p, math.inf)) for p in reowned.moved}
    unmoved = {p: (t0, last) for p in range(plan.partitions) if p not in reowned.moved}
    return moved, unmoved


async def _kill(srv: NatsServer, fleet: Fleet, plan: Plan, worker: int, records: Records,
                result: dict[str, Any]) -> tuple[float, Windows]:
    """SIGKILL the victims' worker; per victim member, how long until another of its
    instances processed a message. Returns the moment of the kill and the windows of the
    victims' partitions (from the kill to their member's failover)."""
    victims = {member_of_instance(n): n for n in plan.victims()}
    async with connected(srv.url) as js:
        owner = owners((await admin.get_group(js, STREAM, GROUP)).config)
    result["kill_victims"] = len(victims)
    result["victims_active_at_kill"] = sum(
        s.get("state") == "active" for n, s in fleet.states().items() if n in victims.values())
    records.poll()
    t_kill = time.time()
    fleet.kill(worker)
    firsts: dict[str, float] = {}

    def failed_over() -> bool:
        for e in records.poll():
            m = e["member"]
            if m in victims and m not in firsts and e["t"] > t_kill \
                    and e["instance"] != victims[m]:
                firsts[m] = e["t"]
        return len(firsts) == len(victims)

    await _quietly(failed_over, plan.timeout)
    result["failed_over"] = len(firsts)
    _seconds(result, "failover", [t - t_kill for t in firsts.values()])
    return t_kill, {p: (t_kill, firsts.get(m, math.inf)) for p, m in owner.items()
                    if m in victims}


@contextlib.contextmanager
def fleet_on(srv: NatsServer, workdir: Path) -> Iterator[Fleet]:
    fleet = Fleet(srv.url, workdir)
    try:
        yield fleet
    finally:
        fleet.stop()


def add_plan_arguments(p: argparse.ArgumentParser, processes_help: str) -> None:
    """The options that make a :class:`Plan` (see :func:`plan_of`), and ``--processes``:
    shared with ``bench.fleet_peer``, which runs the same plan on both sides."""
    p.add_argument("--members", type=int, default=50)
    p.add_argument("--copies", type=int, default=2, help="instances per member")
    p.add_argument("--processes", type=int, default=2, help=processes_help)
    p.add_argument("--idle", type=float, default=20.0, help="seconds at rest measured")
    p.add_argument("--restart", action="store_true", help="restart the server under it")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--add", type=int, default=0, metavar="N",
                   help="add N members under traffic; report re-ownership")
    p.add_argument("--kill", type=int, default=0, metavar="K",
                   help="SIGKILL the active instances of K members under traffic; "
                        "report failover")
    p.add_argument("--rate", type=float, default=Plan.rate,
                   help="msg/s of the traffic under --add and --kill")


def plan_of(args: argparse.Namespace) -> Plan:
    return Plan(members=args.members, copies=args.copies, idle=args.idle,
                restart=args.restart, timeout=args.timeout, add=getattr(args, "add", 0),
                kill=getattr(args, "kill", 0), rate=getattr(args, "rate", Plan.rate))


async def drive(srv: NatsServer, fleet: Fleet, plan: Plan, processes: int
                ) -> dict[str, Any]:
    """Mass-start the plan's instances over ``processes`` workers (the victims' worker
    first, active before the rest) and measure."""
    names = [f"{m}-{i}" for m in plan.names() for i in range(plan.copies)]
    victims = plan.victims() if plan.kill else []
    victim_worker = None
    if victims:  # active first, so that the kill hits active instances
        victim_worker = fleet.start_worker(victims)
        await wait_for(lambda: fleet.in_state(victims, "active"), plan.timeout, 0.2,
                       "the victims' instances to become active")
    fleet.start([n for n in names if n not in victims], processes)
    return await measure(srv, fleet, plan, victim_worker)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = plan_of(args)
    if plan.kill and (plan.copies < 2 or plan.kill > plan.members):
        raise SystemExit("--kill needs --copies >= 2 and at most --members victims")
    with server() as srv:
        await create_group(srv.url, plan.names(), plan.partitions)
        with fleet_on(srv, srv.workdir) as fleet:
            result = await drive(srv, fleet, plan, args.processes)
    return {"bench": "fleet", "machine": machine(), **result}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        url, status, records, names = sys.argv[2:6]
        # Line-buffered: each completion reaches the file before its ack is sent.
        _Events.file = open(records, "a", buffering=1)  # noqa: SIM115 - the process's lifetime
        asyncio.run(run_worker(url, Path(status), names.split(",")))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_plan_arguments(p, processes_help="worker processes")
    emit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
