"""Sync exclusivity against a real nats-server, in process: what the member runtime does
when handlers outlive the drain, messages are nak'ed with a delay, two processes share an
instance id, its own helpers fail, or the connection drops (issue 13 items 7, 10 and its
"smaller ones"). Faults that need separate processes are in tests/faults.

Where a fault must hit one precise step (a failing adapter call, a claim taken between a
check and a delete), a subclass of the adapter or of Member injects it; everything else is
the real runtime on a real server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from cgroupd import admin
from cgroupd.core.errors import InstanceIdInUse, ServerUnreachable
from cgroupd.core.partitions import sync_filters
from cgroupd.core.settings import MemberSettings
from cgroupd.join.handlers import DeadLetterOptions, HandlerWrapper
from cgroupd.member import INSTANCE_KEY, MEMBER_KEY, Member, MemberState
from cgroupd.member.dispatch import Ordering
from cgroupd.nats.jetstream import JetStream, Record
from cgroupd.nats.message import Message
from cgroupd.nats.pull import PullOptions
from tests.faults.injectors import HoldingProxy
from tests.support.groups import Record as Events
from tests.support.groups import check, make_group
from tests.support.natsserver import NatsServer, client_options
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


class Instances:
    """Member instances of one test, each on its own connection; always stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.members: list[Member] = []
        self.conns: list[Client] = []
        self.events = Events()

    async def add(self, member: str, handler: Any, settings: MemberSettings | None = None,
                  js_class: type[JetStream] = JetStream, member_class: type[Member] = Member,
                  start: bool = True, **kw: Any) -> Member:
        nc = await nats.connect(servers=[self.url], **client_options())
        self.conns.append(nc)
        m = member_class(js_class(nc), "ORDERS", "g", member, handler, settings, **kw)
        holder = getattr(handler, "holder", None)
        if isinstance(holder, dict):
            holder["m"] = m
        self.members.append(m)
        if start:
            await m.start()
        return m

    def recorder(self, slow: dict[int, float] | None = None, sync: bool = False) -> Any:
        """A handler recording start and end of each message (``slow``: n -> seconds)."""
        slow = slow or {}
        holder: dict[str, Member] = {}

        def record(event: str, msg: Message) -> None:
            n = json.loads(msg.data)["n"]
            self.events.add(event, holder["m"].instance_id, subject=msg.subject, n=n,
                            seq=msg.stream_sequence, partition=msg.partition)

        if sync:
            def handle(msg: Message) -> None:
                record("start", msg)
                time.sleep(slow.get(json.loads(msg.data)["n"], 0.0))
                record("end", msg)
            handle.holder = holder  # type: ignore[attr-defined]
            return handle

        async def handle_async(msg: Message) -> None:
            record("start", msg)
            await asyncio.sleep(slow.get(json.loads(msg.data)["n"], 0.0))
            record("end", msg)
        handle_async.holder = holder  # type: ignore[attr-defined]
        return handle_async

    async def close(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members), return_exceptions=True)
        for nc in self.conns:
            await nc.close()


@pytest.fixture
async def instances(nats_server: NatsServer) -> AsyncIterator[Instances]:
    inst = Instances(nats_server.url)
    try:
        yield inst
    finally:
        await inst.close()


async def publish(js: JetStream, n: int, key: str) -> tuple[str, int]:
    subject = f"orders.{key}"
    await js.publish(subject, json.dumps({"key": subject, "n": n}).encode())
    return subject, n


def member_of(_: dict[str, Any]) -> str:
    return "m1"


