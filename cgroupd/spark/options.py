"""Options of the ``cgroupd`` Spark format, read once into frozen dataclasses.

Spark hands a data source its options as strings in a case-insensitive map; this is the
only place that reads them. Every problem is reported at once, as a
:class:`~cgroupd.core.errors.ConfigError`, when the query is defined, not when a task runs;
an option this format does not know is an error that names the closest known one (a
misspelt ``maxOffsetsPerTrigger`` would otherwise read without any limit). Durations are
seconds (float), like everywhere in cgroupd, except Kafka's ``maxTriggerDelay`` (Kafka's
format: ``15m``, ``30s``, ``500ms``; a bare number is milliseconds).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cgroupd.cli.natscontext import CONTEXT_ENV, with_context
from cgroupd.core import logs
from cgroupd.core.config import name_problems
from cgroupd.core.errors import ConfigError
from cgroupd.nats.connect import DEFAULT_CONNECT_TIMEOUT, DEFAULT_SERVER, ConnectionOptions, connect
from cgroupd.spark.layout import Mode
from cgroupd.spark.wire import ReaderClient

log = logs.get_logger("cgroupd.spark")

#: How many messages one direct-get request asks for when reading (at most 8 MiB of them;
#: 200k messages of 100 B, local[2]: 96k msg/s with 5,000, 138k with 20,000).
DEFAULT_FETCH_BATCH = 20_000
#: The server deletes the query's synchronization consumers this long after the query's
#: driver stops pulling on them: a crashed or stopped query releases its members after
#: it, and a NATS outage shorter than it keeps the lease.
DEFAULT_LEASE_INACTIVE = 10.0
#: How long a starting query waits for another holder of a member to let go.
DEFAULT_LEASE_WAIT = 10.0
#: Kafka's default maxTriggerDelay.
DEFAULT_MAX_TRIGGER_DELAY = 15 * 60.0
#: While nothing new arrives, the driver looks at the stream at most this often (Spark
#: asks every 10 ms with the default trigger).
DEFAULT_IDLE_WAIT = 0.5

CONNECTION_OPTIONS = ("servers", "creds", "nkeySeed", "token", "user", "password", "tlsCert",
                      "tlsKey", "tlsCa", "tlsFirst", "connectTimeout", "context", "jsDomain")
SOURCE_OPTIONS = (
    *CONNECTION_OPTIONS, "stream", "group", "member", "mode", "subject", "startingOffsets",
    "startingTimestamp", "endingOffsets", "failOnDataLoss", "maxOffsetsPerTrigger",
    "maxMessagesPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay", "minPartitions",
    "fetchBatch", "includeHeaders", "leaseInactiveThreshold",
    "leaseWaitTimeout", "idleWait")
SINK_OPTIONS = (
    *CONNECTION_OPTIONS, "subject", "stream", "idPrefix", "maxPending", "publishTimeout",
    "triggerInterval",
    # Spark passes the writer's own options on to the sink.
    "checkpointLocation", "path")
#: Names users bring from Spark's Kafka source, and what they are called here.
KAFKA_NAMES = {
    "kafka.bootstrap.servers": "servers", "subscribe": "stream", "topic": "stream",
    "subscribepattern": "stream", "assign": "startingOffsets",
    "maxrecordsperpartition": "fetchBatch",
    # cgroupd's own earlier name: tasks are now cut by sequence, minPartitions of them.
    "partitionspertask": "minPartitions",
}


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in options.items() if v is not None}


def unknown_option_problems(options: Iterable[str], known: Iterable[str],
                            what: str) -> list[str]:
    """One message per option not in ``known``, naming the closest known one."""
    by_lower = {k.lower(): k for k in known}
    out = []
    for name in options:
        low = name.lower()
        if low in by_lower:
            continue
        hint = KAFKA_NAMES.get(low)
        if hint is None:
            close = difflib.get_close_matches(low, list(by_lower), n=1, cutoff=0.6)
            hint = by_lower[close[0]] if close else None
        else:
            hint = by_lower.get(hint.lower(), hint)
        suggestion = f"; did you mean {hint!r}?" if hint else ""
        out.append(f"unknown {what} option {name!r}{suggestion} (known: "
                   f"{', '.join(sorted(by_lower.values(), key=str.lower))})")
    return out


#: How the connection options are spelt here, and the field of
#: :class:`~cgroupd.nats.connect.ConnectionOptions` each sets (the CLI's and the daemon's
#: options, so a query connects exactly as ``cgroupd join`` does: TLS included).
_CONNECTION_FIELDS = {"creds": "creds", "nkeySeed": "nkey_seed", "tlsCert": "tls_cert",
                      "tlsKey": "tls_key", "tlsCa": "tls_ca"}


def parse_connection(opts: Mapping[str, str],
                     env: Mapping[str, str] | None = None
                     ) -> tuple[ConnectionOptions, list[str]]:
    """``servers`` (comma-separated), at most one of ``creds`` | ``nkeySeed`` | ``token`` |
    ``user`` + ``password``, ``tlsCert`` + ``tlsKey``, ``tlsCa``, ``tlsFirst``,
    ``connectTimeout``, ``jsDomain``, ``context``.

    As the CLI does (read where the query is defined, the driver): without ``servers``,
    ``NATS_URL``; without ``context``, ``NATS_CONTEXT``, then the ``nats`` CLI's selected
    context; options given explicitly override the context's.
    """
    env = os.environ if env is None else env
    problems: list[str] = []
    raw_servers = opts.get("servers") or env.get("NATS_URL") or ""
    servers = tuple(s.strip() for s in raw_servers.split(",") if s.strip())
    if "servers" in opts and not servers:
        problems.append("servers must name at least one NATS server")
    timeout = _float(opts, "connectTimeout", DEFAULT_CONNECT_TIMEOUT, problems)
    given: dict[str, object] = {"servers": servers} if servers else {}
    for option, field in _CONNECTION_FIELDS.items():
        raw = opts.get(option.lower())
        if raw:
            given[field] = Path(raw)
            if not Path(raw).is_file():
                problems.append(f"{option} file {raw!r} does not exist")
    for option, field in (("token", "token"), ("user", "user"), ("password", "password"),
                          ("jsDomain", "js_domain")):
        if opts.get(option.lower()):
            given[field] = opts[option.lower()]
    if _bool(opts, "tlsFirst", False, problems):
        given["tls_first"] = True
    # The rules ConnectionOptions enforces, in this format's option names.
    if sum(bool(opts.get(k)) for k in ("creds", "nkeyseed", "token", "user")) > 1:
        problems.append("choose one of creds, token, nkeySeed, user/password")
    if opts.get("password") is not None and opts.get("user") is None:
        problems.append("password needs user")
    if bool(opts.get("tlscert")) != bool(opts.get("tlskey")):
        problems.append("give both tlsCert and tlsKey (mutual TLS), or neither")
    fallback = ConnectionOptions(servers=servers or (DEFAULT_SERVER,), name="cgroupd-spark")
    if problems:
        return fallback, problems
    try:
        conn = with_context(given, opts.get("context") or env.get(CONTEXT_ENV) or None, env,
                            connect_timeout=timeout if timeout > 0 else DEFAULT_CONNECT_TIMEOUT,
                            name="cgroupd-spark")
    except ConfigError as exc:
        problems.extend(exc.problems)
        conn = fallback
    return conn, problems


async def connect_reader(conn: ConnectionOptions, *, reconnect: bool) -> ReaderClient:
    """A connected :class:`~cgroupd.spark.wire.ReaderClient` (see
    :func:`cgroupd.nats.connect.connect`; drivers reconnect forever, tasks fail fast)."""
    nc = ReaderClient()
    await connect(conn, client=nc, reconnect=reconnect)
    return nc


def _int(opts: Mapping[str, str], key: str, default: int | None, problems: list[str],
         minimum: int = 1) -> int | None:
    raw = opts.get(key.lower())
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        problems.append(f"{key} must be an integer, not {raw!r}")
        return default
    if value < minimum:
        problems.append(f"{key} must be at least {minimum}, not {value}")
    return value


def _float(opts: Mapping[str, str], key: str, default: float, problems: list[str]) -> float:
    raw = opts.get(key.lower())
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        problems.append(f"{key} must be a number of seconds, not {raw!r}")
        return default
    if not value > 0 or value == float("inf"):
        problems.append(f"{key} must be a positive number of seconds, not {raw!r}")
    return value


def _bool(opts: Mapping[str, str], key: str, default: bool, problems: list[str]) -> bool:
    raw = opts.get(key.lower())
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    problems.append(f"{key} must be true or false, not {raw!r}")
    return default


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|sec|m|min|h|d)?\s*$", re.I)
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, None: 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0,
                 "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(key: str, raw: str, problems: list[str]) -> float | None:
    """Kafka's ``timeStringAsMs`` format, in seconds: ``15m``, ``30s``, ``500ms``, ``2h``;
    a bare number is milliseconds. Spark's ``"5 minutes"`` style is read too."""
    text = raw.strip().lower()
    for long, short in (("minutes", "m"), ("minute", "m"), ("seconds", "s"),
                        ("second", "s"), ("hours", "h"), ("hour", "h"),
                        ("milliseconds", "ms"), ("millisecond", "ms")):
        if text.endswith(long):
            text = text[:-len(long)] + short
            break
    match = _DURATION.match(text)
    if not match:
        problems.append(f"{key} must be a duration like 15m, 30s or 500ms, not {raw!r}")
        return None
    unit = match.group(2)
    return float(match.group(1)) * _UNIT_SECONDS[unit.lower() if unit else None]


