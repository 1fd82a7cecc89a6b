"""Failover through ``cgroupd join`` at defaults, next to the peer (natsio-pcgroups).

One member (``m1``) of a 4-partition group, two instances, keyed traffic at ``--rate``
msg/s, the recording handler of :mod:`bench.handlers` (``events``). Every time is taken
from the fault to the standby's first *processed* message (its handler's ``end``), so it
includes everything the new owner needs before it delivers. Parts:

- ``sigkill``: kill -9 of the active instance, ``--trials`` times; a fresh standby is
  started after each and given ``--settle`` seconds once it has joined.
- ``sigterm``: SIGTERM handover, ``--trials`` times; every other trial comes right after
  a kill -9 failover, the others right after the previous handover ("right after": as
  soon as the new owner processes and a fresh standby has joined, no settling).
- ``peer``: the peer's failover by the same method: two peer instances of one member
  (:mod:`tests.support.peer_driver` processes, max ack pending 1, its default ack wait of 5 s,
  which also sets its pinned TTL), kill -9 of the one processing.
- ``peer_stop``: the peer's counterpart of a SIGTERM handover: the processing instance
  ends its consume session (``stop``, what its process does on SIGTERM); ``x_peer`` in
  ``sigterm`` divides the peer's times by cgroupd's.
- ``netns``: host or network loss: the active instance runs in a network namespace
  (:class:`tests.faults.injectors.VethNamespace`, nats-server on the host end) and the
  link is cut, ``--netns-trials`` times for each of ``--cuts`` seconds (a blip and an
  outage): when the standby took over, when the old owner last started work after the
  cut, what it started after the takeover (and ran too), and how long after the link
  healed it stepped down. Skipped, with the reason, where namespaces cannot be made.
- ``stall``: a live owner stalls ``--stall`` seconds, its event loop blocked (a message
  whose handler calls ``time.sleep``) or SIGSTOP/SIGCONT: takeovers (the standby started
  work), overlaps (handler runs of both instances at the same time), messages run by both,
  starts by the old owner after the standby took over, in the ``--observe`` seconds after
  the stall.

With ``--baseline PATH`` (a directory holding another revision's ``cgroupd/``: see
:mod:`bench.revision`), the cgroupd parts (``sigkill``, ``sigterm``, ``stall``) run twice
in the same run, one after the other on a fresh stream each: once with PATH's ``cgroupd``
(reported as ``sigkill@REV`` etc., REV its short hash) and once with the current tree's,
both launched through :mod:`bench.revision`; ``x_baseline`` in ``sigkill`` and ``sigterm``
divides the baseline's times by ours (above 1: we are faster). With ``--rounds N`` each
side runs N times, alternating which goes first, and its trials are pooled.

Run: ``python -m bench.failover [--trials 20] [--rate 200] [--parts sigkill,peer]
[--baseline PATH [--rounds 2]]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import api

from bench import revision
from bench.common import (
    ROOT,
    KeyedTraffic,
    Members,
    Records,
    emit,
    machine,
    percentile,
    server,
    wait_for,
)
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream
from tests.faults.injectors import NetnsUnavailable, VethNamespace
from tests.support.groups import Record, check
from tests.support.natsserver import client_options, running_server
from tests.support.peer import PeerProcess, peer_python, why

PARTS = ("sigkill", "sigterm", "peer", "peer_stop", "netns", "stall")
PARTITIONS = 4
#: The peer's members: max ack pending 1, its default ack wait (5 s: also its pinned TTL).
PEER_MAX_ACK_PENDING = 1
#: Longest a takeover may take before a trial counts as failed (the peer needs ~5 s).
TAKEOVER_TIMEOUT = 60.0


def instance(proc: subprocess.Popen[bytes] | PeerProcess) -> str:
    """The instance name the recording handlers write."""
    return f"{'peer' if isinstance(proc, PeerProcess) else 'cgroupd'}-{proc.pid}"


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"p50_s": None, "p99_s": None, "max_s": None, "trials_s": []}
    return {"p50_s": round(percentile(values, 50), 3), "p99_s": round(percentile(values, 99), 3),
            "max_s": round(max(values), 3),
            "trials_s": [round(v, 3) for v in values]}


async def first_end(record: Path, who: str, after: float,
                    timeout: float = TAKEOVER_TIMEOUT) -> dict[str, Any]:
    """The first message ``who`` completed after ``after``, read from its own record file
    (polling only that file keeps the benchmark's own CPU out of the takeover it times;
    the time is the handler's, so the polling interval does not change it)."""
    deadline = time.monotonic() + timeout
    records = Records(files=[record])
    while True:
        for e in records.poll():
            if e["event"] == "end" and e["instance"] == who and e["t"] > after:
                return e
        if time.monotonic() > deadline:
            raise AssertionError(f"{who} processed nothing within {timeout}s")
        await asyncio.sleep(0.01)


async def group(js: JetStream, stream: str) -> None:
    await js.add_stream(api.StreamConfig(name=stream, subjects=[f"{stream.lower()}.*"]))
    await admin.create_elastic_group(js, stream, "g", ElasticGroupConfig(
        max_members=PARTITIONS, members=("m1",),
        partitioning_filters=(PartitioningFilter(f"{stream.lower()}.*", (1,)),)))


# -- cgroupd ---------------------------------------------------------------------------
class Pair:
    """The two ``cgroupd join`` instances of ``m1`` and what they recorded."""

    def __init__(self, procs: Members, records: Records) -> None:
        self.procs = procs
        self.records = records

    async def steady(self, settle: float) -> tuple[subprocess.Popen[bytes],
                                                  subprocess.Popen[bytes]]:
        """(active, standby): one instance completed a message in the last 0.3 s, the
        other one has joined; then ``settle`` seconds (a measurement condition: how long
        the standby stood by)."""

        def roles() -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]] | None:
            self.records.poll()
            alive = self.procs.alive()
            recent = {e["instance"] for e in self.records.events[-100:]
                      if e["event"] == "end" and e["t"] > time.time() - 0.3}
            active = [p for p in alive if instance(p) in recent]
            if len(alive) != 2 or len(active) != 1:
                return None
            standby = next(p for p in alive if p is not active[0])
            return (active[0], standby) if self.procs.joined(standby) else None

        found = await wait_for(roles, 60, 0.05, "an active instance and a joined standby")
        if settle:
            await asyncio.sleep(settle)
        return found  # type: ignore[no-any-return]

    async def fail(self, sig: signal.Signals, settle: float) -> dict[str, float]:
        """Send ``sig`` to the active instance; seconds until the standby processed (and
        from the old owner's last completion); then start a fresh standby."""
        active, standby = await self.steady(settle)
        self.records.poll()
        t = time.time()
        active.send_signal(sig)
        first = await first_end(self.procs.record_paths[standby.pid], instance(standby), t)
        await asyncio.to_thread(active.wait, 30)
        last_old = max((e["t"] for e in self.records.ends(instance(active))), default=t)
        self.procs.start("m1")
        return {"signal_to_first_s": first["t"] - t, "last_to_first_s": first["t"] - last_old}


