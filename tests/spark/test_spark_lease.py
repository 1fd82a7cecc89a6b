"""The Spark source's lease and direct-get reads against a real nats-server (no Spark).

The lease is what keeps daemon instances and other queries off the partitions a query
reads; these tests drive it directly, next to in-process member instances.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import structlog
from nats.aio.msg import Msg
from nats.js import api

from cgroupd import admin
from cgroupd.core.config import group_key
from cgroupd.core.errors import StreamNotFound
from cgroupd.core.settings import MemberSettings
from cgroupd.member import INSTANCE_KEY, MEMBER_KEY, Member, MemberState
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.lease import legacy_presence_subject
from cgroupd.nats.message import Message
from cgroupd.spark import directget
from cgroupd.spark.directget import DirectGet, nth_sequence, read_range
from cgroupd.spark.layout import PREFIXED, Layout, Mode
from cgroupd.spark.lease import Lease, LeaseLost, LeaseUnavailable, claims_for
from cgroupd.spark.offsets import ReadRange
from cgroupd.spark.options import DEFAULT_LEASE_INACTIVE, SourceOptions, connect_reader
from cgroupd.spark.source import ReadTask, close_executor_connections, read_task
from tests.support.groups import make_group, publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually, within
from tests.support.spark_support import TcpProxy, wait_sourced

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"
FAST = MemberSettings(retry_interval=0.2, rejoin_delay=0.2)


def _handler(message: Message) -> None:
    return None


async def _lease(js: JetStream, partitions: tuple[int, ...], wait: float = 5.0,
                 **kwargs: Any) -> Lease:
    stored = await admin.get_group(js, "ORDERS", "g")
    return Lease(js, WQ, claims_for(stored.config, partitions), label="ORDERS/g",
                 presence_key=group_key("ORDERS", "g"),
                 inactive_threshold=0.5, wait=wait, **kwargs)


async def _stays_standby(member: Member, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while loop.time() < until:
        assert member.state is MemberState.STANDBY, member.state
        await asyncio.sleep(0.02)


async def test_lease_keeps_a_member_instance_standby_until_released(
        jetstream: JetStream) -> None:
    """While held, the member's instance cannot win its election; released, it does."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    lease = await _lease(jetstream, (0, 1))
    await lease.acquire()
    member = Member(jetstream, "ORDERS", "g", "m1", _handler, FAST)
    await member.start()
    try:
        await _stays_standby(member, 1.5)
        lease.check()
        await lease.release()
        await eventually(lambda: member.active, what="the member to take over")
    finally:
        await member.stop()


async def test_lease_is_refused_while_a_member_instance_is_active(
        jetstream: JetStream) -> None:
    """The refusal names the member and the active instance."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    member = Member(jetstream, "ORDERS", "g", "m2", _handler, FAST, instance_id="inst-7")
    await member.start()
    try:
        await eventually(lambda: member.active, what="the member to be active")
        lease = await _lease(jetstream, (2, 3), wait=0.3)
        with pytest.raises(LeaseUnavailable, match=r"member 'm2'.*daemon instance inst-7"):
            await lease.acquire()
        assert await jetstream.consumer_info(WQ, "m2") is not None
    finally:
        await member.stop()


async def test_the_refusal_names_the_member_option_and_a_free_member(
        jetstream: JetStream) -> None:
    """Issue 30 row 3: a query without the 'member' option, beside a daemon instance of
    m2, is told that the option picks the member it reads and that m1 is free, without
    the server's ConsumerExists (10148) chained under it."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    member = Member(jetstream, "ORDERS", "g", "m2", _handler, FAST, instance_id="inst-7")
    await member.start()
    try:
        await eventually(lambda: member.active, what="the member to be active")
        stored = await admin.get_group(jetstream, "ORDERS", "g")
        lease = Lease(jetstream, WQ, claims_for(stored.config, range(4)), label="ORDERS/g",
                      presence_key=group_key("ORDERS", "g"), inactive_threshold=0.5,
                      wait=0.3, group=("ORDERS", "g"),
                      group_claims=claims_for(stored.config, range(4)))
        with pytest.raises(LeaseUnavailable) as refused:
            await lease.acquire()
        text = str(refused.value)
        assert "daemon instance inst-7" in text
        assert "no 'member' option" in text and '.option("member", \'m1\')' in text
        assert "'m1' (partitions [0, 1])" in text and "'m2' (partitions" not in text
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
        assert await jetstream.consumer_info(WQ, "m1") is None, "nothing left held"
    finally:
        await member.stop()