@dataclass(frozen=True)
class SourceOptions:
    """``spark.readStream.format("cgroupd")`` / ``spark.read.format("cgroupd")`` options."""

    connection: ConnectionOptions
    #: The origin stream (the stream the messages are published to).
    stream: str
    #: An elastic or static group on it; None reads the stream itself (one partition).
    group: str | None = None
    #: Read only this member's partitions (and, in workqueue mode, hold only its lease).
    member: str | None = None
    mode: Mode = Mode.READ
    #: A plain stream's subject filter.
    subject: str = ">"
    #: ``earliest``, ``latest`` or JSON (Kafka's meaning: the first sequence to read).
    starting_offsets: str = "earliest"
    #: Milliseconds since the epoch: start at the first message stored at or after it.
    starting_timestamp: int | None = None
    #: Batch reads only: ``latest`` or JSON (the first sequence *not* to read).
    ending_offsets: str = "latest"
    fail_on_data_loss: bool = True
    #: Admission control: at most / at least this many messages per micro-batch.
    max_offsets_per_trigger: int | None = None
    min_offsets_per_trigger: int | None = None
    #: With ``minOffsetsPerTrigger``: run a batch anyway once this long has passed.
    max_trigger_delay: float = DEFAULT_MAX_TRIGGER_DELAY
    #: At least this many tasks per batch (ranges are cut by sequence).
    min_partitions: int | None = None
    #: Messages asked for in one direct-get request.
    fetch_batch: int = DEFAULT_FETCH_BATCH
    include_headers: bool = False
    lease_inactive_threshold: float = DEFAULT_LEASE_INACTIVE
    lease_wait: float = DEFAULT_LEASE_WAIT
    idle_wait: float = DEFAULT_IDLE_WAIT

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = _lower(options)
        problems = unknown_option_problems(options, SOURCE_OPTIONS, "source")
        connection, conn_problems = parse_connection(opts)
        problems += conn_problems
        if not opts.get("stream"):
            problems.append("option 'stream' is required")
        else:
            problems.extend(name_problems("stream", opts["stream"]))
        group = opts.get("group") or None
        if group is not None:
            problems.extend(name_problems("group", group))
        member = opts.get("member") or None
        if member is not None:
            problems.extend(name_problems("member", member))
        mode = Mode.READ
        raw_mode = opts.get("mode", "read").strip().lower()
        try:
            mode = Mode(raw_mode)
        except ValueError:
            problems.append(f"mode must be 'read' or 'workqueue', not {opts['mode']!r}")
        subject = opts.get("subject", ">").strip() or ">"
        if any(c.isspace() for c in subject) or ".." in subject or subject.startswith(".") \
                or subject.endswith("."):
            problems.append(f"subject {subject!r} is not a valid subject filter")
        starting = opts.get("startingoffsets", "earliest")
        timestamp = _int(opts, "startingTimestamp", None, problems, minimum=0)
        max_new = _int(opts, "maxOffsetsPerTrigger", None, problems)
        max_old = _int(opts, "maxMessagesPerTrigger", None, problems)
        if max_new is not None and max_old is not None and max_new != max_old:
            problems.append("give maxOffsetsPerTrigger or maxMessagesPerTrigger (the same "
                            "option), not both")
        min_offsets = _int(opts, "minOffsetsPerTrigger", None, problems)
        delay = DEFAULT_MAX_TRIGGER_DELAY
        if opts.get("maxtriggerdelay"):
            delay = parse_duration("maxTriggerDelay", opts["maxtriggerdelay"],
                                   problems) or delay
        if mode is Mode.WORKQUEUE and (timestamp is not None
                                       or starting.strip().lower() != "earliest"):
            problems.append(
                "in mode 'workqueue' the query consumes the group's queue from its start: "
                "startingOffsets other than 'earliest' and startingTimestamp would leave "
                "queued messages behind for the next commit to purge unread; purge them "
                "first, or read with mode 'read'")
        if mode is Mode.WORKQUEUE and group is None:
            problems.append("mode 'workqueue' reads a group's work-queue stream: give the "
                            "'group' option")
        if member is not None and group is None:
            problems.append("option 'member' needs the 'group' option")
        if subject != ">" and group is not None:
            problems.append("option 'subject' filters a plain stream; a group's filters "
                            "decide what it holds")
        min_parts = _int(opts, "minPartitions", None, problems)
        fetch = _int(opts, "fetchBatch", DEFAULT_FETCH_BATCH, problems)
        inactive = _float(opts, "leaseInactiveThreshold", DEFAULT_LEASE_INACTIVE, problems)
        wait = _float(opts, "leaseWaitTimeout", DEFAULT_LEASE_WAIT, problems)
        idle = _float(opts, "idleWait", DEFAULT_IDLE_WAIT, problems)
        fail = _bool(opts, "failOnDataLoss", True, problems)
        headers = _bool(opts, "includeHeaders", False, problems)
        if problems:
            raise ConfigError(problems)
        return cls(connection=connection, stream=opts["stream"], group=group, member=member,
                   mode=mode, subject=subject, starting_offsets=starting,
                   starting_timestamp=timestamp,
                   ending_offsets=opts.get("endingoffsets", "latest"),
                   fail_on_data_loss=fail,
                   max_offsets_per_trigger=max_new if max_new is not None else max_old,
                   min_offsets_per_trigger=min_offsets, max_trigger_delay=delay,
                   min_partitions=min_parts,
                   fetch_batch=fetch or DEFAULT_FETCH_BATCH, include_headers=headers,
                   lease_inactive_threshold=inactive, lease_wait=wait, idle_wait=idle)