async def sigkill_part(pair: Pair, trials: int, settle: float) -> dict[str, Any]:
    runs = [await pair.fail(signal.SIGKILL, settle) for _ in range(trials)]
    return {"what": "kill -9 of the active instance, to the standby's first processed "
                    "message", **summary([r["signal_to_first_s"] for r in runs]),
            "from_last_processed": summary([r["last_to_first_s"] for r in runs])}


async def sigterm_part(pair: Pair, trials: int, settle: float) -> dict[str, Any]:
    after_failover: list[float] = []
    after_handover: list[float] = []
    kills: list[float] = []
    for i in range(trials):
        if i % 2 == 0:
            kills.append((await pair.fail(signal.SIGKILL, settle))["signal_to_first_s"])
            into = after_failover
        else:
            into = after_handover
        into.append((await pair.fail(signal.SIGTERM, 0.0))["signal_to_first_s"])
    return {"what": "SIGTERM of the active instance right after a kill -9 failover (even "
                    "trials) or a handover (odd), to the standby's first processed message",
            **summary(after_failover + after_handover),
            "right_after_failover": summary(after_failover),
            "right_after_handover": summary(after_handover),
            "the_kill_before": summary(kills)}


async def stall_part(pair: Pair, traffic: KeyedTraffic, trials: int, stall: float,
                     settle: float, observe: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("event_loop_blocked", "sigstop"):
        runs = []
        for _ in range(trials):
            active, standby = await pair.steady(settle)
            stepped = pair.procs.logged(active, "stepped down")
            if kind == "sigstop":
                t0 = time.time()
                active.send_signal(signal.SIGSTOP)
                await asyncio.sleep(stall)  # the fault's duration
                active.send_signal(signal.SIGCONT)
            else:
                n = await traffic.mark(block=stall)

                def started(n: int = n) -> dict[str, Any] | None:
                    pair.records.poll()
                    return next((e for e in reversed(pair.records.events)
                                 if e["event"] == "start" and e["n"] == n), None)

                began = await wait_for(started, 30, 0.01, "the blocking message to start")
                t0 = began["t"]
            await asyncio.sleep(max(0.0, t0 + stall + observe - time.time()))
            pair.records.poll()
            runs.append(judge_stall(pair.records, instance(active), instance(standby), t0,
                                    t0 + stall + observe)
                        | {"stepped_down": pair.procs.logged(active, "stepped down")
                           > stepped})
            if active.poll() is not None:  # a stall must not kill it; replace it if it did
                pair.procs.start("m1")
        out[kind] = {
            "trials": trials, "stall_s": stall,
            "takeovers": sum(r["took_over"] for r in runs),
            "overlaps": sum(r["overlapping_runs"] > 0 for r in runs),
            "overlapping_runs": sum(r["overlapping_runs"] for r in runs),
            "run_by_both": sum(r["run_by_both"] for r in runs),
            "old_owner_starts_after_takeover": sum(r["old_starts_after_takeover"]
                                                   for r in runs),
            "old_owner_stepped_down": sum(r["stepped_down"] for r in runs),
            "longest_gap_s": round(max(r["longest_gap_s"] for r in runs), 3),
        }
    return out


def judge_stall(records: Records, old: str, new: str, begin: float,
                end: float) -> dict[str, Any]:
    """What happened between ``begin`` (the stall) and ``end``."""
    window = [e for e in records.events if begin - 1 <= e["t"] <= end]
    new_starts = [e["t"] for e in window if e["event"] == "start" and e["instance"] == new
                  and e["t"] >= begin]
    took_over = bool(new_starts)
    late = [e for e in window if e["event"] == "start" and e["instance"] == old
            and took_over and e["t"] > min(new_starts)]
    ends = [e for e in window if e["event"] == "end"]
    by: dict[int, set[str]] = {}
    for e in ends:
        by.setdefault(e["n"], set()).add(e["instance"])
    times = sorted(e["t"] for e in ends if e["t"] >= begin - 0.5)
    gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    overlaps = check(Record(sorted(window, key=lambda e: e["t"])), [],
                     member_of=lambda e: "m1").overlaps
    return {"took_over": took_over, "old_starts_after_takeover": len(late),
            "run_by_both": sum(len(who) > 1 for who in by.values()),
            "overlapping_runs": len(overlaps), "longest_gap_s": gap}


async def cgroupd_parts(url: str, nc: Client, js: JetStream, tmp: Path, parts: set[str],
                        trials: int, rate: float, stall: float, stall_trials: int,
                        settle: float, observe: float, stream: str = "BENCH",
                        code: Path | None = None) -> dict[str, Any]:
    """The cgroupd parts on a fresh ``stream``, deleted afterwards; with ``code`` the
    processes import ``cgroupd`` from there (:mod:`bench.revision`), and
    ``cgroupd_files`` says what they imported."""
    result: dict[str, Any] = {}
    await group(js, stream)
    traffic = await KeyedTraffic(url, stream.lower(), rate).start()
    records = Records(tmp / "records")
    (tmp / "hold").mkdir(parents=True)
    with Members(url, stream, "g", handler="bench.handlers:events", records=tmp / "records",
                 logs=tmp / "logs", metrics=False,
                 env={"BENCH_HOLD_DIR": str(tmp / "hold")}, code=code) as procs:
        pair = Pair(procs, records)
        procs.start("m1")
        await wait_for(lambda: records.poll() is not None and records.ends(), 60, 0.05,
                       "the first instance to process")
        procs.start("m1")
        if "sigkill" in parts:
            result["sigkill"] = await sigkill_part(pair, trials, settle)
        if "sigterm" in parts:
            result["sigterm"] = await sigterm_part(pair, trials, settle)
        if "stall" in parts:
            result["stall"] = await stall_part(pair, traffic, stall_trials, stall, settle,
                                               observe)
        sent = await traffic.stop()
        await wait_for(lambda: records.poll() is not None
                       and {n for _, n in sent} <= {e["n"] for e in records.ends()},
                       120, 0.1, "every message processed")
    verdict = check(records.as_record(), sent, rewinds=True)
    result["cgroupd_checks"] = {"published": len(sent), "lost": len(verdict.lost),
                                "order_violations": len(verdict.order_violations),
                                "duplicates": verdict.duplicates}
    if code is not None:
        result["cgroupd_files"] = procs.imported()
    await admin.delete_group(js, stream, "g")
    await js.delete_stream(stream)
    return result


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the rounds of one side: every trial's time pooled (each summary
    taken again over all of them, with each round's p50 in ``p50_s_rounds``), counts
    summed, the longest gap the longest."""
    pooled: dict[str, Any] = _pool(runs, "")
    return pooled


def _pool(values: list[Any], key: str) -> Any:
    first = values[0]
    if len(values) == 1:
        return first
    if isinstance(first, dict):
        out: dict[str, Any] = {}
        if "trials_s" in first:  # and each round's p50, to see the noise between rounds
            out |= summary([t for v in values for t in v["trials_s"]])
            out["p50_s_rounds"] = [v.get("p50_s") for v in values]
        for name in first:
            if name not in out:
                out[name] = _pool([v[name] for v in values], name)
        return out
    if isinstance(first, list):  # cgroupd_files
        return sorted({item for v in values for item in v})
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    if key == "longest_gap_s":
        return max(values)
    return first if key == "stall_s" else sum(values)


def add_x_baseline(result: dict[str, Any], rev: str) -> dict[str, Any]:
    """The baseline's times over ours (p50 and p99) in ``sigkill`` and ``sigterm``,
    where both sides ran; what was added, by part."""
    added: dict[str, Any] = {}
    for part in ("sigkill", "sigterm"):
        mine, base = result.get(part), result.get(f"{part}@{rev}")
        if not isinstance(mine, dict) or not isinstance(base, dict):
            continue
        mine["x_baseline"] = added[part] = {
            q: round(base[q] / mine[q], 2) if base.get(q) and mine.get(q) else None
            for q in ("p50_s", "p99_s")}
    return added


# -- the peer --------------------------------------------------------------------------
async def peer_part(url: str, nc: Client, js: JetStream, python: str, tmp: Path, trials: int,
                    rate: float, settle: float, stop: bool = False) -> dict[str, Any]:
    """The peer's kill -9 failover, or (``stop``) its graceful stop."""
    name = "PEERSTOP" if stop else "PEER"
    if stop:
        tmp = tmp / "peer-stop"
    await js.add_stream(api.StreamConfig(name=name, subjects=[f"{name.lower()}.*"]))
    records = Records(tmp / "peer")
    (tmp / "peer").mkdir(parents=True)
    running: list[PeerProcess] = []
    paths: dict[int, Path] = {}

    async def start() -> PeerProcess:
        path = tmp / "peer" / f"{len(paths)}.jsonl"
        path.touch()
        peer = await PeerProcess(python, url, tmp / f"peer-{len(paths)}.log").start()
        running.append(peer)
        paths[peer.pid] = path
        await peer.call("consume", kind="elastic", stream=name, group="g", member="m1",
                        record=str(path), max_ack_pending=PEER_MAX_ACK_PENDING)
        return peer

    async with PeerProcess(python, url, tmp / "peer-admin.log") as admin_peer:
        await admin_peer.call("create_elastic", stream=name, group="g",
                              max_members=PARTITIONS, filters=[[f"{name.lower()}.*", [1]]])
        await admin_peer.call("add_members", stream=name, group="g", members=["m1"])
    traffic: KeyedTraffic | None = None
    try:
        traffic = await KeyedTraffic(url, name.lower(), rate).start()
        await start()
        await wait_for(lambda: records.poll() is not None and records.ends(), 60, 0.05,
                       "the first peer instance to process")
        await start()
        gaps = []
        for _ in range(trials):
            alive = [p for p in running if p.proc is not None and p.proc.returncode is None]
            names = {instance(p) for p in alive}

            def one_processes(names: set[str] = names) -> bool:
                records.poll()
                return records.latest_instance() in names

            await wait_for(one_processes, 60, 0.05, "a processing peer")
            await asyncio.sleep(settle)
            records.poll()
            active = next(p for p in alive if instance(p) == records.latest_instance())
            standby = next(p for p in alive if p is not active)
            t = time.time()
            if stop:
                await active.call("stop")
            else:
                active.kill()
            first = await first_end(paths[standby.pid], instance(standby), t)
            gaps.append(first["t"] - t)
            await active.close()
            running.remove(active)
            await start()
        sent = await traffic.stop()
        traffic = None
        await wait_for(lambda: records.poll() is not None
                       and {n for _, n in sent} <= {e["n"] for e in records.ends()},
                       120, 0.1, "every message processed by the peer")
    finally:
        if traffic is not None:
            await traffic.stop()
        for peer in running:
            await peer.close()
    verdict = check(records.as_record(), sent, rewinds=True)
    fault = ("the processing instance stops its consume session" if stop
             else "kill -9 of the processing instance")
    return {"what": f"natsio-pcgroups, {fault} (max ack pending "
                    f"{PEER_MAX_ACK_PENDING}, ack wait 5 s = pinned TTL), to the standby's "
                    "first processed message", **summary(gaps),
            "checks": {"published": len(sent), "lost": len(verdict.lost),
                       "order_violations": len(verdict.order_violations),
                       "duplicates": verdict.duplicates}}


# -- network loss ----------------------------------------------------------------------
def log_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


async def netns_part(tmp: Path, trials: int, rate: float, cuts: list[float],
                     settle: float) -> dict[str, Any]:
    ns = VethNamespace()
    try:
        ns.create()
    except (NetnsUnavailable, OSError) as exc:
        ns.close()
        return {"skipped": f"network namespaces unavailable: {exc}"}
    result: dict[str, Any] = {
        "what": "the active instance's network cut (no connection close) for each length: "
                "the standby's first processed message after the cut; when the old owner "
                "last started work; its starts after the takeover and messages both ran; "
                "when it stepped down after the link came back"}
    try:
        with running_server(backend="process", host=ns.host_addr,
                            workdir=tmp / "netns-server") as srv:
            nc = await nats.connect(servers=[srv.url], **client_options())
            try:
                js = JetStream(nc, timeout=10)
                await group(js, "NET")
                traffic = await KeyedTraffic(srv.url, "net", rate).start()
                records = Records(tmp / "netns")
                with Members(srv.url, "NET", "g", handler="bench.handlers:events",
                             records=tmp / "netns", logs=tmp / "netns-logs",
                             metrics=False) as procs:
                    isolated = procs.start("m1", netns=ns.name)
                    await wait_for(_processing(records, isolated), 60, 0.05,
                                   "the namespaced instance to process")
                    for cut in cuts:
                        runs = await _netns_trials(ns, procs, isolated, records, trials, cut,
                                                   settle)
                        result[f"cut_{cut:g}s"] = _netns_summary(runs)
                        if any("note" in r for r in runs):
                            break
                await traffic.stop()
            finally:
                await nc.close()
    finally:
        ns.close()
    return result


def _netns_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if "takeover_s" in r]
    return {"trials": len(runs),
            "takeover": summary([r["takeover_s"] for r in done]),
            "old_owner_last_start_after_cut_s_max": max(
                (r["old_last_start_after_cut_s"] for r in done), default=None),
            "old_owner_starts_after_takeover": sum(r["old_starts_after_takeover"]
                                                   for r in done),
            "run_by_both": sum(r["run_by_both"] for r in done),
            "stepped_down_after_heal": summary([r["stepped_down_after_heal_s"] for r in done
                                                if r["stepped_down_after_heal_s"] is not None]),
            "runs": runs}


