"""``spark.readStream.format("cgroupd")`` and ``spark.read.format("cgroupd")``.

Reads a stream, a consumer group on it, or a group's work queue, the way Spark's Kafka
source reads a topic: group partitions are the source's partitions, progress is kept in
Spark's checkpoint (see :mod:`cgroupd.spark.offsets`), and every uncommitted range reads
back identically, so a failed batch replays exactly. Layouts and modes:
:mod:`cgroupd.spark.layout`.

Life of a streaming query:

* The reader object is created on the driver and pickled to the executors. Only the
  driver-side copy (the Python process the JVM keeps for the query) opens a
  :class:`~cgroupd.spark.driver.DriverSession`, lazily, on the first driver call: it
  connects, resolves the layout and, in work-queue mode, takes the lease
  (:mod:`cgroupd.spark.lease`).
* ``latestOffset`` asks the stream's leader for its extent (and, for per-partition
  layouts, every partition's last sequence, concurrently), applies admission control
  (``maxOffsetsPerTrigger``, ``minOffsetsPerTrigger`` + ``maxTriggerDelay``) and, in
  work-queue mode, purges what Spark has committed.
* ``partitions`` plans the batch's tasks, a pure function of the two offsets; ``read``
  runs on executors over a connection kept per Python worker and reads every range to
  its end (:func:`~cgroupd.spark.directget.read_range`), checking the lease before and
  after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
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
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from cgroupd.core.errors import ConfigError, LeaseLost
from cgroupd.nats.connect import ConnectionOptions
from cgroupd.spark import Shipped
from cgroupd.spark.directget import DirectGet, Item, read_range
from cgroupd.spark.driver import DriverSession, LoopThread
from cgroupd.spark.layout import Layout, Mode
from cgroupd.spark.lease import LeaseRef, application_subject, lease_problem
from cgroupd.spark.offsets import Offset, ReadRange, parse_requested, resolve_end
from cgroupd.spark.options import SinkOptions, SourceOptions, connect_reader
from cgroupd.spark.rows import RowBuilder
from cgroupd.spark.wire import ReaderClient

FORMAT = "cgroupd"

HEADERS_FIELD = StructField("headers", ArrayType(StructType([
    StructField("key", StringType()), StructField("value", BinaryType())])))
SCHEMA = StructType([
    StructField("partition", IntegerType()),
    StructField("stream_sequence", LongType()),
    StructField("origin_sequence", LongType()),
    StructField("subject", StringType()),
    StructField("key", StringType()),
    StructField("data", BinaryType()),
    StructField("timestamp", TimestampType()),
])
SCHEMA_WITH_HEADERS = StructType([*SCHEMA.fields, HEADERS_FIELD])
def schema_for(options: SourceOptions) -> StructType:
    return SCHEMA_WITH_HEADERS if options.include_headers else SCHEMA


@dataclass(frozen=True)
class ReadTask(Shipped, InputPartition):
    """One task's work: a run of the stream, of which it keeps the messages of each
    partition's ``(start, end]``."""

    layout: Layout
    range: ReadRange
    #: ``(partition, start, end)`` of every partition with something to read.
    bounds: tuple[tuple[int, int, int], ...] = ()
    #: Work-queue mode: the lease the query must still hold while the task reads.
    lease: LeaseRef | None = None


def _tasks(session: DriverSession, start: Offset, end: Offset,
           lease: LeaseRef | None) -> list[ReadTask]:
    layout = session.plan_layout
    if end.origin is not None:
        start = end.origin  # batch 0: the start it was planned from, not a new one
    if not start.same_stream(end):
        start = Offset(end.stream, end.created, 0, {p: 0 for p in layout.partitions})
    bounds = tuple((p, start.partitions.get(p, 0), end.partitions[p])
                   for p in layout.partitions if end.partitions[p] > start.partitions.get(p, 0))
    return [ReadTask(layout, r, bounds, lease) for r in session.plan(start, end)]


