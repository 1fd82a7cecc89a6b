"""The member runtime against real nats-servers: election, delivery, faults, config changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from cgroupd import admin
from cgroupd.core.config import ELASTIC_BUCKET, MemberMapping, group_key
from cgroupd.core.errors import GroupNotFound
from cgroupd.core.settings import Exclusivity, MemberSettings
from cgroupd.member import Member, MemberState
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.message import Message
from tests.support.groups import (
    Fleet,
    MemberProcess,
    Record,
    all_done,
    check,
    make_group,
    publish_keyed,
    wait_started,
)
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually, within

pytestmark = pytest.mark.slow


async def test_three_members_two_instances_each_process_everything_once_in_order(
        fleet: Fleet, jetstream: JetStream) -> None:
    """3 members x 2 instances over 64 keys: no loss, no duplicate, per-key order, and one
    receiving instance per member at any time."""
    await make_group(jetstream, partitions=6)
    for name in ("m1", "m2", "m3"):
        for _ in range(2):
            await fleet.add(name)
    await eventually(lambda: len(fleet.active()) == 3, what="one active instance per member")
    sent = await publish_keyed(jetstream, 600, keys=64)
    await all_done(fleet, sent)
    verdict = check(fleet.record, sent, fleet.by_member)
    verdict.assert_ok()
    assert verdict.duplicates == 0
    receivers = {(fleet.by_member(e), e["instance"]) for e in fleet.record.ends()}
    assert len(receivers) == 3, f"exactly one instance per member received: {receivers}"
    owned = sorted(p for m in fleet.active() for p in m.partitions)
    assert owned == list(range(6))


async def test_reordered_member_list_does_not_restart_members(
        fleet: Fleet, jetstream: JetStream) -> None:
    """A config write that leaves this member's partitions alone causes no step-down."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    a = await fleet.add("m1")
    b = await fleet.add("m2")
    await eventually(lambda: a.active and b.active)
    stored = await admin.get_group(jetstream, "ORDERS", "g")
    await jetstream.update_record(ELASTIC_BUCKET, group_key("ORDERS", "g"),
                                  stored.config.with_members(["m2", "m1"]).to_json(),
                                  last=stored.revision)
    changed = await admin.get_group(jetstream, "ORDERS", "g")
    assert changed.config.members == ("m2", "m1")
    await eventually(lambda: a.config is not None and a.config.members == ("m2", "m1"))
    assert a.stats["step_downs"] == 0 and b.stats["step_downs"] == 0
    assert a.active and b.active


async def test_stop_hands_over_to_the_standby_quickly(
        fleet: Fleet, jetstream: JetStream) -> None:
    """stop() deletes this instance's consumers; the standby is delivering within 0.3 s."""
    await make_group(jetstream, partitions=2, members=("m1",))
    first = await fleet.add("m1")
    second = await fleet.add("m1")
    await eventually(lambda: first.active or second.active)
    active, standby = (first, second) if first.active else (second, first)
    assert standby.state is MemberState.STANDBY
    t0 = time.monotonic()
    await active.stop()
    await eventually(lambda: standby.active, 5, 0.005, "standby to take over")
    handover = time.monotonic() - t0
    sent = await publish_keyed(jetstream, 20, keys=4)
    await all_done(fleet, sent)
    assert {e["instance"] for e in fleet.record.ends()} == {standby.instance_id}
    print(f"stop() handover: {handover:.3f}s")
    assert handover < 0.3, f"handover took {handover:.3f}s"


async def test_handler_exception_is_retried_in_place_without_breaking_order(
        fleet: Fleet, jetstream: JetStream) -> None:
    """A raising handler never kills the runtime: the message is naked with backoff and
    redelivered before any later message of its partition."""
    await make_group(jetstream, partitions=1, members=("m1",))
    fleet.fail_once = {3, 7}
    await fleet.add("m1", MemberSettings(retry_backoff=0.05))
    sent = await publish_keyed(jetstream, 12, keys=1)
    await all_done(fleet, sent)
    check(fleet.record, sent).assert_ok()
    order = [e["n"] for e in fleet.record.ends()]
    assert order == list(range(12)), order
    assert len([e for e in fleet.record.events if e["event"] == "fail"]) == 2