@dataclass(frozen=True)
class SinkOptions:
    """``df.write.format("cgroupd")`` / ``writeStream`` options."""

    connection: ConnectionOptions
    #: Subject for rows without a ``subject`` column (or with a null one).
    subject: str | None = None
    #: Stream the subjects must land in (checked by the server: ``Nats-Expected-Stream``).
    stream: str | None = None
    #: Prefix of ``Nats-Msg-Id``; default: the streaming query id (stable across restarts
    #: from one checkpoint) or, for a batch write, ``cgroupd-write`` (a rerun of the same
    #: write is de-duplicated; see :mod:`cgroupd.spark.writer`).
    id_prefix: str | None = None
    #: Publishes awaiting their acknowledgement at once, per task.
    max_pending: int = 256
    publish_timeout: float = 5.0
    #: The query's trigger interval (seconds), to check the stream's duplicate window
    #: against when the query starts.
    trigger_interval: float | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        opts = _lower(options)
        problems = unknown_option_problems(options, SINK_OPTIONS, "sink")
        connection, conn_problems = parse_connection(opts)
        problems += conn_problems
        subject = opts.get("subject") or None
        if subject is not None and (any(c.isspace() for c in subject) or "*" in subject
                                    or ">" in subject or ".." in subject):
            problems.append(f"subject {subject!r} is not a valid publish subject")
        pending = _int(opts, "maxPending", 256, problems)
        timeout = _float(opts, "publishTimeout", 5.0, problems)
        trigger = None
        if opts.get("triggerinterval"):
            trigger = parse_duration("triggerInterval", opts["triggerinterval"] + (
                "s" if opts["triggerinterval"].strip().replace(".", "").isdigit() else ""),
                problems)
        if problems:
            raise ConfigError(problems)
        return cls(connection=connection, subject=subject, stream=opts.get("stream") or None,
                   id_prefix=opts.get("idprefix") or None, max_pending=pending or 256,
                   publish_timeout=timeout, trigger_interval=trigger)
