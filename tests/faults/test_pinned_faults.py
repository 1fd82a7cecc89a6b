"""Pinned mode (priority groups) and static groups under process faults and churn.

In pinned mode every instance of a member shares one consumer (``<member>`` on the
elastic stream, durable ``<group>-<member>`` on a static stream) and the server pins one
of them. The server confirms acks per consumer, not per pin, so an instance that lost the
pin while suspended still gets its ``double_ack`` confirmed; what keeps the guarantees is
the instance's own lease on the pin (see :mod:`cgroupd.core.pinning`) and the takeover rule: a
newly pinned instance starts nothing while the consumer holds messages delivered to
someone else.
"""

from __future__ import annotations

import signal
import time

import pytest

from cgroupd import admin
from cgroupd.core.config import work_queue_stream
from cgroupd.core.settings import PIN_SPARE
from cgroupd.nats.jetstream import JetStream
from tests.faults.runner import JoinProc
from tests.faults.scenario import Scenario

pytestmark = [pytest.mark.faults, pytest.mark.slow]

PINNED = ("--exclusivity", "pinned")
KEYED = (*PINNED, "--ordering", "key", "--max-in-flight", "64")


async def _pinned_setup(sc: Scenario, args: tuple[str, ...], count: int,
                        rate: float) -> tuple[JoinProc, JoinProc, int]:
    """m1 (partitions 0, 1) with two instances, m2 (2, 3); traffic running with one
    message of m1 held 3 s by its first handler. A pinned consumer pins an instance with
    its first message, so who is active shows only once traffic flows. Returns (the
    instance that started the held message, the other one, held n)."""
    await sc.make_group(partitions=4, members=("m1", "m2"))
    procs = [sc.start("m1", args=args), sc.start("m1", args=args)]
    sc.start("m2", args=args)
    await sc.wait_joined(sc.procs)
    pub = sc.traffic(count, rate=rate)
    held = pub.first_of_key(sc.keys_of([0, 1])[0], after=count // 4)
    pub.holds[held] = 3.0
    pub.start()
    row = await sc.wait_started(held)
    active = next(p for p in procs if p.instance == row.instance)
    return active, next(p for p in procs if p is not active), held


async def _slow_handlers_under_backlog(sc: Scenario, args: tuple[str, ...], delay: float,
                                      count: int) -> tuple[JoinProc, JoinProc]:
    """m1 with two instances, m2, every handler taking ``delay`` s (exactly-once recorder),
    ``count`` messages at 200 msg/s started: (m1's active instance, its standby)."""
    sc.variant = "exactly_once"
    env = {"FAULTS_DELAY": str(delay)}
    await sc.make_group(partitions=4, members=("m1", "m2"))
    procs = [sc.start("m1", args=args, env=env), sc.start("m1", args=args, env=env)]
    sc.start("m2", args=args, env=env)
    await sc.wait_joined(sc.procs)
    sc.traffic(count, rate=200).start()
    active = await sc.wait_active("m1")
    return active, next(p for p in procs if p is not active)


async def test_sigstop_pinned_active_in_key_mode(single: Scenario) -> None:
    """SIGSTOP m1's pinned active instance (key ordering, 64 in flight) inside a handler,
    past the pinned TTL, until the standby (pinned now) has committed work; then SIGCONT.

    Attacks issue 13 item 1: the suspended instance's ``double_ack`` must not be trusted
    after its pin moved (the server still confirms it), and it must start nothing more;
    the new pin holder must not run later messages of a key while an earlier one is still
    held by the suspended instance (it takes those back first, in stream order)."""
    sc = single
    active, standby, held = await _pinned_setup(sc, KEYED, 1400, 200.0)
    active.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    sc.note(f"SIGSTOP {active.instance} while it held #{held}")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    await sc.wait_progress(50, by=standby)
    sc.note(f"{standby.instance} pinned and committed 50 after "
            f"{time.monotonic() - stopped_at:.2f}s")
    active.signal(signal.SIGCONT)
    await sc.wait_for(lambda: active.count("stepped down") >= 1, 20,
                      "the resumed instance to step down")
    verdict = await sc.finish()
    verdict.assert_ok()
    held_rows = [r for r in sc.rows() if r.n == held]
    assert any(r.instance == active.instance and r.status in ("aborted", "prepared")
               for r in held_rows), "the resumed handler's ack must not count as committed"
    assert verdict.failover_gap is not None and verdict.failover_gap < 15


async def test_sigterm_pinned_active_under_backlog_in_key_mode(single: Scenario) -> None:
    """SIGTERM m1's pinned active instance while every key of m1 has messages queued
    behind a running one (key ordering, slow handlers).

    Attacks issue 13 item 2: the stopping instance must hand back what it holds but has
    not started, in stream order, before the pin moves; otherwise those messages wait
    out their ack wait (30 s) while the successor runs later messages of their keys."""
    sc = single
    active, standby = await _slow_handlers_under_backlog(sc, KEYED, 0.15, 1400)
    await sc.wait_progress(150, by=active)
    active.signal(signal.SIGTERM)
    sc.note(f"SIGTERM {active.instance} under backlog")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    await sc.wait_for(lambda: active.returncode is not None, 20, "the old instance to exit")
    assert active.returncode == 0, active.tail()
    handed = [e for e in active.events() if e.get("event") == "handed back messages not started"]
    sc.note(f"{active.instance} handed back {handed[0]['count'] if handed else 0} messages")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert verdict.aborted == 0 and not verdict.raw_overlaps
    assert verdict.stall < 5, "the successor gets the queued messages at once"
    assert handed and handed[0]["count"] > 0, "it held queued messages: they went back"


async def test_a_holder_stopped_with_a_full_window_is_replaced_before_the_ack_wait(
        single: Scenario) -> None:
    """SIGSTOP m1's pinned holder while it holds a full window (``--max-in-flight``
    messages delivered and unacknowledged: slow handlers under a backlog), then SIGCONT
    once the standby has committed work.

    The server pins only with a delivery. With ``max_ack_pending`` equal to the window,
    nobody could be pinned until the stopped holder's messages ran out their ack wait (30 s:
    CI on 039a510, test_stall_attacks pinned-sigstop-10s). The member consumer keeps one
    spare delivery (PIN_SPARE) that the holder never asks for (its pin renewals bring no
    message), so the standby is pinned with the next message, takes the rest back at its
    takeover's reset, and commits within a few pinned TTLs; nothing runs twice."""
    sc = single
    window = 8
    args = (*PINNED, "--ordering", "key", "--max-in-flight", str(window))
    # 8 slots at 0.2 s: 40 msg/s, under m1's share of 200.
    active, standby = await _slow_handlers_under_backlog(sc, args, 0.2, 1200)
    await sc.wait_progress(40, by=active)
    wq = work_queue_stream(sc.stream, sc.group)

    async def full() -> bool:
        info = await _js(sc).consumer_info(wq, "m1")
        return info is not None and int(info.get("num_ack_pending", 0)) >= window \
            and int(info.get("num_pending", 0)) > 0

    await sc.wait_for(full, 20, "m1's holder to hold a full window under a backlog")
    info = await _js(sc).consumer_info(wq, "m1")
    assert info is not None and info["config"]["max_ack_pending"] == window + PIN_SPARE
    active.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    sc.note(f"SIGSTOP {active.instance} holding {info['num_ack_pending']} of "
            f"{info['config']['max_ack_pending']}")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    await sc.wait_progress(20, by=standby)
    took = time.monotonic() - stopped_at
    sc.note(f"{standby.instance} pinned and committed 20 after {took:.2f}s")
    assert took < 15, "the standby waited for the stopped holder's ack wait"
    active.signal(signal.SIGCONT)
    await sc.wait_for(lambda: active.count("stepped down") >= 1, 20,
                      "the resumed instance to step down")
    verdict = await sc.finish()
    verdict.assert_ok()


async def test_stop_of_a_resumed_former_holder_leaves_the_successor_pinned(
        single: Scenario) -> None:
    """SIGSTOP the pinned instance past the pinned TTL; once the standby holds the pin and
    works, resume the old one and SIGTERM it at once.

    Attacks the smaller issue 13 item "_unpin on stop can hit a successor": the stopping
    instance must not unpin (it no longer holds the pin), so the successor keeps it."""
    sc = single
    active, standby, held = await _pinned_setup(sc, KEYED, 1000, 200.0)
    active.signal(signal.SIGSTOP)
    sc.note(f"SIGSTOP {active.instance} while it held #{held}")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    await sc.wait_progress(50, by=standby)
    active.signal(signal.SIGCONT)
    active.signal(signal.SIGTERM)
    sc.note(f"SIGCONT + SIGTERM {active.instance}")
    await sc.wait_for(lambda: active.returncode is not None, 20, "the old instance to exit")
    verdict = await sc.finish()
    verdict.assert_ok()
    lost = [e for e in standby.events() if e.get("event") == "stepped down"
            and e.get("reason") != "stopping"]
    assert not lost, lost
    assert standby.count("became active") == 1, standby.tail()


def _js(sc: Scenario) -> JetStream:
    assert sc.js is not None
    return sc.js


async def test_pinned_membership_changes_commit_nothing_twice(single: Scenario) -> None:
    """Pinned mode, key ordering, two instances per member, exactly-once recorder: add m3,
    drop m1, add m1 back while 200 msg/s flow.

    Attacks issue 13 item 3: on a config change every instance deleted the shared member
    consumer and the next one recreated it under the same name, so acks of the old
    incarnation were confirmed by the new one (committed twice). Partitions now move in
    place on the member consumer; nothing may be committed twice, lost or reordered."""
    sc = single
    await sc.make_group(partitions=6, members=("m1", "m2"))
    for member in ("m1", "m1", "m2", "m2", "m3"):
        sc.start(member, args=KEYED)
    await sc.wait_joined(sc.procs)
    pub = sc.traffic(2000, rate=200, keys=48)
    pub.start()
    await sc.wait_progress(200)
    await admin.add_members(_js(sc), sc.stream, sc.group, ["m3"])
    sc.note("added m3")
    await sc.wait_active("m3")
    await sc.wait_progress(len(sc.finished()) + 200)
    await admin.drop_members(_js(sc), sc.stream, sc.group, ["m1"])
    sc.note("dropped m1")
    await sc.wait_progress(len(sc.finished()) + 200)
    await admin.add_members(_js(sc), sc.stream, sc.group, ["m1"])
    sc.note("added m1 back")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert not verdict.committed_twice
    assert {r.member for r in sc.rows() if r.status == "committed"} == {"m1", "m2", "m3"}


async def test_static_membership_change_resumes_where_members_left_off(
        single: Scenario) -> None:
    """A static group (limits stream: messages stay after they are acked), members m1 (two
    instances) and m2; after 1,000 consumed messages m3 is added (every member gains or
    loses partitions), later m2 is dropped, while 200 msg/s flow.

    Attacks issue 13 item 4: a membership change deleted the durable and recreated it
    with deliver policy all, so every retained message of the moved partitions was
    processed again. Each partition must resume where its previous owner left off:
    nothing processed twice, nothing lost, per-key order kept."""
    sc = single
    await sc.make_static_group(partitions=4, members=("m1", "m2"))
    for member in ("m1", "m1", "m2", "m3"):
        sc.start(member)
    await sc.wait_joined(sc.procs)
    pub = sc.traffic(2400, rate=200)
    pub.start()
    await sc.wait_progress(1000)
    await admin.add_members(_js(sc), sc.stream, sc.group, ["m3"])
    sc.note(f"added m3 after {len(sc.finished())} messages")
    await sc.wait_active("m3")
    await sc.wait_progress(len(sc.finished()) + 300)
    await admin.drop_members(_js(sc), sc.stream, sc.group, ["m2"])
    sc.note("dropped m2")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert verdict.duplicates == 0, "a partition resumes where its previous owner left off"
    assert not verdict.committed_twice
    assert {r.member for r in sc.rows() if r.status == "committed"} == {"m1", "m2", "m3"}