def _processing(records: Records, proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
    """Whether ``proc`` completed a message in the last 0.3 s."""
    def check() -> bool:
        records.poll()
        return any(e["event"] == "end" and e["instance"] == instance(proc)
                   and e["t"] > time.time() - 0.3 for e in records.events[-100:])
    return check


async def _netns_trials(ns: VethNamespace, procs: Members, isolated: subprocess.Popen[bytes],
                        records: Records, trials: int, cut_for: float,
                        settle: float) -> list[dict[str, Any]]:
    """Each trial starts with ``isolated`` (in the namespace) active: a fresh standby
    joins, the link is cut for ``cut_for`` seconds, healed; once ``isolated`` stepped
    down, the standby is stopped (SIGTERM) so ``isolated`` takes over again."""
    runs: list[dict[str, Any]] = []
    for _ in range(trials):
        standby = procs.start("m1")
        await wait_for(partial(procs.joined, standby), 60, 0.05, "the standby to join")
        await asyncio.sleep(settle)
        records.poll()
        t_cut = time.time()
        await asyncio.to_thread(ns.cut)
        run: dict[str, Any] = {}
        try:
            first = await first_end(procs.record_paths[standby.pid], instance(standby), t_cut)
        except AssertionError as exc:
            run["error"] = str(exc)
        await asyncio.sleep(max(0.0, t_cut + cut_for - time.time()))  # the cut's duration
        t_heal = time.time()
        await asyncio.to_thread(ns.heal)

        def stepped_down(after: float = t_cut) -> dict[str, Any] | None:
            return next((e for e in procs.events(isolated) if e.get("event") == "stepped down"
                         and log_time(e) > after), None)

        try:
            event = await wait_for(stepped_down, 60, 0.1, "the cut-off instance to step down")
            stepped_at = log_time(event)
            stepped_after: float | None = stepped_at - t_heal
        except AssertionError:
            stepped_at, stepped_after = time.time(), None
        records.poll()
        if "error" not in run:
            taken = min(e["t"] for e in records.starts(instance(standby), t_cut))
            # Until it stepped down: what it starts later is after a legitimate return.
            old = [e for e in records.starts(instance(isolated), t_cut)
                   if e["t"] <= stepped_at]
            new_ns = {e["n"] for e in records.starts(instance(standby), t_cut)}
            run |= {"takeover_s": round(first["t"] - t_cut, 3),
                    "old_last_start_after_cut_s": round(max((e["t"] for e in old),
                                                            default=t_cut) - t_cut, 3),
                    "old_starts_after_takeover": sum(e["t"] > taken for e in old),
                    "run_by_both": len({e["n"] for e in old} & new_ns),
                    "stepped_down_after_heal_s": (None if stepped_after is None
                                                  else round(stepped_after, 3))}
        runs.append(run)
        if stepped_after is None or isolated.poll() is not None:
            run["note"] = "the cut-off instance did not step down; trials stopped"
            break
        # Hand the member back to the namespaced instance for the next trial.
        standby.send_signal(signal.SIGTERM)
        await asyncio.to_thread(standby.wait, 30)
        await wait_for(_processing(records, isolated), 60, 0.05,
                       "the namespaced instance to resume")
    return runs


# -- all of it -------------------------------------------------------------------------
async def main(parts: set[str], trials: int = 20, peer_trials: int = 20, rate: float = 200,
               stall: float = 2.0, stall_trials: int = 5, netns_trials: int = 5,
               cuts: tuple[float, ...] = (0.5, 5.0), settle: float = 1.0,
               observe: float = 5.0, workdir: Path | None = None,
               baseline: Path | None = None, rounds: int = 1) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "failover", "machine": machine(),
        "setup": {"members": 1, "instances": 2, "partitions": PARTITIONS, "rate": rate,
                  "trials": trials, "settle_s": settle, "cgroupd_options": "defaults",
                  "rounds": rounds}}
    # (suffix of the result's keys, where cgroupd comes from): None is `-m cgroupd`.
    sides: list[tuple[str, Path | None]] = [("", None)]
    rev = ""
    if baseline is not None:
        path = revision.check(baseline)
        rev = revision.name(path)
        sides = [(f"@{rev}", path), ("", ROOT)]
        result["baseline"] = {"path": str(path), "revision": rev}
    with server() as srv, tempfile.TemporaryDirectory(prefix="bench-failover-") as scratch:
        tmp = str(workdir or scratch)
        nc = await nats.connect(servers=[srv.url], **client_options())
        js = JetStream(nc, timeout=10)
        try:
            if parts & {"sigkill", "sigterm", "stall"}:
                runs: dict[str, list[dict[str, Any]]] = {suffix: [] for suffix, _ in sides}
                for turn in range(rounds):
                    for suffix, code in sides if turn % 2 == 0 else sides[::-1]:
                        index = sum(map(len, runs.values()))
                        where = Path(tmp) if rounds * len(sides) == 1 else \
                            Path(tmp) / f"cgroupd{suffix}-{turn}"
                        runs[suffix].append(await cgroupd_parts(
                            srv.url, nc, js, where, parts, trials, rate, stall, stall_trials,
                            settle, observe, f"BENCH{index or ''}", code))
                for suffix, done in runs.items():
                    result |= {f"{key}{suffix}": value for key, value in pool(done).items()}
                if baseline is not None:
                    result["baseline"]["x_baseline"] = add_x_baseline(result, rev)
            for part, stop in (("peer", False), ("peer_stop", True)):
                if part not in parts:
                    continue
                try:
                    python = peer_python()
                    reason = "" if python else why()
                except RuntimeError as exc:
                    python, reason = None, str(exc)
                result[part] = (
                    await peer_part(srv.url, nc, js, python, Path(tmp), peer_trials, rate,
                                    settle, stop) if python else {"skipped": reason})
        finally:
            await nc.close()
        if "netns" in parts:
            result["netns"] = await netns_part(Path(tmp), netns_trials, rate, list(cuts),
                                               settle)
    result["machine"]["load_average_after"] = machine()["load_average_1_5_15_min"]
    add_x_peer(result)
    result["targets"] = targets(result)
    return result