async def test_lease_taken_and_released_are_logged_at_info(jetstream: JetStream) -> None:
    """Issue 30 row 6: the driver says at INFO which members it took and let go."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    with structlog.testing.capture_logs() as logs:
        lease = await _lease(jetstream, (0, 1), group=("ORDERS", "g"))
        await lease.acquire()
        await lease.release()
    lines = [(e["event"], e.get("members"), e["log_level"]) for e in logs
             if e["event"].startswith("lease ")]
    assert lines == [("lease taken", ["m1"], "info"), ("lease released", ["m1"], "info")]


async def test_a_crashed_holders_lease_expires(jetstream: JetStream) -> None:
    """A holder that stops pulling without cleaning up (a killed driver) loses its
    consumers after the inactive threshold; a waiting query then gets them."""
    await make_group(jetstream, partitions=2, members=("m1",))
    first = await _lease(jetstream, (0, 1))
    await first.acquire()
    for puller in first._pullers.values():  # the process dies: no release()
        await puller.stop()
    second = await _lease(jetstream, (0, 1), wait=10.0)
    await second.acquire()
    assert second.held
    await second.release()


async def test_a_lease_on_unowned_and_owned_partitions_fences_members_added_later(
        jetstream: JetStream) -> None:
    """Reading every partition claims the unowned ones too: a member added meanwhile
    cannot start consuming them."""
    await make_group(jetstream, partitions=4, members=())
    lease = await _lease(jetstream, (0, 1, 2, 3))
    await lease.acquire()
    await admin.add_members(jetstream, "ORDERS", "g", ["m2"])
    member = Member(jetstream, "ORDERS", "g", "m2", _handler, FAST)
    await member.start()
    try:
        await _stays_standby(member, 1.0)
        lease.check()
    finally:
        await member.stop()
        await lease.release()


async def test_lease_is_lost_when_its_consumer_is_deleted(jetstream: JetStream) -> None:
    """A step-down deletes the lease's consumer: check() raises from then on."""
    await make_group(jetstream, partitions=2, members=("m1",))
    lease = await _lease(jetstream, (0, 1), check_interval=0.1)
    await lease.acquire()
    assert await admin.step_down(jetstream, "ORDERS", "g", "m1")

    def lost() -> bool:
        try:
            lease.check()
        except LeaseLost:
            return True
        return False

    await eventually(lost, what="the lease to be lost")
    with pytest.raises(LeaseLost, match="lost its lease on group ORDERS/g"):
        lease.check()
    await lease.release()


async def test_abandoned_data_consumer_is_removed_live_one_refuses(
        jetstream: JetStream) -> None:
    """A previous owner's data consumer nobody pulls on is deleted; one being pulled on
    makes the acquisition fail."""
    await make_group(jetstream, partitions=2, members=("m1",))
    data = {"ack_policy": "explicit", "deliver_policy": "all",
            "filter_subjects": ["0.>", "1.>"], "inactive_threshold": int(60e9)}
    await jetstream.create_consumer(WQ, "m1-old", data)
    lease = await _lease(jetstream, (0, 1))
    await lease.acquire()
    assert await jetstream.consumer_info(WQ, "m1-old") is None
    await lease.release()

    await jetstream.create_consumer(WQ, "m1-live", data)
    sub = await jetstream.js.pull_subscribe_bind("m1-live", stream=WQ)
    fetch = asyncio.create_task(sub.fetch(1, timeout=5))
    try:
        await eventually(lambda: _waiting(jetstream, "m1-live"), what="a waiting pull")
        lease = await _lease(jetstream, (0, 1), wait=0.5)
        with pytest.raises(LeaseUnavailable, match="being consumed by consumer 'm1-live'"):
            await lease.acquire()
    finally:
        fetch.cancel()
        await asyncio.gather(fetch, return_exceptions=True)


async def _waiting(js: JetStream, name: str) -> bool:
    info = await js.consumer_info(WQ, name)
    return bool(info and info.get("num_waiting"))


