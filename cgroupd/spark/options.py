"""Options of the ``cgroupd`` Spark format, read once into frozen dataclasses.

Spark hands a data source its options as strings in a case-insensitive map; this is the
only place that reads them. Every problem is reported at once, as a
:class:`~cgroupd.errors.ConfigError`, when the query is defined, not when a task runs.
Durations are seconds (float), like everywhere in cgroupd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import structlog
from nats.aio.client import Client

from cgroupd.config import name_problems
from cgroupd.errors import ConfigError, PermissionDenied, ServerUnreachable

log = structlog.get_logger("cgroupd.spark")

DEFAULT_SERVER = "nats://127.0.0.1:4222"
DEFAULT_CONNECT_TIMEOUT = 5.0
#: How many messages one direct-get request asks for when reading a partition.
DEFAULT_FETCH_BATCH = 5000
#: The server deletes the query's synchronization consumers this long after the query's
#: driver stops pulling on them (a crashed or stopped query releases its members).
DEFAULT_LEASE_INACTIVE = 2.0
#: How long a starting query waits for another holder of a member to let go.
DEFAULT_LEASE_WAIT = 10.0


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in options.items() if v is not None}


@dataclass(frozen=True)
class Connection:
    """How to reach NATS: ``servers`` (comma-separated) and at most one credential."""

    servers: tuple[str, ...] = (DEFAULT_SERVER,)
    creds: str | None = None
    token: str | None = None
    user: str | None = None
    password: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT

    def problems(self) -> list[str]:
        out = []
        if not self.servers:
            out.append("servers must name at least one NATS server")
        if sum(x is not None for x in (self.creds, self.token, self.user)) > 1:
            out.append("choose one of creds, token, user/password")
        if self.password is not None and self.user is None:
            out.append("password needs user")
        if self.creds is not None and not Path(self.creds).is_file():
            out.append(f"creds file {self.creds!r} does not exist")
        if self.connect_timeout <= 0:
            out.append("connectTimeout must be positive")
        return out

    @classmethod
    def parse(cls, opts: Mapping[str, str]) -> tuple[Connection, list[str]]:
        problems: list[str] = []
        servers = tuple(s.strip() for s in opts.get("servers", DEFAULT_SERVER).split(",")
                        if s.strip())
        timeout = _float(opts, "connecttimeout", DEFAULT_CONNECT_TIMEOUT, problems)
        conn = cls(servers=servers, creds=opts.get("creds"), token=opts.get("token"),
                   user=opts.get("user"), password=opts.get("password"),
                   connect_timeout=timeout)
        return conn, problems + conn.problems()

    def kwargs(self, *, reconnect: bool) -> dict[str, Any]:
        """``nats.connect`` arguments; drivers reconnect forever, tasks fail fast."""
        kwargs: dict[str, Any] = {
            "servers": list(self.servers),
            "name": "cgroupd-spark",
            "connect_timeout": self.connect_timeout,
            "allow_reconnect": reconnect,
            "max_reconnect_attempts": -1 if reconnect else 0,
            "reconnect_time_wait": 0.5,
        }
        if self.creds is not None:
            kwargs["user_credentials"] = self.creds
        if self.token is not None:
            kwargs["token"] = self.token
        if self.user is not None:
            kwargs["user"] = self.user
            kwargs["password"] = self.password or ""
        return kwargs

    async def connect(self, *, reconnect: bool, client: Client | None = None) -> Client:
        """A connected client, or ServerUnreachable/PermissionDenied within the timeout.

        nats-py retries a first connect forever when told to reconnect forever; the
        deadline here bounds it.
        """
        nc = client or Client()

        async def on_error(exc: Exception) -> None:  # nats-py logs a traceback otherwise
            log.warning("nats error", error=str(exc) or type(exc).__name__)

        attempt = nc.connect(error_cb=on_error, **self.kwargs(reconnect=reconnect))
        try:
            await asyncio.wait_for(attempt, timeout=self.connect_timeout * 2)
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - already failed; report the first cause
                pass
            where = ", ".join(self.servers)
            if "authorization" in str(exc).lower():
                raise PermissionDenied(f"{where}: authorization violation") from exc
            raise ServerUnreachable(f"cannot connect to NATS at {where}: "
                                    f"{exc or type(exc).__name__}") from exc
        return nc


def _int(opts: Mapping[str, str], key: str, default: int | None, problems: list[str],
         minimum: int = 1) -> int | None:
    raw = opts.get(key)
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
    raw = opts.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        problems.append(f"{key} must be a number of seconds, not {raw!r}")
        return default
    if value <= 0:
        problems.append(f"{key} must be positive, not {value}")
    return value


@dataclass(frozen=True)
class SourceOptions:
    """``spark.readStream.format("cgroupd")`` options."""

    connection: Connection
    #: The origin stream and the elastic group on it.
    stream: str
    group: str
    #: Read only this member's partitions (and take only its lease); None: all partitions.
    member: str | None = None
    #: ``earliest``, ``latest`` or a JSON object of partition -> last sequence already read.
    starting_offsets: str = "earliest"
    #: Admission control: at most this many messages per micro-batch (None: no limit).
    max_messages_per_trigger: int | None = None
    #: Group partitions read by one Spark task, in partition order.
    partitions_per_task: int = 1
    #: Messages asked for in one direct-get request.
    fetch_batch: int = DEFAULT_FETCH_BATCH
    lease_inactive_threshold: float = DEFAULT_LEASE_INACTIVE
    lease_wait: float = DEFAULT_LEASE_WAIT

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = _lower(options)
        connection, problems = Connection.parse(opts)
        for key in ("stream", "group"):
            if not opts.get(key):
                problems.append(f"option {key!r} is required")
            else:
                problems.extend(name_problems(key, opts[key]))
        member = opts.get("member") or None
        if member is not None:
            problems.extend(name_problems("member", member))
        starting = opts.get("startingoffsets", "earliest")
        max_msgs = _int(opts, "maxmessagespertrigger", None, problems)
        per_task = _int(opts, "partitionspertask", 1, problems)
        fetch = _int(opts, "fetchbatch", DEFAULT_FETCH_BATCH, problems)
        inactive = _float(opts, "leaseinactivethreshold", DEFAULT_LEASE_INACTIVE, problems)
        wait = _float(opts, "leasewaittimeout", DEFAULT_LEASE_WAIT, problems)
        if problems:
            raise ConfigError(problems)
        return cls(connection=connection, stream=opts["stream"], group=opts["group"],
                   member=member, starting_offsets=starting,
                   max_messages_per_trigger=max_msgs, partitions_per_task=per_task or 1,
                   fetch_batch=fetch or DEFAULT_FETCH_BATCH,
                   lease_inactive_threshold=inactive, lease_wait=wait)


@dataclass(frozen=True)
class SinkOptions:
    """``df.write.format("cgroupd")`` / ``writeStream`` options."""

    connection: Connection
    #: Subject for rows without a ``subject`` column (or with a null one).
    subject: str | None = None
    #: Stream the subjects must land in (checked by the server: ``Nats-Expected-Stream``).
    stream: str | None = None
    #: Stable prefix of ``Nats-Msg-Id``; default: the streaming query id (stable across
    #: restarts from one checkpoint) or, for a batch write, one random id per write.
    id_prefix: str | None = None
    #: Publishes awaiting their acknowledgement at once, per task.
    max_pending: int = 256
    publish_timeout: float = 5.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        opts = _lower(options)
        connection, problems = Connection.parse(opts)
        subject = opts.get("subject") or None
        if subject is not None and (any(c.isspace() for c in subject) or "*" in subject
                                    or ">" in subject or ".." in subject):
            problems.append(f"subject {subject!r} is not a valid publish subject")
        pending = _int(opts, "maxpending", 256, problems)
        timeout = _float(opts, "publishtimeout", 5.0, problems)
        if problems:
            raise ConfigError(problems)
        return cls(connection=connection, subject=subject, stream=opts.get("stream") or None,
                   id_prefix=opts.get("idprefix") or None, max_pending=pending or 256,
                   publish_timeout=timeout)
