"""The partition listener's ordering guarantees, against the in-memory adapters (no
server): ``on_partitions_assigned`` before a partition's first handler start,
``on_partitions_revoked`` strictly after the last settle (the ack sent) of what the
instance started and before the next owner's ``assigned`` (and so its first message),
``on_partitions_lost`` instead of ``revoked`` when ownership went under us. Across an
incremental move (sync), a takeover after a kill and a step-down, in both exclusivity
modes; a hook that raises or hangs. The same order with real ``cgroupd join``
processes and a real server: tests/integration/test_listener.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from cgroupd.core.config import (
    ELASTIC_BUCKET,
    ElasticGroupConfig,
    PartitioningFilter,
    group_key,
    work_queue_stream,
)
from cgroupd.core.partitions import member_partitions
from cgroupd.core.settings import MemberSettings
from cgroupd.member import Member, MemberState
from cgroupd.member.state import Phase
from cgroupd.nats.pull import Puller
from tests.support.fakes import FakeJetStream, FakeMsg, FakeServer, data_puller
from tests.support.fakes_pinned import PinnedJetStream, PinnedServer
from tests.support.polling import eventually, within
from tests.unit.test_election_pinned_unit import SETTINGS as PINNED
from tests.unit.test_election_unit import SETTINGS as SYNC

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

WQ = work_queue_stream("ORDERS", "g")
KEY = (ELASTIC_BUCKET, group_key("ORDERS", "g"))


def config(*members: str) -> ElasticGroupConfig:
    return ElasticGroupConfig(
        max_members=4, partitioning_filters=(PartitioningFilter("orders.*", (1,)),),
        members=members)


class Timeline:
    """Every hook call, handler start and ack of every instance, in the order they
    happened. Instances are named by the test (``a``, ``b``)."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.events: list[tuple[str, str, Any]] = []
        self.members: list[Member] = []
        #: Stream sequences whose handler waits until the event is set.
        self.gates: dict[int, asyncio.Event] = {}
        #: Called (and awaited) inside a hook of (kind, name), before it returns.
        self.during: dict[tuple[str, str], Callable[[], Any]] = {}

    def at(self, kind: str, name: str, what: Any = None) -> int:
        """Index of the first event ``(kind, name[, what])``; fails when none."""
        for i, (k, n, w) in enumerate(self.events):
            if k == kind and n == name and (what is None or w == what):
                return i
        raise AssertionError(f"no {kind} of {name} ({what}) in {self.events}")

    def kinds(self, name: str) -> list[str]:
        return [k for k, n, _ in self.events if n == name]

    async def start(self, name: str, member: str = "m1", settings: MemberSettings = SYNC,
                    **hooks: Any) -> Member:
        pinned = isinstance(self.server, PinnedServer)
        js = (PinnedJetStream(self.server) if pinned  # type: ignore[arg-type]
              else FakeJetStream(self.server))
        original = js.nc.publish

        async def publish(subject: str, *args: Any, **kw: Any) -> None:
            if subject.startswith("$JS.ACK."):
                self.events.append(("ack", name, int(subject.split(".")[5])))
            await original(subject, *args, **kw)

        js.nc.publish = publish  # type: ignore[method-assign]

        async def handler(msg: Any) -> None:
            self.events.append(("start", name, msg.stream_sequence))
            gate = self.gates.get(msg.stream_sequence)
            if gate is not None:
                await gate.wait()

        def hook(kind: str) -> Any:
            async def call(partitions: tuple[int, ...]) -> None:
                extra = self.during.get((kind, name))
                if extra is not None:
                    await extra()
                self.events.append((kind, name, partitions))
            return call

        callbacks = {f"on_partitions_{k}": hook(k) for k in ("assigned", "revoked", "lost")}
        callbacks.update(hooks)
        m = Member(js, "ORDERS", "g", member, handler, settings,  # type: ignore[arg-type]
                   **callbacks)
        await m.start()
        self.members.append(m)
        return m


#: Deliveries made so far, per puller (see deliver_to).
_delivered: weakref.WeakKeyDictionary[Puller, int] = weakref.WeakKeyDictionary()