async def test_direct_get_reads_and_counts_like_a_full_scan(jetstream: JetStream) -> None:
    """Batched reads return a subject's messages in order; the n-th message search
    agrees with a scan; the last sequence is the subject's last."""
    await make_group(jetstream, partitions=3, members=("m1",))
    await publish_keyed(jetstream, 300, keys=10)

    async def sourced() -> bool:
        info = await jetstream.stream_info(WQ)
        return info is not None and info.state.messages == 300

    await eventually(sourced, what="the group's stream to hold every message")
    nc = await connect_reader(ConnectionOptions(servers=(jetstream.nc.connected_url.geturl(),)),
                              reconnect=False)
    dg = DirectGet(nc, WQ)
    try:
        for p in range(3):
            subject = f"{p}.>"
            seqs = [item[0] async for chunk in read_range(dg, subject, 0, 300, fetch=37)
                    for item in chunk]
            assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
            assert await dg.last(subject) == seqs[-1]
            for n in (1, 2, 17, len(seqs) - 1, len(seqs)):
                assert await nth_sequence(dg, subject, 0, n, 300) == seqs[n - 1]
            assert await nth_sequence(dg, subject, seqs[4], 3, 300) == seqs[7]
            assert await nth_sequence(dg, subject, 0, len(seqs) + 5, 300) == 300
        everything = [item[0] async for chunk in read_range(dg, ">", 0, 300, fetch=64)
                      for item in chunk]
        assert everything == list(range(1, 301))
        assert await dg.last("7.>") is None
        assert (await dg.batch(1, "7.>", 10)).items == []
    finally:
        await dg.close()
        await nc.close()


async def test_direct_get_waits_out_a_moment_without_replicas(
        jetstream: JetStream, monkeypatch: pytest.MonkeyPatch) -> None:
    """"No responders" on the direct-get subject is what a replicated stream says while
    its leader changes: a read asks again until a replica answers (here: the stream
    appears 0.3 s after the first ask), and fails with StreamNotFound only when nobody
    answers for the whole UNAVAILABLE_TIMEOUT (CI on 5e3894c failed a follower read)."""
    nc = await connect_reader(ConnectionOptions(servers=(jetstream.nc.connected_url.geturl(),)),
                              reconnect=False)
    dg = DirectGet(nc, "LATE")
    try:
        async def appear() -> None:
            await asyncio.sleep(0.3)
            await jetstream.add_stream(api.StreamConfig(name="LATE", subjects=["late.>"],
                                                        allow_direct=True))
            await jetstream.publish("late.a", b"x")

        started = time.monotonic()
        creating = asyncio.create_task(appear())
        # Answered once the stream exists: nothing there yet (None), or the message.
        assert await dg.last("late.>") in (None, 1)
        assert time.monotonic() - started >= 0.3
        await creating
        assert await dg.last("late.>") == 1
        monkeypatch.setattr(directget, "UNAVAILABLE_TIMEOUT", 0.4)
        gone = DirectGet(nc, "NEVER")
        started = time.monotonic()
        with pytest.raises(StreamNotFound, match="no replica is available"):
            await gone.last("x.>")
        assert 0.4 <= time.monotonic() - started < 3.0
        await gone.close()
    finally:
        await dg.close()
        await nc.close()


# -- the liveness check, outages, and tasks that check the lease --------------------------
async def test_taking_the_lease_leaves_a_live_draining_instance_alone(
        jetstream: JetStream) -> None:
    """A daemon instance still finishing its handlers keeps its data consumer without
    pulling on it. Taking the lease used to delete such a consumer after two idle looks;
    like the daemon's own reclaim it now asks the instance first: one that answers on
    its presence subject is waited for (and named when the wait runs out); once it is
    gone (no responders), its consumer is removed and the lease taken."""
    await make_group(jetstream, partitions=2, members=("m1",))
    data = {"ack_policy": "explicit", "deliver_policy": "all",
            "filter_subjects": ["0.>", "1.>"], "inactive_threshold": int(60e9),
            "metadata": {MEMBER_KEY: "m1", INSTANCE_KEY: "draining-1"}}
    await jetstream.create_consumer(WQ, "m1-data", data)

    async def alive(msg: Msg) -> None:
        await jetstream.nc.publish(msg.reply, b"draining-1")

    presence = await jetstream.nc.subscribe(
        legacy_presence_subject(group_key("ORDERS", "g"), "draining-1"), cb=alive)
    lease = await _lease(jetstream, (0, 1), wait=1.5)
    with pytest.raises(LeaseUnavailable, match="daemon instance draining-1"):
        await lease.acquire()
    assert await jetstream.consumer_info(WQ, "m1-data") is not None, "a live one's consumer"
    await presence.unsubscribe()  # the instance finished and went away
    lease = await _lease(jetstream, (0, 1), wait=5.0)
    await lease.acquire()
    assert await jetstream.consumer_info(WQ, "m1-data") is None
    await lease.release()


