"""``df.write.format("cgroupd")`` and ``df.writeStream.format("cgroupd")``: publish rows.

Each row becomes one JetStream publish, acknowledged by the stream that captures its
subject. Columns (by name; others are ignored):

=========  ==============================================  ================================
column     type                                            meaning
=========  ==============================================  ================================
data       binary or string                                payload (required; strings are
                                                           sent as UTF-8)
subject    string                                          subject (or the ``subject``
                                                           option)
headers    map<string,string>, or Kafka's                  message headers (optional; the
           array<struct<key:string,value:binary|string>>   source's ``includeHeaders``
                                                           column writes back as it is)
msg_id     string                                          ``Nats-Msg-Id`` (optional;
                                                           default below)
=========  ==============================================  ================================

Exactly-once into the stream **within its duplicate window** (2 minutes by default):
every message carries a ``Nats-Msg-Id`` that is the same when Spark replays the same row,
so the server drops the replayed copy. The default id is
``<prefix>:<batch id>:<task partition>:<row position>:<digest>`` for a streaming query,
where the prefix is the query id (kept in the checkpoint, so stable across restarts), the
batch id Spark's micro-batch id, and the digest a hash of the row's subject, headers and
payload; ``<prefix>:<task partition>:<row position>:<digest>`` for a batch write, with one
random prefix per write (task retries share it) unless ``idPrefix`` is given. The digest
makes an id name one row: a reused ``idPrefix`` (a new query on an old prefix, a second
write with the same prefix) publishes its new rows instead of losing them as
"duplicates", and a replay whose rows come in another order (after a shuffle) publishes
the rows it had not published rather than dropping them. A row repeated at the same
position of the same batch is the one case the server drops, by design. Give a
``msg_id`` column derived from the data to de-duplicate across batches or writes.

A replay later than the duplicate window publishes again: keep the window longer than
a failed query may stay down. The writer refuses to start when the ``triggerInterval``
option (the query's trigger interval) is longer than the target stream's window;
:func:`check_duplicate_window` checks a target before a query is started.

Streams are append-only: ``overwrite`` (batch) and ``complete`` (streaming) output modes
are refused rather than silently appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import nats.errors
import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    MapType,
    StringType,
    StructType,
)

from cgroupd import jsapi, logs
from cgroupd.connect import ConnectionOptions, connect
from cgroupd.errors import CgroupdError, ConfigError, ServerUnreachable
from cgroupd.jserrors import translated
from cgroupd.spark.options import SinkOptions, parse_duration

log = logs.get_logger("cgroupd.spark.writer")

MSG_ID = "Nats-Msg-Id"
#: Local properties Spark sets on every task of a streaming micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


@dataclass
class PublishReport(WriterCommitMessage):
    """What one task published: new messages, and replays the server dropped."""

    published: int = 0
    duplicates: int = 0


def _headers_type_ok(dtype: DataType) -> bool:
    if isinstance(dtype, MapType):
        return isinstance(dtype.keyType, StringType) and isinstance(dtype.valueType,
                                                                    StringType)
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, StructType):
        fields = {f.name.lower(): f.dataType for f in dtype.elementType.fields}
        return (set(fields) == {"key", "value"} and isinstance(fields["key"], StringType)
                and isinstance(fields["value"], (BinaryType, StringType)))
    return False


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
    if "headers" in fields and not _headers_type_ok(fields["headers"]):
        problems.append("column 'headers' must be a map<string,string> or an "
                        "array<struct<key:string,value:binary>> (Kafka's shape)")
    if "msg_id" in fields and not isinstance(fields["msg_id"], StringType):
        problems.append("column 'msg_id' must be a string")
    if problems:
        raise ConfigError(problems)


def _refuse_overwrite(overwrite: bool, what: str) -> None:
    if overwrite:
        raise ConfigError(f"{what}: a JetStream stream is append-only, so the cgroupd sink "
                          "cannot overwrite or replace what it holds; use append mode "
                          "(for an aggregate, outputMode('update') publishes each change)")


def _column(batch: pa.RecordBatch, name: str) -> list[Any] | None:
    for i, field in enumerate(batch.schema):
        if field.name.lower() == name:
            return batch.column(i).to_pylist()  # type: ignore[no-any-return]
    return None


def _header_dict(raw: Any) -> dict[str, str]:
    """A row's headers, from a map (list of pairs) or Kafka's array of key/value structs.

    nats-py sends one value per name: of repeated names the last wins.
    """
    out: dict[str, str] = {}
    for item in raw or []:
        if isinstance(item, dict):
            key, value = item.get("key"), item.get("value")
        else:
            key, value = item
        if key is None:
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        out[str(key)] = "" if value is None else str(value)
    return out


def row_digest(subject: str, headers: Mapping[str, str], body: bytes) -> str:
    """What makes a default message id name one row (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(subject.encode())
    for key in sorted(headers):
        h.update(b"\0" + key.encode() + b"\0" + headers[key].encode())
    h.update(b"\1" + body)
    return h.hexdigest()


async def _publish(options: SinkOptions, batches: Iterator[pa.RecordBatch],
                   prefix: str) -> PublishReport:
    nc = await connect(options.connection, reconnect=False)
    js = nc.jetstream(timeout=options.publish_timeout, prefix=jsapi.api(nc))
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
                hdrs = _header_dict(headers[i]) if headers else {}
                body = payload.encode() if isinstance(payload, str) else (payload or b"")
                given = ids[i] if ids else None
                hdrs[MSG_ID] = given or f"{prefix}:{row}:{row_digest(subject, hdrs, body)}"
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


# -- the duplicate window ------------------------------------------------------------------
async def _windows(connection: ConnectionOptions, stream: str | None,
                   subject: str | None) -> dict[str, float]:
    """Duplicate window (seconds) of the target stream(s): ``stream``, or the streams
    capturing ``subject``."""
    nc = await connect(connection, reconnect=False)
    try:
        names = [stream] if stream else (await jsapi.stream_names(nc, subject)
                                         if subject else [])
        out = {}
        for name in names:
            info = await jsapi.stream_state(nc, name)
            out[name] = int((info.get("config") or {}).get("duplicate_window", 0)) / 1e9
        return out
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def duplicate_window_problems(windows: Mapping[str, float], trigger_interval: float) -> list[str]:
    """Why replays of a query with this trigger interval could publish twice."""
    out = []
    for name, window in sorted(windows.items()):
        if window < trigger_interval:
            out.append(
                f"stream {name!r} drops duplicates for {window:g}s, less than the trigger "
                f"interval ({trigger_interval:g}s): a batch replayed after a failure would "
                f"be published again. Raise it (nats stream edit {name} --dupe-window "
                f"{max(2 * trigger_interval, 120):g}s) or trigger more often")
    return out


def check_duplicate_window(options: Mapping[str, str], trigger_interval: float | str) -> list[str]:
    """Check a sink target before starting a query: ``options`` are the ones the query
    passes to ``writeStream.format("cgroupd")`` (``servers``, ``stream`` or ``subject``),
    ``trigger_interval`` its trigger (seconds, or ``"5 minutes"``). Returns the problems
    (none: fine); raises when the target cannot be found."""
    sink = SinkOptions.parse(options)
    if isinstance(trigger_interval, str):
        problems: list[str] = []
        seconds = parse_duration("trigger_interval", trigger_interval, problems)
        if seconds is None:
            raise ConfigError(problems)
        trigger_interval = seconds
    if sink.stream is None and sink.subject is None:
        raise ConfigError("name the target: the 'stream' or 'subject' option")
    windows = asyncio.run(_windows(sink.connection, sink.stream, sink.subject))
    if not windows:
        raise ConfigError(f"no stream captures subject {sink.subject!r}")
    return duplicate_window_problems(windows, trigger_interval)


class CgroupdStreamWriter(DataSourceStreamArrowWriter):
    """Streaming sink: ``df.writeStream.format("cgroupd")`` (append and update modes)."""

    def __init__(self, options: SinkOptions, schema: StructType, overwrite: bool = False) -> None:
        _refuse_overwrite(overwrite, "outputMode('complete')")
        check_schema(schema, options)
        self.options = options
        if options.trigger_interval is not None:
            target = options.stream or options.subject
            try:
                windows = asyncio.run(_windows(options.connection, options.stream,
                                               options.subject))
            except CgroupdError as exc:
                raise ConfigError(f"cannot check the duplicate window of {target!r}: "
                                  f"{exc}") from exc
            problems = duplicate_window_problems(windows, options.trigger_interval)
            if problems:
                raise ConfigError(problems)

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
        duplicates = sum(m.duplicates for m in done)
        log.info("batch published", batch=batchId,
                 published=sum(m.published for m in done), duplicates=duplicates)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # Nothing to undo: what was published stays, and the replay's copies are dropped
        # by the server as duplicates (within the stream's duplicate window).
        log.warning("batch aborted; its replay will be de-duplicated", batch=batchId)


class CgroupdBatchWriter(DataSourceArrowWriter):
    """Batch sink: ``df.write.format("cgroupd").mode("append").save()``."""

    def __init__(self, options: SinkOptions, schema: StructType, overwrite: bool = False) -> None:
        _refuse_overwrite(overwrite, "mode('overwrite')")
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