def deliver_to(m: Member, seq: int, partition: int) -> Any:
    """A delivery of stream sequence ``seq`` of ``partition`` on ``m``'s data consumer."""
    puller = data_puller(m)
    assert puller is not None
    # The consumer's own delivery numbers have no gap (a gap is a delivery lost), from 1
    # for each puller: counted per puller, not per consumer name (a name comes back in a
    # later test, or to the standby; counted on, its first delivery read as a lost one,
    # and the data consumer was replaced: test_sync_step_down, now and then).
    cseq = _delivered[puller] = _delivered.get(puller, 0) + 1
    msg = FakeMsg(subject=f"{partition}.orders.k{partition}", data=b"m",
                  reply=f"$JS.ACK.{WQ}.{puller.consumer}.1.{seq}.{cseq}.0.0",
                  consumer_seq=cseq)
    return m.js.nc.deliver(puller.inbox, msg)  # type: ignore[attr-defined]


def _number(m: Member) -> int | None:
    info = m.generation
    return info.number if info is not None else None


def data_puller_ready(m: Member) -> bool:
    puller = data_puller(m)
    return puller is not None and bool(puller.inbox)


@pytest.fixture
async def sync() -> AsyncIterator[Timeline]:
    # Data consumers have per-member names now (m1~0..m1~3): a count left by an earlier
    # test would look like a lost delivery to this test's consumer of the same name.
    _delivered.clear()
    server = FakeServer()
    server.records[KEY] = config("m1").to_json()
    t = Timeline(server)
    yield t
    for gate in t.gates.values():
        gate.set()
    for m in t.members:
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


@pytest.fixture
async def pinned() -> AsyncIterator[Timeline]:
    _delivered.clear()
    server = PinnedServer()
    server.records[KEY] = config("m1").to_json()
    t = Timeline(server)
    yield t
    for gate in t.gates.values():
        gate.set()
    for m in t.members:
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


async def test_sync_incremental_move(sync: Timeline) -> None:
    """m1 (instance a) owns all 4 partitions and is running a message of a partition that
    m2 (instance b) gets when it joins. a hears ``revoked`` only after that message's ack,
    and only those partitions; b hears ``assigned`` for them after that, and before its
    first message; a's other partitions stay assigned (no revoke, no reassign). a is in
    its moving phase while the move waits, and running again once it is done."""
    a = await sync.start("a")
    await eventually(lambda: a.active and data_puller_ready(a), 5, what="a active")
    moving = member_partitions(config("m1", "m2"), "m2")
    staying = tuple(p for p in range(4) if p not in moving)
    sync.gates[1] = asyncio.Event()
    await deliver_to(a, 1, moving[0])
    await eventually(lambda: ("start", "a", 1) in sync.events, 5, what="a runs #1")
    sync.server.records[KEY] = config("m1", "m2").to_json()
    sync.server.changed.set()
    b = await sync.start("b", member="m2")
    await asyncio.sleep(0.3)
    assert "revoked" not in sync.kinds("a"), "revoked while its message still runs"
    assert "assigned" not in sync.kinds("b"), "the next owner before the last settle"
    assert (a.state, a.phase) == (MemberState.ACTIVE, Phase.MOVING)
    sync.gates[1].set()
    await eventually(lambda: b.active and data_puller_ready(b), 10, what="b active")
    await deliver_to(b, 2, moving[0])
    await eventually(lambda: ("start", "b", 2) in sync.events, 5, what="b runs #2")
    assert sync.at("assigned", "a") < sync.at("start", "a", 1) < sync.at("ack", "a", 1) \
        < sync.at("revoked", "a", moving) < sync.at("assigned", "b", moving) \
        < sync.at("start", "b", 2)
    assert sync.events[sync.at("assigned", "a")][2] == (0, 1, 2, 3)
    assert sync.kinds("a") == ["assigned", "start", "ack", "revoked"]
    assert a.active and a.partitions == staying
    assert a.phase is Phase.RUNNING


