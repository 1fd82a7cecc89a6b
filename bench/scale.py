"""Scale: the idle cost of many ``cgroupd join`` processes, then a big membership change.

One nats-server; a group of 64 partitions with 16 members x 2 instances (32 ``cgroupd
join`` processes at defaults: no metrics server, info logs to files, the recording
handler of :mod:`bench.handlers`). Once every member is active and ``--settle`` seconds
have passed, for ``--idle`` seconds with no traffic: the server's CPU in % of one core,
each member process's CPU % (mean and max; active and standby instances apart) and RSS
(all read from /proc).

Then 16 more members (one instance each, started and joined first, as non-members) are
added in one config write while ``--rate`` msg/s flow over 1,024 keys (every partition
gets traffic): the time until every partition that moved was processed by its new owner
(``reowned_s``), the longest gap between two completions of one partition around the
change (next to the same measure before it), messages processed more than once, and the
checks (nothing lost, per-key order).

The peer's idle cost at the same shape (16 members x 2 instances of natsio-pcgroups, one
:mod:`tests.support.peer_driver` process per instance, max ack pending 1) is measured on a fresh
server of its own (skipped with ``--no-peer``).

Run: ``python -m bench.scale [--idle 30] [--rate 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import nats
from nats.js import api

from bench.common import (
    CpuMeter,
    KeyedTraffic,
    Members,
    Records,
    Reowned,
    emit,
    machine,
    percentiles,
    rss_mb,
    server,
    wait_for,
)
from bench.footprint import ServerTraffic, sniff
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream
from tests.support.groups import check
from tests.support.natsserver import NatsServer, client_options
from tests.support.peer import PeerProcess, peer_python, why

#: The peer's members, as in the throughput benchmark.
PEER_MAX_ACK_PENDING = 1


@dataclass(frozen=True)
class Shape:
    partitions: int = 64
    members: int = 16
    instances: int = 2
    added: int = 16
    keys: int = 1024
    rate: float = 1000.0
    idle: float = 30.0
    settle: float = 5.0
    #: Seconds of traffic before and after the membership change (for the gap measures).
    window: float = 3.0
    #: Member settings the command line lacks (bench.variant), e.g. "presence_interval=0.25".
    settings: str = ""
    #: Add members under traffic after the idle measurement.
    add: bool = True
    #: Seconds of counting what the server routes, by kind, after the idle window.
    sniff: float = 10.0


def spread(values: list[float], digits: int = 2) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "max": None}
    return {"mean": round(statistics.fmean(values), digits), "max": round(max(values), digits)}


def _pid(srv: NatsServer) -> int:
    assert srv.pid is not None
    return srv.pid


def server_counters(srv: NatsServer) -> dict[str, float]:
    """What the server routed and answered so far: messages in and out (every pull
    request, heartbeat, probe and reply is one) and JetStream API requests."""
    varz = srv.monitor("/varz")
    api_total = int((srv.monitor("/jsz").get("api") or {}).get("total", 0))
    return {"in_msgs": varz["in_msgs"], "out_msgs": varz["out_msgs"], "js_api": api_total}


async def idle_cost(srv: NatsServer, pids: list[int], seconds: float,
                    active: list[int] | None = None) -> dict[str, Any]:
    """CPU % of a core of the server and of each process over ``seconds``; RSS each (and
    of the ``active`` instances and the others apart, when given); the server's message
    and JetStream API rates (what its CPU is spent on)."""
    server_pid = _pid(srv)
    counted = await asyncio.to_thread(server_counters, srv)
    roles = {p: "active" if active is None or p in active else "standby" for p in pids}
    traffic = await asyncio.to_thread(ServerTraffic(srv, roles).start)
    meter = CpuMeter([server_pid, *pids]).start()
    await asyncio.sleep(seconds)  # the measurement window
    cpu = meter.stop()
    after = await asyncio.to_thread(server_counters, srv)
    by_connection = await asyncio.to_thread(traffic.stop)
    percent = {pid: 100 * used / meter.wall for pid, used in cpu.items()}
    rss = {pid: rss_mb(pid) for pid in pids}
    out: dict[str, Any] = {
        "seconds": round(meter.wall, 1), "processes": len(pids),
        "server_cpu_percent": round(percent[server_pid], 2),
        "members_cpu_percent_total": round(sum(percent[pid] for pid in pids), 2),
        "member_cpu_percent_each": spread([percent[pid] for pid in pids]),
        "rss_mb_each": spread(list(rss.values()), 1),
        "server_per_s": {k: round((after[k] - counted[k]) / meter.wall, 1) for k in after},
        "server_traffic": by_connection}
    if active is not None:
        for label, chosen in (("active", [p for p in pids if p in active]),
                              ("standby", [p for p in pids if p not in active])):
            out[label] = {"instances": len(chosen),
                          "cpu_percent_each": spread([percent[p] for p in chosen]),
                          "rss_mb_each": spread([rss[p] for p in chosen], 1)}
    return out


def member_names(start: int, count: int) -> list[str]:
    return [f"m{i:02d}" for i in range(start, start + count)]


async def cgroupd_scale(shape: Shape, tmp: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with server() as srv:
        nc = await nats.connect(servers=[srv.url], **client_options())
        js = JetStream(nc, timeout=10)
        try:
            await js.add_stream(api.StreamConfig(name="SCALE", subjects=["scale.*"]))
            first = member_names(0, shape.members)
            await admin.create_elastic_group(js, "SCALE", "g", ElasticGroupConfig(
                max_members=shape.partitions, members=tuple(first),
                partitioning_filters=(PartitioningFilter("scale.*", (1,)),)))
            records = Records(tmp / "records")
            launcher = ("-m", "bench.variant", shape.settings, "--") if shape.settings else (
                "-m", "cgroupd")
            with Members(srv.url, "SCALE", "g", handler="bench.handlers:events",
                         records=tmp / "records", logs=tmp / "logs", metrics=False) as procs:
                for name, _ in itertools.product(first, range(shape.instances)):
                    procs.start(name, launcher=launcher)
                began = time.monotonic()
                await wait_for(lambda: asyncio.to_thread(procs.ready), 600, 0.2,
                               "every instance to join")

                def active() -> list[int]:
                    return [p.pid for _, p in procs.procs if state(procs, p.pid) == "active"]

                await wait_for(lambda: len(active()) == shape.members, 300, 0.2,
                               "one active instance per member")
                result["started_s"] = round(time.monotonic() - began, 1)
                await asyncio.sleep(shape.settle)  # let start-up work die down
                pids = [p.pid for _, p in procs.procs]
                result["idle"] = await idle_cost(srv, pids, shape.idle, active())
                if shape.sniff:  # after the measurement: the sniffer costs the server
                    result["idle"]["server_traffic"]["sniffed_per_s"] = await sniff(
                        srv.url, shape.sniff)
                if shape.add:
                    result["add_members"] = await add_members(shape, js, procs, records,
                                                              launcher)
        finally:
            await nc.close()
    return result


def state(procs: Members, pid: int) -> str | None:
    """``active`` or ``standby`` from the process's log (None before it joined)."""
    now = None
    for e in procs.events(next(p for _, p in procs.procs if p.pid == pid)):
        name = e.get("event")
        if name == "became active":
            now = "active"
        elif name == "stepped down" or (name == "joined" and now is None):
            now = "standby"
    return now