async def test_lease_survives_a_nats_outage_of_a_few_seconds(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """The query's connection is cut for 3 s (a network outage, the server running on):
    with the default threshold the lease is still held afterwards; a 1 s threshold (the
    old default was 2 s) loses it."""
    await make_group(jetstream, partitions=2, members=("m1", "m2"))
    proxy = TcpProxy(nats_server.port)
    await proxy.start()
    nc = await connect(ConnectionOptions(servers=(proxy.url,)))
    js = JetStream(nc)
    stored = await admin.get_group(js, "ORDERS", "g")
    lease = Lease(js, WQ, claims_for(stored.config, (0, 1)), label="ORDERS/g",
                  presence_key=group_key("ORDERS", "g"),
                  inactive_threshold=DEFAULT_LEASE_INACTIVE, check_interval=0.2)
    short = Lease(js, WQ, claims_for(stored.config, (2, 3)), label="ORDERS/g",
                  presence_key=group_key("ORDERS", "g"),
                  inactive_threshold=1.0, check_interval=0.2)
    await lease.acquire()
    await short.acquire()
    try:
        await proxy.cut()
        await asyncio.sleep(3.0)
        await proxy.heal()
        await eventually(lambda: nc.is_connected, timeout=10, what="the reconnect")
        await lease.verify()
        lease.check()
        assert await jetstream.consumer_info(WQ, "m1") is not None

        def short_lost() -> bool:
            try:
                short.check()
            except LeaseLost:
                return True
            return False

        await eventually(short_lost, timeout=5, what="the short lease to be lost")
    finally:
        await lease.release()
        await short.release()
        await nc.close()
        await proxy.close()


async def test_a_task_refuses_to_hand_over_rows_once_the_lease_is_gone(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Executors check the lease too, before and after reading: a task that read while
    an operator's step-down handed the partitions to someone else fails, naming it."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 20, keys=4)
    await wait_sourced(jetstream, WQ, 20)
    lease = await _lease(jetstream, (0, 1))
    await lease.acquire()
    options = SourceOptions.parse({"servers": nats_server.url, "stream": "ORDERS",
                                   "group": "g", "mode": "workqueue"})
    layout = Layout(WQ, "ORDERS", "g", Mode.WORKQUEUE, PREFIXED, (0, 1), 2)
    task = ReadTask(layout, ReadRange(">", 0, 30), ((0, 0, 30), (1, 0, 30)), lease.ref)
    try:
        rows = sum(b.num_rows for b in await asyncio.to_thread(
            lambda: list(read_task(options, task))))
        assert rows == 20
        assert await admin.step_down(jetstream, "ORDERS", "g", "m1")
        with pytest.raises(LeaseLost, match=r"lease .* is gone: consumer 'm1'"):
            await asyncio.to_thread(lambda: list(read_task(options, task)))
    finally:
        await lease.release()
        await asyncio.to_thread(close_executor_connections)


async def test_release_ends_a_lease_check_that_swallowed_its_cancellation() -> None:
    """A check's request can swallow the cancellation meant to end the check loop
    (nats-py's wait_for on Python 3.11); the loop then goes on, and a release that only
    cancelled it once waited for it for ever (a 300 s hang in CI on e92d1b3)."""
    lease = Lease(None, WQ, [], presence_key="ORDERS.g", label="ORDERS/g",  # type: ignore[arg-type]
                  check_interval=0.01)
    checking = asyncio.Event()
    swallowed = 0

    async def verify() -> None:
        nonlocal swallowed
        checking.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed += 1  # once, as the race in wait_for does

    lease.verify = verify  # type: ignore[method-assign]
    lease._watch = asyncio.create_task(lease._watch_loop())
    await within(checking.wait(), 5, "the check loop to verify")
    began = time.monotonic()
    releasing = asyncio.ensure_future(lease.release())
    await asyncio.wait({releasing}, timeout=5)
    assert releasing.done(), "release still waiting for the check loop after 5 s"
    releasing.result()
    assert swallowed == 1 and time.monotonic() - began < 5