async def test_sync_step_down(sync: Timeline) -> None:
    """a stops while a handler runs: ``revoked`` (all its partitions) after that
    message's ack; the standby b hears ``assigned`` after it, and b's first message,
    delivered while b's ``assigned`` hook still runs, starts only once it returned."""
    a = await sync.start("a")
    await eventually(lambda: a.active and data_puller_ready(a), 5, what="a active")
    b = await sync.start("b")

    async def deliver_during_assigned() -> None:
        await deliver_to(b, 2, 3)
        await asyncio.sleep(0.1)

    sync.during[("assigned", "b")] = deliver_during_assigned
    sync.gates[1] = asyncio.Event()
    await deliver_to(a, 1, 0)
    await eventually(lambda: ("start", "a", 1) in sync.events, 5, what="a runs #1")
    stopping = asyncio.create_task(a.stop())
    await asyncio.sleep(0.2)
    assert "revoked" not in sync.kinds("a")
    sync.gates[1].set()
    await stopping
    await eventually(lambda: ("start", "b", 2) in sync.events, 10, what="b runs #2")
    assert sync.at("ack", "a", 1) < sync.at("revoked", "a", (0, 1, 2, 3)) \
        < sync.at("assigned", "b", (0, 1, 2, 3)) < sync.at("start", "b", 2)
    assert "lost" not in sync.kinds("a")


async def test_sync_takeover_after_kill(sync: Timeline) -> None:
    """a dies (no presence answers, no connection): the standby b takes over and hears
    ``assigned`` before its first message (delivered while the hook runs); a dead
    process hears nothing, and a never heard ``revoked``."""
    a = await sync.start("a")
    await eventually(lambda: a.active and data_puller_ready(a), 5, what="a active")
    await deliver_to(a, 1, 0)
    await eventually(lambda: ("ack", "a", 1) in sync.events, 5, what="a acks #1")
    b = await sync.start("b")

    async def deliver_during_assigned() -> None:
        await deliver_to(b, 2, 0)
        await asyncio.sleep(0.1)

    sync.during[("assigned", "b")] = deliver_during_assigned
    assert isinstance(a.js, FakeJetStream)
    a.js.crash()
    await eventually(lambda: ("start", "b", 2) in sync.events, 10, what="b runs #2")
    assert sync.at("assigned", "b", (0, 1, 2, 3)) < sync.at("start", "b", 2)
    assert "revoked" not in sync.kinds("a")


async def test_sync_consumer_deleted_under_a_live_instance_is_lost(sync: Timeline) -> None:
    """An operator deletes the active instance's data consumer: its partitions are
    ``lost`` (not revoked: nothing was handed over), then ``assigned`` again when it wins
    the member back, before its next message."""
    a = await sync.start("a")
    await eventually(lambda: a.active and data_puller_ready(a), 5, what="a active")
    gen = a.generation
    assert gen is not None
    await a.js.delete_consumer(WQ, gen.consumers[0])
    await eventually(lambda: a.active and _number(a) != gen.number and data_puller_ready(a), 10,
                     what="a active again")
    await deliver_to(a, 1, 2)
    await eventually(lambda: ("start", "a", 1) in sync.events, 5, what="a runs #1")
    assert sync.kinds("a")[:4] == ["assigned", "lost", "assigned", "start"]
    assert sync.events[sync.at("lost", "a")][2] == (0, 1, 2, 3)


async def test_pinned_step_down(pinned: Timeline) -> None:
    """Pinned mode: the pin holder a stops while a handler runs; ``revoked`` comes after
    that message's ack and before the standby's ``assigned``, which comes before b's
    first message (offered while a still drains)."""
    a = await pinned.start("a", settings=PINNED)
    b = await pinned.start("b", settings=PINNED)
    await eventually(lambda: pinned.server.state(WQ, "m1") is not None, 5,  # type: ignore[attr-defined]
                     what="the member consumer")
    pinned.gates[1] = asyncio.Event()
    pinned.server.offer(WQ, "m1", 1)  # type: ignore[attr-defined]
    await eventually(lambda: any(k == "start" for k, _, _ in pinned.events), 5,
                     what="the first message runs")
    holder, standby = ("a", "b") if ("start", "a", 1) in pinned.events else ("b", "a")
    first = a if holder == "a" else b
    stopping = asyncio.create_task(first.stop())
    await asyncio.sleep(0.2)
    assert "revoked" not in pinned.kinds(holder)
    pinned.server.offer(WQ, "m1", 1)  # type: ignore[attr-defined]
    pinned.gates[1].set()
    await stopping
    await eventually(lambda: ("start", standby, 2) in pinned.events, 10,
                     what="the standby runs #2")
    assert pinned.at("ack", holder, 1) < pinned.at("revoked", holder, (0, 1, 2, 3)) \
        < pinned.at("assigned", standby, (0, 1, 2, 3)) < pinned.at("start", standby, 2)


