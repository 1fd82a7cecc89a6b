"""The JetStream adapter: the one place above :mod:`cgroupd.nats.jsapi` that talks to nats-py.

Streams, KV records and consumers, with nats-py's exceptions translated into
:mod:`cgroupd.core.errors`. The admin API and the member runtime use only this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.kv import KeyValue

from cgroupd.core import logs
from cgroupd.core.answer_timeout import AnswerTimeout
from cgroupd.core.errors import (
    ApiError,
    BucketNotFound,
    ConflictError,
    NoAnswer,
    PermissionDenied,
    ServerUnreachable,
    StreamNotFound,
)
from cgroupd.core.retrying import retry_delay
from cgroupd.nats import jsapi, streamread
from cgroupd.nats.jserrors import translated
from cgroupd.nats.lease import QUIET_PROBE, Answer, OwnerWatch, Prober, probe
from cgroupd.nats.pull import Puller, PullOptions

log = logs.get_logger("cgroupd.jetstream")
T = TypeVar("T")

#: Header of a KV delete or purge marker.
KV_OPERATION = "KV-Operation"
#: A record watch reads the record again this often (seconds) even when it heard nothing.
WATCH_RESYNC = 60.0
#: Pauses before a record watch reads again a record that a notification did not change yet.
WATCH_SETTLE = (0.01, 0.03, 0.1, 0.3, 0.6)
#: How often a bucket creation is asked for before its timeout is the caller's error.
BUCKET_CREATE_ATTEMPTS = 3


@dataclass(frozen=True)
class Record:
    """A KV record: its bytes (None when deleted) and revision."""

    value: bytes | None
    revision: int


class _PrefixedPublish:
    """A nats-py JetStream context whose ``publish`` goes to ``<prefix>.<subject>``."""

    def __init__(self, js: Any, prefix: str) -> None:
        self._js = js
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        return await self._js.publish(f"{self._prefix}.{subject}", *args, **kwargs)


class JetStream:
    """Streams, group records and consumers over one NATS connection."""

    def __init__(self, nc: Client, timeout: float = jsapi.API_TIMEOUT) -> None:
        self.nc = nc
        # The JetStream domain's API prefix that connect() recorded for this client.
        self.api = jsapi.api(nc)
        self.js = nc.jetstream(timeout=timeout, prefix=self.api)
        self.jsm = self.js._jsm
        #: How long to wait for an API answer: ``timeout``, longer after unanswered requests
        #: only with a cap above it (off by default; issue 27: :mod:`cgroupd.core.answer_timeout`).
        self.answers = AnswerTimeout(timeout)
        self._kv: dict[str, KeyValue] = {}
        self._denials: list[tuple[float, str]] = []
        self._pullers: weakref.WeakSet[Puller] = weakref.WeakSet()
        self._listeners: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._watch_permission_errors()
        self._watch_connection()

    def _watch_connection(self) -> None:
        """Chain nats-py's disconnect and reconnect callbacks (whoever connected may have
        set their own): after a reconnect every puller asks again at once (its requests
        died with the old connection), and listeners (:meth:`on_connection`) hear both."""
        disconnected, reconnected = self.nc._disconnected_cb, self.nc._reconnected_cb

        async def on_disconnected() -> None:
            for lost, _ in list(self._listeners):
                lost()
            if disconnected is not None:
                await disconnected()

        async def on_reconnected() -> None:
            for puller in list(self._pullers):
                puller.reconnected()
            for _, back in list(self._listeners):
                back()
            if reconnected is not None:
                await reconnected()

        self.nc._disconnected_cb = on_disconnected
        self.nc._reconnected_cb = on_reconnected

    def on_connection(self, lost: Callable[[], None],
                      back: Callable[[], None]) -> Callable[[], None]:
        """Call ``lost`` when the connection drops and ``back`` once it is re-established;
        returns a function that removes them."""
        entry = (lost, back)
        self._listeners.append(entry)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(entry)

        return remove

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    def server_version(self) -> tuple[int, int, int] | None:
        """The connected server's version from its INFO (None when unknown)."""
        try:
            v = self.nc.connected_server_version
            return int(v.major), int(v.minor), int(v.patch)
        except (AttributeError, ValueError, TypeError, IndexError):
            return None

    def _watch_permission_errors(self) -> None:
        """A denied publish gets no API reply, only an async -ERR on the connection; keep
        those so a request that then times out is reported as PermissionDenied."""
        chained = self.nc._error_cb

        async def on_error(exc: Exception) -> None:
            if "permissions violation" in str(exc).lower():
                self._denials = [*self._denials[-9:], (time.monotonic(), str(exc))]
            if chained is not None:
                await chained(exc)

        self.nc._error_cb = on_error

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """:func:`translated`, plus: a timeout after a permissions violation is a denial."""
        started = time.monotonic()
        try:
            with translated(what):
                yield
        except ServerUnreachable as exc:
            denial = next((text for at, text in reversed(self._denials) if at >= started), None)
            if denial is not None:
                raise PermissionDenied(f"{what}: {denial}") from exc
            raise

    async def _asked(self, what: str, call: Callable[[float], Awaitable[T]]) -> T:
        """One request of ours (:mod:`cgroupd.nats.jsapi`), given the wait
        :attr:`answers` says, which learns from its answer or its silence. nats-py's own
        requests (streams, KV records) wait as long and do not teach it. Silence after a
        permissions violation is a denial (see :meth:`_translated`), not a slow server."""
        wait = self.answers.seconds
        sent = time.monotonic()
        with self._translated(what):
            try:
                result = await call(wait)
            except NoAnswer:
                if not any(at >= sent for at, _ in self._denials):
                    self._learnt(None, wait)
                raise
            except ApiError:
                self._learnt(time.monotonic() - sent, wait)
                raise
            self._learnt(time.monotonic() - sent, wait)
            return result

    def _learnt(self, elapsed: float | None, wait: float) -> None:
        was, raised = self.answers.seconds, self.answers.raised
        if elapsed is None:
            self.answers.unanswered(wait)
        else:
            self.answers.answered(elapsed)
        now = self.answers.seconds
        if now == was:
            return
        # nats-py reads its contexts' timeout at each call (nats-py 2.x).
        self.js._timeout = self.jsm._timeout = now
        if self.answers.raised != raised:
            if raised:
                log.info("the server answers promptly again", answer_timeout=round(now, 2))
            else:
                log.warning("the server is slow to answer; waiting longer for it",
                            answer_timeout=round(now, 2), unanswered_after=round(wait, 2))

    # -- streams ---------------------------------------------------------------------
    async def stream_info(self, name: str) -> api.StreamInfo | None:
        """Info of a stream, or None when it does not exist."""
        try:
            with self._translated(f"stream {name}"):
                return await self.jsm.stream_info(name)
        except StreamNotFound:
            return None

    async def add_stream(self, config: api.StreamConfig) -> api.StreamInfo:
        with self._translated(f"creating stream {config.name}"):
            return await self.jsm.add_stream(config)

    async def delete_stream(self, name: str) -> bool:
        """Delete a stream; False if it did not exist."""
        try:
            with self._translated(f"deleting stream {name}"):
                return bool(await self.jsm.delete_stream(name))
        except StreamNotFound:
            return False

    async def subject_counts(self, stream: str) -> dict[str, int]:
        """Messages per subject in a stream (the server caps very large answers)."""
        with self._translated(f"stream {stream}"):
            info = await self.jsm.stream_info(stream, subjects_filter=">")
        return dict(info.state.subjects or {})

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> int:
        """Publish into a stream and wait for its acknowledgement; the stream sequence."""
        with self._translated(f"publishing to {subject}"):
            ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
        return int(ack.seq)

    async def publish_stored(self, subject: str, data: bytes, headers: dict[str, str],
                             timeout: float | None = None) -> tuple[str, int, bool]:
        """Publish into a stream and wait for its acknowledgement: ``(stream, sequence,
        duplicate)``; ``duplicate``: the stream dropped it, having stored a message with
        the same ``Nats-Msg-Id`` (at ``sequence``) within its duplicate window."""
        with self._translated(f"publishing to {subject}"):
            ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
        return str(ack.stream), int(ack.seq), bool(ack.duplicate)

    async def purge(self, stream: str, subject: str | None = None,
                    keep_from_seq: int | None = None) -> None:
        """Purge ``subject`` (all if None) below sequence ``keep_from_seq``."""
        with self._translated(f"purging {stream}"):
            await self.jsm.purge_stream(stream, subject=subject, seq=keep_from_seq)

    # -- KV records ------------------------------------------------------------------
    async def bucket(self, name: str, create_with: api.KeyValueConfig | None = None) -> KeyValue:
        """The KV bucket ``name``; created with ``create_with`` when absent and given."""
        if name in self._kv:
            return self._kv[name]
        kv = await (self._open_bucket(name) if create_with is None
                    else self._open_or_create_bucket(create_with))
        if self.api != jsapi.API:
            # nats-py 2.16 publishes KV writes to $KV.<bucket>.<key> whatever the domain;
            # from a leaf node those reach no stream. Address them as nats.go does, to
            # <api prefix>.$KV.<bucket>.<key>, which the domain's servers map back.
            kv._js = _PrefixedPublish(kv._js, self.api)  # type: ignore[assignment]
        self._kv[name] = kv
        return kv

    async def _open_bucket(self, name: str) -> KeyValue:
        with self._translated(f"bucket {name}"):
            return await self.js.key_value(name)

    async def _open_or_create_bucket(self, config: api.KeyValueConfig) -> KeyValue:
        """Open the bucket, or create it; asked again when the server did not answer in time.

        A replicated bucket is answered only once its stream's replicas elected a leader,
        which on a busy cluster (or one still forming) can outlast the request's timeout
        while the creation goes on; asking again with the same config is harmless: the
        server answers with the bucket it made. CI on 5e3894c timed out once at 10 s.
        """
        attempt = 0
        while True:
            try:
                try:
                    return await self._open_bucket(config.bucket)
                except BucketNotFound:
                    with self._translated(f"creating bucket {config.bucket}"):
                        return await self.js.create_key_value(config=config)
            except ServerUnreachable:
                attempt += 1
                if attempt == BUCKET_CREATE_ATTEMPTS:
                    raise
            await asyncio.sleep(retry_delay(attempt - 1, 0.5))

    async def get_record(self, bucket: str, key: str) -> Record | None:
        """Current value of a record; None when absent or deleted.

        Read with the stream's message-get API, whose JSON answer carries the record's
        headers apart from any status, rather than nats-py's ``kv.get``: on a bucket with
        direct get (the reference creates them so) that takes a record's own header
        ``Status: 503`` for "no responders" and ``Status: 100`` crashes it.
        """
        await self.bucket(bucket)
        try:
            with self._translated(f"reading {bucket}/{key}"):
                try:
                    msg = await self.jsm.get_msg(f"KV_{bucket}",
                                                 subject=f"$KV.{bucket}.{key}")
                except nats.js.errors.NotFoundError as exc:
                    if exc.err_code == jsapi.ERR_STREAM_NOT_FOUND:
                        raise
                    return None  # no message for the key
        except StreamNotFound as exc:
            raise BucketNotFound(f"reading {bucket}/{key}: the consumer group KV bucket "
                                 "does not exist") from exc
        operation = (msg.headers or {}).get(KV_OPERATION, "")
        if operation.upper() in ("DEL", "PURGE"):
            return None
        return Record(msg.data or b"", int(msg.seq or 0))

    async def create_record(self, bucket: str, key: str, value: bytes) -> int:
        """Create a record that must not exist yet; ConflictError if it does."""
        kv = await self.bucket(bucket)
        with self._translated(f"creating {bucket}/{key}"):
            try:
                return int(await kv.create(key, value))
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                raise ConflictError(f"{bucket}/{key} already exists") from exc

    async def update_record(self, bucket: str, key: str, value: bytes, last: int) -> int:
        """Compare-and-set on revision ``last``; ConflictError when it moved on."""
        kv = await self.bucket(bucket)
        with self._translated(f"updating {bucket}/{key}"):
            return int(await kv.update(key, value, last=last))

    async def delete_record(self, bucket: str, key: str, last: int | None = None) -> None:
        """Delete a record; with ``last``, only while it is still at that revision
        (ConflictError otherwise)."""
        kv = await self.bucket(bucket)
        with self._translated(f"deleting {bucket}/{key}"):
            try:
                await kv.delete(key, last=last)
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                raise ConflictError(f"{bucket}/{key} changed meanwhile") from exc

    async def keys(self, bucket: str) -> list[str]:
        """Keys of live records in a bucket.

        Read from the bucket stream's subjects, then each key's last entry (a delete or
        purge marker is no record), not with nats-py's ``kv.keys()``: its watcher may
        signal the end of the initial values before one it already received (CI: a group
        created just before was missing from ``list_groups``), as ``watch_record``
        works around too."""
        await self.bucket(bucket)
        prefix = f"$KV.{bucket}."
        with self._translated(f"listing {bucket}"):
            info = await self.jsm.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        subjects = info.state.subjects or {}
        return [subject[len(prefix):] for subject in subjects
                if await self.get_record(bucket, subject[len(prefix):]) is not None]

    async def watch_record(self, bucket: str, key: str) -> AsyncIterator[Record]:
        """The current record, then every change (value None = deleted), until cancelled.

        A record absent when the watch starts comes first as ``Record(None, 0)``.

        Changes are heard on a plain subscription to the record's subject (every put,
        delete and purge of a KV record is published there) and read back with
        :meth:`get_record`, so a watcher costs the server no consumer. nats-server 2.15
        limits a stream to 1,000 consumers unless the stream says otherwise
        (``default_max_consumers``), and every instance of every group on a server
        watches the one bucket: with nats-py's ``kv.watch`` (an ordered consumer each,
        heartbeating) 280 of 1,000 instances could not start (``bench.fleet --members 500``
        on 2.15.1: err_code 10026). A notification can be lost while the connection is
        down, or across a cut route, so the record is read again after each reconnect
        and every ``WATCH_RESYNC`` seconds (jittered).
        """
        if self.api != jsapi.API:
            # Across a leaf node to another JetStream domain, nats-server passes no
            # ``$KV.>`` traffic (its denyAllClientJs list, both ways): nothing would be
            # heard. A consumer's deliveries reach our inbox there.
            async for record in self._watch_with_consumer(bucket, key):
                yield record
            return
        changed = asyncio.Event()
        notified = False

        async def heard(msg: Msg) -> None:
            nonlocal notified
            notified = True
            changed.set()

        with self._translated(f"watching {bucket}/{key}"):
            await self.bucket(bucket)
            sub = await self.nc.subscribe(f"$KV.{bucket}.{key}", cb=heard)
            await self.nc.flush()  # subscribed before the first read: no change missed
        remove = self.on_connection(lambda: None, changed.set)
        last: int | None = None
        try:
            while True:
                changed.clear()
                record = await self._read_watched(bucket, key, last if notified else None)
                notified = False
                if record.revision != last:
                    last = record.revision
                    yield record
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WATCH_RESYNC * random.uniform(0.75, 1.25)):
                        await changed.wait()
        finally:
            remove()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _read_watched(self, bucket: str, key: str, unchanged: int | None) -> Record:
        """The watched record; after a notification (``unchanged``: the revision known
        before it), read again for a moment while it still shows that one. Subscribers hear
        a write before the stream has stored it, so the first read can come too early, and
        nothing else would wake the watch for ``WATCH_RESYNC`` (CI on 868810b: a standby
        missed its group's deletion and retried for 18 s). A notification of a write the
        stream refused (a failed compare-and-set) changes nothing: given up after
        :data:`WATCH_SETTLE`."""
        for pause in (0.0, *WATCH_SETTLE):
            if pause:
                await asyncio.sleep(pause)
            record = await self.get_record(bucket, key) or Record(None, 0)
            if unchanged is None or record.revision != unchanged:
                break
        return record

    async def _watch_with_consumer(self, bucket: str, key: str) -> AsyncIterator[Record]:
        """:meth:`watch_record` through nats-py's ``kv.watch`` (an ordered consumer on the
        bucket): for a JetStream domain reached through a leaf node only, as each watcher
        costs a consumer (nats-server 2.15 allows 1,000 per stream by default)."""
        kv = await self.bucket(bucket)
        with self._translated(f"watching {bucket}/{key}"):
            watcher = await kv.watch(key)
        seen = False
        last = 0
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=60.0)  # type: ignore[no-untyped-call]
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                if entry is None:  # end of the initial values
                    if not seen:
                        # nats-py may signal the end before an initial value it already
                        # received reaches us: ask for the record itself.
                        seen = True
                        current = await self.get_record(bucket, key)
                        last = current.revision if current else 0
                        yield current or Record(None, 0)
                    continue
                if entry.revision is not None and entry.revision <= last:
                    continue  # already yielded by the lookup above
                seen = True
                last = entry.revision or last
                deleted = entry.operation in ("DEL", "PURGE")
                yield Record(None if deleted else entry.value, entry.revision or 0)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    # -- consumers -------------------------------------------------------------------
    async def create_consumer(self, stream: str, name: str, config: dict[str, Any],
                              action: str = "create") -> dict[str, Any]:
        return await self._asked(f"creating consumer {name}", lambda wait: jsapi.create_consumer(
            self.nc, stream, name, config, action, wait))

    async def delete_consumer(self, stream: str, name: str) -> bool:
        return await self._asked(f"deleting consumer {name}", lambda wait: jsapi.delete_consumer(
            self.nc, stream, name, wait))

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        return await self._asked(f"consumer {name}", lambda wait: jsapi.consumer_info(
            self.nc, stream, name, wait))

    async def step_down_consumer_leader(self, stream: str, name: str) -> None:
        await self._asked(f"consumer {name}'s leader step-down",
                          lambda wait: jsapi.step_down_consumer_leader(self.nc, stream, name,
                                                                       wait))

    @property
    def server_name(self) -> str:
        """The name of the server this connection is on ("" before the first connect):
        a consumer info's ``cluster.leader`` names servers so."""
        return str((self.nc._server_info or {}).get("server_name") or "")

    async def list_consumers(self, stream: str) -> list[dict[str, Any]]:
        return await self._asked(f"listing consumers of {stream}",
                                 lambda wait: jsapi.list_consumers(self.nc, stream, wait))

    async def reset_consumer(self, stream: str, consumer: str, seq: int = 0) -> dict[str, Any]:
        """Redeliver from ``seq`` (0: the ack floor) in stream order; the info after it."""
        return await self._asked(f"resetting consumer {consumer}", lambda wait:
                                 jsapi.reset_consumer(self.nc, stream, consumer, seq, wait))

    async def unpin(self, stream: str, consumer: str, group: str) -> None:
        await self._asked(f"unpinning {consumer}",
                          lambda wait: jsapi.unpin(self.nc, stream, consumer, group, wait))

    async def puller(self, stream: str, consumer: str, options: PullOptions,
                     on_message: Callable[[Any], None] | None = None,
                     capacity: Callable[[], int] | None = None) -> Puller:
        """A started :class:`Puller` on ``consumer``."""
        puller = Puller(self.nc, stream, consumer, options, on_message, capacity=capacity)
        await puller.start()
        self._pullers.add(puller)
        return puller

    # -- lag and replay ----------------------------------------------------------------
    async def first_matches(self, stream: str, queries: list[tuple[str, int]],
                            concurrency: int = 64) -> list[streamread.FirstMatch]:
        """Per ``(filter, start sequence)``: matching messages from there, and the first
        one's sequence and time (one direct get each; see :func:`streamread.first_matches`)."""
        with self._translated(f"reading stream {stream}"):
            return await streamread.first_matches(self.nc, stream, queries,
                                             concurrency=concurrency)

    async def update_stream(self, config: api.StreamConfig) -> api.StreamInfo:
        with self._translated(f"updating stream {config.name}"):
            return await self.jsm.update_stream(config)

    async def get_message(self, stream: str, seq: int = 0, next_subject: str | None = None,
                          start_time: float | None = None) -> streamread.StoredMessage | None:
        """A stored message by sequence, or the first at/after ``seq`` (or ``start_time``)
        matching ``next_subject``; None if there is none."""
        with self._translated(f"reading stream {stream}"):
            return await streamread.msg_get(self.nc, stream, seq, next_subject, start_time)

    async def scan_subjects(self, stream: str, filters: list[str],
                            start_seq: int) -> AsyncIterator[tuple[int, str]]:
        """``(sequence, subject)`` of the messages from ``start_seq`` matching ``filters``."""
        with self._translated(f"scanning stream {stream}"):
            async for item in streamread.scan_subjects(self.nc, stream, filters, start_seq):
                yield item
    # -- plain NATS: presence, notifications, ack confirmation -------------------------
    async def notify(self, subject: str,
                     callback: Callable[[], Awaitable[None] | None]) -> Subscription:
        """Call ``callback`` for every message on ``subject`` (its content is not needed)."""

        async def on_message(msg: Msg) -> None:
            result = callback()
            if result is not None:
                await result

        with self._translated(f"subscribing to {subject}"):
            return await self.nc.subscribe(subject, cb=on_message)

    async def watch_deletion(self, stream: str, consumer: str,
                             callback: Callable[[str], Awaitable[None] | None]
                             ) -> Subscription:
        """Call ``callback`` with the consumer's name whenever the server advises that
        ``consumer`` of ``stream`` was deleted.

        One consumer's subject, not the stream's wildcard: the server copies each advisory
        to every subscriber, so with every instance of a group on ``stream.*`` each deletion
        reached them all. In a mass start of 1,000 instances the failed claims' deletions
        made 28,600 messages a second to instances that ignored all but their own
        (issue 27, ``bench.fleet --members 500`` at load 3-8)."""

        async def on_message(msg: Msg) -> None:
            result = callback(msg.subject.rsplit(".", 1)[-1])
            if result is not None:
                await result

        subject = f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{stream}.{consumer}"
        with self._translated(f"subscribing to {subject}"):
            return await self.nc.subscribe(subject, cb=on_message)

    async def serve(self, subject: str, respond: Callable[[bytes], str | None]
                    ) -> Subscription:
        """Answer every request on ``subject`` with ``respond(body)`` (None: no answer)."""

        async def on_request(msg: Msg) -> None:
            answer = respond(msg.data) if msg.reply else None
            if answer is not None:
                with contextlib.suppress(Exception):
                    await self.nc.publish(msg.reply, answer.encode())

        with self._translated(f"subscribing to {subject}"):
            return await self.nc.subscribe(subject, cb=on_request)

    async def answer(self, subject: str, text: Callable[[], str | None]) -> Subscription:
        """Answer every request on ``subject`` with ``text()`` (None: no answer). On a
        presence subject the server itself says "no responders" once this connection is
        gone; a quiet probe only checks that we listen."""
        return await self.serve(subject, lambda body: None if body == QUIET_PROBE else text())

    async def probe(self, subject: str, timeout: float, body: bytes = b"") -> Answer:
        """Ask once whether the instance answering on ``subject`` is alive."""
        return await probe(self.nc, subject, timeout, body)

    def prober(self, subject: str, watch: OwnerWatch, clock: Callable[[], float],
               on_replaceable: Callable[[], None] | None = None) -> Prober:
        """Probes one instance's presence over and over (see :class:`Prober`)."""
        return Prober(self.nc, subject, watch, clock, on_replaceable)

    async def confirm_ack(self, reply: str, timeout: float) -> bool:
        """Ack the message of ``reply`` again and wait for the server's answer: the server
        applies one consumer's acks in order, so a confirmed repeat of the last one proves
        all of them applied. False: the server did not apply it; raises
        :class:`ServerUnreachable` when no answer came."""
        try:
            msg = await self.nc.request(reply, b"+ACK", timeout=timeout)
        except (nats.errors.Error, TimeoutError) as exc:
            raise ServerUnreachable(f"ack confirmation: {exc!r}") from exc
        status = jsapi.server_status(msg)
        return status is None or status.code == "200"

    async def flush(self, timeout: float) -> None:
        """Wait until the server has read everything sent so far (a round trip)."""
        try:
            await self.nc.flush(timeout=max(1, int(timeout)))
        except (nats.errors.Error, TimeoutError) as exc:
            raise ServerUnreachable(f"flush: {exc!r}") from exc

    async def message_stored(self, stream: str, seq: int) -> bool:
        """Whether ``stream`` still holds the message with sequence ``seq``."""
        with self._translated(f"looking up message {seq} of {stream}"):
            return await jsapi.message_stored(self.nc, stream, seq)
