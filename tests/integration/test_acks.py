"""Acks under wire faults, against a real nats-server through a proxy that can hold a
direction of traffic or cut the connection (:class:`tests.faults.injectors.HoldingProxy`).

- ``double_ack`` tells "not applied" (:class:`AckNotConfirmed`) from "outcome unknown"
  (:class:`AckOutcomeUnknown`), and a reply lost once does not make an applied ack look
  failed (issue 13 item 8).
- In an ordered mode, acks lost with a connection are sent again and confirmed before
  anything new starts, and a redelivery of a message already completed is settled again,
  not run again: no rerun behind later messages of its key (issue 13 item 9).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import api

from cgroupd.core.errors import AckNotConfirmed, AckOutcomeUnknown
from cgroupd.core.settings import MemberSettings
from cgroupd.member.dispatch import Ordering
from cgroupd.nats import jsapi
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.message import Message
from tests.faults.injectors import HoldingProxy
from tests.support.groups import Fleet, check, make_group
from tests.support.natsserver import NatsServer, client_options
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

STREAM = "WQ"
CONSUMER = "C"


@pytest_asyncio.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[HoldingProxy]:
    host, port = nats_server.url.removeprefix("nats://").rsplit(":", 1)
    async with HoldingProxy(host, int(port)) as p:
        yield p


@pytest_asyncio.fixture
async def through(proxy: HoldingProxy) -> AsyncIterator[Client]:
    """A client connected through the proxy."""
    nc = await nats.connect(servers=[proxy.url], **client_options())
    try:
        yield nc
    finally:
        await nc.close()


async def _delivery(nc: Client, jetstream: JetStream) -> Message:
    """A work-queue stream with one message, delivered to ``nc`` by consumer C."""
    await jetstream.add_stream(api.StreamConfig(
        name=STREAM, subjects=["wq.>"], retention=api.RetentionPolicy.WORK_QUEUE))
    await jetstream.create_consumer(STREAM, CONSUMER, {
        "ack_policy": "explicit", "deliver_policy": "all", "ack_wait": int(30e9)})
    await jetstream.publish("wq.a", b"x")
    inbox = await nc.subscribe(nc.new_inbox())  # deliveries carry their own subject
    await nc.publish(jsapi.pull_subject(STREAM, CONSUMER),
                     json.dumps({"batch": 1, "expires": int(2e9)}).encode(),
                     reply=inbox.subject)
    msg = await inbox.next_msg(timeout=3)
    await inbox.unsubscribe()
    return Message.from_msg(nc, msg)


async def _stored(jetstream: JetStream) -> bool:
    return await jetstream.message_stored(STREAM, 1)


async def test_double_ack_of_a_message_whose_consumer_is_gone_is_not_applied(
        through: Client, jetstream: JetStream) -> None:
    """The consumer was deleted (a takeover): "not applied", definitely, and the message
    is still there for the next owner."""
    message = await _delivery(through, jetstream)
    await jetstream.delete_consumer(STREAM, CONSUMER)
    with pytest.raises(AckNotConfirmed) as err:
        await message.double_ack(timeout=1.0)
    assert not isinstance(err.value, AckOutcomeUnknown)
    assert message.ack_failed and await _stored(jetstream)


async def test_a_reply_lost_once_does_not_make_an_applied_ack_look_failed(
        through: Client, jetstream: JetStream, proxy: HoldingProxy) -> None:
    """The server applies the ack but its reply is held past the timeout: the repeated ack
    gets the answer, and double_ack returns (before: AckNotConfirmed, and an exactly-once
    handler rolled back work whose message was gone: lost)."""
    message = await _delivery(through, jetstream)
    proxy.hold_down = True
    acking = asyncio.create_task(message.double_ack(timeout=0.5))
    await proxy.wait_seen(b"+ACK", 2)  # the first attempt timed out, the second is out
    await proxy.release()
    await acking
    assert message.confirmed and not await _stored(jetstream)


async def test_no_reply_at_all_is_an_unknown_outcome(
        through: Client, jetstream: JetStream, proxy: HoldingProxy) -> None:
    """Applied, but no reply ever comes back: the outcome cannot be known, and
    AckOutcomeUnknown (a subclass of AckNotConfirmed) says so."""
    message = await _delivery(through, jetstream)
    proxy.hold_down = True
    with pytest.raises(AckOutcomeUnknown):
        await message.double_ack(timeout=0.3)
    assert not await _stored(jetstream), "the ack was in fact applied"
    await proxy.release()


async def test_unanswered_ack_then_consumer_gone_and_message_gone_is_unknown(
        through: Client, jetstream: JetStream, proxy: HoldingProxy) -> None:
    """The first ack is applied but unanswered; the consumer is then deleted; the second
    attempt hears "no responders" and the message is no longer in the stream: applied by
    us or processed by the next owner, nobody can tell. AckOutcomeUnknown."""
    message = await _delivery(through, jetstream)
    proxy.hold_down = True
    acking = asyncio.create_task(message.double_ack(timeout=0.5))
    await proxy.wait_seen(b"+ACK", 1)
    await jetstream.delete_consumer(STREAM, CONSUMER)
    await proxy.wait_seen(b"+ACK", 2)
    await proxy.release()
    with pytest.raises(AckOutcomeUnknown):
        await acking


async def test_unsent_ack_then_consumer_gone_and_message_stored_is_not_applied(
        through: Client, jetstream: JetStream, proxy: HoldingProxy) -> None:
    """The acks are held on their way to the server until the consumer is gone; the
    second attempt hears "no responders" and the message is still stored: definitely not
    applied (an ack to a deleted consumer never applies later)."""
    message = await _delivery(through, jetstream)
    proxy.hold_up = True
    acking = asyncio.create_task(message.double_ack(timeout=0.5))
    await proxy.wait_seen(b"+ACK", 1)
    await jetstream.delete_consumer(STREAM, CONSUMER)
    await proxy.wait_seen(b"+ACK", 2)
    await proxy.release()
    with pytest.raises(AckNotConfirmed) as err:
        await acking
    assert not isinstance(err.value, AckOutcomeUnknown)
    assert await _stored(jetstream)


async def test_acks_lost_in_a_reconnect_are_not_rerun_behind_later_messages(
        nats_server: NatsServer, jetstream: JetStream, proxy: HoldingProxy) -> None:
    """Key ordering, one instance connected through the proxy, a short ack wait: its acks
    of five messages of one key are held and then lost when the connection is cut. After
    the reconnect they are sent again (or a redelivery is settled again); no message runs
    twice, per-key order of every completion holds."""
    await make_group(jetstream, partitions=2, members=("m1",))
    fleet = Fleet(proxy.url)
    try:
        member = await fleet.add("m1", MemberSettings(ordering=Ordering.KEY, ack_wait=1.0,
                                                      max_in_flight=16))
        await eventually(lambda: member.active, 20, what="m1 to be active")
        sent: list[tuple[str, int]] = []

        async def publish(n: int) -> None:
            await jetstream.publish("orders.k1", json.dumps({"key": "orders.k1",
                                                            "n": n}).encode())
            sent.append(("orders.k1", n))

        await publish(0)
        await eventually(lambda: len(fleet.record.ends()) == 1, 10, what="#0 handled")
        proxy.hold_up = True  # its acks (and anything else it sends) stay in the proxy
        for n in range(1, 6):
            await publish(n)
        await eventually(lambda: len(fleet.record.ends()) == 6, 10, what="#1-5 handled")
        await proxy.wait_seen(b"+ACK", 6)
        await proxy.cut()  # the held acks are lost with the connection
        await eventually(lambda: member.js.nc.stats["reconnects"] >= 1, 20,
                         what="the member to reconnect")
        for n in range(6, 11):
            await publish(n)
        await eventually(lambda: {n for _, n in sent} <= {
            e["n"] for e in fleet.record.ends()}, 20, what="everything handled")
        await asyncio.sleep(2.5)  # two ack waits: a lost ack would be redelivered by now
        verdict = check(fleet.record, sent)
        verdict.assert_ok()
        starts = [e["n"] for e in fleet.record.events if e["event"] == "start"]
        assert sorted(starts) == list(range(11)), f"something ran twice: {starts}"
        assert member.stats["ack_fences"] + member.stats["resettled"] >= 1
    finally:
        await fleet.close()