# -- item 7: the drain timeout cancels the awaiting task, not the work ------------------
async def test_a_sync_handler_running_past_the_drain_timeout_keeps_its_partitions(
        instances: Instances, jetstream: JetStream) -> None:
    """A sync handler (a thread) takes 2 s; its instance is stopped with a 0.3 s drain
    timeout. The thread cannot be cancelled, so the consumers are released only once it
    returned: the standby never runs anything of the member while it runs, and does not run
    that message again."""
    await make_group(jetstream, partitions=2, members=("m1",))
    settings = MemberSettings(ordering=Ordering.KEY, max_in_flight=8, drain_timeout=0.3)
    a = await instances.add("m1", instances.recorder({0: 2.0}, sync=True), settings)
    await eventually(lambda: a.active, 20, what="a active")
    b = await instances.add("m1", instances.recorder(sync=True), settings)
    sent = [await publish(jetstream, 0, "k0")]
    await eventually(lambda: any(e["event"] == "start" for e in instances.events.events),
                     10, what="#0 started")
    stopping = asyncio.create_task(a.stop())
    sent += [await publish(jetstream, n, f"k{n % 3}") for n in range(1, 10)]
    await eventually(lambda: b.active, 20, what="b to take over")
    await eventually(lambda: {n for _, n in sent} <= {e["n"] for e in instances.events.ends()},
                     20, what="everything handled")
    await stopping
    verdict = check(instances.events, sent, member_of)
    verdict.assert_ok()
    assert [e["instance"] for e in instances.events.ends() if e["n"] == 0] == [a.instance_id]


# -- item 10: a message nak'ed with a delay is not a stall -----------------------------
async def test_delayed_naks_cause_no_step_down_and_max_deliver_8_is_reached(
        instances: Instances, jetstream: JetStream) -> None:
    """Ordering none: a poison message is nak'ed with growing delays (up to 1 s, three
    times the self-check period). The server counts it unacknowledged while the member
    holds nothing: that is not a stalled consumer. No step-down, its delivery count keeps
    growing, and it is given up on at the 8th delivery."""
    await make_group(jetstream, partitions=2, members=("m1",))
    settings = MemberSettings(ordering=Ordering.NONE, retry_interval=0.2,
                              retry_backoff=0.4, retry_backoff_max=1.0)
    deliveries: list[int] = []

    async def poison(msg: Message) -> None:
        if json.loads(msg.data)["n"] == 0:
            deliveries.append(msg.delivery_count)
            raise RuntimeError("poison")

    handler = HandlerWrapper(poison, DeadLetterOptions(max_deliver=8))
    m = await instances.add("m1", handler.handle, settings)
    await eventually(lambda: m.active, 20, what="active")
    await publish(jetstream, 0, "k0")
    await eventually(lambda: m.stats["termed"] == 1, 30, what="the poison message termed")
    assert deliveries == list(range(1, 9))
    assert m.stats["step_downs"] == 0


# -- smaller ones ---------------------------------------------------------------------
async def test_a_drain_does_not_pull_and_nak_in_a_hot_loop(
        instances: Instances, jetstream: JetStream) -> None:
    """While a stopping instance waits for a slow handler, messages that keep arriving are
    neither started nor nak'ed back to its own consumer (which would deliver them again at
    once, over and over): the consumer delivers a handful, not hundreds."""
    await make_group(jetstream, partitions=2, members=("m1",))
    gate = asyncio.Event()

    async def handler(msg: Message) -> None:
        if json.loads(msg.data)["n"] == 0:
            await gate.wait()

    m = await instances.add("m1", handler, MemberSettings(ordering=Ordering.KEY,
                                                          max_in_flight=4))
    await eventually(lambda: m.active, 20, what="active")
    await publish(jetstream, 0, "k0")
    await eventually(lambda: m.stats["delivered"] == 1, 10, what="#0 delivered")
    stopping = asyncio.create_task(m.stop())
    await eventually(lambda: m.state is MemberState.STEPPING_DOWN, 10, what="draining")
    for n in range(1, 21):
        await publish(jetstream, n, f"k{n}")
    await asyncio.sleep(1.0)  # the observation window of the drain
    info = await jetstream.consumer_info(WQ, m.data_consumer)
    gate.set()
    await stopping
    assert info is not None
    delivered = int(info["delivered"]["consumer_seq"])
    assert delivered <= 2 * 4, f"{delivered} deliveries during the drain"