class CgroupdDataSource(DataSource):
    """The ``cgroupd`` format: a streaming and batch source, a streaming and batch sink.

    Register it with :func:`cgroupd.spark.register` (or
    ``spark.dataSource.register(CgroupdDataSource)``).
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return schema_for(SourceOptions.parse(self.options))

    def _check_schema(self, schema: StructType | None, options: SourceOptions) -> None:
        want = schema_for(options)
        if schema is not None and schema.simpleString() != want.simpleString():
            raise ConfigError(f"the cgroupd source has a fixed schema ({want.simpleString()}); "
                              "do not pass .schema(...)")

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = SourceOptions.parse(self.options)
        self._check_schema(schema, options)
        return CgroupdStreamReader(options)

    def reader(self, schema: StructType) -> DataSourceReader:
        options = SourceOptions.parse(self.options)
        self._check_schema(schema, options)
        if options.mode is Mode.WORKQUEUE:
            raise ConfigError("a batch read cannot consume a work queue (nothing would "
                              "purge what it read, and daemons could take it meanwhile): "
                              "read with mode 'read', or use readStream")
        return CgroupdBatchReader(options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from cgroupd.spark.writer import CgroupdBatchWriter

        return CgroupdBatchWriter(SinkOptions.parse(self.options), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from cgroupd.spark.writer import CgroupdStreamWriter

        return CgroupdStreamWriter(SinkOptions.parse(self.options), schema, overwrite)


def _exit_on_sigterm() -> None:
    """Spark ends the source's driver process with SIGTERM when the query stops. Python
    would die at once, and the lease outlive the query by its inactive threshold with
    no ``stepped_down`` event; instead the process exits (``SystemExit``: Spark's
    runner then calls ``stop()``, which releases the lease), ignoring the further
    SIGTERMs Spark sends meanwhile. Only in Spark's own Python worker processes, on
    their main thread, and only where nobody set a SIGTERM handler."""
    if os.environ.get("SPARK_PYTHON_RUNTIME") != "PYTHON_WORKER" \
            or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


class _DriverSide:
    """The session and the thread its loop runs on, opened on first use."""

    def __init__(self, options: SourceOptions) -> None:
        _exit_on_sigterm()
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


def _clamp(end: Offset, start: Offset, target: Offset) -> Offset:
    """``end`` no further than ``target`` (and never behind ``start``)."""
    parts = {p: max(start.partitions.get(p, 0), min(e, target.partitions.get(p, e)))
             for p, e in end.partitions.items()}
    position = max(start.position, min(end.position, target.position))
    return Offset(end.stream, end.created, position, parts, end.origin)


class CgroupdStreamReader(Shipped, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads a stream or group; see the module docstring for the life of a query."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._driver: _DriverSide | None = None
        #: Trigger.AvailableNow: the offsets to stop at.
        self._target: Offset | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Executors get a copy without the driver's connection, thread and lease.
        state = self.__dict__.copy()
        state["_driver"] = None
        return state

    # -- driver side --------------------------------------------------------------------
    def _session(self) -> tuple[LoopThread, DriverSession]:
        if self._driver is None:
            self._driver = _DriverSide(self.options)
        self._driver.session.check()
        return self._driver.thread, self._driver.session

    def initialOffset(self) -> dict[str, Any]:
        thread, session = self._session()
        return thread.run(session.initial()).to_json()

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        thread, session = self._session()
        self._target = thread.run(session.target())

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        thread, session = self._session()
        begin = Offset.from_json(start)
        end = thread.run(session.latest(begin))
        if end is begin:
            return start
        if self._target is not None and end.same_stream(self._target):
            end = _clamp(end, begin, self._target)
        if isinstance(limit, ReadMaxRows):
            end = thread.run(session.cap(begin, end, limit.max_rows))
        if self._target is None and self.options.min_offsets_per_trigger is not None \
                and not session.enough(thread.run(session.available(begin, end))):
            return start
        if end.partitions == dict(begin.partitions) and end.position == begin.position \
                and end.same_stream(begin) and end.origin is None:
            return start
        session.planned()
        return end.to_json()

    def reportLatestOffset(self) -> dict[str, Any] | None:
        if self._driver is None or self._driver.session.latest_seen is None:
            return None
        return self._driver.session.latest_seen.to_json()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        _, session = self._session()
        lease = session.lease.ref if session.lease is not None else None
        return list(_tasks(session, Offset.from_json(start), Offset.from_json(end), lease))

    def commit(self, end: dict[str, Any]) -> None:
        thread, session = self._session()
        if session.plan_layout.workqueue:
            thread.run(session.purge_below(Offset.from_json(end)))

    def stop(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    # -- executor side ------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ReadTask)
        return read_task(self.options, partition)


class CgroupdBatchReader(Shipped, DataSourceReader):
    """``spark.read.format("cgroupd")``: ``startingOffsets`` to ``endingOffsets``."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def partitions(self) -> list[InputPartition]:
        return list(asyncio.run(_plan_batch(self.options)))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ReadTask)
        return read_task(self.options, partition)


