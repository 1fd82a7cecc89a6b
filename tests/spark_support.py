"""Helpers for the Spark tests: one local SparkSession, queries run to the end, and
data sources that fail once on purpose.

Spark's Python workers import this module (the failing sources are pickled by
reference), so the SparkSession is started with the repository root on ``PYTHONPATH``.
Both the driver-side and the executor-side Python processes are children of the JVM,
which :func:`stop_spark` ends, so a test module leaves no Java or Python process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSourceStreamWriter, InputPartition
from pyspark.sql.streaming import StreamingQuery

import cgroupd.spark
from cgroupd.jetstream import JetStream
from cgroupd.spark.options import SinkOptions, SourceOptions
from cgroupd.spark.source import CgroupdDataSource, CgroupdStreamReader, GroupPartitions
from cgroupd.spark.writer import CgroupdStreamWriter, PublishReport

ROOT = Path(__file__).resolve().parent.parent
#: Bound on any one Spark query in the tests.
QUERY_TIMEOUT = 120.0


def start_spark(tmp: Path) -> SparkSession:
    """A local[2] session whose Python workers use this interpreter and see ``tests``."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    spark = (SparkSession.builder.master("local[2]")
             .appName("cgroupd-tests")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.sql.streaming.stopTimeout", "30s")
             .config("spark.local.dir", str(tmp / "spark-local"))
             .config("spark.sql.warehouse.dir", str(tmp / "warehouse"))
             .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={tmp}")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    cgroupd.spark.register(spark)
    spark.dataSource.register(FlakySource)
    spark.dataSource.register(FlakySink)
    return spark


def stop_spark(spark: SparkSession) -> None:
    """Stop every query, the session, and the JVM with its Python workers."""
    from pyspark import SparkContext

    for query in spark.streams.active:
        with contextlib.suppress(Exception):
            query.stop()
    spark.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        with contextlib.suppress(Exception):
            if proc.stdin is not None:
                proc.stdin.close()  # the JVM exits when its stdin closes
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def source(spark: SparkSession, url: str, stream: str = "ORDERS", group: str = "g",
           fmt: str = "cgroupd", **options: Any) -> DataFrame:
    reader = (spark.readStream.format(fmt).option("servers", url).option("stream", stream)
              .option("group", group).option("leaseInactiveThreshold", "1"))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def to_parquet(df: DataFrame, out: Path, *, available_now: bool = True,
               name: str | None = None) -> StreamingQuery:
    """Start ``df`` into Parquet at ``out/data`` with its checkpoint in ``out/checkpoint``."""
    writer = (df.writeStream.format("parquet").option("path", str(out / "data"))
              .option("checkpointLocation", str(out / "checkpoint")))
    if name:
        writer = writer.queryName(name)
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="200 milliseconds")
    return writer.start()


def finish(query: StreamingQuery, timeout: float = QUERY_TIMEOUT) -> None:
    """Wait for an AvailableNow query to end; raise its error if it failed."""
    if not query.awaitTermination(timeout):
        query.stop()
        raise AssertionError(f"query did not finish within {timeout}s")


def wait_for(check: Any, timeout: float = 60.0, what: str = "condition",
             interval: float = 0.1) -> Any:
    """Poll ``check`` (blocking) until truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_sourced(js: JetStream, stream: str, count: int, timeout: float = 20.0) -> None:
    """Wait until the group's work-queue stream holds ``count`` messages."""
    deadline = time.monotonic() + timeout
    while True:
        info = await js.stream_info(stream)
        if info is not None and info.state.messages >= count:
            return
        if time.monotonic() > deadline:
            have = info.state.messages if info else None
            raise AssertionError(f"{stream} holds {have} messages, expected {count}")
        await asyncio.sleep(0.05)


# -- failures on purpose ----------------------------------------------------------------
class FlakyReader(CgroupdStreamReader):
    """The first read anywhere fails after emitting its first batch; later reads work.

    In ``failOnceDir``: ``failed`` names the ranges of the read that failed, and every
    read appends its ranges (``<partition>-<start>-<end>``, space-separated) to
    ``reads.log``.
    """

    def __init__(self, options: SourceOptions, marker_dir: str) -> None:
        super().__init__(options)
        self.marker_dir = marker_dir

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, GroupPartitions)
        folder = Path(self.marker_dir)
        names = " ".join(f"{r.partition}-{r.start}-{r.end}" for r in partition.ranges)
        with open(folder / "reads.log", "a") as log:
            log.write(names + "\n")
        try:
            with open(folder / "failed", "x") as marker:
                marker.write(names)
            fail = True
        except FileExistsError:
            fail = False
        for i, batch in enumerate(super().read(partition)):
            yield batch
            if fail and i == 0:
                raise RuntimeError(f"injected read failure in {names}")


class FlakySource(CgroupdDataSource):
    @classmethod
    def name(cls) -> str:
        return "cgroupd_flaky"

    def streamReader(self, schema: Any) -> FlakyReader:
        return FlakyReader(SourceOptions.parse(self.options), self.options["failOnceDir"])


class FlakyWriter(CgroupdStreamWriter):
    """The first task anywhere publishes its rows, then fails; later tasks work.

    Each task that gets to the end appends ``<name> <published> <duplicates>`` to
    ``reports.log`` in ``failOnceDir``.
    """

    def __init__(self, options: SinkOptions, schema: Any, marker_dir: str) -> None:
        super().__init__(options, schema)
        self.marker_dir = marker_dir

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        from pyspark import TaskContext

        report = super().write(iterator)
        ctx = TaskContext.get()
        assert ctx is not None
        name = f"batch-{ctx.getLocalProperty('streaming.sql.batchId')}-{ctx.partitionId()}"
        folder = Path(self.marker_dir)
        with open(folder / "reports.log", "a") as log:
            log.write(f"{name} {report.published} {report.duplicates}\n")
        try:
            with open(folder / "failed", "x") as marker:
                marker.write(name)
        except FileExistsError:
            return report
        raise RuntimeError(f"injected failure after publishing {name}")


class FlakySink(CgroupdDataSource):
    @classmethod
    def name(cls) -> str:
        return "cgroupd_flaky_sink"

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamWriter:
        return FlakyWriter(SinkOptions.parse(self.options), schema, self.options["failOnceDir"])
