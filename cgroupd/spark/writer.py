"""``df.write.format("cgroupd")`` and ``df.writeStream.format("cgroupd")``: publish rows.

Each row becomes one JetStream publish, acknowledged by the stream that captures its
subject. Columns (by name; others are ignored):

=========  ==========================  ==============================================
column     type                        meaning
=========  ==========================  ==============================================
data       binary or string            payload (required; strings are sent as UTF-8)
subject    string                      subject (or the ``subject`` option)
headers    map<string,string>          message headers (optional)
msg_id     string                      ``Nats-Msg-Id`` (optional; default below)
=========  ==========================  ==============================================

Exactly-once into the stream, within its duplicate window (2 minutes by default): every
message carries a ``Nats-Msg-Id`` that is the same when Spark replays the same rows, so
the server drops the replayed copies. The default id is
``<prefix>:<batch id>:<task partition>:<row position>`` for a streaming query, where the
prefix is the query id (kept in the checkpoint, so stable across restarts) and the batch id
is Spark's micro-batch id; and ``<prefix>:<task partition>:<row position>`` for a batch
write, with one random prefix per write (task retries share it) unless ``idPrefix`` is
given. Row positions are stable when the rows' order within a task is (straight from the
cgroupd source, or any narrow transformation of it); after a shuffle Spark does not keep
row order across attempts, so give a ``msg_id`` column derived from the data instead
(for example ``concat_ws(':', partition, stream_sequence)`` of the source row).

A replay later than the duplicate window publishes again: keep the window longer than a
failed query may stay down.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import nats.errors
import pyarrow as pa
import structlog
from nats.aio.client import Client
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, MapType, StringType, StructType

from cgroupd.errors import ConfigError, ServerUnreachable
from cgroupd.jetstream import translated
from cgroupd.spark.options import SinkOptions

log = structlog.get_logger("cgroupd.spark.writer")

MSG_ID = "Nats-Msg-Id"
#: Local properties Spark sets on every task of a streaming micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


@dataclass
class PublishReport(WriterCommitMessage):
    """What one task published: new messages, and replays the server dropped."""

    published: int = 0
    duplicates: int = 0


def check_schema(schema: StructType, options: SinkOptions) -> None:
    """ConfigError unless the DataFrame has what a publish needs."""
    fields = {f.name.lower(): f.dataType for f in schema.fields}
    problems = []
    if "data" not in fields:
        problems.append("the DataFrame needs a 'data' column (binary or string)")
    elif not isinstance(fields["data"], (BinaryType, StringType)):
        problems.append(f"column 'data' must be binary or string, not {fields['data']}")
    if "subject" in fields:
        if not isinstance(fields["subject"], StringType):
            problems.append("column 'subject' must be a string")
    elif options.subject is None:
        problems.append("give a 'subject' column or the 'subject' option")
    if "headers" in fields and not (
            isinstance(fields["headers"], MapType)
            and isinstance(fields["headers"].keyType, StringType)
            and isinstance(fields["headers"].valueType, StringType)):
        problems.append("column 'headers' must be a map<string,string>")
    if "msg_id" in fields and not isinstance(fields["msg_id"], StringType):
        problems.append("column 'msg_id' must be a string")
    if problems:
        raise ConfigError(problems)


def _column(batch: pa.RecordBatch, name: str) -> list[Any] | None:
    for i, field in enumerate(batch.schema):
        if field.name.lower() == name:
            return batch.column(i).to_pylist()  # type: ignore[no-any-return]
    return None


async def _publish(options: SinkOptions, batches: Iterator[pa.RecordBatch],
                   prefix: str) -> PublishReport:
    nc = await options.connection.connect(reconnect=False, client=Client())
    js = nc.jetstream(timeout=options.publish_timeout)
    report = PublishReport()
    window: list[asyncio.Task[Any]] = []

    async def drain() -> None:
        acks = await asyncio.gather(*window)
        window.clear()
        for ack in acks:
            if getattr(ack, "duplicate", False):
                report.duplicates += 1
            else:
                report.published += 1

    try:
        row = 0
        for batch in batches:
            data = _column(batch, "data") or []
            subjects = _column(batch, "subject")
            headers = _column(batch, "headers")
            ids = _column(batch, "msg_id")
            for i, payload in enumerate(data):
                subject = (subjects[i] if subjects else None) or options.subject
                if subject is None:
                    raise ConfigError(f"row {row} has no subject and no 'subject' option")
                hdrs = dict(headers[i] or []) if headers else {}
                hdrs[MSG_ID] = (ids[i] if ids and ids[i] else None) or f"{prefix}:{row}"
                body = payload.encode() if isinstance(payload, str) else (payload or b"")
                window.append(asyncio.ensure_future(
                    js.publish(subject, body, stream=options.stream, headers=hdrs)))
                row += 1
                if len(window) >= options.max_pending:
                    with translated(f"publishing to {subject}"):
                        await drain()
        with translated("publishing"):
            await drain()
    except BaseException:
        for task in window:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*window, return_exceptions=True)
        raise
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return report


def publish(options: SinkOptions, batches: Iterator[pa.RecordBatch], prefix: str) -> PublishReport:
    """Publish every row (on executors: a private loop and connection per task)."""
    try:
        return asyncio.run(_publish(options, batches, prefix))
    except nats.errors.NoRespondersError as exc:
        raise ServerUnreachable("no stream captures the subject (no responders)") from exc


def _task() -> TaskContext:
    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("cgroupd writer: not running in a Spark task")
    return ctx


class CgroupdStreamWriter(DataSourceStreamArrowWriter):
    """Streaming sink: ``df.writeStream.format("cgroupd")``."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        check_schema(schema, options)
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        ctx = _task()
        batch_id = ctx.getLocalProperty(BATCH_ID_PROPERTY)
        query_id = ctx.getLocalProperty(QUERY_ID_PROPERTY)
        prefix = self.options.id_prefix or query_id
        if prefix is None or batch_id is None:
            raise RuntimeError("cgroupd stream writer: Spark did not tell the batch/query id")
        return publish(self.options, iterator, f"{prefix}:{batch_id}:{ctx.partitionId()}")

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, PublishReport)]
        log.info("batch published", batch=batchId,
                 published=sum(m.published for m in done),
                 duplicates=sum(m.duplicates for m in done))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # Nothing to undo: what was published stays, and the replay's copies are dropped
        # by the server as duplicates.
        log.warning("batch aborted; its replay will be de-duplicated", batch=batchId)


class CgroupdBatchWriter(DataSourceArrowWriter):
    """Batch sink: ``df.write.format("cgroupd").mode("append").save()``."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        check_schema(schema, options)
        self.options = options
        # Created once per write on the driver and pickled to every task (and retry).
        self.prefix = options.id_prefix or f"write-{secrets.token_hex(8)}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        return publish(self.options, iterator, f"{self.prefix}:{_task().partitionId()}")

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        done = [m for m in messages if isinstance(m, PublishReport)]
        log.info("write published", published=sum(m.published for m in done),
                 duplicates=sum(m.duplicates for m in done))
