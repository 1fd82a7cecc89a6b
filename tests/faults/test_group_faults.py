"""Faults in the group itself: membership churn, a garbage config record, a poison message.

These use the at-least-once recording handler (the runtime acks when it returns): with
no process or server fault, what must hold is that nothing is lost, per-key order is kept,
and no key (or member) is processed by two instances at the same time, even while
partitions move between members.
"""

from __future__ import annotations

import json

import pytest

from cgroupd import admin
from cgroupd.core.config import ELASTIC_BUCKET, group_key
from cgroupd.nats.jetstream import JetStream
from tests.faults.scenario import Scenario

pytestmark = [pytest.mark.faults, pytest.mark.slow]


async def test_membership_add_and_drop_under_load(single: Scenario) -> None:
    """Add m3, drop m1, add m1 back while 200 msg/s flow: partitions move between
    members (incrementally where possible), no key is ever processed by two instances at
    once, nothing is lost and per-key order holds."""
    sc = single
    sc.variant = "at_least_once"
    await sc.make_group(partitions=6, members=("m1", "m2"))
    m1 = sc.start("m1")
    sc.start("m2")
    m3 = sc.start("m3")
    await sc.wait_active("m1")
    await sc.wait_active("m2")
    await sc.wait_joined([m3])
    pub = sc.traffic(1800, rate=200, keys=48)
    pub.start()
    await sc.wait_progress(200)
    await admin.add_members(js(sc), sc.stream, sc.group, ["m3"])
    sc.note("added m3")
    await sc.wait_active("m3")
    await sc.wait_progress(len(sc.finished()) + 200)
    await admin.drop_members(js(sc), sc.stream, sc.group, ["m1"])
    sc.note("dropped m1")
    await sc.wait_for(lambda: m1.state() == "standby", 20, "m1 to stand down")
    await sc.wait_progress(len(sc.finished()) + 200)
    await admin.add_members(js(sc), sc.stream, sc.group, ["m1"])
    sc.note("added m1 back")
    await sc.wait_active("m1")
    verdict = await sc.finish()
    verdict.assert_ok()
    by_member = {r.member for r in sc.rows() if r.status == "done"}
    assert by_member == {"m1", "m2", "m3"}


async def test_group_config_garbage_then_fixed(single: Scenario) -> None:
    """Replace the group record with garbage (not JSON, wrong types, a changed partition
    count, a member name no consumer may have) under traffic: members keep consuming with
    the last good config; a fixed record (with m3 added) is then followed. (Repeated
    member names are not garbage: the reference writes and reads them.)"""
    sc = single
    sc.variant = "at_least_once"
    await sc.make_group(partitions=4, members=("m1", "m2"))
    sc.start("m1")
    sc.start("m2")
    m3 = sc.start("m3")
    await sc.wait_active("m1")
    await sc.wait_active("m2")
    await sc.wait_joined([m3])
    pub = sc.traffic(1600, rate=200)
    pub.start()
    await sc.wait_progress(200)
    key = group_key(sc.stream, sc.group)
    good = (await admin.get_group(js(sc), sc.stream, sc.group)).config
    as_json = json.loads(good.to_json())
    garbage = [b"not json", b"[1, 2]", b'{"max_members": "four"}',
               json.dumps(as_json | {"max_members": 8}).encode(),
               json.dumps(as_json | {"members": ["m1", "m.2"]}).encode(), b""]
    for value in garbage:
        record = await js(sc).get_record(ELASTIC_BUCKET, key)
        assert record is not None
        await js(sc).update_record(ELASTIC_BUCKET, key, value, last=record.revision)
        sc.note(f"wrote garbage {value[:40]!r}")
    await sc.wait_progress(len(sc.finished()) + 300)
    assert sum(p.count("stepped down") for p in sc.procs) == 0, "garbage must be ignored"
    record = await js(sc).get_record(ELASTIC_BUCKET, key)
    assert record is not None
    await js(sc).update_record(ELASTIC_BUCKET, key, good.with_members(["m1", "m2", "m3"])
                               .to_json(), last=record.revision)
    sc.note("fixed: the good record with m3 added")
    await sc.wait_active("m3")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert any(r.member == "m3" for r in sc.rows()), "m3 consumed after the fix"


async def test_poison_message_dead_lettered_while_others_flow(single: Scenario) -> None:
    """A handler that always fails on one message: with --max-deliver 3 it is retried in
    place (blocking only its own key's successors), then published to the dead-letter
    subject (captured by a DLQ stream) and termed; every other message is processed, in
    order, and other keys keep flowing meanwhile."""
    sc = single
    sc.variant = "at_least_once"
    await sc.make_group(partitions=4, members=("m1", "m2"))
    await sc.add_stream("DLQ", ["dlq.>"])
    count = 1000
    poison = 301
    args = ("--max-deliver", "3", "--dead-letter-subject", "dlq.orders")
    env = {"FAULTS_POISON": str(poison)}
    sc.start("m1", args=args, env=env)
    sc.start("m2", args=args, env=env)
    await sc.wait_active("m1")
    await sc.wait_active("m2")
    pub = sc.traffic(count, rate=200)
    pub.start()

    async def dead_letters() -> int:
        info = await js(sc).stream_info("DLQ")
        return info.state.messages if info is not None else 0

    await sc.wait_for(dead_letters, 30, "the poison message in the DLQ stream")
    await sc.settle(exclude={poison})
    assert await dead_letters() == 1
    letter = await js(sc).js.get_msg("DLQ", 1)
    assert json.loads(letter.data or b"{}")["n"] == poison
    headers = letter.headers or {}
    assert headers["Cgroupd-Original-Subject"] == pub.subject(poison)
    assert headers["Cgroupd-Deliveries"] == "3"
    assert "PoisonMessage" in headers["Cgroupd-Error"]
    rows = sc.rows()
    failed = sorted((r for r in rows if r.n == poison), key=lambda r: r.t_start)
    assert [(r.status, r.deliveries) for r in failed] == [("failed", 1), ("failed", 2),
                                                          ("failed", 3)]
    assert not any(r.n == poison and r.status == "done" for r in rows)
    first, last = failed[0].t_start, failed[-1].t_end or failed[-1].t_start
    others = [r for r in rows if r.status == "done" and r.member != failed[0].member
              and r.t_end is not None and first <= r.t_end <= last]
    sc.note(f"poison #{poison} failed 3 deliveries in {last - first:.2f}s, then "
            f"dead-lettered; {len(others)} messages of the other member finished meanwhile")
    verdict = sc.verdict()
    verdict.assert_ok()
    assert others, "other members' keys must keep flowing while the poison is retried"
    later = [r for r in rows if r.subject == pub.subject(poison) and r.n > poison]
    assert later and all(r.t_start >= last for r in later), "its key waits for it"


def js(sc: Scenario) -> JetStream:
    assert sc.js is not None
    return sc.js