def add_x_peer(result: dict[str, Any]) -> None:
    """How many times faster than the peer (its time over ours, p50 and p99), where both
    ran: kill -9 against the peer's kill -9, SIGTERM against the peer's stop."""
    for ours, theirs in (("sigkill", "peer"), ("sigterm", "peer_stop")):
        mine, peer = result.get(ours), result.get(theirs)
        if not isinstance(mine, dict) or not isinstance(peer, dict):
            continue
        mine["x_peer"] = {q: round(peer[q] / mine[q], 1) if peer.get(q) and mine.get(q)
                          else None for q in ("p50_s", "p99_s")}


def targets(result: dict[str, Any]) -> dict[str, bool | None]:
    """Issue 15's targets (None when the part did not run)."""

    def get(*path: str) -> Any:
        value: Any = result
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def bound(value: Any, limit: float, most: bool = True) -> bool | None:
        return None if value is None else (value <= limit if most else value >= limit)

    stall_runs = [get("stall", kind) for kind in ("event_loop_blocked", "sigstop")]
    netns = [v for k, v in (result.get("netns") or {}).items() if k.startswith("cut_")]
    return {
        "sigkill p50 <= 0.3 s": bound(get("sigkill", "p50_s"), 0.3),
        "sigkill p99 <= 0.6 s": bound(get("sigkill", "p99_s"), 0.6),
        "sigterm p99 <= 0.05 s": bound(get("sigterm", "p99_s"), 0.05),
        "stall: 0 takeovers, 0 overlaps": None if None in stall_runs else all(
            r["takeovers"] == 0 and r["overlaps"] == 0 for r in stall_runs),
        "netns: old owner starts nothing after the takeover": None if not netns else all(
            cut["old_owner_starts_after_takeover"] == 0 for cut in netns),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run ({', '.join(PARTS)})")
    parser.add_argument("--trials", type=int, default=20, help="kill -9 and SIGTERM trials")
    parser.add_argument("--peer-trials", type=int, default=None,
                        help="the peer's kill -9 trials [default: --trials]")
    parser.add_argument("--rate", type=float, default=200, help="msg/s during the trials")
    parser.add_argument("--stall", type=float, default=2.0, help="seconds an owner stalls")
    parser.add_argument("--stall-trials", type=int, default=5, help="trials per stall kind")
    parser.add_argument("--netns-trials", type=int, default=5)
    parser.add_argument("--cuts", default="0.5,5",
                        help="comma-separated seconds the link is down, each --netns-trials "
                             "times")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds a fresh standby stands by before a fault")
    parser.add_argument("--observe", type=float, default=5.0,
                        help="seconds watched after a stall ends")
    parser.add_argument("--baseline", type=Path, default=None, metavar="PATH",
                        help="run the cgroupd parts also with the cgroupd/ package in PATH "
                             "(another revision: python -m bench.revision checkout REV PATH)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the cgroupd parts of each side this many times, "
                             "alternating; trials pooled")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the records and logs here (an empty directory) to see "
                             "where a slow trial's time went")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.baseline is not None:
        try:
            revision.check(args.baseline)
        except ValueError as exc:
            parser.error(str(exc))
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    emit(asyncio.run(main(set(args.parts.split(",")), args.trials,
                          args.trials if args.peer_trials is None else args.peer_trials,
                          args.rate, args.stall, args.stall_trials, args.netns_trials,
                          tuple(float(c) for c in args.cuts.split(",")), args.settle,
                          args.observe, args.workdir, args.baseline, args.rounds)))