class FailingInfo(JetStream):
    """consumer_info raises once ``fail`` is set (the server unreachable for it)."""

    fail = False

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        if self.fail:
            raise ServerUnreachable(f"consumer {name}: injected")
        return await super().consumer_info(stream, name)


async def test_a_release_that_cannot_check_still_deletes_its_data_consumer(
        instances: Instances, jetstream: JetStream) -> None:
    """Consumer info fails while the active instance releases: it still deletes its data
    consumer (never skipped silently), so the standby takes over at once instead of
    waiting for the server to drop it."""
    await make_group(jetstream, partitions=2, members=("m1",))
    a = await instances.add("m1", instances.recorder(), js_class=FailingInfo)
    await eventually(lambda: a.active, 20, what="a active")
    b = await instances.add("m1", instances.recorder())
    assert isinstance(a.js, FailingInfo)
    a.js.fail = True
    await a.stop()
    assert await jetstream.consumer_info(WQ, a.data_consumer) is None
    await eventually(lambda: b.active, 5, what="b to take over")


async def test_pulls_resume_at_once_after_a_reconnect(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """A puller whose requests died with the connection (the server dropped them while
    nobody listened: a message came) asks again as soon as the client has reconnected, not
    after its missed-heartbeat watchdog (here 12 s)."""
    await make_group(jetstream, partitions=1, members=("m1",))
    await jetstream.create_consumer(WQ, "p", {"ack_policy": "explicit",
                                              "deliver_policy": "all"})
    host, port = nats_server.url.removeprefix("nats://").rsplit(":", 1)
    async with HoldingProxy(host, int(port)) as proxy:
        nc = await nats.connect(servers=[proxy.url], **client_options())
        got: list[Any] = []
        puller = await JetStream(nc).puller(WQ, "p", PullOptions(batch=4, expires=30,
                                                                 heartbeat=4),
                                            got.append, capacity=lambda: 4)
        try:
            await eventually(lambda: proxy.seen(b"MSG.NEXT") >= 1, 5, what="a pull")
            proxy.refuse = True
            await proxy.cut()
            await publish(jetstream, 0, "k0")

            async def dropped() -> bool:
                info = await jetstream.consumer_info(WQ, "p")
                return info is not None and info["num_waiting"] == 0
            await eventually(dropped, 5, what="the server to drop the dead requests")
            proxy.refuse = False
            await eventually(lambda: nc.stats["reconnects"] >= 1, 10, what="a reconnect")
            await eventually(lambda: got, 3, what="the message after the reconnect")
        finally:
            await puller.stop()
            await nc.close()


class CountingInfo(JetStream):
    """Counts self-checks of the sync consumer running at once (each takes 50 ms)."""

    running = 0
    most = 0

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        if name != "m1":
            return await super().consumer_info(stream, name)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.05)
            return await super().consumer_info(stream, name)
        finally:
            self.running -= 1


class JumpingClock:
    """The loop's time, plus jumps the test makes (a suspended machine waking up)."""

    def __init__(self) -> None:
        self.jump = 0.0

    def now(self) -> float:
        return asyncio.get_running_loop().time() + self.jump

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def test_a_lease_that_ran_out_is_checked_once_not_by_every_waiting_handler(
        instances: Instances, jetstream: JetStream) -> None:
    """The clock jumps (as after a suspension) and 32 messages arrive at once: every
    handler waits for one self-check, not 32 checks at once."""
    await make_group(jetstream, partitions=2, members=("m1",))
    clock = JumpingClock()
    m = await instances.add("m1", instances.recorder(), MemberSettings(
        ordering=Ordering.KEY, max_in_flight=64), js_class=CountingInfo, clock=clock)
    await eventually(lambda: m.active, 20, what="active")
    assert isinstance(m.js, CountingInfo)
    m.js.most = 0
    clock.jump += 100.0
    sent = [await publish(jetstream, n, f"k{n}") for n in range(32)]
    await eventually(lambda: len(instances.events.ends()) == 32, 10, what="all handled")
    check(instances.events, sent).assert_ok()
    assert m.js.most == 1, f"{m.js.most} self-checks at once"


