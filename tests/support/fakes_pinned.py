"""Priority groups (``pinned_client``) for the in-memory adapter of :mod:`tests.fakes`.

What the fake server does, as nats-server 2.11+ does it (ADR-42; checked against a real
server in /work/shared/notes/jetstream-facts.md, "Priority groups"):

- a pull request waits until its ``expires``, then ends with ``408 Request Timeout`` and
  ``Nats-Pending-Messages`` (what it still asked for); while it waits and brings nothing,
  ``100 Idle Heartbeat`` every ``idle_heartbeat``;
- a pull carries ``group`` and, once pinned, ``id``; while nobody is pinned, the next
  message goes to the oldest waiting request and pins its client: the message carries
  ``Nats-Pin-Id`` (a fresh id, never reused);
- while a client is pinned, a request with no id waits (it is served only after an unpin);
  a request with another id gets 423 "Nats-Pin-Id mismatch";
- the pinned client is unpinned after ``priority_timeout`` without a pull carrying its id,
  or by the UNPIN API; consumer info shows ``priority_groups[].pinned_client_id``;
- acks are applied per consumer, from anyone (not per pin); a nak or a consumer reset
  (to the ack floor) makes a delivered message available again, in stream order, and a
  reset restarts delivery numbers at 1;
- a consumer reset can be made to fail (:attr:`PinnedServer.reset_failures`): the error
  the adapter raises, after applying the reset or not (a reply lost on its way back).

Messages are offered by the test (:meth:`PinnedServer.offer`); deliveries go to the
process whose request was picked, through its :class:`RoutedNats`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from cgroupd.core.errors import ConsumerNotFound, ServerUnreachable
from cgroupd.nats.jsapi import ERR_CONSUMER_NOT_FOUND
from tests.support.fakes import FakeConsumer, FakeJetStream, FakeMsg, FakeNats, FakeServer

NEXT = "$JS.API.CONSUMER.MSG.NEXT."


@dataclass
class Waiting:
    nats: RoutedNats
    inbox: str
    left: int
    pin: str | None
    expires_at: float
    heartbeat: float = 0.0


@dataclass
class PinState:
    """One pinned_client consumer's delivery state on the fake server."""

    ttl: float
    pin: str | None = None
    last_pull: float = 0.0
    pinned_ts: float = 0.0
    #: The consumer's leader (consumer info ``cluster.leader``); see ``change_leader``.
    leader: str = "n0"
    waiting: list[Waiting] = field(default_factory=list)
    #: Stream sequences available for delivery (stream order), and delivered unacked.
    ready: list[int] = field(default_factory=list)
    pending: dict[int, int] = field(default_factory=dict)
    dseq: int = 0
    acked: set[int] = field(default_factory=set)
    deliveries: dict[int, int] = field(default_factory=dict)
    pins_given: list[str] = field(default_factory=list)
    resets: int = 0
    failed_resets: int = 0
    #: The next deliveries that never reach their client (lost with a stopping server):
    #: counted as delivered, unacknowledged, and not sent.
    lose_next: int = 0


@dataclass
class Delivery(FakeMsg):
    """A delivery of a pinned_client consumer, with the metadata a member reads."""

    stream: str = ""
    consumer: str = ""
    stream_seq: int = 0
    deliveries: int = 1

    @property
    def metadata(self) -> Any:
        return SimpleNamespace(
            sequence=SimpleNamespace(consumer=self.consumer_seq, stream=self.stream_seq),
            num_delivered=self.deliveries, num_pending=0, stream=self.stream,
            consumer=self.consumer, timestamp=None, domain=None)