async def _plan_batch(options: SourceOptions) -> list[ReadTask]:
    session = DriverSession(options)
    await session.open(take_lease=False)
    try:
        layout = session.plan_layout
        start = await session.initial()
        state = await session.state()
        start = session.checked_start(start.plain(), state)
        latest = await session.target()
        ending = parse_requested("endingOffsets", options.ending_offsets, layout.stream,
                                 layout.partitions, ending=True)
        ends = resolve_end(ending, layout.partitions, latest.partitions)
        ends = {p: max(e, start.partitions[p]) for p, e in ends.items()}
        end = Offset(latest.stream, latest.created, max(ends.values(), default=0), ends)
        return _tasks(session, start, end, None)
    finally:
        await session.close()


# -- executors --------------------------------------------------------------------------
class _ExecutorIO:
    """Per Python worker process: one event loop thread and a connection per server set,
    kept across tasks and micro-batches (Spark reuses its Python workers)."""

    _lock = threading.Lock()
    _instance: _ExecutorIO | None = None

    def __init__(self) -> None:
        self.thread = LoopThread("cgroupd-spark-reader")
        self._clients: dict[ConnectionOptions, ReaderClient] = {}
        self._told: set[str] = set()

    @classmethod
    def get(cls) -> _ExecutorIO:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _ExecutorIO()
            return cls._instance

    async def _client(self, connection: ConnectionOptions) -> ReaderClient:
        nc = self._clients.get(connection)
        if nc is not None and nc.is_connected:
            return nc
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        # No reconnecting: a task fails fast (Spark retries it) and the next task
        # connects anew, rather than a worker retrying a server that went away forever.
        nc = await connect_reader(connection, reconnect=False)
        self._clients[connection] = nc
        return nc

    def tell_application(self, nc: ReaderClient, lease_id: str) -> None:
        """Tell the query's driver the Spark application id, once per lease and worker
        process (see :func:`cgroupd.spark.lease.application_subject`)."""
        ctx = TaskContext.get()
        app = ctx.getLocalProperty("spark.app.id") if ctx is not None else None
        if not app or lease_id in self._told:
            return
        self._told.add(lease_id)
        with contextlib.suppress(Exception):  # status detail, never a failed task
            self.thread.run(nc.publish(application_subject(lease_id), app.encode()), 5)

    def client(self, connection: ConnectionOptions) -> ReaderClient:
        return self.thread.run(self._client(connection))

    async def _close_all(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for nc in clients:
            with contextlib.suppress(Exception):
                await nc.close()

    def close_all(self) -> None:
        self.thread.run(self._close_all(), timeout=10)

    def iterate(self, chunks: AsyncGenerator[list[Item], None]) -> Iterator[list[Item]]:
        """The chunks of an async generator running on the loop, one fetched ahead."""
        loop = self.thread.loop

        async def step() -> list[Item] | None:
            try:
                return await chunks.__anext__()
            except StopAsyncIteration:
                return None

        pending = asyncio.run_coroutine_threadsafe(step(), loop)
        try:
            while True:
                chunk = pending.result()
                if chunk is None:
                    return
                pending = asyncio.run_coroutine_threadsafe(step(), loop)
                yield chunk
        finally:
            if not pending.done():
                with contextlib.suppress(BaseException):
                    pending.result()
            with contextlib.suppress(BaseException):
                asyncio.run_coroutine_threadsafe(chunks.aclose(), loop).result(10)


def close_executor_connections() -> None:
    """Close the connections this process keeps for tasks (tests; a process that ends
    closes them anyway)."""
    if _ExecutorIO._instance is not None:
        _ExecutorIO._instance.close_all()


def read_task(options: SourceOptions, task: ReadTask) -> Iterator[pa.RecordBatch]:
    """Every message of the task's ranges, in range order then sequence order.

    Deterministic for a range not yet committed: nothing but the query's own commit
    removes messages it has not read (the lease keeps daemons off in work-queue mode;
    anything else is data loss, reported).
    """
    io = _ExecutorIO.get()
    nc = io.client(options.connection)
    dg = DirectGet(nc, task.layout.stream, timeout=10.0)
    rows = RowBuilder(task.layout, include_headers=options.include_headers,
                      bounds={p: (lo, hi) for p, lo, hi in task.bounds})

    def check_lease(when: str) -> None:
        if task.lease is None:
            return
        problem = io.thread.run(lease_problem(nc, task.lease))
        if problem is not None:
            raise LeaseLost(f"{problem} ({when} reading); another instance may be consuming "
                            "these partitions, so the task does not hand over what it read")

    check_lease("before")
    if task.lease is not None:
        io.tell_application(nc, task.lease.lease_id)
    try:
        r = task.range
        for items in io.iterate(read_range(dg, r.subject, r.start, r.end,
                                           fetch=options.fetch_batch)):
            batch = rows.build(items)
            if batch is not None:
                yield batch
        check_lease("after")
    finally:
        with contextlib.suppress(Exception):
            io.thread.run(dg.close(), timeout=5)