class RacingMember(Member):
    """A successor takes the claim between this instance's ownership check and its delete."""

    successor: Callable[[], Any] | None = None

    async def _sync_is_ours(self) -> bool:
        ours = await super()._sync_is_ours()
        if self.successor is not None:
            await self.successor()
        return ours


async def test_a_released_claim_is_not_deleted_once_a_successor_holds_it(
        instances: Instances, jetstream: JetStream) -> None:
    """A successor takes the member's synchronization consumer right after the stopping
    instance checked it was still its own: the stopping instance must not delete the
    successor's."""
    await make_group(jetstream, partitions=2, members=("m1",))
    a = await instances.add("m1", instances.recorder(), member_class=RacingMember)
    await eventually(lambda: a.active, 20, what="a active")
    assert isinstance(a, RacingMember)

    async def take_over() -> None:
        await jetstream.delete_consumer(WQ, "m1")
        await jetstream.create_consumer(WQ, "m1", {
            "ack_policy": "explicit", "deliver_policy": "all",
            "filter_subjects": sync_filters((0, 1)), "max_ack_pending": 1,
            "inactive_threshold": int(30e9),
            "metadata": {MEMBER_KEY: "m1", INSTANCE_KEY: "successor"}})

    a.successor = take_over
    await a.stop()
    info = await jetstream.consumer_info(WQ, "m1")
    assert info is not None, "the successor's claim was deleted"
    assert info["config"]["metadata"][INSTANCE_KEY] == "successor"


async def test_a_second_instance_with_the_same_id_is_refused(
        instances: Instances, jetstream: JetStream) -> None:
    """Started after the first: refused at start with a clear error."""
    await make_group(jetstream, partitions=2, members=("m1",))
    a = await instances.add("m1", instances.recorder(), instance_id="twin")
    await eventually(lambda: a.active, 20, what="a active")
    with pytest.raises(InstanceIdInUse, match="'twin' is already used"):
        await instances.add("m1", instances.recorder(), instance_id="twin")


async def test_two_instances_started_together_with_one_id_never_both_win(
        instances: Instances, jetstream: JetStream) -> None:
    """Started at the same moment (both pass the start-up check): their consumers differ
    by a per-process token, so only one wins; the other stops with InstanceIdInUse."""
    await make_group(jetstream, partitions=2, members=("m1",))
    a = await instances.add("m1", instances.recorder(), instance_id="twin", start=False)
    b = await instances.add("m1", instances.recorder(), instance_id="twin", start=False)
    results = await asyncio.gather(a.start(), b.start(), return_exceptions=True)
    started = [m for m, r in zip((a, b), results, strict=True) if r is None]
    await eventually(lambda: any(m.active for m in started), 20, what="one active")

    async def loser_stopped() -> bool:
        for m in started:
            if not m.active and m._supervisor is not None and m._supervisor.done():
                with pytest.raises(InstanceIdInUse):
                    await m.wait_stopped()
                return True
        return len(started) == 1  # the other was refused at start

    await eventually(loser_stopped, 20, what="the other one refused")
    assert sum(m.active for m in (a, b)) == 1
    for r in results:
        assert r is None or isinstance(r, InstanceIdInUse)


class BrokenWatch(JetStream):
    """The config watch raises an error nobody translated, once, after the first record."""

    broke = False

    async def watch_record(self, bucket: str, key: str) -> AsyncIterator[Record]:
        async for record in super().watch_record(bucket, key):
            yield record
            if not self.broke:
                self.broke = True
                raise RuntimeError("injected: an untranslated error in the watch")