class RoutedNats(FakeNats):
    """A process's connection: pulls and acks go to the fake server."""

    def __init__(self, server: PinnedServer) -> None:
        super().__init__()
        self.server = server

    async def publish(self, subject: str, data: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        await super().publish(subject, data, reply, headers)
        self.server.route(self, subject, data, reply)

    async def request(self, subject: str, data: bytes = b"", timeout: float = 1.0,
                      headers: dict[str, str] | None = None) -> FakeMsg:
        await self.publish(subject, data)
        return FakeMsg(data=b"")


class PinnedServer(FakeServer):
    """A FakeServer whose pinned_client consumers deliver messages the test offers."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: dict[tuple[str, str], PinState] = {}
        self.next_sseq = 0
        #: The next consumer resets fail, in turn: (error raised, applied before it).
        self.reset_failures: list[tuple[Exception, bool]] = []

    def state(self, stream: str, name: str) -> PinState | None:
        consumer = self.consumers.get((stream, name))
        if consumer is None or consumer.config.get("priority_policy") != "pinned_client":
            self.pinned.pop((stream, name), None)
            return None
        st = self.pinned.get((stream, name))
        if st is None:
            ttl = int(consumer.config.get("priority_timeout", 120e9)) / 1e9
            st = self.pinned[(stream, name)] = PinState(ttl)
        self._expire(st)
        return st

    def _expire(self, st: PinState) -> None:
        now = asyncio.get_running_loop().time()
        if st.pin is not None and now - st.last_pull >= st.ttl:
            st.pin = None  # unpinned: timeout
        st.waiting = [w for w in st.waiting if w.expires_at > now and w.nats.is_connected]

    # -- the wire ------------------------------------------------------------------
    def route(self, nats: RoutedNats, subject: str, data: bytes, reply: str) -> None:
        if subject.startswith(NEXT):
            stream, name = subject[len(NEXT):].split(".", 1)
            self._pull(nats, stream, name, json.loads(data), reply)
        elif subject.startswith("$JS.ACK."):
            tokens = subject.split(".")
            stream, name, sseq = tokens[2], tokens[3], int(tokens[5])
            st = self.state(stream, name)
            if st is not None and sseq in st.pending:
                del st.pending[sseq]
                if data.startswith(b"-NAK"):
                    st.ready = sorted([*st.ready, sseq])
                    self._serve(stream, name)
                else:
                    st.acked.add(sseq)

    def _pull(self, nats: RoutedNats, stream: str, name: str, body: dict[str, Any],
              inbox: str) -> None:
        st = self.state(stream, name)
        if st is None:  # nobody listens on a consumer that is gone (nats-server 2.15.1)
            self._send(nats, inbox, FakeMsg(headers={"Status": "503",
                                                     "Description": "No Responders"}))
            return
        pin = body.get("id")
        if pin is not None and pin != st.pin:
            # Nobody pinned (an unpin, a timeout, a new leader): the server queues it and
            # answers "Wrong-Pin-Id" when it would pin someone; someone else pinned: at once.
            why = "Nats-Wrong-Pin-Id" if st.pin is None else "Nats-Pin-Id mismatch"
            self._send(nats, inbox, FakeMsg(headers={"Status": "423", "Description": why}))
            return
        if pin is not None:
            st.last_pull = asyncio.get_running_loop().time()
        expires = int(body.get("expires", 1e9)) / 1e9
        req = Waiting(nats, inbox, int(body.get("batch", 1)), pin,
                      asyncio.get_running_loop().time() + expires,
                      int(body.get("idle_heartbeat", 0)) / 1e9)
        st.waiting.append(req)
        self._serve(stream, name)
        loop = asyncio.get_running_loop()
        loop.call_later(expires, self._time_out, st, req)
        if req.heartbeat > 0:
            loop.call_later(req.heartbeat, self._beat, st, req)

    def _time_out(self, st: PinState, req: Waiting) -> None:
        """A request that expires unserved (or part served) ends with a 408."""
        if req in st.waiting:
            st.waiting.remove(req)
        if req.left > 0:
            self._send(req.nats, req.inbox, FakeMsg(headers={
                "Status": "408", "Description": "Request Timeout",
                "Nats-Pending-Messages": str(req.left), "Nats-Pending-Bytes": "0"}))

    def _beat(self, st: PinState, req: Waiting) -> None:
        """Idle heartbeats while the request waits."""
        if req in st.waiting and req.nats.is_connected:
            self._send(req.nats, req.inbox, FakeMsg(headers={
                "Status": "100", "Description": "Idle Heartbeat"}))
            asyncio.get_running_loop().call_later(req.heartbeat, self._beat, st, req)

    def _send(self, nats: RoutedNats, inbox: str, msg: FakeMsg) -> None:
        if inbox in nats.subs and nats.is_connected:
            asyncio.get_running_loop().create_task(nats.deliver(inbox, msg))

    def _serve(self, stream: str, name: str) -> None:
        st = self.pinned[(stream, name)]
        self._expire(st)
        while st.ready:
            if st.pin is None:
                eligible = [w for w in st.waiting if w.pin is None]
            else:
                eligible = [w for w in st.waiting if w.pin == st.pin]
            if not eligible:
                return
            req = eligible[0]
            if st.pin is None:
                st.pin = secrets.token_hex(11)
                st.pins_given.append(st.pin)
                st.pinned_ts = st.last_pull = asyncio.get_running_loop().time()
            sseq = st.ready.pop(0)
            st.dseq += 1
            st.pending[sseq] = st.dseq
            req.left -= 1
            if req.left <= 0:
                st.waiting.remove(req)
            st.deliveries[sseq] = st.deliveries.get(sseq, 0) + 1
            if st.lose_next > 0:
                st.lose_next -= 1
                continue
            self._send(req.nats, req.inbox, Delivery(
                subject="0.orders.k", data=b"m", headers={"Nats-Pin-Id": st.pin},
                reply=f"$JS.ACK.{stream}.{name}.{st.deliveries[sseq]}.{sseq}.{st.dseq}.0.0",
                consumer_seq=st.dseq, stream=stream, consumer=name, stream_seq=sseq,
                deliveries=st.deliveries[sseq]))

    # -- what the test does ----------------------------------------------------------
    def offer(self, stream: str, name: str, count: int = 1) -> None:
        """``count`` new messages for the consumer (stored in the stream)."""
        st = self.state(stream, name)
        assert st is not None, "no pinned_client consumer"
        for _ in range(count):
            self.next_sseq += 1
            st.ready.append(self.next_sseq)
        self._serve(stream, name)

    def ack_wait_expired(self, stream: str, name: str, seqs: list[int]) -> None:
        """The ack wait of these delivered messages ran out: they are delivered again (to
        the pinned client), in stream order among what is ready."""
        st = self.state(stream, name)
        assert st is not None, "no pinned_client consumer"
        for sseq in seqs:
            assert sseq in st.pending, f"#{sseq} is not delivered unacknowledged"
            del st.pending[sseq]
        st.ready = sorted([*st.ready, *seqs])
        self._serve(stream, name)

    def change_leader(self, stream: str, name: str, leader: str) -> None:
        """A new consumer leader, as nats-server 2.15 makes one: the pin (kept only in the
        old leader's memory) is gone, with no advisory, and so are the waiting requests."""
        st = self.state(stream, name)
        assert st is not None, "no pinned_client consumer"
        st.leader, st.pin, st.waiting = leader, None, []

    def pinned_id(self, stream: str, name: str) -> str | None:
        st = self.state(stream, name)
        return None if st is None else st.pin


class PinnedConsumer(FakeConsumer):
    server: PinnedServer

    def info(self) -> dict[str, Any]:
        out = super().info()
        st = self.server.state(self.stream, self.name)
        if st is not None:
            out["num_ack_pending"] = len(st.pending)
            out["num_pending"] = len(st.ready)
            out["priority_groups"] = [{"group": g, "pinned_client_id": st.pin or ""}
                                      for g in self.config.get("priority_groups", [])]
            out["cluster"] = {"leader": st.leader}
            out["delivered"] = {**(out.get("delivered") or {}), "consumer_seq": st.dseq}
        return out


class PinnedJetStream(FakeJetStream):
    """One process's adapter on a :class:`PinnedServer`."""

    server: PinnedServer

    def __init__(self, server: PinnedServer) -> None:
        super().__init__(server)
        self.nc = RoutedNats(server)
        #: Consumer infos go unanswered (a node restarting under this process's server).
        self.info_silent = False

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        if self.info_silent:
            raise ServerUnreachable(f"no answer to consumer info {stream}.{name}")
        return await super().consumer_info(stream, name)

    async def create_consumer(self, stream: str, name: str, config: dict[str, Any],
                              action: str = "create") -> dict[str, Any]:
        await super().create_consumer(stream, name, config, action)
        old = self.server.consumers[(stream, name)]
        consumer = PinnedConsumer(old.stream, old.name, old.config)
        consumer.server = self.server
        self.server.consumers[(stream, name)] = consumer
        return consumer.info()

    async def unpin(self, stream: str, consumer: str, group: str) -> None:
        st = self.server.state(stream, consumer)
        if st is not None:
            st.pin = None
            self.server._serve(stream, consumer)

    async def reset_consumer(self, stream: str, consumer: str, seq: int = 0) -> dict[str, Any]:
        st = self.server.state(stream, consumer)
        if st is None:
            raise ConsumerNotFound(404, ERR_CONSUMER_NOT_FOUND, "consumer not found")
        failure, applied = (self.server.reset_failures.pop(0) if self.server.reset_failures
                            else (None, True))
        if applied:
            st.resets += 1
            st.ready = sorted([*st.ready, *st.pending])
            st.pending.clear()
            st.dseq = 0
        first = st.ready[0] if st.ready else self.server.next_sseq + 1
        self.server._serve(stream, consumer)
        if failure is not None:
            st.failed_resets += 1
            raise failure
        return {**self.server.consumers[(stream, consumer)].info(), "reset_seq": first}

    def crash(self) -> None:
        super().crash()
        self.nc.is_connected = False
