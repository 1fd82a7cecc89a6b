"""Footprint of an idle member: RSS of the active instance and of a standby, and the CPU
an idle active instance burns (pulling, heartbeats, self-checks).
Run: ``python -m bench.footprint [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def main(seconds: float) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "footprint", "seconds": seconds,
                              "machine": machine()}
    with server() as srv:
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "g", 8, ("m1",))
            with Members(srv.url, "BENCH", "g") as procs:
                procs.start("m1")
                procs.start("m1")
                await wait_for(lambda: asyncio.to_thread(procs.ready), 60, 0.05, "ready")
                active = await wait_for(lambda: next(
                    (p for _, p in procs.procs
                     if metric(procs, p, "cgroupd_member_active") == 1), None), 30, 0.05)
                standby = next(p for _, p in procs.procs if p is not active)
                await asyncio.sleep(2)
                before = {p.pid: cpu_seconds(p.pid) for p in (active, standby)}
                await asyncio.sleep(seconds)
                result["active"] = {
                    "rss_mb": round(rss_mb(active.pid), 1),
                    "cpu_percent": round(100 * (cpu_seconds(active.pid) - before[active.pid])
                                         / seconds, 2)}
                result["standby"] = {
                    "rss_mb": round(rss_mb(standby.pid), 1),
                    "cpu_percent": round(100 * (cpu_seconds(standby.pid)
                                                - before[standby.pid]) / seconds, 2)}
    result["targets"] = {"idle member RSS <= 60 MB": result["active"]["rss_mb"] <= 60}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    emit(asyncio.run(main(parser.parse_args().seconds)))