async def add_members(shape: Shape, js: JetStream, procs: Members, records: Records,
                      launcher: tuple[str, ...] = ("-m", "cgroupd")) -> dict[str, Any]:
    """Add ``shape.added`` members (their processes joined first) under traffic."""
    added = member_names(shape.members, shape.added)
    before_start = len(procs.procs)
    for name in added:
        procs.start(name, launcher=launcher)
    await wait_for(lambda: asyncio.to_thread(
        lambda: all(procs.joined(p) for _, p in procs.procs[before_start:])), 300, 0.2,
        "the added members' processes to join")
    traffic = await KeyedTraffic(procs.url, "scale", shape.rate, keys=shape.keys).start()
    await wait_for(lambda: records.poll() is not None and len(records.ends()) > shape.rate / 4,
                   60, 0.1, "traffic to flow")
    await asyncio.sleep(shape.window)  # normal traffic, to compare gaps with
    before = (await admin.get_group(js, "SCALE", "g")).config
    t0 = time.time()
    after = await admin.add_members(js, "SCALE", "g", added)
    member_of = {f"cgroupd-{p.pid}": m for m, p in procs.procs}
    reowned = Reowned(before, after, t0, lambda e: member_of.get(e["instance"]))
    moved, firsts = reowned.moved, reowned.firsts

    try:
        # New records only: a poll costs what was written since the last one.
        await wait_for(lambda: reowned.see(records.poll()), 120, 0.1,
                       "every moved partition processed by its new owner")
    finally:
        t_all = max(firsts.values(), default=t0)
        await asyncio.sleep(shape.window)  # traffic after the change, for the gap measure
        sent = await traffic.stop()
    await wait_for(lambda: records.poll() is not None
                   and {n for _, n in sent} <= {e["n"] for e in records.ends()},
                   120, 0.2, "every message processed")
    verdict = check(records.as_record(), sent)
    return {
        "added_members": shape.added, "rate": shape.rate, "published": len(sent),
        "moved_partitions": len(moved),
        "reowned_s": round(t_all - t0, 3),
        "reowned_s_p50": round(statistics.median(t - t0 for t in firsts.values()), 3)
        if firsts else None,
        "longest_gap_s": longest_gap(records, t0 - 0.5, t_all + min(1.0, shape.window)),
        "longest_gap_before_s": longest_gap(records, t0 - shape.window, t0),
        "handover_gap_s": handover_gaps(records, firsts),
        "gap_before_s": gap_spread(records, t0 - shape.window, t0),
        "duplicates": verdict.duplicates,
        "lost": len(verdict.lost),
        "order_violations": len(verdict.order_violations),
    }


