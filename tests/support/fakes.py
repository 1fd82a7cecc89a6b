"""Fakes for fast unit tests without a server: a nats-py connection stand-in (what
:class:`cgroupd.nats.pull.Puller` uses of it), a JetStream adapter
(:class:`cgroupd.nats.adapter.JetStreamPort`) keeping consumers in memory, and a clock the test
moves by hand. Behaviour that crosses the wire is tested against real servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import nats.errors

from cgroupd.core.errors import ConsumerExists, ConsumerNotFound, WorkQueueOverlap
from cgroupd.nats.jetstream import Record
from cgroupd.nats.jsapi import ERR_CONSUMER_EXISTS, ERR_CONSUMER_NOT_FOUND, ERR_WQ_NOT_UNIQUE
from cgroupd.nats.lease import Answer, OwnerWatch, Presence, Prober
from cgroupd.nats.pull import Puller, PullOptions


class FakeClock:
    """A :class:`cgroupd.core.clock.Clock` whose time moves only when told to (its sleeps are
    the loop's: a test steps the reading apart from the timers)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.t = now

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class FakeMsg:
    """What the runtime reads of a nats-py message."""

    subject: str = ""
    data: bytes = b""
    reply: str = ""
    headers: dict[str, str] | None = None
    consumer_seq: int | None = None

    @property
    def metadata(self) -> Any:
        if self.consumer_seq is None:
            raise ValueError("not a JetStream message")
        return SimpleNamespace(sequence=SimpleNamespace(consumer=self.consumer_seq))


def delivery(seq: int, stream: str = "S", consumer: str = "c", **headers: str) -> FakeMsg:
    """A JetStream delivery numbered ``seq`` (its ack subject carries the number)."""
    return FakeMsg(subject="x", data=b"m", headers=dict(headers) or None,
                   reply=f"$JS.ACK.{stream}.{consumer}.1.{seq}.{seq}.0.0",
                   consumer_seq=seq)


def status(code: str, description: str = "", **headers: str) -> FakeMsg:
    """A status the server sends on a pull inbox (no body, no reply)."""
    return FakeMsg(headers={"Status": code, "Description": description, **headers})


class FakeNats:
    """The part of a nats-py client a Puller uses: inboxes, subscriptions, publishes."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.is_connected = True
        self.published: list[tuple[str, bytes, str]] = []
        self.subs: dict[str, Callable[[Any], Awaitable[None]]] = {}
        self._n = 0

    def new_inbox(self) -> str:
        self._n += 1
        return f"_INBOX.{self._n}"

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        self.subs[subject] = cb
        fake = self

        class Sub:
            pending_msgs = 0

            async def unsubscribe(self, limit: int = 0) -> None:
                fake.subs.pop(subject, None)

        return Sub()

    async def publish(self, subject: str, data: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if not self.is_connected:
            raise ConnectionError("not connected")
        self.published.append((subject, data, reply))

    async def request(self, subject: str, data: bytes = b"", timeout: float = 1.0,
                      headers: dict[str, str] | None = None) -> FakeMsg:
        """Published; answered at once with an empty reply (an ack confirmed). Not
        connected: what nats-py raises then."""
        if not self.is_connected:
            raise nats.errors.ConnectionClosedError
        await self.publish(subject, data)
        return FakeMsg(data=b"")

    def pulls(self) -> list[dict[str, Any]]:
        """Bodies of the pull requests sent so far."""
        return [json.loads(data) for subject, data, _ in self.published
                if ".CONSUMER.MSG.NEXT." in subject]

    async def deliver(self, inbox: str, msg: FakeMsg) -> None:
        await self.subs[inbox](msg)


def _server_time() -> float:
    """The fake server's clock: the loop's (virtual) time; 0 outside a loop."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return 0.0


def _stamp(t: float) -> str:
    """``t`` seconds of the fake server's clock as the server writes times (RFC 3339)."""
    return datetime.fromtimestamp(1_780_000_000 + t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class FakeConsumer:
    stream: str
    name: str
    config: dict[str, Any]
    num_ack_pending: int = 0
    num_pending: int = 0
    #: Who pulls from it: a process and its puller (see :meth:`num_waiting`).
    pulling: list[tuple[FakeJetStream, Puller]] = field(default_factory=list)
    #: Pull requests of pullers outside the fake processes (a consumer a test put there).
    waiting: int = 0
    #: When it was made, by the fake server's clock (an update keeps it, as the server's).
    created: float = field(default_factory=_server_time)
    #: The server that leads it ("": not clustered), and how often it was asked to step
    #: down (``step_down_consumer_leader``; the fake leaves the leader as it is).
    leader: str = ""
    step_downs: int = 0

    @property
    def num_waiting(self) -> int:
        """Pull requests the leader holds: one per puller still running in a process whose
        requests reach the leader (a crashed or stalled process's expire; a process cut
        off from the prober's server only still pulls)."""
        return self.waiting + sum(1 for process, puller in self.pulling
                   if process.connected and process.pulls_reach_leader
                   and puller._sub is not None)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "stream_name": self.stream, "config": self.config,
                "num_pending": self.num_pending, "num_ack_pending": self.num_ack_pending,
                "num_waiting": self.num_waiting,
                "delivered": {"consumer_seq": 0, "stream_seq": 0},
                "ack_floor": {"stream_seq": 0},
                "created": _stamp(self.created), "ts": _stamp(_server_time()),
                **({"cluster": {"leader": self.leader}} if self.leader else {})}


@dataclass
class FakeServer:
    """State shared by every FakeJetStream (one per simulated process): consumers, the
    group records, and which instances answer presence probes."""

    consumers: dict[tuple[str, str], FakeConsumer] = field(default_factory=dict)
    records: dict[tuple[str, str], bytes] = field(default_factory=dict)
    presence: dict[str, list[Callable[[bytes], str | None]]] = field(default_factory=dict)
    deletions: list[tuple[str, str, Callable[[str], Awaitable[None] | None]]] = field(
        default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Like nats-server 2.15 (single server): an update checks the filter overlap, then
    #: applies it, without excluding a concurrent create or update, so the two can both
    #: pass (98-99 in 100 at the same moment); two creates are checked one after the other
    #: (0 in 100): tests/integration/test_workqueue_claim_race.py. Off: all atomic.
    racy_overlap_check: bool = False
    #: Stream sequences a stream still stores after their ack (a stream without a leader).
    stored: dict[str, set[int]] = field(default_factory=dict)

    def names(self, stream: str) -> set[str]:
        return {name for s, name in self.consumers if s == stream}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "name"} == {
        k: v for k, v in b.items() if k != "name"}


class FakeJetStream:
    """:class:`cgroupd.nats.adapter.JetStreamPort` in memory, for one process: consumer create
    rules as the server applies them on a work-queue stream (10148 create-only, 10100
    overlapping filters), presence answered by the instances registered on the server."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.nc = FakeNats()
        self.connected = True
        #: (lost, back) callbacks given to :meth:`on_connection`.
        self.connection_listeners: list[tuple[Callable[[], None], Callable[[], None]]] = []
        #: False: this process's pull requests no longer reach the consumers' leaders (it
        #: is stalled, or cut off from the cluster), so they expire there.
        self.pulls_reach_leader = True
        #: The server this process is connected to (see FakeConsumer.leader).
        self.server_name = ""
        self._answering: list[tuple[str, Callable[[bytes], str | None]]] = []
        #: Every puller this process started, oldest first (a test delivers through them).
        self.pullers: list[Puller] = []

    # -- consumers ---------------------------------------------------------------------
    async def create_consumer(self, stream: str, name: str, config: dict[str, Any],
                              action: str = "create") -> dict[str, Any]:
        existing = self.server.consumers.get((stream, name))
        if existing is not None and action == "create" and not _same(existing.config,
                                                                      config):
            raise ConsumerExists(400, ERR_CONSUMER_EXISTS, "consumer already exists")
        filters = set(config.get("filter_subjects") or [])
        for (s, other), consumer in self.server.consumers.items():
            if s == stream and other != name and filters & set(
                    consumer.config.get("filter_subjects") or []):
                raise WorkQueueOverlap(400, ERR_WQ_NOT_UNIQUE,
                                       "filtered consumer not unique on workqueue stream")
        if self.server.racy_overlap_check and action == "update":
            await asyncio.sleep(0)  # another request is checked meanwhile
        consumer = FakeConsumer(stream, name, dict(config))
        if existing is not None:
            consumer.created, consumer.leader = existing.created, existing.leader
        self.server.consumers[(stream, name)] = consumer
        return consumer.info()

    async def delete_consumer(self, stream: str, name: str) -> bool:
        gone = self.server.consumers.pop((stream, name), None) is not None
        if gone:
            for watched_stream, watched, callback in list(self.server.deletions):
                if (stream, name) == (watched_stream, watched):
                    result = callback(name)
                    if result is not None:
                        await result
        return gone

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        consumer = self.server.consumers.get((stream, name))
        return consumer.info() if consumer is not None else None

    async def list_consumers(self, stream: str) -> list[dict[str, Any]]:
        return [c.info() for (s, _), c in self.server.consumers.items() if s == stream]

    async def step_down_consumer_leader(self, stream: str, name: str) -> None:
        consumer = self.server.consumers.get((stream, name))
        if consumer is None:
            raise ConsumerNotFound(404, ERR_CONSUMER_NOT_FOUND, "consumer not found")
        consumer.step_downs += 1

    async def reset_consumer(self, stream: str, consumer: str, seq: int = 0) -> dict[str, Any]:
        if (stream, consumer) not in self.server.consumers:
            raise ConsumerNotFound(404, ERR_CONSUMER_NOT_FOUND, "consumer not found")
        return self.server.consumers[(stream, consumer)].info()

    async def unpin(self, stream: str, consumer: str, group: str) -> None:
        return None

    async def puller(self, stream: str, consumer: str, options: PullOptions,
                     on_message: Callable[[Any], None] | None = None,
                     capacity: Callable[[], int] | None = None) -> Puller:
        puller = Puller(self.nc, stream, consumer, options,  # type: ignore[arg-type]
                        on_message, capacity=capacity)
        await puller.start()
        self.pullers.append(puller)
        pulled = self.server.consumers.get((stream, consumer))
        if pulled is not None:
            pulled.pulling.append((self, puller))
        return puller

    # -- the group record ----------------------------------------------------------------
    async def watch_record(self, bucket: str, key: str) -> AsyncIterator[Record]:
        revision = 0
        while True:
            value = self.server.records.get((bucket, key))
            revision += 1
            yield Record(value, revision)
            self.server.changed.clear()
            await self.server.changed.wait()

    async def get_record(self, bucket: str, key: str) -> Record | None:
        value = self.server.records.get((bucket, key))
        return None if value is None else Record(value, 1)

    # -- connection, presence ------------------------------------------------------------
    def on_connection(self, lost: Callable[[], None],
                      back: Callable[[], None]) -> Callable[[], None]:
        entry = (lost, back)
        self.connection_listeners.append(entry)
        return lambda: self.connection_listeners.remove(entry)

    def bounce(self) -> None:
        """The connection drops and comes back at once (its server restarted), as the
        adapter reports it to whoever listens."""
        for lost, _ in list(self.connection_listeners):
            lost()
        for _, back in list(self.connection_listeners):
            back()

    async def notify(self, subject: str, callback: Callable[[], Awaitable[None] | None]) -> Any:
        return _Unsubscribe(lambda: None)

    async def watch_deletion(self, stream: str, consumer: str,
                             callback: Callable[[str], Awaitable[None] | None]) -> Any:
        entry = (stream, consumer, callback)
        self.server.deletions.append(entry)
        return _Unsubscribe(lambda: self.server.deletions.remove(entry))

    async def serve(self, subject: str, respond: Callable[[bytes], str | None]) -> Any:
        responders = self.server.presence.setdefault(subject, [])
        responders.append(respond)
        self._answering.append((subject, respond))
        return _Unsubscribe(lambda: self._unserve(subject, respond))

    def _unserve(self, subject: str, respond: Callable[[bytes], str | None]) -> None:
        responders = self.server.presence.get(subject, [])
        if respond in responders:
            responders.remove(respond)
        if not responders:
            self.server.presence.pop(subject, None)

    def answers(self, subject: str, body: bytes = b"") -> list[str | None]:
        """What this process's own responders on ``subject`` answer ``body`` (each
        instance of a member hears a request; a test asks one of them)."""
        return [respond(body) for s, respond in self._answering if s == subject]

    async def answer(self, subject: str, text: Callable[[], str | None]) -> Any:
        return await self.serve(subject, lambda body: text())

    def crash(self) -> None:
        """This process dies: its presence subjects get "no responders" from now on."""
        self.hide()
        self.connected = self.nc.is_connected = False

    def hide(self) -> None:
        """Probers' server loses sight of this process (a cut between two servers): its
        presence subjects get "no responders", while it lives and pulls through another."""
        for subject, respond in self._answering:
            self._unserve(subject, respond)

    async def probe(self, subject: str, timeout: float, body: bytes = b"") -> Answer:
        responders = self.server.presence.get(subject)
        if not responders:
            return Answer(Presence.GONE)
        # Every subscriber hears it; the first answer is the reply.
        answer = next((a for a in [r(body) for r in list(responders)] if a is not None), None)
        if answer is None:
            return Answer(Presence.SILENT)
        return Answer(Presence.ALIVE, answer.partition(" ")[2])

    def prober(self, subject: str, watch: OwnerWatch, clock: Callable[[], float],
               on_replaceable: Callable[[], None] | None = None) -> Prober:
        fake = self

        class FakeProber(Prober):
            async def send(self) -> None:
                self.watch.update(await fake.probe(subject, 1.0), clock())
                if (self.watch.gone or self.watch.idle) and on_replaceable is not None:
                    on_replaceable()

            async def close(self) -> None:
                return None

        return FakeProber(self.nc, subject, watch, clock,  # type: ignore[arg-type]
                          on_replaceable)

    async def confirm_ack(self, reply: str, timeout: float) -> bool:
        return True

    async def message_stored(self, stream: str, seq: int) -> bool:
        return seq in self.server.stored.get(stream, set())

    async def flush(self, timeout: float) -> None:
        return None


class _Unsubscribe:
    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo = undo

    async def unsubscribe(self, limit: int = 0) -> None:
        self._undo()


def data_puller(member: Any) -> Puller | None:
    """The running puller (started through the fake adapter) of ``member``'s current
    data consumer, found through public reads only: ``member.generation`` names the
    consumers, the fake adapter knows its pullers."""
    gen = member.generation
    js = member.js
    if gen is None or not isinstance(js, FakeJetStream):
        return None
    return next((p for p in reversed(js.pullers)
                 if p.delivers and p.consumer in gen.consumers and not p.ended.done()), None)
