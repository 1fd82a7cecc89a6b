"""What reading the lag costs at 1,000 partitions: one direct get per partition (what an
active instance does every --status-interval for its partitions, and `cgroupd status`
for all of them), against the stream-info subject listing it replaced, plus rendering
/metrics with 1,000 partitions' lag series.

Run: ``python -m bench.lag [--partitions 1000] [--messages 20000] [--keys 5000]``.
The whole group's lag is measured from one client: a fleet spreads it over the active
instances (each reads only its own partitions), so this is the fleet's total per interval.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench.common import (
    connected,
    emit,
    keyed_group,
    machine,
    origin_stream,
    publish,
    server,
    stream_messages,
    wait_for,
)
from cgroupd import admin
from cgroupd.admin.lag import read_lag
from cgroupd.join.metrics import Metrics


def _server_cpu(pid: int) -> float:
    """CPU seconds the server process used so far (user + system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime, stime in clock ticks


async def main(partitions: int, messages: int, keys: int, rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "lag", "partitions": partitions,
                              "messages": messages, "keys": keys, "machine": machine()}
    with server() as srv:
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "lag", partitions)
            await publish(js, messages, keys=keys)
            await wait_for(lambda: _sourced(js, messages), 120, 0.1, "sourcing")
            stored = await admin.get_group(js, "BENCH", "lag")
            nc = js.nc
            timings, server_cpu, received = [], [], []
            lags = {}
            for _ in range(rounds):
                bytes_before, cpu_before = nc.stats["in_bytes"], _server_cpu(srv.pid)
                started = time.perf_counter()
                lags = await read_lag(js, stored.consume_stream, stored.config,
                                      range(partitions))
                timings.append(time.perf_counter() - started)
                server_cpu.append(_server_cpu(srv.pid) - cpu_before)
                received.append(nc.stats["in_bytes"] - bytes_before)
            assert sum(x.messages for x in lags.values()) == messages
            result["direct_get"] = {
                "requests_per_read": partitions,
                "seconds_per_read_median": sorted(timings)[len(timings) // 2],
                "seconds_per_read_max": max(timings),
                "server_cpu_seconds_per_read": sum(server_cpu) / rounds,
                "payload_bytes_received_per_read": sum(received) // rounds,
                "partitions_with_messages": sum(1 for x in lags.values() if x.messages),
            }
            # What status used before: every subject's count in one stream-info answer.
            listing = []
            for _ in range(rounds):
                bytes_before = nc.stats["in_bytes"]
                started = time.perf_counter()
                counts = await js.subject_counts(stored.consume_stream)
                listing.append((time.perf_counter() - started,
                                nc.stats["in_bytes"] - bytes_before))
            result["subject_listing"] = {
                "subjects": len(counts),
                "seconds_per_read_median": sorted(t for t, _ in listing)[rounds // 2],
                "payload_bytes_received_per_read": sum(b for _, b in listing) // rounds,
            }
    metrics = Metrics("BENCH", "lag", "m1")
    now = time.time()
    values = {p: (x.messages, x.seconds(now)) for p, x in lags.items()}
    started = time.perf_counter()
    metrics.set_lag(values, 0.0)
    result["metrics"] = {"set_lag_seconds": time.perf_counter() - started}
    started = time.perf_counter()
    body = metrics.render()
    result["metrics"].update(render_seconds=time.perf_counter() - started,
                             render_bytes=len(body))
    return result


async def _sourced(js: Any, n: int) -> bool:
    return await stream_messages(js, "BENCH-lag") >= n


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    emit(asyncio.run(main(args.partitions, args.messages, args.keys, args.rounds)))
