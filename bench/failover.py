"""Failover gap: one member, two instances, steady traffic; kill or stop the active one.

For each trial the gap is the time from the last message the old instance finished to the
first message the new one finished (both recorded by the handler), so it includes the
time the new instance needs to deliver, not just to be elected. Run:
``python -m bench.failover [--trials 10] [--rate 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Members,
    connected,
    emit,
    keyed_group,
    machine,
    metric,
    origin_stream,
    percentile,
    read_records,
    server,
    steady_traffic,
    wait_for,
)


async def trials(url: str, js: Any, record: Path, count: int, sig: signal.Signals,
                 procs: Members) -> list[float]:
    gaps = []
    for _ in range(count):
        alive = [p for _, p in procs.procs if p.poll() is None]
        active = await wait_for(
            lambda alive=alive: next(  # type: ignore[misc]
                (p for p in alive if metric(procs, p, "cgroupd_member_active") == 1), None),
            30, 0.05, "an active instance")
        standby = next(p for p in alive if p is not active)
        await wait_for(lambda s=standby: procs.probe(s), 30, 0.05, "standby ready")
        await wait_for(lambda a=active: any(r["pid"] == a.pid for r in read_records(record)
                                            if r["t"] > time.time() - 0.5),
                       30, 0.05, "traffic")
        active.send_signal(sig)
        await wait_for(lambda s=standby: any(r["pid"] == s.pid for r in read_records(record)),
                       30, 0.02, "the standby to deliver")
        await asyncio.to_thread(active.wait)
        records = read_records(record)
        last_old = max(r["t"] for r in records if r["pid"] == active.pid)
        first_new = min(r["t"] for r in records if r["pid"] == standby.pid)
        gaps.append(first_new - last_old)
        procs.start("m1")  # a fresh standby for the next trial
    return gaps


async def main(count: int, rate: float) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "failover", "trials": count, "rate": rate,
                              "machine": machine()}
    with server() as srv, tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record.jsonl"
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "g", 4, ("m1",))
            stop = asyncio.Event()
            publisher = asyncio.create_task(steady_traffic(js, rate, stop))
            with Members(srv.url, "BENCH", "g", handler="bench.handlers:record",
                         record=record) as procs:
                procs.start("m1")
                procs.start("m1")
                await wait_for(lambda: asyncio.to_thread(procs.ready), 60, 0.05, "ready")
                for sig in (signal.SIGKILL, signal.SIGTERM):
                    gaps = await trials(srv.url, js, record, count, sig, procs)
                    result[sig.name] = {
                        "p50_s": round(percentile(gaps, 50), 3),
                        "p99_s": round(percentile(gaps, 99), 3),
                        "max_s": round(max(gaps), 3),
                        "gaps_s": [round(g, 3) for g in gaps]}
            stop.set()
            result["published"] = await publisher
    result["targets"] = {
        "SIGKILL p50 <= 1.0 s": result["SIGKILL"]["p50_s"] <= 1.0,
        "SIGKILL p99 <= 1.5 s": result["SIGKILL"]["p99_s"] <= 1.5,
        "SIGTERM p99 <= 0.3 s": result["SIGTERM"]["p99_s"] <= 0.3,
    }
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--rate", type=float, default=200)
    args = parser.parse_args()
    emit(asyncio.run(main(args.trials, args.rate)))
