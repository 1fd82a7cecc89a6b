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
or when the same job is run again, so the server drops the second copy. The default id
names a row by what it is and where the job puts it::

    streaming:  <prefix>:<batch id>:<task partition>:<occurrence>:<digest>
    batch:      <prefix>:<task partition>:<occurrence>:<digest>

``digest`` is a hash of the row's subject, headers and payload; ``occurrence`` counts
the earlier rows with the same digest in the same task (0 for the first), so two
identical rows of one write are two messages, and a rerun's ``n``-th copy of a row is
dropped as the first run's ``n``-th. The task partition is in the id because only
within one task is the count known; Spark gives a task the same rows on a retry and on a
rerun of a deterministic plan (files, tables, ``createDataFrame``, a sorted or hashed
shuffle). A rerun that moves a row to another task (an unsorted ``repartition`` of
rows read in another order) publishes it again rather than risk dropping a genuine row.

The prefix: for a streaming query the query id (kept in the checkpoint, so stable
across restarts) and Spark's micro-batch id; for a batch write ``idPrefix``, by default
the Spark application's name (``spark.app.name``): running the same batch job again
publishes nothing new, a rerun that adds rows to its input publishes only those, and
another application writing the very same rows publishes them. Give each write that
must publish the same rows again its own ``idPrefix`` (a run date); give a ``msg_id``
column to name rows yourself (it wins over the default).

Why content rather than position: a position (row ``n`` of task ``p``) says nothing of
the row, so a shuffle that reorders a replay, or a reused prefix, would drop a new
row as the "duplicate" of another one; an id built from the content can only drop a
copy of the very row. A random prefix per write, the earlier default, made a rerun
publish every row twice (issue 30).

A replay or rerun later than the duplicate window publishes again: the server remembers
ids for that long only, and nothing in the sink can know of an older run. Keep the
window longer than a failed query may stay down and than the gap between a failed
batch write and its rerun (``nats stream edit <stream> --dupe-window 1h``), or make the
consumers idempotent. The driver logs each write's counts with the target's window
(``write published ... duplicates=... dedup_window_s=...``): a rerun that reports
``published`` instead of ``duplicates`` came too late. A streaming writer refuses to
start when its ``triggerInterval`` option (the query's trigger interval) is longer than
the target stream's window; :func:`check_duplicate_window` checks a target before a
query is started.

Streams are append-only: ``overwrite`` (batch) and ``complete`` (streaming) output modes
are refused rather than silently appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
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

from cgroupd.core import logs
from cgroupd.core.errors import CgroupdError, ConfigError, ServerUnreachable
from cgroupd.nats import jsapi
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jserrors import translated
from cgroupd.spark import Shipped, worker_logging
from cgroupd.spark.options import SinkOptions, parse_duration

log = logs.get_logger("cgroupd.spark.writer")

MSG_ID = "Nats-Msg-Id"
#: Local properties Spark sets on every task of a streaming micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: Local property naming the application (a batch write's default ``idPrefix``).
APP_NAME_PROPERTY = "spark.app.name"
#: A batch write's ``idPrefix`` when the application has no name.
DEFAULT_BATCH_PREFIX = "cgroupd-write"


def batch_prefix(app_name: str | None) -> str:
    """A batch write's default ``idPrefix``: the application's name, without the ``:``
    and blanks that separate the id's parts."""
    name = "_".join((app_name or "").replace(":", "_").split())
    return name[:100] or DEFAULT_BATCH_PREFIX
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

    seen: Counter[str] = Counter()
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
                if not given:
                    digest = row_digest(subject, hdrs, body)
                    given = f"{prefix}:{seen[digest]}:{digest}"
                    seen[digest] += 1
                hdrs[MSG_ID] = given
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


class CgroupdStreamWriter(Shipped, DataSourceStreamArrowWriter):
    """Streaming sink: ``df.writeStream.format("cgroupd")`` (append and update modes)."""

    def __init__(self, options: SinkOptions, schema: StructType, overwrite: bool = False) -> None:
        worker_logging()
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
        worker_logging()  # unpickled here: __init__ ran in another process
        done = [m for m in messages if isinstance(m, PublishReport)]
        duplicates = sum(m.duplicates for m in done)
        log.info("batch published", batch=batchId,
                 published=sum(m.published for m in done), duplicates=duplicates)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        worker_logging()  # unpickled here: __init__ ran in another process
        # Nothing to undo: what was published stays, and the replay's copies are dropped
        # by the server as duplicates (within the stream's duplicate window).
        log.warning("batch aborted; its replay will be de-duplicated", batch=batchId)


class CgroupdBatchWriter(Shipped, DataSourceArrowWriter):
    """Batch sink: ``df.write.format("cgroupd").mode("append").save()``."""

    def __init__(self, options: SinkOptions, schema: StructType, overwrite: bool = False) -> None:
        worker_logging()
        _refuse_overwrite(overwrite, "mode('overwrite')")
        check_schema(schema, options)
        self.options = options
        self.prefix = options.id_prefix

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        ctx = _task()
        # The same for every task, retry and rerun of the write (module docstring).
        prefix = self.prefix or batch_prefix(ctx.getLocalProperty(APP_NAME_PROPERTY))
        return publish(self.options, iterator, f"{prefix}:{ctx.partitionId()}")

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        worker_logging()  # unpickled here: __init__ ran in another process
        done = [m for m in messages if isinstance(m, PublishReport)]
        log.info("write published", published=sum(m.published for m in done),
                 duplicates=sum(m.duplicates for m in done),
                 id_prefix=self.prefix or "<spark.app.name>",
                 **self._window())

    def _window(self) -> dict[str, Any]:
        """The target's duplicate window, for the log line (best effort: a target named
        by the rows' subjects alone is not looked up)."""
        o = self.options
        if o.stream is None and o.subject is None:
            return {}
        try:
            windows = asyncio.run(_windows(o.connection, o.stream, o.subject))
        except Exception:  # noqa: BLE001 - a log detail, never a failed write
            return {}
        return {"dedup_window_s": min(windows.values())} if windows else {}
