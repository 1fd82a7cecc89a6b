"""The active instance of a member dies, freezes, or is asked to leave, under traffic.

Setup of each: group of 4 partitions, members m1 (partitions 0, 1; an active instance and
a standby) and m2 (partitions 2, 3; one instance), ``cgroupd join`` processes with the
exactly-once recording handler, 200 msg/s over 32 keys. One message of m1 is *held* (its
first handler sleeps), so the fault provably hits m1's active instance inside a handler.

Overlaps are judged on committed work: an instance frozen inside a handler and resumed
finishes that handler while its successor runs, which is concurrency by definition; the
promise is that such work never commits (its ``double_ack`` fails and it rolls back). The
raw processing overlaps are reported next to it.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime

import pytest

from cgroupd.core.settings import MemberSettings
from tests.faults.runner import JoinProc
from tests.faults.scenario import Scenario

pytestmark = [pytest.mark.faults, pytest.mark.slow]

COUNT = 1400
RATE = 200.0
#: The join processes keep MemberSettings at its defaults: a standby replaces an active
#: instance it has not heard from for this long.
TAKEOVER = MemberSettings().lease + MemberSettings().takeover_margin


async def _setup(sc: Scenario, args: tuple[str, ...] = ()) -> tuple[JoinProc, JoinProc, int]:
    """m1 active + standby, m2; traffic running; returns (active, standby, held n)."""
    await sc.make_group(partitions=4, members=("m1", "m2"))
    first = sc.start("m1", args=args)
    sc.start("m2", args=args)
    await sc.wait_active("m1")
    standby = sc.start("m1", args=args)
    await sc.wait_joined([standby])
    await sc.wait_active("m2")
    pub = sc.traffic(COUNT, rate=RATE)
    held = pub.first_of_key(sc.keys_of([0, 1])[0], after=COUNT // 4)
    pub.holds[held] = 3.0
    pub.start()
    return first, standby, held


async def test_kill_9_active(single: Scenario) -> None:
    """SIGKILL m1's active instance inside a handler: the standby takes over (reclaiming
    the dead instance's data consumer), nothing is lost or committed twice, order holds."""
    sc = single
    active, standby, held = await _setup(sc)
    row = await sc.wait_started(held)
    assert row.instance == active.instance
    active.kill()
    sc.note(f"SIGKILL {active.instance} while it held #{held}")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    sc.note(f"{standby.instance} active")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert [(m, new) for m, _, new, _ in verdict.handovers] == [("m1", standby.instance)]
    assert verdict.failover_gap is not None and verdict.failover_gap < 10


async def test_kill_9_of_an_owner_a_moment_after_its_own_takeover(single: Scenario) -> None:
    """Issue 29: SIGKILL m1's active instance, then its successor under a second after that
    one took over (its claim younger than a lease, its data consumer made): the third
    instance takes over as from an owner active for long. Before, a claim that young was
    trusted dead only once it was a lease old (kill -9 p50 1.3 s in the failover bench)."""
    sc = single
    await sc.make_group(partitions=4, members=("m1", "m2"))
    first = sc.start("m1")
    sc.start("m2")
    await sc.wait_active("m1")
    others = [sc.start("m1"), sc.start("m1")]
    await sc.wait_joined(others)
    await sc.wait_active("m2")
    pub = sc.traffic(COUNT, rate=RATE)
    pub.start()
    await sc.wait_progress(100)
    first.kill()
    second = await sc.wait_active("m1", exclude=[first])
    await sc.wait_progress(20, by=second)  # its data consumer delivers
    third = next(p for p in others if p is not second)
    second.kill()
    killed_at, killed_wall = time.monotonic(), time.time()
    assert await sc.wait_active("m1", exclude=[first, second]) is third
    became = next(e for e in second.events() if e.get("event") == "became active")
    took = time.monotonic() - killed_at
    age = killed_wall - datetime.fromisoformat(became["timestamp"]).timestamp()
    sc.note(f"SIGKILL {second.instance} {age:.2f}s after it became active; "
            f"{third.instance} active {took:.2f}s later")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert age < MemberSettings().lease / 2, "not a young claim: the test proves nothing"
    assert took < MemberSettings().lease - age - 0.3, "waited for the claim to be a lease old"


async def test_kill_9_active_with_keys_in_flight(single: Scenario) -> None:
    """Key ordering, 32 messages in flight, SIGKILL of m1's active instance: whatever it
    had not acknowledged goes to the standby in stream order, so per-key order of
    committed work still holds and nothing is lost or committed twice."""
    sc = single
    active, standby, held = await _setup(sc, ("--ordering", "key", "--max-in-flight", "32"))
    row = await sc.wait_started(held)
    assert row.instance == active.instance
    active.kill()
    sc.note(f"SIGKILL {active.instance} while it held #{held} (key ordering)")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    verdict = await sc.finish()
    verdict.assert_ok()
    assert [(m, new) for m, _, new, _ in verdict.handovers] == [("m1", standby.instance)]


async def test_sigstop_past_the_takeover_time_then_sigcont(single: Scenario) -> None:
    """SIGSTOP m1's active instance inside a handler until the standby has taken over and
    committed work, then SIGCONT: the resumed handler's double_ack fails and rolls back,
    the old instance steps down, and no committed work overlaps or repeats."""
    sc = single
    active, standby, held = await _setup(sc)
    row = await sc.wait_started(held)
    assert row.instance == active.instance
    active.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    sc.note(f"SIGSTOP {active.instance} while it held #{held}")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    await sc.wait_progress(50, by=standby)
    active.signal(signal.SIGCONT)
    suspended = time.monotonic() - stopped_at
    sc.note(f"SIGCONT {active.instance} after {suspended:.2f}s, once {standby.instance} "
            "had committed 50")
    assert suspended > TAKEOVER
    await sc.wait_for(lambda: active.count("stepped down") >= 1, 20,
                      "the resumed instance to step down")
    verdict = await sc.finish()
    verdict.assert_ok()
    assert verdict.aborted >= 1, "the resumed handler's double_ack must fail"
    assert verdict.raw_overlaps, "the resumed handler ran alongside its successor"
    assert verdict.failover_gap is not None and verdict.failover_gap < 15


async def test_sigterm_active_hands_over_gracefully(single: Scenario) -> None:
    """SIGTERM m1's active instance inside a handler: it finishes and commits that
    message, releases its consumers and exits 0; the standby carries on at once with
    nothing rolled back or processed twice."""
    sc = single
    active, standby, held = await _setup(sc)
    row = await sc.wait_started(held)
    assert row.instance == active.instance
    active.signal(signal.SIGTERM)
    sc.note(f"SIGTERM {active.instance} while it held #{held}")
    assert await sc.wait_active("m1", exclude=[active]) is standby
    await sc.wait_for(lambda: active.returncode is not None, 20, "the old instance to exit")
    assert active.returncode == 0, active.tail()
    verdict = await sc.finish()
    verdict.assert_ok()
    assert verdict.aborted == 0 and verdict.duplicates == 0 and not verdict.raw_overlaps
    held_by = {r.instance for r in sc.rows() if r.n == held and r.status == "committed"}
    assert held_by == {active.instance}, "the in-flight message is finished, not handed over"
    assert verdict.failover_gap is not None and verdict.failover_gap < 3 + 3.0
