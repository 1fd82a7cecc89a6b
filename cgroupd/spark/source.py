"""``spark.readStream.format("cgroupd")``: a consumer group as a Spark streaming source.

Reads a group the way Spark's Kafka source reads a topic: group partitions are the
source's partitions, progress is ``{"<partition>": last stream sequence}`` kept in Spark's
checkpoint, and each partition is read in order by one task.

Life of a query:

* The reader object is created on the driver and pickled to the executors. Only the
  driver-side copy (the Python process the JVM keeps for the query) opens a
  :class:`~cgroupd.spark.driver.DriverSession`, lazily, on the first driver call: it
  connects, reads the group config and takes the lease (:mod:`cgroupd.spark.lease`).
* ``latestOffset`` asks, per partition, for the last sequence on ``<p>.>`` and applies
  ``maxMessagesPerTrigger`` (admission control, ``ReadMaxRows``).
* ``partitions`` plans the batch's ranges (a pure function of the offsets, so a replay
  after a failure plans the same tasks); ``read`` runs on executors over a connection of
  its own and fetches ``(start, end]`` of each partition with batched direct get.
* ``commit(end)`` purges each partition below ``end + 1``. Spark calls it for batch N
  while planning batch N+1, after the sink committed N; never for the last batch before a
  stop, which is why purging is derived from ``end`` alone and idempotent.

Never run the source and a daemon instance of the same member at once: the daemon's data
consumer would ack, and so delete, messages Spark may still need to replay. The lease
enforces it for as long as the query runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import structlog
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from cgroupd.config import PartitioningFilter
from cgroupd.errors import ConfigError
from cgroupd.spark.directget import DirectGet, ReaderClient
from cgroupd.spark.driver import DriverSession, LoopThread
from cgroupd.spark.offsets import KeyExtractor, Offsets, Range, decode, encode, plan
from cgroupd.spark.options import SinkOptions, SourceOptions
from cgroupd.spark.rows import record_batch, sequence_of

FORMAT = "cgroupd"

SCHEMA = StructType([
    StructField("partition", IntegerType()),
    StructField("stream_sequence", LongType()),
    StructField("subject", StringType()),
    StructField("key", StringType()),
    StructField("data", BinaryType()),
    StructField("headers", MapType(StringType(), StringType())),
    StructField("timestamp", TimestampType()),
])


@dataclass(frozen=True)
class GroupPartitions(InputPartition):
    """One task's work: ranges of one or more partitions, read one after the other."""

    stream: str
    ranges: tuple[Range, ...]
    filters: tuple[PartitioningFilter, ...]


class CgroupdDataSource(DataSource):
    """The ``cgroupd`` format: a streaming source and a (streaming or batch) sink.

    Register it with :func:`cgroupd.spark.register` (or
    ``spark.dataSource.register(CgroupdDataSource)``).
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if schema is not None and schema.simpleString() != SCHEMA.simpleString():
            raise ConfigError(f"the cgroupd source has a fixed schema ({SCHEMA.simpleString()}); "
                              "do not pass .schema(...)")
        return CgroupdStreamReader(SourceOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from cgroupd.spark.writer import CgroupdBatchWriter

        return CgroupdBatchWriter(SinkOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from cgroupd.spark.writer import CgroupdStreamWriter

        return CgroupdStreamWriter(SinkOptions.parse(self.options), schema)


def _quiet_logs() -> None:
    """Info and up only, in the Python process Spark starts for the driver side (nothing
    configured structlog there; its default prints every pull's debug line)."""
    if not structlog.is_configured():
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))


class _DriverSide:
    """The session and the thread its loop runs on, opened on first use."""

    def __init__(self, options: SourceOptions) -> None:
        _quiet_logs()
        self.thread = LoopThread()
        self.session = DriverSession(options)
        try:
            # A lease acquisition may wait for another holder to let go.
            self.thread.run(self.session.open(), timeout=options.lease_wait + 60)
        except BaseException:
            self.thread.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.thread.run(self.session.close(), timeout=10)
        self.thread.close()


class CgroupdStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads a group's partitions; see the module docstring for the life of a query."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._driver: _DriverSide | None = None
        #: Trigger.AvailableNow: the offsets to stop at.
        self._target: Offsets | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Executors get a copy without the driver's connection, thread and lease.
        state = self.__dict__.copy()
        state["_driver"] = None
        return state

    # -- driver side ------------------------------------------------------------------
    def _session(self) -> tuple[LoopThread, DriverSession]:
        if self._driver is None:
            self._driver = _DriverSide(self.options)
        self._driver.session.check()
        return self._driver.thread, self._driver.session

    def initialOffset(self) -> dict[str, int]:
        thread, session = self._session()
        return encode(thread.run(session.initial()))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_messages_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        thread, session = self._session()
        self._target = thread.run(session.latest())

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        thread, session = self._session()
        begin = session.own(decode(start))
        latest = thread.run(session.latest(begin))
        if self._target is not None:
            latest = {p: max(begin[p], min(latest[p], self._target.get(p, begin[p])))
                      for p in latest}
        if isinstance(limit, ReadMaxRows):
            latest = thread.run(session.cap(begin, latest, limit.max_rows))
        return encode(latest)

    def reportLatestOffset(self) -> dict[str, int] | None:
        thread, session = self._session()
        return encode(thread.run(session.latest()))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        _, session = self._session()
        tasks = plan(decode(start), decode(end), self.options.partitions_per_task)
        return [GroupPartitions(session.stream, tuple(ranges), session.filters)
                for ranges in tasks]

    def commit(self, end: dict[str, Any]) -> None:
        thread, session = self._session()
        thread.run(session.commit(decode(end)))

    def stop(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    # -- executor side ----------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, GroupPartitions)
        return read_partitions(self.options, partition)


def read_partitions(options: SourceOptions, task: GroupPartitions) -> Iterator[pa.RecordBatch]:
    """Every message of the task's ranges, in partition order then sequence order.

    Deterministic for a range not yet committed: the lease keeps everyone else from
    consuming it and only ``commit`` (below a committed end) purges.
    """
    loop = asyncio.new_event_loop()
    nc = None
    try:
        nc = loop.run_until_complete(
            options.connection.connect(reconnect=False, client=ReaderClient()))
        dg = DirectGet(nc, task.stream, timeout=10.0)
        key = KeyExtractor(task.filters)
        for r in task.ranges:
            subject = f"{r.partition}.>"
            seq = r.start + 1
            while seq <= r.end:
                batch = min(options.fetch_batch, r.end - seq + 1)
                msgs = loop.run_until_complete(dg.run(seq, subject, batch))
                keep = [m for m in msgs if sequence_of(m) <= r.end]
                if keep:
                    yield record_batch(r.partition, keep, key)
                if not msgs or len(keep) < len(msgs):
                    break
                seq = sequence_of(keep[-1]) + 1
        loop.run_until_complete(dg.close())
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                loop.run_until_complete(nc.close())
        loop.close()