async def test_admin_step_down_moves_delivery_to_the_standby(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Deleting the sync consumer (admin step-down) makes the active instance drain and
    release; the standby takes over and nothing is lost."""
    await make_group(jetstream, partitions=2, members=("m1",))
    first = await fleet.add("m1")
    second = await fleet.add("m1")
    await eventually(lambda: first.active or second.active)
    active, standby = (first, second) if first.active else (second, first)
    sent = await publish_keyed(jetstream, 20, keys=4)
    await all_done(fleet, sent)
    assert await admin.step_down(jetstream, "ORDERS", "g", "m1")
    await eventually(lambda: standby.active, 10, what="standby to take over")
    more = await publish_keyed(jetstream, 20, keys=4, start=20)
    await all_done(fleet, sent + more)
    check(fleet.record, sent + more, fleet.by_member).assert_ok()
    assert active.stats["step_downs"] == 1
    assert {e["instance"] for e in fleet.record.ends() if e["n"] >= 20} == {standby.instance_id}


async def test_membership_and_mapping_changes_under_traffic_lose_nothing(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Add and drop members and set mappings while messages flow: nothing lost, per-key
    order kept, and at any time at most one instance per member receives."""
    await make_group(jetstream, partitions=6, members=("m1", "m2"))
    for name in ("m1", "m2", "m3"):
        await fleet.add(name)
        await fleet.add(name)
    fleet.handler_delay = 0.002

    async def traffic() -> list[tuple[str, int]]:
        return await publish_keyed(jetstream, 900, keys=64, rate=300)

    publisher = asyncio.create_task(traffic())
    await eventually(lambda: len(fleet.record.ends()) > 50)
    await admin.add_members(jetstream, "ORDERS", "g", ["m3"])
    await eventually(lambda: len(fleet.active()) == 3, what="m3 active")
    await admin.drop_members(jetstream, "ORDERS", "g", ["m1"])
    await eventually(lambda: not fleet.active("m1"), what="m1 to stand down")
    await admin.set_mappings(jetstream, "ORDERS", "g", [
        MemberMapping("m1", (0, 1)), MemberMapping("m2", (2, 3)), MemberMapping("m3", (4, 5))])
    await eventually(lambda: len(fleet.active()) == 3, what="three mapped members active")
    sent = await publisher
    await all_done(fleet, sent, timeout=60)
    verdict = check(fleet.record, sent, fleet.by_member)
    verdict.assert_ok()
    print(f"rebalances under traffic: {len(sent)} messages, {verdict.duplicates} redelivered")
    assert sorted(p for m in fleet.active() for p in m.partitions) == list(range(6))


async def test_group_deleted_stops_every_instance(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Deleting the group makes active and standby instances stop by themselves."""
    await make_group(jetstream, partitions=2, members=("m1", "m2"))
    for name in ("m1", "m1", "m2", "m3"):
        await fleet.add(name)
    await eventually(lambda: len(fleet.active()) == 2)
    await admin.delete_group(jetstream, "ORDERS", "g")
    reasons = await within(
        asyncio.gather(*(m.wait_stopped() for m in fleet.members)), 10,
        "every instance to stop")
    assert set(reasons) == {"group deleted"}
    assert all(m.state is MemberState.STOPPED for m in fleet.members)


async def test_garbage_record_is_survived_and_a_fix_is_picked_up(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Undecodable or invalid KV records are logged and ignored; the member keeps its
    current state and follows the next valid record."""
    await make_group(jetstream, partitions=4, members=("m1",))
    m = await fleet.add("m1")
    await eventually(lambda: m.active)
    key = group_key("ORDERS", "g")
    good = (await admin.get_group(jetstream, "ORDERS", "g")).config
    duplicate_members = json.loads(good.to_json()) | {"members": ["m1", "m1"]}
    for garbage in (b"not json", b"[1,2]", b'{"max_members": "x"}',
                    json.dumps(duplicate_members).encode()):
        rec = await jetstream.get_record(ELASTIC_BUCKET, key)
        assert rec is not None
        await jetstream.update_record(ELASTIC_BUCKET, key, garbage, last=rec.revision)
    sent = await publish_keyed(jetstream, 10, keys=4)
    await all_done(fleet, sent)
    assert m.active and m.partitions == (0, 1, 2, 3)
    rec = await jetstream.get_record(ELASTIC_BUCKET, key)
    assert rec is not None
    await jetstream.update_record(ELASTIC_BUCKET, key,
                                  good.with_members(["m0", "m1"]).to_json(), last=rec.revision)
    await eventually(lambda: m.active and m.partitions == (2, 3), what="fixed config applied")


async def test_not_a_member_stays_standby_until_added(
        fleet: Fleet, jetstream: JetStream) -> None:
    """An instance whose member owns no partition waits, and starts once it is added."""
    await make_group(jetstream, partitions=2, members=("m1",))
    m = await fleet.add("m9")
    await eventually(lambda: m.state is MemberState.STANDBY)
    assert not m.active
    await admin.add_members(jetstream, "ORDERS", "g", ["m9"])
    await eventually(lambda: m.active, what="m9 active once added")
    assert m.partitions == (1,)


async def test_pinned_mode_failover_and_unpin_step_down(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Priority-group exclusivity: one pinned instance delivers; unpin (admin step-down)
    moves delivery to the other; stop() of the pinned one hands over too."""
    await make_group(jetstream, partitions=2, members=("m1",))
    settings = MemberSettings(exclusivity=Exclusivity.PINNED)
    first = await fleet.add("m1", settings)
    second = await fleet.add("m1", settings)
    sent = await publish_keyed(jetstream, 10, keys=2)
    await all_done(fleet, sent)
    active = first if first.active else second
    other = second if active is first else first
    assert active.active and not other.active
    assert await admin.step_down(jetstream, "ORDERS", "g", "m1")
    more = await publish_keyed(jetstream, 10, keys=2, start=10)
    await all_done(fleet, sent + more)
    await eventually(lambda: other.active, what="other instance pinned after unpin")
    check(fleet.record, sent + more, fleet.by_member).assert_ok()
    await other.stop()
    last = await publish_keyed(jetstream, 10, keys=2, start=20)
    await all_done(fleet, sent + more + last)
    await eventually(lambda: active.active, what="first instance pinned again")
    check(fleet.record, sent + more + last).assert_ok()


# -- real processes: crash and suspension ----------------------------------------------


def _procs(url: str, tmp_path: Path, n: int, *extra: str) -> list[MemberProcess]:
    return [MemberProcess(url, tmp_path / f"p{i}.jsonl", "ORDERS", "g", "m1", *extra)
            for i in range(n)]


async def test_sigkill_of_the_active_process_fails_over_without_loss(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path) -> None:
    """SIGKILL the active instance mid-traffic: the standby takes over within ~1 s (the
    consumers' inactive threshold) and every message is processed, in per-key order."""
    await make_group(jetstream, partitions=4, members=("m1",))
    procs = _procs(nats_server.url, tmp_path, 2)
    try:
        await wait_started(procs)
        active = await eventually(lambda: next((p for p in procs if p.active), None))
        standby = next(p for p in procs if p is not active)
        sent = await publish_keyed(jetstream, 100, keys=16)
        await eventually(lambda: sum(e["event"] == "end" for e in active.events()) >= 20)
        t0 = time.monotonic()
        active.signal(signal.SIGKILL)
        await eventually(lambda: standby.active, 10, 0.01, "standby to take over")
        print(f"crash failover: {time.monotonic() - t0:.3f}s")
        sent += await publish_keyed(jetstream, 100, keys=16, start=100)
        await eventually(lambda: {n for _, n in sent} <= {
            e["n"] for e in Record.load(p.record for p in procs).ends()}, 20)
        record = Record.load(p.record for p in procs)
        # SIGKILL loses the killed instance's unflushed acks: its successor may redo them.
        check(record, sent, rewinds=True).assert_ok()
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.close()


async def test_sigstop_past_inactive_threshold_then_sigcont_steps_down(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path) -> None:
    """Suspend the active instance while it holds a message: the standby takes over and
    processes that message; on SIGCONT the old instance's double_ack fails and it steps
    down instead of carrying on."""
    await make_group(jetstream, partitions=2, members=("m1",))
    procs = _procs(nats_server.url, tmp_path, 2, "--handler-delay", "0.3")
    try:
        await wait_started(procs)
        active = await eventually(lambda: next((p for p in procs if p.active), None))
        standby = next(p for p in procs if p is not active)
        sent = await publish_keyed(jetstream, 10, keys=2)

        def holding() -> bool:
            events = active.events()
            started = {e["seq"] for e in events if e["event"] == "start"}
            ended = {e["seq"] for e in events if e["event"] == "end"}
            return bool(started - ended)

        await eventually(holding, what="active instance to be inside a handler")
        active.signal(signal.SIGSTOP)
        await eventually(lambda: standby.active, 15, 0.02, "standby to take over")
        active.signal(signal.SIGCONT)
        await eventually(lambda: active.last_state() == "standby", 10,
                         what="old instance to step down")
        def acked() -> set[int]:
            return {e["n"] for e in Record.load(p.record for p in procs).events
                    if e["event"] == "ack" and e["confirmed"]}

        await eventually(lambda: {n for _, n in sent} <= acked(), 20)
        record = Record.load(p.record for p in procs)
        old = active.events()[0]["instance"]
        old_acks = [e for e in record.events if e["event"] == "ack" and e["instance"] == old]
        assert any(not e["confirmed"] for e in old_acks), "the suspended handler's ack must fail"
        # Exactly-once view: only work whose double_ack was confirmed counts.
        confirmed = {(e["instance"], e["seq"]) for e in record.events
                     if e["event"] == "ack" and e["confirmed"]}
        committed = Record([e for e in record.events if e["event"] != "end"
                            or (e["instance"], e["seq"]) in confirmed])
        verdict = check(committed, sent)
        verdict.assert_ok()
        assert verdict.duplicates == 0
    finally:
        for p in procs:
            p.close()



async def test_server_restart_under_traffic_resumes_without_loss(
        fleet: Fleet, jetstream: JetStream, nats_server: NatsServer, nc: Client) -> None:
    """Restart the only nats-server while members consume: they reconnect, pull again
    (or re-elect), and every message is processed in per-key order."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    for name in ("m1", "m1", "m2", "m2"):
        await fleet.add(name)
    await eventually(lambda: len(fleet.active()) == 2)
    sent = await publish_keyed(jetstream, 200, keys=16)
    await eventually(lambda: len(fleet.record.ends()) >= 50)
    nats_server.kill()
    await eventually(lambda: not nc.is_connected, what="client to notice the restart")
    nats_server.restart()
    await eventually(lambda: nc.is_connected, 15, what="reconnect")
    more = await eventually(lambda: _publish_when_ready(jetstream, 200), 15,
                            what="publishing after restart")
    await all_done(fleet, sent + more, timeout=45)
    # A server killed with SIGKILL may lose acks it had not synced: they are redone.
    check(fleet.record, sent + more, fleet.by_member, rewinds=True).assert_ok()
    await eventually(lambda: len(fleet.active()) == 2, what="both members active again")


async def _publish_when_ready(js: JetStream, count: int) -> list[tuple[str, int]] | None:
    try:
        return await publish_keyed(js, count, keys=16, start=200)
    except Exception:  # noqa: BLE001 - JetStream may still be recovering: try again
        return None


async def test_start_on_a_missing_group_fails_fast(jetstream: JetStream, nc: Client) -> None:
    """Joining a group that was never created raises GroupNotFound instead of waiting."""
    await make_group(jetstream, partitions=2, members=("m1",))

    async def handler(msg: Message) -> None:
        return None

    member = Member(jetstream, "ORDERS", "nope", "m1", handler)
    with pytest.raises(GroupNotFound, match="nope"):
        await within(member.start(), 5, "start to fail")
    await member.stop()
    assert member.state is MemberState.STOPPED


async def test_static_group_members_consume_their_partitions(
        fleet: Fleet, jetstream: JetStream, nc: Client) -> None:
    """A static group on a stream whose subjects already carry the partition: each member
    (pinned mode, durable <group>-<member>) gets only its partitions; a standby takes
    over when the pinned instance stops."""
    from nats.js import api

    from cgroupd.core.config import StaticGroupConfig

    await jetstream.add_stream(api.StreamConfig(
        name="ORDERS", subjects=[f"{p}.orders.>" for p in range(4)]))
    await admin.create_static_group(jetstream, "ORDERS", "g", StaticGroupConfig(
        max_members=4, members=("m1", "m2")))
    a = await fleet.add("m1", static=True)
    b = await fleet.add("m1", static=True)
    c = await fleet.add("m2", static=True)
    for i in range(40):
        await jetstream.js.publish(f"{i % 4}.orders.k{i % 8}", json.dumps({"n": i}).encode())
    want = set(range(40))
    await eventually(lambda: want <= {e["n"] for e in fleet.record.ends()}, 20)
    by_member: dict[str, set[int]] = {}
    for e in fleet.record.ends():
        by_member.setdefault(fleet.by_member(e), set()).add(e["partition"])
    assert by_member == {"m1": {0, 1}, "m2": {2, 3}}
    assert {i.get("name") for i in await jetstream.list_consumers("ORDERS")} == {"g-m1", "g-m2"}
    active = a if a.active else b
    other = b if active is a else a
    await active.stop()
    for i in range(40, 48):
        await jetstream.js.publish(f"{i % 2}.orders.k{i % 8}", json.dumps({"n": i}).encode())
    await eventually(lambda: set(range(48)) <= {e["n"] for e in fleet.record.ends()}, 20)
    assert other.active and c.active


async def test_pinned_config_change_never_confirms_a_stale_ack_twice(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Pinned mode, two instances of m1, exactly-once handler. Instance A holds message
    #0 (of a partition m1 keeps) in its handler when m2 is added. Whoever else might get
    #0 during the change gets 4 s to commit it; then A finishes and double-acks.

    Attacks issue 13 item 3: every instance deleted the shared member consumer on a config
    change and the next one recreated it under the same name, so the standby got #0 again
    and committed it, and A's ack, addressed to the old incarnation, was confirmed by the
    new one: committed twice."""
    import nats as nats_client

    from tests.faults.traffic import partition_of
    from tests.support.natsserver import client_options

    await make_group(jetstream, partitions=2, members=("m1",))
    key = next(f"k{i}" for i in range(32) if partition_of(f"k{i}", 2) == 0)
    commits: list[str] = []
    held = asyncio.Event()
    release = asyncio.Event()
    conns = []
    members: list[Member] = []

    def handler_for(name: str) -> Any:
        async def handler(msg: Message) -> None:
            if not held.is_set():
                held.set()
                await release.wait()
            await msg.double_ack()  # raises when not confirmed: then it does not commit
            commits.append(name)
        return handler

    settings = MemberSettings(exclusivity=Exclusivity.PINNED)
    try:
        for name in ("a", "b"):
            nc = await nats_client.connect(servers=[nats_server.url], **client_options())
            conns.append(nc)
            m = Member(JetStream(nc), "ORDERS", "g", "m1", handler_for(name), settings)
            await m.start()
            members.append(m)
        nc = await nats_client.connect(servers=[nats_server.url], **client_options())
        conns.append(nc)
        other = Member(JetStream(nc), "ORDERS", "g", "m2", handler_for("m2"), settings)
        await other.start()
        members.append(other)
        await jetstream.js.publish(f"orders.{key}", json.dumps({"n": 0}).encode())
        await eventually(held.is_set, what="#0 held by a handler")
        await admin.add_members(jetstream, "ORDERS", "g", ["m2"])
        with contextlib.suppress(AssertionError):  # nobody else may commit it: look 4 s
            await eventually(lambda: bool(commits), 4.0, what="another commit of #0")
        release.set()
        await eventually(lambda: bool(commits), 10, what="#0 committed")
        with contextlib.suppress(AssertionError):  # and A's ack must not count again
            await eventually(lambda: len(commits) > 1, 2.0, what="a second commit")
        assert len(commits) == 1, f"#0 committed {len(commits)} times: {commits}"
    finally:
        for m in members:
            await m.stop()
        for nc in conns:
            await nc.close()
