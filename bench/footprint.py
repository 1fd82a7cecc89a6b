"""Footprint of an idle member: RSS of the active instance and of a standby, and the CPU
each of them and the server burn while nothing is published (pulling, heartbeats,
self-checks, a standby's attempts to take over).

``--extra ARGS`` passes options to both instances (to measure a proposed default, e.g.
``--extra '--retry-interval 2'``), ``--settings`` member settings the command line lacks
(:mod:`bench.variant`, e.g. ``pull_expires=5,heartbeat=1``); ``--profile-standby``
samples the standby with py-spy over the idle window (``waiting_in_select_share`` is how
much of its sampled time it slept in the event loop) to say what wakes it up.
Run: ``python -m bench.footprint [--seconds 10] [--extra ARGS] [--profile-standby]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    Members,
    connected,
    cpu_seconds,
    emit,
    keyed_group,
    machine,
    metric,
    origin_stream,
    rss_mb,
    server,
    wait_for,
)
from bench.profile import analyse_py_spy, start_py_spy
from tests.support.natsserver import NatsServer


def wakeups(pid: int) -> int:
    """Voluntary context switches of all of ``pid``'s threads so far: each is a sleep
    (an event loop's ``select``, a goroutine parking) that something woke up again, which
    is what an idle process's CPU is spent on."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def _pid(srv: NatsServer) -> int:
    assert srv.pid is not None
    return srv.pid


async def main(seconds: float, extra: tuple[str, ...] = (),
               profile_standby: bool = False, variant: str = "") -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "footprint", "seconds": seconds,
                              "options": " ".join(extra) or "(defaults)",
                              "settings": variant or "(defaults)",
                              "machine": machine()}
    with server() as srv:
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "g", 8, ("m1",))
            with Members(srv.url, "BENCH", "g", extra=extra) as procs, \
                    tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp:
                launcher = ("-m", "bench.variant", variant, "--") if variant else (
                    "-m", "cgroupd")
                procs.start("m1", launcher=launcher)
                procs.start("m1", launcher=launcher)
                await wait_for(lambda: asyncio.to_thread(procs.ready), 60, 0.05, "ready")
                active = await wait_for(lambda: next(
                    (p for _, p in procs.procs
                     if metric(procs, p, "cgroupd_member_active") == 1), None), 30, 0.05)
                standby = next(p for _, p in procs.procs if p is not active)
                await asyncio.sleep(2)
                spy = None
                out = Path(tmp) / "standby.txt"
                if profile_standby:
                    spy = await start_py_spy(standby.pid, out, 1000)
                pids = (active.pid, standby.pid, _pid(srv))
                before = {pid: cpu_seconds(pid) for pid in pids}
                woke = {pid: wakeups(pid) for pid in pids}
                await asyncio.sleep(seconds)
                rates = {pid: round((wakeups(pid) - woke[pid]) / seconds, 1) for pid in pids}
                result["server_wakeups_per_s"] = rates[_pid(srv)]
                result["server_cpu_percent"] = round(
                    100 * (cpu_seconds(_pid(srv)) - before[_pid(srv)]) / seconds, 2)
                result["active"] = {
                    "rss_mb": round(rss_mb(active.pid), 1), "wakeups_per_s": rates[active.pid],
                    "cpu_percent": round(100 * (cpu_seconds(active.pid) - before[active.pid])
                                         / seconds, 2)}
                result["standby"] = {
                    "rss_mb": round(rss_mb(standby.pid), 1),
                    "wakeups_per_s": rates[standby.pid],
                    "cpu_percent": round(100 * (cpu_seconds(standby.pid)
                                                - before[standby.pid]) / seconds, 2)}
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    await asyncio.wait_for(spy.wait(), 60)
                    result["standby"]["profile"] = analyse_py_spy(out, 0.0, 15)
    result["machine"]["load_average_after"] = machine()["load_average_1_5_15_min"]
    result["targets"] = {"idle member RSS <= 60 MB": result["active"]["rss_mb"] <= 60}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--extra", default="", help="cgroupd join options for both")
    parser.add_argument("--settings", default="", metavar="NAME=VALUE,...",
                        help="member settings the CLI lacks, via bench.variant "
                             "(e.g. pull_expires=5,heartbeat=1)")
    parser.add_argument("--profile-standby", action="store_true",
                        help="sample the standby with py-spy (pip install py-spy)")
    a = parser.parse_args()
    emit(asyncio.run(main(a.seconds, tuple(shlex.split(a.extra)), a.profile_standby,
                          a.settings)))