async def test_the_config_watch_survives_an_unexpected_error(
        instances: Instances, jetstream: JetStream) -> None:
    """The config watch fails with an error that is not a CgroupdError: it is logged,
    counted and restarted, and later membership changes are still followed."""
    await make_group(jetstream, partitions=4, members=("m1",))
    m = await instances.add("m1", instances.recorder(), js_class=BrokenWatch)
    await eventually(lambda: m.active, 20, what="active")
    await eventually(lambda: m.stats["watch_failures"] == 1, 10, what="the failure")
    await admin.add_members(jetstream, "ORDERS", "g", ["m2"])
    await eventually(lambda: m.config is not None and "m2" in m.config.members, 10,
                     what="the membership change to be seen")
    assert not m.health()


class Muted(Member):
    """An instance whose presence answers get lost (``muted``): alive but silent."""

    muted = False

    def _presence_text(self) -> str | None:
        return None if self.muted else super()._presence_text()

    async def cut_off(self) -> None:
        """Silent, and its pull requests stop reaching the consumers' leaders (they expire
        there), as for an instance cut off from the cluster; its self-checks still work."""
        self.muted = True
        assert self._gen is not None
        for puller in self._gen.pullers:
            await puller.pause()


async def test_an_owner_our_server_cannot_see_but_the_leader_can_is_not_replaced(
        instances: Instances, jetstream: JetStream) -> None:
    """Issue 29: the server answers "no responders" for the owner's presence (as the
    standby's server does across a cut between two servers) while the owner's pull
    requests still reach its consumers' leader: the standby declines, for three leases
    and more, and the owner keeps the member. A plain silence (a stall) is the lease's
    case (the test below)."""
    await make_group(jetstream, partitions=2, members=("m1",))
    settings = MemberSettings(lease=1.5, takeover_margin=0.5, retry_interval=0.5)
    a = await instances.add("m1", instances.recorder(), settings)
    await eventually(lambda: a.active, 20, what="a active")
    b = await instances.add("m1", instances.recorder(), settings)
    await eventually(lambda: b.state is MemberState.STANDBY, 10, what="b to watch a")
    assert a._presence_sub is not None
    await a._presence_sub.unsubscribe()  # "no responders" for a, which lives on
    await eventually(lambda: b.stats["takeovers_declined"] >= 1, 15, what="b to decline")
    await asyncio.sleep(3 * settings.lease)
    assert a.active and b.state is MemberState.STANDBY
    assert b.stats["takeovers"] == 0 and a.stats["step_downs"] == 0


async def test_two_standbys_replace_a_silent_owner_once_and_leave_each_other_alone(
        instances: Instances, jetstream: JetStream) -> None:
    """The active instance is cut off (alive, connected, but its answers are lost and its
    pull requests expire): after lease + margin one of the two standbys takes the claim; the
    other sees it is claiming (not idle) and leaves it alone; the old owner learns it lost
    and releases. Exactly one new owner, no hand-over back and forth. (Two standbys that
    decide within the same millisecond may both delete the old claim; the second delete
    then ends the first one's claim before it became active: churn, never two owners.)"""
    await make_group(jetstream, partitions=2, members=("m1",))
    settings = MemberSettings(lease=1.5, takeover_margin=0.5, retry_interval=0.5)
    a = await instances.add("m1", instances.recorder(), settings, member_class=Muted)
    await eventually(lambda: a.active, 20, what="a active")
    b = await instances.add("m1", instances.recorder(), settings)
    c = await instances.add("m1", instances.recorder(), settings)
    assert isinstance(a, Muted)
    await asyncio.sleep(0.5)  # both standbys are watching a
    await a.cut_off()
    await eventually(lambda: b.active or c.active, 15, what="a standby to take over")
    await eventually(lambda: a.state is MemberState.STANDBY, 10, what="a to step down")
    owner = b if b.active else c
    await asyncio.sleep(3 * settings.lease)  # time for any back and forth to show
    assert owner.active and sum(m.active for m in (b, c)) == 1
    assert b.stats["step_downs"] + c.stats["step_downs"] == 0
    assert a.stats["step_downs"] == 1
