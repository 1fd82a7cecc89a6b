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
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
from nats.js import api
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSourceStreamWriter, InputPartition
from pyspark.sql.streaming import StreamingQuery

import cgroupd.spark
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream
from cgroupd.spark.options import SinkOptions, SourceOptions
from cgroupd.spark.source import (
    CgroupdDataSource,
    CgroupdStreamReader,
    ReadTask,
    schema_for,
)
from cgroupd.spark.writer import CgroupdStreamWriter, PublishReport
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
#: Bound on any one Spark query in the tests.
QUERY_TIMEOUT = 120.0


async def make_group(js: JetStream, stream: str = "ORDERS", group: str = "g",
                     partitions: int = 4, members: tuple[str, ...] = ("m1", "m2"),
                     replicas: int = 1) -> ElasticGroupConfig:
    """An origin stream ``orders.<key>`` that allows direct get (the source reads with
    it) and an elastic group keyed on ``<key>``."""
    await js.add_stream(api.StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"],
                                         num_replicas=replicas, allow_direct=True))
    config = ElasticGroupConfig(
        max_members=partitions,
        partitioning_filters=(PartitioningFilter(f"{stream.lower()}.*", (1,)),),
        members=members)
    return await admin.create_elastic_group(js, stream, group, config)


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


_SHARED: SparkSession | None = None


def shared_spark() -> SparkSession:
    """One local SparkSession for every Spark test module of this process (starting one
    costs 5-15 s), stopped with its JVM when the process exits."""
    global _SHARED
    if _SHARED is None:
        import atexit
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="cgroupd-spark-tests-"))
        _SHARED = start_spark(tmp)

        def stop() -> None:
            import shutil

            if _SHARED is not None:
                stop_spark(_SHARED)
            shutil.rmtree(tmp, ignore_errors=True)

        atexit.register(stop)
    return _SHARED


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


async def wait_sourced(js: JetStream, stream: str, count: int, timeout: float = 20.0) -> None:
    """Wait until the group's work-queue stream holds ``count`` messages."""
    seen: list[int | None] = [None]

    async def sourced() -> bool:
        info = await js.stream_info(stream)
        seen[0] = info.state.messages if info is not None else None
        return seen[0] is not None and seen[0] >= count

    await eventually(sourced, timeout, 0.05, f"{stream} to hold {count} messages",
                     diagnostics=lambda: f"{stream} holds {seen[0]} messages")


# -- failures on purpose ----------------------------------------------------------------
def _without_marker(options: Any) -> dict[str, str]:
    """The options without the test-only ``failOnceDir`` (the format rejects unknown ones)."""
    return {k: v for k, v in options.items() if k.lower() != "failoncedir"}


class FlakyReader(CgroupdStreamReader):
    """The first read anywhere fails after emitting its first batch; later reads work.

    In ``failOnceDir``: ``failed`` names the range of the read that failed, and every
    read appends its range (``<start>-<end>``) to ``reads.log``.
    """

    def __init__(self, options: SourceOptions, marker_dir: str) -> None:
        super().__init__(options)
        self.marker_dir = marker_dir

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ReadTask)
        folder = Path(self.marker_dir)
        names = f"{partition.range.start}-{partition.range.end}"
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

    def schema(self) -> Any:
        return schema_for(SourceOptions.parse(_without_marker(self.options)))

    def streamReader(self, schema: Any) -> FlakyReader:
        return FlakyReader(SourceOptions.parse(_without_marker(self.options)),
                           self.options["failOnceDir"])


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
        return FlakyWriter(SinkOptions.parse(_without_marker(self.options)), schema,
                           self.options["failOnceDir"])