def longest_gap(records: Records, start: float, end: float) -> dict[str, Any]:
    """The longest time between two completions of one partition within [start, end]."""
    times: dict[int, list[float]] = {}
    for e in records.ends():
        if start <= e["t"] <= end:
            times.setdefault(e["partition"], []).append(e["t"])
    worst, where = 0.0, None
    for p, ts in times.items():
        ts.sort()
        gap = max((b - a for a, b in itertools.pairwise(ts)), default=0.0)
        if gap > worst:
            worst, where = gap, p
    return {"seconds": round(worst, 3), "partition": where}


def handover_gaps(records: Records, firsts: dict[int, float]) -> dict[str, Any]:
    """Per moved partition, the time from its last completion before its new owner's
    first one to that first one: the dark time of the move (it includes the wait for
    the partition's next message, ~partitions / rate on average)."""
    last: dict[int, float] = {}
    for e in records.ends():
        p = e["partition"]
        if p in firsts and e["t"] < firsts[p] and e["t"] > last.get(p, -math.inf):
            last[p] = e["t"]
    gaps = {p: firsts[p] - last[p] for p in firsts if p in last}
    return {**percentiles(list(gaps.values())), "partitions": len(gaps),
            "worst_partition": max(gaps, key=gaps.__getitem__) if gaps else None}


def gap_spread(records: Records, start: float, end: float) -> dict[str, float | None]:
    """Every gap between two completions of one partition within [start, end]: what
    the traffic's own spacing gives, to compare the handover gaps with."""
    times: dict[int, list[float]] = {}
    for e in records.ends():
        if start <= e["t"] <= end:
            times.setdefault(e["partition"], []).append(e["t"])
    return percentiles([b - a for ts in times.values()
                        for a, b in itertools.pairwise(sorted(ts))])


async def consuming(peer: PeerProcess) -> bool:
    return all(await peer.call("consuming"))