async def test_pinned_takeover_after_kill(pinned: Timeline) -> None:
    """Pinned mode: the holder dies; once its pin expires the standby is pinned by its
    first message, but hears ``assigned`` before that message starts (the hook takes a
    while here); the dead holder never hears ``revoked``."""
    a = await pinned.start("a", settings=PINNED)
    await eventually(lambda: pinned.server.state(WQ, "m1") is not None, 5,  # type: ignore[attr-defined]
                     what="the member consumer")
    pinned.server.offer(WQ, "m1", 1)  # type: ignore[attr-defined]
    await eventually(lambda: ("ack", "a", 1) in pinned.events, 5, what="a acks #1")
    await pinned.start("b", settings=PINNED)

    async def slow() -> None:
        await asyncio.sleep(0.2)

    pinned.during[("assigned", "b")] = slow
    assert isinstance(a.js, PinnedJetStream)
    a.js.crash()
    pinned.server.offer(WQ, "m1", 1)  # type: ignore[attr-defined]
    await eventually(lambda: ("start", "b", 2) in pinned.events, 10, what="b runs #2")
    assert pinned.at("assigned", "b", (0, 1, 2, 3)) < pinned.at("start", "b", 2)
    assert "revoked" not in pinned.kinds("a")


@pytest.mark.parametrize("kind", ["raises", "hangs", "hangs_sync"])
async def test_a_failing_hook_never_holds_a_hand_over(sync: Timeline, kind: str) -> None:
    """A ``revoked`` hook that raises, or hangs (async: cancelled; sync: its thread left
    running), is logged and counted; the hand-over goes on within the listener timeout
    and the standby takes over."""
    release = asyncio.Event()
    block = threading.Event()

    async def raises(partitions: tuple[int, ...]) -> None:
        raise RuntimeError("boom")

    async def hangs(partitions: tuple[int, ...]) -> None:
        await release.wait()

    def hangs_sync(partitions: tuple[int, ...]) -> None:
        block.wait(5)

    bad = {"raises": raises, "hangs": hangs, "hangs_sync": hangs_sync}[kind]
    settings = dataclasses.replace(SYNC, listener_timeout=0.3)
    a = await sync.start("a", settings=settings, on_partitions_revoked=bad)
    await eventually(lambda: a.active and data_puller_ready(a), 5, what="a active")
    b = await sync.start("b")
    loop = asyncio.get_running_loop()
    began = loop.time()
    await a.stop()
    took = loop.time() - began
    block.set()
    await eventually(lambda: b.active, 5, what="b takes over")
    assert took < 0.3 + 1.0
    assert a.listener.stats["revoked"] == 1
    assert a.listener.stats["revoked_failed" if kind == "raises" else "revoked_timed_out"] == 1


async def test_a_hanging_hook_never_holds_a_pinned_hand_over(pinned: Timeline) -> None:
    """Pinned mode: the holder's ``revoked`` hook hangs; after the listener timeout the
    holder unpins anyway and the standby runs the next message."""
    release = asyncio.Event()

    async def hangs(partitions: tuple[int, ...]) -> None:
        await release.wait()

    settings = dataclasses.replace(PINNED, listener_timeout=0.3)
    a = await pinned.start("a", settings=settings, on_partitions_revoked=hangs)
    await eventually(lambda: pinned.server.state(WQ, "m1") is not None, 5,  # type: ignore[attr-defined]
                     what="the member consumer")
    pinned.server.offer(WQ, "m1", 1)  # type: ignore[attr-defined]
    await eventually(lambda: ("ack", "a", 1) in pinned.events, 5, what="a acks #1")
    await pinned.start("b", settings=PINNED)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await a.stop()
    assert loop.time() - began < 0.3 + 1.5
    pinned.server.offer(WQ, "m1", 1)  # type: ignore[attr-defined]
    await eventually(lambda: ("start", "b", 2) in pinned.events, 10, what="b runs #2")
    assert a.listener.stats["revoked_timed_out"] == 1
    release.set()
