"""Rebalance pauses: 4 members under steady traffic; add a 5th, then drop one.

For each change: the longest gap between completions of the partitions that moved, and of
those that did not (a gap under normal traffic is ~1/rate per partition), and how many
messages were processed more than once. Run: ``python -m bench.rebalance [--rate 400]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import (
    Members,
    connected,
    emit,
    keyed_group,
    machine,
    origin_stream,
    read_records,
    server,
    steady_traffic,
    wait_for,
)
from cgroupd import admin
from cgroupd.core.partitions import moved_partitions

PARTITIONS = 20


def longest_gap(records: list[dict[str, Any]], partitions: set[int], start: float,
                end: float) -> float:
    """Longest time between two completions of ``partitions`` within [start, end]."""
    times = sorted(r["t"] for r in records if r["p"] in partitions and start < r["t"] < end)
    return max((b - a for a, b in itertools.pairwise(times)), default=float("nan"))


async def change(js: Any, record: Path, what: str, apply: Any) -> dict[str, Any]:
    before = (await admin.get_group(js, "BENCH", "g")).config
    t0 = time.time()
    after = await apply()
    await asyncio.sleep(5)  # let the measurement window fill (and precede the next change)
    records = read_records(record)
    moved = moved_partitions(before, after)
    unmoved = set(range(PARTITIONS)) - moved
    return {"change": what, "moved_partitions": len(moved),
            "pause_moved_s": round(longest_gap(records, moved, t0 - 0.5, t0 + 3.5), 3),
            "pause_unmoved_s": round(longest_gap(records, unmoved, t0 - 0.5, t0 + 3.5), 3),
            # The same measure over the 3.5 s before the change: normal latency.
            "normal_moved_s": round(longest_gap(records, moved, t0 - 4, t0 - 0.5), 3),
            "normal_unmoved_s": round(longest_gap(records, unmoved, t0 - 4, t0 - 0.5), 3)}


async def main(rate: float) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "rebalance", "rate": rate,
                              "partitions": PARTITIONS, "machine": machine()}
    with server() as srv, tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record.jsonl"
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "g", PARTITIONS, ("m1", "m2", "m3", "m4"))
            with Members(srv.url, "BENCH", "g", handler="bench.handlers:record",
                         record=record) as procs:
                for name in ("m1", "m2", "m3", "m4", "m5"):
                    procs.start(name)
                await wait_for(lambda: asyncio.to_thread(procs.ready), 60, 0.05, "ready")
                stop = asyncio.Event()
                publisher = asyncio.create_task(steady_traffic(js, rate, stop))
                await asyncio.sleep(5)
                result["add_member"] = await change(
                    js, record, "add m5",
                    lambda: admin.add_members(js, "BENCH", "g", ["m5"]))
                result["drop_member"] = await change(
                    js, record, "drop m2",
                    lambda: admin.drop_members(js, "BENCH", "g", ["m2"]))
                stop.set()
                published = await publisher
                await wait_for(lambda: len({r["seq"] for r in read_records(record)})
                               >= published, 60, 0.1, "all processed")
            counts = Counter(r["seq"] for r in read_records(record))
            result["published"] = published
            result["processed_more_than_once"] = sum(1 for n in counts.values() if n > 1)
    result["targets"] = {
        "moved pause <= 1 s": all(result[c]["pause_moved_s"] <= 1.0
                                  for c in ("add_member", "drop_member")),
        "no redelivery on planned changes": result["processed_more_than_once"] == 0,
    }
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=400)
    emit(asyncio.run(main(parser.parse_args().rate)))