async def peer_idle(shape: Shape, python: str, tmp: Path) -> dict[str, Any]:
    """The peer at the same shape, idle, on a server of its own."""
    with server() as srv:
        nc = await nats.connect(servers=[srv.url], **client_options())
        js = JetStream(nc, timeout=10)
        peers: list[PeerProcess] = []
        try:
            await js.add_stream(api.StreamConfig(name="PSCALE", subjects=["pscale.*"]))
            names = member_names(0, shape.members)
            async with PeerProcess(python, srv.url) as admin_peer:
                await admin_peer.call("create_elastic", stream="PSCALE", group="g",
                                      max_members=shape.partitions,
                                      filters=[["pscale.*", [1]]])
                await admin_peer.call("add_members", stream="PSCALE", group="g",
                                      members=names)
            began = time.monotonic()
            for name, i in itertools.product(names, range(shape.instances)):
                peers.append(await PeerProcess(python, srv.url,
                                               tmp / f"peer-{name}-{i}.log").start())
            for (name, i), peer in zip(itertools.product(names, range(shape.instances)),
                                       peers, strict=True):
                await peer.call("consume", kind="elastic", stream="PSCALE", group="g",
                                member=name, record=str(tmp / f"peer-{name}-{i}.jsonl"),
                                max_ack_pending=PEER_MAX_ACK_PENDING)
            for peer in peers:
                await wait_for(partial(consuming, peer), 120, 0.2,
                               "the peer instances to consume")
            started = round(time.monotonic() - began, 1)
            await asyncio.sleep(shape.settle)
            idle = await idle_cost(srv, [p.pid for p in peers], shape.idle)
            return {"what": "natsio-pcgroups, one tests/support/peer_driver.py process per "
                            f"instance (Python of the peer's venv), max ack pending "
                            f"{PEER_MAX_ACK_PENDING}", "started_s": started, "idle": idle}
        finally:
            for peer in peers:
                await peer.close()
            await nc.close()


async def main(shape: Shape, with_peer: bool, workdir: Path | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "scale", "shape": shape.__dict__,
                              "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as scratch:
        tmp = str(workdir or scratch)
        result["cgroupd"] = await cgroupd_scale(shape, Path(tmp) / "cgroupd")
        if with_peer:
            try:
                python = peer_python()
                reason = "" if python else why()
            except RuntimeError as exc:
                python, reason = None, str(exc)
            (Path(tmp) / "peer").mkdir()
            result["peer"] = (await peer_idle(shape, python, Path(tmp) / "peer") if python
                              else {"skipped": reason})
    result["machine"]["load_average_after"] = machine()["load_average_1_5_15_min"]
    idle = result["cgroupd"]["idle"]
    add = result["cgroupd"].get("add_members")
    result["targets"] = {
        "server <= 3% of a core": idle["server_cpu_percent"] <= 3,
        "members <= 0.2% each (mean)": idle["member_cpu_percent_each"]["mean"] <= 0.2,
        "RSS <= 40 MB per instance (max)": idle["rss_mb_each"]["max"] <= 40,
        "re-owned < 1 s": None if add is None else add["reowned_s"] < 1,
        "no duplicates": None if add is None else add["duplicates"] == 0,
    }
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--partitions", type=int, default=Shape.partitions)
    parser.add_argument("--members", type=int, default=Shape.members)
    parser.add_argument("--instances", type=int, default=Shape.instances)
    parser.add_argument("--added", type=int, default=Shape.added)
    parser.add_argument("--keys", type=int, default=Shape.keys)
    parser.add_argument("--rate", type=float, default=Shape.rate)
    parser.add_argument("--idle", type=float, default=Shape.idle,
                        help="seconds of the idle measurement")
    parser.add_argument("--settle", type=float, default=Shape.settle,
                        help="seconds after every member is active before measuring")
    parser.add_argument("--window", type=float, default=Shape.window,
                        help="seconds of traffic before and after the membership change")
    parser.add_argument("--settings", default="", metavar="NAME=VALUE,...",
                        help="member settings the CLI lacks, via bench.variant "
                             "(e.g. presence_interval=0.25)")
    parser.add_argument("--no-add", action="store_true",
                        help="only the idle measurement (no members added under traffic)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--sniff", type=float, default=Shape.sniff, metavar="SECONDS",
                        help="count what the server routes, by kind, after the idle "
                             "window (bench.footprint.sniff; 0: skip)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the records and logs here (an empty directory)")
    a = parser.parse_args()
    if a.workdir is not None:
        a.workdir.mkdir(parents=True, exist_ok=True)
    emit(asyncio.run(main(Shape(
        partitions=a.partitions, members=a.members, instances=a.instances, added=a.added,
        keys=a.keys, rate=a.rate, idle=a.idle, settle=a.settle, window=a.window,
        settings=a.settings, add=not a.no_add, sniff=a.sniff),
        not a.no_peer, a.workdir)))
