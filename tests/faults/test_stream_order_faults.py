"""``--ordering stream`` (the whole member in stream order, one handler at a time) with
prefetch: up to 256 messages held while one runs. Attacked under a backlog: SIGTERM of
the active instance (its held, unstarted messages are left to the successor), then kill -9
of the next one (everything it held comes back after its consumer is reclaimed).

Setup: one member m1 (2 partitions) with an active instance and a standby, ``cgroupd
join`` processes with the exactly-once recording handler, traffic published faster than
one handler at a time processes it, so hundreds are held when each fault hits. Checked:
nothing lost, nothing committed twice, per-key order of every completion (the fault
suite's checks, :func:`tests.groups.check`), and the promise of the mode itself: within
one instance every handler starts after the previous one ended, in stream order.
"""

from __future__ import annotations

import itertools
import signal

import pytest

from tests.faults.checks import Row
from tests.faults.scenario import Scenario

pytestmark = [pytest.mark.faults, pytest.mark.slow]

COUNT = 4000
#: Faster than one handler at a time with a double_ack (a server round trip) each: a
#: backlog builds and the instance holds up to its max in flight.
RATE = 4000.0
ARGS = ("--ordering", "stream")


def stream_order_violations(rows: list[Row]) -> list[str]:
    """Per instance: a handler started before the previous one ended, or a message
    started before a lower stream sequence it had not finished (a retry of the same
    message is fine)."""
    problems = []
    for instance in {r.instance for r in rows}:
        runs = sorted((r for r in rows if r.instance == instance), key=lambda r: r.t_start)
        for before, after in itertools.pairwise(runs):
            if after.seq < before.seq:
                problems.append(f"{instance}: #{after.seq} started after #{before.seq}")
            overlapping = before.t_end is None or after.t_start < before.t_end
            if overlapping and (before.t_end is not None or after.seq != before.seq):
                problems.append(f"{instance}: #{after.seq} started while #{before.seq} ran")
    return problems


async def test_sigterm_then_kill_9_under_backlog_in_stream_order(single: Scenario) -> None:
    sc = single
    await sc.make_group(partitions=2, members=("m1",))
    first = sc.start("m1", args=ARGS)
    await sc.wait_active("m1")
    second = sc.start("m1", args=ARGS)
    await sc.wait_joined([second])
    pub = sc.traffic(COUNT, rate=RATE)
    pub.start()
    await sc.wait_progress(300, by=first)
    first.signal(signal.SIGTERM)
    sc.note(f"SIGTERM {first.instance} under backlog")
    assert await sc.wait_active("m1", exclude=[first]) is second
    await sc.wait_for(lambda: first.returncode is not None, 20, "the old instance to exit")
    assert first.returncode == 0, first.tail()
    third = sc.start("m1", args=ARGS)
    await sc.wait_joined([third])
    await sc.wait_progress(300, by=second)
    backlog = COUNT - len(sc.finished())
    assert backlog > 500, "no backlog left to attack: publish faster"
    second.kill()
    sc.note(f"SIGKILL {second.instance} under backlog ({backlog} messages unfinished)")
    assert await sc.wait_active("m1", exclude=[first, second]) is third
    verdict = await sc.finish()
    verdict.assert_ok()
    rows = sc.rows()
    assert {r.instance for r in rows} == {first.instance, second.instance, third.instance}
    # Killed inside a handler, the second instance's last run has no end: the check
    # skips a run without an end only as the last of its instance.
    assert stream_order_violations(rows) == []
