"""Stepping down while a handler runs, and a second reason to step down arriving while
the active instance is still draining.

The active instance of m1 runs a handler held for a few seconds (a slow handler) when a
first event makes it step down and drain: m1 is dropped from the group (a config change),
it gets SIGTERM, or an operator asks for a step-down. While that drain still waits for the
slow handler, a second event may arrive: SIGTERM, the group's deletion, or an operator's
step-down. What must hold: the drain is not started
twice, not cut short and not abandoned (the slow handler finishes and its outcome is
settled), the process exits 0 soon after the handler ends, nothing is started after the
instance began stepping down, and (while the group exists) nothing is lost, committed
twice or reordered.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from cgroupd import admin
from cgroupd.nats.jetstream import JetStream
from tests.faults.checks import FaultVerdict
from tests.faults.runner import JoinProc
from tests.faults.scenario import Scenario

pytestmark = [pytest.mark.faults, pytest.mark.slow]

HOLD = 3.0
#: The slow handler ends HOLD after it began; the process exits within this after that.
EXIT_AFTER = 2.0
KEYED = ("--ordering", "key", "--max-in-flight", "16")


def _js(sc: Scenario) -> JetStream:
    assert sc.js is not None
    return sc.js


def _crashed(proc: JoinProc) -> list[str]:
    return [str(e.get("event")) for e in proc.events()
            if e.get("event") in ("member runtime failed", "background task failed")
            or e.get("level") == "critical"]


async def _held_by_active(sc: Scenario, args: tuple[str, ...], count: int
                          ) -> tuple[JoinProc, JoinProc, int]:
    """m1 (active + standby) and m2 on 4 partitions; traffic with one message of m1 held
    HOLD seconds by the first handler that gets it. Returns (active, standby, held n)."""
    await sc.make_group(partitions=4, members=("m1", "m2"))
    procs = [sc.start("m1", args=args), sc.start("m1", args=args)]
    sc.start("m2", args=args)
    await sc.wait_joined(sc.procs)
    pub = sc.traffic(count, rate=200)
    held = pub.first_of_key(sc.keys_of([0, 1])[0], after=200)
    pub.holds[held] = HOLD
    pub.start()
    row = await sc.wait_started(held)
    active = next(p for p in procs if p.instance == row.instance)
    return active, next(p for p in procs if p is not active), held


@pytest.mark.parametrize("mode", ["sync", "pinned"])
async def test_sigterm_while_a_config_change_drains(single: Scenario, mode: str) -> None:
    """m1 is dropped while its active instance runs a slow handler (the config change
    starts a drain); SIGTERM arrives during that drain. The drain carries on to its end:
    the slow handler's work is committed once, the process exits 0 right after, and
    m2, which gains m1's partitions, runs the held key's later messages after it."""
    sc = single
    sc.name = f"sigterm_during_config_change_drain_{mode}"
    args = KEYED + (("--exclusivity", "pinned") if mode == "pinned" else ())
    active, standby, held = await _held_by_active(sc, args, 900)
    began = (await sc.wait_started(held)).t_start
    await admin.drop_members(_js(sc), sc.stream, sc.group, ["m1"])
    # Sync: a full step-down (drain, release). Pinned: an in-place move to no partitions
    # (the member consumer is shared), which first settles what the lost partitions hold;
    # it logs nothing when it begins, so the SIGTERM follows the change by a fixed delay
    # (the fault's timing; asserted below to fall inside the slow handler).
    if mode == "sync":
        await sc.wait_for(lambda: any(e.get("new") == "stepping-down"
                                      for e in active.events()), 10,
                          "the active instance to begin stepping down")
    else:
        await asyncio.sleep(0.3)
    active.signal(signal.SIGTERM)
    termed = time.time()
    sc.note(f"dropped m1, then SIGTERM {active.instance} during its drain "
            f"({time.time() - began:.2f}s into the {HOLD:g}s handler)")
    await _exits_soon_after_the_slow_handler(sc, active, began)
    verdict = await sc.finish()
    verdict.assert_ok()
    assert not verdict.committed_twice and verdict.aborted == 0
    rows = [r for r in sc.rows() if r.n == held]
    assert [(r.instance, r.status) for r in rows] == [(active.instance, "committed")], rows
    assert rows[0].t_end is not None and rows[0].t_end > termed, "SIGTERM came too late"
    assert not _crashed(active) and not _crashed(standby)


async def test_group_deleted_while_a_sigterm_drains(single: Scenario) -> None:
    """SIGTERM the active instance of m1 while it runs a slow handler; delete the group
    during the drain. The slow handler still finishes (its row is settled, not left
    'started'), the draining instance and every other one exit 0, none crashes."""
    sc = single
    sc.name = "group_deleted_during_sigterm_drain"
    active, _standby, held = await _held_by_active(sc, KEYED, 600)
    began = (await sc.wait_started(held)).t_start
    active.signal(signal.SIGTERM)
    await sc.wait_for(lambda: any(e.get("new") == "stepping-down" for e in active.events()),
                      10, "the active instance to begin stepping down")
    assert sc.publisher is not None
    await sc.publisher.stop()
    await admin.delete_group(_js(sc), sc.stream, sc.group)
    sc.note(f"SIGTERM {active.instance}, then group deleted "
            f"{time.time() - began:.2f}s into the {HOLD:g}s handler")
    await sc.wait_for(lambda: not any(p.alive for p in sc.procs), HOLD + 15,
                      "every instance to exit")
    exited = time.time() - began
    assert exited <= HOLD + EXIT_AFTER, f"exit took {exited:.2f}s"
    assert [(p.instance, p.returncode) for p in sc.procs] == [
        (p.instance, 0) for p in sc.procs], sc.diagnostics()
    rows = [r for r in sc.rows() if r.n == held]
    assert rows and rows[0].instance == active.instance
    assert rows[0].status in ("committed", "aborted", "prepared"), rows
    assert not any(_crashed(p) for p in sc.procs), sc.diagnostics()
    late = [r for r in sc.rows() if r.instance == active.instance and r.t_start > began
            and r.subject == rows[0].subject]
    assert not late, f"started after the drain began: {late[:3]}"


@pytest.mark.parametrize("mode", ["sync", "pinned"])
async def test_admin_step_down_while_a_sigterm_drains(single: Scenario, mode: str) -> None:
    """SIGTERM m1's active instance while it runs a slow handler; during that drain an
    operator asks for a step-down (``cgroupd step-down``). The draining owner is not
    robbed: in sync mode its data consumer stays until it released; in pinned mode it
    answers the request as already stepping down, so the pin is not cleared under it
    (an unpin would move the pin at once: its result refused, the message run again
    beside it). The slow handler's work is committed once, by it; nothing of the member
    runs beside it; it exits 0 soon after; the standby takes over."""
    sc = single
    sc.name = f"admin_step_down_during_sigterm_drain_{mode}"
    args = KEYED + (("--exclusivity", "pinned") if mode == "pinned" else ())
    active, standby, held = await _held_by_active(sc, args, 900)
    began = (await sc.wait_started(held)).t_start
    active.signal(signal.SIGTERM)
    await sc.wait_for(lambda: any(e.get("new") == "stepping-down" for e in active.events()),
                      10, "the active instance to begin stepping down")
    assert await admin.step_down(_js(sc), sc.stream, sc.group, "m1")
    stepped = time.time()
    sc.note(f"SIGTERM {active.instance}, then admin step-down "
            f"{stepped - began:.2f}s into the {HOLD:g}s handler")
    await _exits_soon_after_the_slow_handler(sc, active, began)
    _assert_the_slow_handler_counted(sc, await sc.finish(), active, standby, held, stepped)


@pytest.mark.parametrize("mode", ["sync", "pinned"])
async def test_admin_step_down_lets_a_running_handler_finish(single: Scenario,
                                                             mode: str) -> None:
    """``cgroupd step-down`` while m1's active instance runs a slow handler: it finishes
    that handler (sync: the claim is gone but its data consumer stays until released;
    pinned: the holder was asked, not unpinned, and keeps the pin while it drains),
    then the standby takes over at once and runs the key's later messages after it
    (nothing started by the old instance once replaced: ``late_starts``). The old
    instance stays up, as a standby."""
    sc = single
    sc.name = f"admin_step_down_of_a_busy_active_{mode}"
    args = KEYED + (("--exclusivity", "pinned") if mode == "pinned" else ())
    active, standby, held = await _held_by_active(sc, args, 900)
    began = (await sc.wait_started(held)).t_start
    assert await admin.step_down(_js(sc), sc.stream, sc.group, "m1")
    stepped = time.time()
    sc.note(f"admin step-down of {active.instance} {stepped - began:.2f}s into the "
            f"{HOLD:g}s handler")
    await sc.wait_for(lambda: any(r.instance == standby.instance for r in sc.rows()),
                      HOLD + 15, "the standby to take over")
    first = min(r.t_start for r in sc.rows() if r.instance == standby.instance)
    sc.note(f"the standby's first start {first - began:.2f}s after the slow handler began")
    # Right after the slow handler: a newly pinned standby pulls again with its pin id
    # (its earlier requests carry none) and gets what the old holder handed back; it
    # used to wait a pinned TTL (2 s) for a consumer reset.
    assert first - began <= HOLD + 1.5, f"taken over {first - began:.2f}s after"
    assert active.alive, active.tail()
    verdict = await sc.finish()
    _assert_the_slow_handler_counted(sc, verdict, active, standby, held, stepped)


async def _exits_soon_after_the_slow_handler(sc: Scenario, proc: JoinProc,
                                             began: float) -> None:
    """``proc`` drains the slow handler that began at ``began``, then exits 0 at once."""
    await sc.wait_for(lambda: proc.returncode is not None, HOLD + 15,
                      "the draining instance to exit")
    exited = time.time() - began
    sc.note(f"{proc.instance} exited {exited:.2f}s after the slow handler began")
    assert proc.returncode == 0, proc.tail()
    assert exited <= HOLD + EXIT_AFTER, f"exit took {exited:.2f}s"


def _assert_the_slow_handler_counted(sc: Scenario, verdict: FaultVerdict, active: JoinProc,
                                     standby: JoinProc, held: int, stepped: float) -> None:
    verdict.assert_ok()
    assert not verdict.committed_twice and verdict.aborted == 0, verdict.table()
    assert not verdict.raw_overlaps, verdict.table()
    rows = [r for r in sc.rows() if r.n == held]
    assert [(r.instance, r.status) for r in rows] == [(active.instance, "committed")], rows
    assert rows[0].t_end is not None and rows[0].t_end > stepped, \
        "the step-down came after the slow handler ended"
    assert any(r.instance == standby.instance for r in sc.rows()), "no takeover"
    assert not _crashed(active) and not _crashed(standby)