# -- Spark's micro-batch loop, without Spark ----------------------------------------------
class ManualQuery:
    """Drives a :class:`CgroupdStreamReader` the way Spark's micro-batch loop does (the
    same driver and executor methods, in this process, without a JVM): fast tests of
    offsets, planning and reads. Blocking: call it from a thread in async tests."""

    #: Queries not closed yet: a test's teardown closes and reports what it left open
    #: (tests/spark/conftest.py), as a driver left behind reconnects for ever.
    open: ClassVar[list[ManualQuery]] = []

    def __init__(self, **options: Any) -> None:
        self.options = SourceOptions.parse({k: str(v) for k, v in options.items()})
        self.reader = CgroupdStreamReader(self.options)
        ManualQuery.open.append(self)
        #: The end offset of the last batch (Spark's offset log); None before batch 0.
        self.committed: dict[str, Any] | None = None
        self.batches = 0

    def plan(self, limit: Any = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The next batch's (start, end), or None when there is nothing new."""
        from pyspark.sql.streaming.datasource import ReadAllAvailable

        start = self.committed if self.committed is not None else self.reader.initialOffset()
        end = self.reader.latestOffset(start, limit or ReadAllAvailable())
        if self.committed is not None and end == start:
            return None
        return start, end

    def read(self, start: dict[str, Any], end: dict[str, Any]) -> list[dict[str, Any]]:
        tasks = self.reader.partitions(start, end)
        return [row for task in tasks for batch in self.reader.read(task)
                for row in batch.to_pylist()]

    def step(self, limit: Any = None) -> list[dict[str, Any]] | None:
        """One micro-batch: its rows, or None when nothing was new."""
        planned = self.plan(limit)
        if planned is None:
            return None
        rows = self.read(*planned)
        self.committed = planned[1]
        self.batches += 1
        return rows

    def drain(self, limit: Any = None, max_batches: int = 100) -> list[dict[str, Any]]:
        """Batches until nothing is new: every row read."""
        out: list[dict[str, Any]] = []
        for _ in range(max_batches):
            rows = self.step(limit)
            if rows is None:
                return out
            out.extend(rows)
        raise AssertionError(f"still reading after {max_batches} batches")

    def close(self) -> None:
        self.reader.stop()
        if self in ManualQuery.open:
            ManualQuery.open.remove(self)

    def __enter__(self) -> ManualQuery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a TCP proxy to cut a client off its server --------------------------------------------
class TcpProxy:
    """Forwards a local port to ``target``; :meth:`cut` drops every connection and
    refuses new ones (a network outage as the client sees it), :meth:`heal` ends it."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        from tests.support.natsserver import find_free_port

        self.host = host
        self.port = find_free_port(host)
        self.target = target_port
        self._server: asyncio.base_events.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target)
        except OSError:
            writer.close()
            return
        self._links |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._links -= {writer, up_writer}

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for link in list(self._links):
            link.transport.abort()
        self._links.clear()
        if server is not None:
            await server.wait_closed()

    async def heal(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()


# -- messages any publisher may send ----------------------------------------------------------
#: A status line (``NATS/1.0 404 ...``) in a message's own header block: nats-py reads
#: it, and a ``Status: 503`` line, as the server's "no responders".
RAW_STATUS_HEADER = b"NATS/1.0 404 No Messages\r\nStatus: 503\r\nDescription: x\r\n\r\n"
ONE_MB = bytes(range(256)) * 4096


@dataclass(frozen=True)
class Published:
    """A message as published: what a reader must give back for sequence ``seq``."""

    seq: int
    subject: str
    data: bytes
    #: The headers as published, in order (None: no header block at all).
    headers: tuple[tuple[str, str], ...] | None


def hostile_messages(prefix: str, count: int) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """``count`` messages for the stream ``<prefix>.>``, keyed on token 1: every tenth is
    hostile (server-status-like and reserved headers, empty/binary/1 MB payloads, long
    and unicode subjects), the rest ordinary."""
    statuses = {"100": "Idle Heartbeat", "404": "No Messages", "408": "Request Timeout",
                "409": "Consumer Deleted", "423": "Nats-Pin-Id mismatch",
                "503": "No Responders"}
    specials: list[tuple[str, bytes, dict[str, str] | None]] = [
        (f"{prefix}.s{code}.x", b"", {"Status": code, "Description": desc})
        for code, desc in statuses.items()]
    specials += [
        (f"{prefix}.s404.y", b"body", {"Status": "404"}),
        (f"{prefix}.pin.x", b"p", {"Nats-Pin-Id": "bogus-pin"}),
        (f"{prefix}.pending.x", b"", {"Nats-Pending-Messages": "7",
                                      "Nats-Pending-Bytes": "not-a-number"}),
        (f"{prefix}.seq.x", b"s", {"Nats-Sequence": "1", "Nats-Subject": "fake.subject",
                                   "Nats-Time-Stamp": "1999-01-01T00:00:00Z",
                                   "Nats-Stream": "OTHER", "Nats-Num-Pending": "0",
                                   "Nats-Last-Sequence": "999"}),
        (f"{prefix}.empty.x", b"", None),
        (f"{prefix}.binary.x", bytes(range(256)) + b"\xff\xfe\x00", {"Bin": "1"}),
        (f"{prefix}.big.x", ONE_MB, None),
        (f"{prefix}.long." + ".".join(["t"] * 600), b"long", None),
        (f"{prefix}.ключ.ü.日本", "ünïcode".encode(), {"Unicode": "ja"}),
        (f"{prefix}.42.7", b"numberish", {"Nats-Msg-Id": "dup-looking"}),
    ]
    out = []
    for i in range(count):
        if i % 10 == 3:
            subject, data, headers = specials[(i // 10) % len(specials)]
            out.append((subject, data, None if headers is None else {**headers, "I": str(i)}))
        else:
            out.append((f"{prefix}.k{i % 13}.v", f"n:{i}".encode(), None))
    return out


async def publish_hostile(nc: Any, prefix: str, count: int,
                          raw_status: int = 3) -> list[Published]:
    """Publish :func:`hostile_messages` (and ``raw_status`` messages whose header block
    starts with a status line) to a stream capturing ``<prefix>.>``."""
    js = nc.jetstream()
    out = []
    for subject, data, headers in hostile_messages(prefix, count):
        ack = await js.publish(subject, data, headers=headers)
        out.append(Published(ack.seq, subject, data,
                             tuple(headers.items()) if headers is not None else None))
    for i in range(raw_status):
        subject = f"{prefix}.raw.{i}"
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, max_msgs=1)
        await nc._send_command(b"HPUB %s %s %d %d\r\n%s\r\n" % (
            subject.encode(), inbox.encode(), len(RAW_STATUS_HEADER),
            len(RAW_STATUS_HEADER), RAW_STATUS_HEADER))
        await nc.flush()
        reply = await sub.next_msg(timeout=5)
        seq = int(json.loads(reply.data)["seq"])
        out.append(Published(seq, subject, b"", (("Status", "503"), ("Description", "x"))))
    return out


def check_rows(rows: list[dict[str, Any]], sent: list[Published], *,
               sequence: str = "stream_sequence", headers: bool = True) -> None:
    """Every published message exactly once, intact (subject, payload, headers)."""
    by_seq = {p.seq: p for p in sent}
    seen = [r[sequence] for r in rows]
    dupes = sorted({s for s in seen if seen.count(s) > 1}) if len(seen) != len(set(seen)) else []
    assert not dupes, f"read twice: {dupes[:10]}"
    missing = sorted(set(by_seq) - set(seen))
    assert not missing, f"{len(missing)} of {len(by_seq)} not read, e.g. {missing[:10]}"
    extra = sorted(set(seen) - set(by_seq))
    assert not extra, f"rows for sequences never published: {extra[:10]}"
    for r in rows:
        p = by_seq[r[sequence]]
        assert r["subject"] == p.subject, (p.seq, r["subject"][:80])
        assert r["data"] == p.data, (p.seq, len(r["data"]), len(p.data))
        if headers:
            got = [(h["key"], h["value"].decode()) for h in r["headers"]]
            assert got == list(p.headers or ()), (p.seq, got, p.headers)
