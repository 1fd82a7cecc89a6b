"""The pinned holder's in-place move resets the member consumer at a quiet point (issue
13, the reorder seen once in ``test_member_toggled_50_times_at_2000_per_second[pinned]``).
These attack a move whose reset does not go through, on the in-memory adapter with
priority groups (tests/support/fakes_pinned.py): whatever the holder held and had not
started must still run, before anything later of its key. A message dropped from the
dispatcher while the consumer goes on delivering comes back only after its ack wait (30 s)
or at the next reset, behind later messages of its key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cgroupd.core.config import (
    ELASTIC_BUCKET,
    ElasticGroupConfig,
    PartitioningFilter,
    group_key,
)
from cgroupd.core.errors import ServerUnreachable
from cgroupd.core.naming import RESET_KEY
from cgroupd.core.partitions import HOLD_TOKEN, member_consumer_filters
from cgroupd.member import Member
from tests.support.fakes import FakeConsumer
from tests.support.fakes_pinned import PinState
from tests.support.polling import eventually, within
from tests.unit.test_election_pinned_reset_unit import NO_ANSWER, NO_RESPONDERS, RESET_SETTINGS
from tests.unit.test_election_pinned_unit import MEMBER, WQ, Group

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group(RESET_SETTINGS)
    yield g
    for m in g.members:
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


def _state(group: Group) -> PinState:
    state = group.server.state(WQ, MEMBER)
    assert state is not None
    return state


def _number(m: Member) -> int | None:
    """The number of ``m``'s current generation (None: it has none)."""
    info = m.generation
    return info.number if info is not None else None


def _paused(m: Member, number: int) -> bool:
    """Generation ``number`` of ``m`` is current and starts nothing."""
    info = m.generation
    return info is not None and info.number == number and info.paused


def _ended(m: Member) -> bool:
    info = m.generation
    return info is not None and info.ended


async def _holding_three(group: Group) -> Member:
    """a is pinned and ran #1; it runs #2 (held open by the test) and holds #3, #4."""
    a = await group.start()
    await group.offer(1)
    await eventually(lambda: a.active and group.by(a) == [1], 5, what="a pinned, ran #1")
    group.gates[2] = asyncio.Event()
    await group.offer(3)
    await eventually(lambda: a.generation is not None and a.generation.holding == 3, 5,
                     what="a holding #2, #3, #4")
    return a


async def _retargeted(group: Group, a: Member) -> None:
    """What a standby does when it finds the member consumer with other filters while
    nobody is pinned (``_retarget_unpinned``): it marks it for a reset at a quiet point.
    The holder sees the mark at its next renewal and moves in place (``move_pinned``)."""
    info = await a.js.consumer_info(WQ, MEMBER)
    assert info is not None
    real, held = member_consumer_filters(info["config"].get("filter_subjects") or [])
    assert real and not held, "the member consumer delivers a's partitions, holds none"
    config = dict(info["config"])
    config["metadata"] = {**(config.get("metadata") or {}), RESET_KEY: "1"}
    await a.js.create_consumer(WQ, MEMBER, config, action="update")


@pytest.mark.parametrize("failure", [NO_ANSWER, NO_RESPONDERS], ids=["no-answer", "no-responders"])
async def test_a_move_whose_reset_fails_once_drops_nothing_it_held(
        group: Group, failure: Exception) -> None:
    """The move's reset fails once and is not applied (no answer; no responders while a
    server restarts). On main 4038153 the holder had already dropped #3 and #4 (held, not
    started), then resumed pulling: the consumer, never reset, went on past them, so #5
    ran while #3 and #4 waited for their ack wait. Now nothing is dropped before a reset
    went through, and the failed reset is retried while nothing starts: #1..#5 run once
    each, in stream order, on a, which stays active."""
    a = await _holding_three(group)
    group.server.reset_failures.append((failure, False))
    await _retargeted(group, a)
    gen = a.generation
    assert gen is not None
    await eventually(lambda: _paused(a, gen.number), 5, what="a pausing for the reset")
    group.gates[2].set()
    await eventually(lambda: _state(group).failed_resets == 1, 5, what="the failed reset")
    await group.offer(1)
    await eventually(lambda: len(group.by(a)) >= 5, 5,
                     what=f"a to run #3, #4 and #5 (ran {group.by(a)})")
    await asyncio.sleep(0.3)  # a duplicate would run by now
    assert group.by(a) == [1, 2, 3, 4, 5]
    assert a.active and _number(a) == gen.number, "a passing reset failure costs no step-down"
    state = _state(group)
    assert state.resets == 1 and not state.pending and not state.ready


async def test_a_move_whose_reset_never_goes_through_steps_down_without_starting(
        group: Group) -> None:
    """The reset keeps failing past the drain timeout: the holder ends its generation
    (paused: nothing starts with the filters changed and the consumer not reset), and
    whoever is pinned next takes everything back in stream order: #1..#5 once each."""
    a = await _holding_three(group)
    group.server.reset_failures.extend([(NO_ANSWER, False)] * 4)
    await _retargeted(group, a)
    gen = a.generation
    assert gen is not None
    await eventually(lambda: _paused(a, gen.number), 5, what="a pausing for the reset")
    group.gates[2].set()
    await eventually(lambda: _number(a) != gen.number or _ended(a), 10,
                     what="a to give up on the reset")
    assert group.by(a) == [1, 2], "nothing starts while the consumer is not reset"
    await group.offer(1)
    await eventually(lambda: len(group.ran) >= 5, 15,
                     what=f"#3, #4, #5 to run (ran {group.ran})")
    await asyncio.sleep(0.3)
    assert [seq for _, seq in group.ran] == [1, 2, 3, 4, 5]


async def test_a_move_refused_by_another_members_claim_drops_nothing_it_held(
        group: Group) -> None:
    """The move's filter update is refused (10100: another member's consumer still holds
    one of the partitions, as happens when moves overtake each other every 0.2 s). This is
    what the toggle test hit on main 4038153: the holder had already dropped #3 and #4
    (held, not started) and resumed, and the consumer, never reset, went on with #5;
    #3 and #4 came back only with the next reset or their ack wait, after #5. Now the
    refusal leaves everything held where it was: #3, #4, #5 run in order, and the retry
    (once the other claim is gone) resets the consumer without running anything twice."""
    a = await _holding_three(group)
    await _retargeted(group, a)
    gen = a.generation
    assert gen is not None
    await eventually(lambda: _paused(a, gen.number), 5, what="a pausing for the reset")
    info = await a.js.consumer_info(WQ, MEMBER)
    assert info is not None
    taken = info["config"]["filter_subjects"][-1]
    # Another member's claim on one of a's partitions, as the server would have let it
    # in while a had let that partition go half-way.
    group.server.consumers[(WQ, "m2")] = FakeConsumer(WQ, "m2", {"filter_subjects": [taken]},
                                                      waiting=1)
    group.gates[2].set()
    await group.offer(1)
    await eventually(lambda: 5 in group.by(a), 5, what=f"#5 to run (ran {group.by(a)})")
    del group.server.consumers[(WQ, "m2")]
    await eventually(lambda: len(group.by(a)) >= 5 and _state(group).resets >= 1, 5,
                     what=f"a to run #3, #4 and reset (ran {group.by(a)})")
    await asyncio.sleep(0.3)  # a duplicate would run by now
    assert group.by(a) == [1, 2, 3, 4, 5]
    state = _state(group)
    assert not state.pending and not state.ready, "everything acknowledged"


async def test_a_move_whose_update_goes_unanswered_resets_anyway(group: Group) -> None:
    """The move's filter update is applied but its answer is lost (no answer in time): the
    consumer may deliver other partitions now, from where it stands. The holder resets it
    anyway (paused) and starts over from the consumer as it is: #3 and #4, held when the
    update went out, run after the reset, before #5, once each."""
    a = await _holding_three(group)
    await _retargeted(group, a)
    gen = a.generation
    assert gen is not None
    await eventually(lambda: _paused(a, gen.number), 5, what="a pausing for the reset")
    update = a.js.create_consumer
    lost_answers = [ServerUnreachable("updating consumer m1: the server did not answer in "
                                      "time")]

    async def answer_lost(stream: str, name: str, config: dict[str, Any],
                          action: str = "create") -> dict[str, Any]:
        info = await update(stream, name, config, action)
        if action == "update" and lost_answers:
            raise lost_answers.pop()
        return info

    a.js.create_consumer = answer_lost  # type: ignore[method-assign]
    group.gates[2].set()
    await eventually(lambda: not lost_answers and _state(group).resets >= 1, 5,
                     what="the unanswered update, then the reset")
    await group.offer(1)
    await eventually(lambda: len(group.by(a)) >= 5, 5,
                     what=f"a to run #3, #4 and #5 (ran {group.by(a)})")
    await asyncio.sleep(0.3)  # a duplicate would run by now
    assert group.by(a) == [1, 2, 3, 4, 5]
    assert a.active and _number(a) == gen.number


def _set_members(group: Group, *members: str) -> None:
    config = ElasticGroupConfig(
        max_members=4, partitioning_filters=(PartitioningFilter("orders.*", (1,)),),
        members=members)
    group.server.records[(ELASTIC_BUCKET, group_key("ORDERS", "g"))] = config.to_json()
    group.server.changed.set()


async def _filters(a: Member) -> tuple[set[int], set[int]]:
    info = await a.js.consumer_info(WQ, MEMBER)
    assert info is not None
    return member_consumer_filters(info["config"].get("filter_subjects") or [])


async def test_a_move_superseded_half_way_does_not_stay_half_way(group: Group) -> None:
    """m1 (partitions 0, 1 of 4; m2 has no instance) gains 2 and 3 when m2 is dropped: it
    claims them (hold filters), then waits for a quiet point, which does not come (#2 runs
    past the drain timeout) while m2 is added back: the move fails, superseded by a target
    equal to what m1 had before. On main 4038153 the loop then saw nothing to do and the
    member consumer kept its hold on 2 and 3 for good (no m2 instance could ever claim
    them: the toggle test's m1 waited for a partition m2 held that way, then stepped
    down). Now the next attempt starts from the consumer as it is and lets them go."""
    _set_members(group, "m1", "m2")
    a = await group.start()
    await group.offer(1)
    await eventually(lambda: a.active and group.by(a) == [1], 5, what="a pinned, ran #1")
    assert await _filters(a) == ({0, 1}, set())
    group.gates[2] = asyncio.Event()
    await group.offer(1)
    await eventually(lambda: group.by(a) == [1, 2], 5, what="a running #2")
    _set_members(group, "m1")

    async def claimed() -> bool:
        return await _filters(a) == ({0, 1}, {2, 3})

    await eventually(claimed, 5, what="a to claim 2 and 3")
    _set_members(group, "m1", "m2")
    await asyncio.sleep(RESET_SETTINGS.drain_timeout + 0.3)  # no quiet point in time
    group.gates[2].set()

    async def released() -> bool:
        return await _filters(a) == ({0, 1}, set())

    await eventually(released, 5, what="a to let 2 and 3 go")
    assert a.active and a.partitions == (0, 1)
    await group.offer(2)
    await eventually(lambda: len(group.by(a)) >= 4, 5, what=f"#3, #4 (ran {group.by(a)})")
    await asyncio.sleep(0.3)
    assert group.by(a) == [1, 2, 3, 4]


async def test_a_claim_that_raced_another_members_claim_is_let_go(group: Group) -> None:
    """m1 (partitions 0, 1 of 4) gains 2 and 3; at the same moment another member's
    consumer claims 2 too, and the server accepts both claims (it does, for updates made
    at the same moment: tests/integration/test_workqueue_claim_race.py). m1 sees the
    other claim, lets its own go, waits while the other holds 2, and takes 2 and 3 once
    it is gone. On main 4038153 m1 went on to deliver 2 beside the other claim (in the
    toggle test both members then had their moves refused, then stalled)."""
    _set_members(group, "m1", "m2")
    a = await group.start()
    await group.offer(1)
    await eventually(lambda: a.active and group.by(a) == [1], 5, what="a pinned, ran #1")
    update = a.js.create_consumer
    rival = FakeConsumer(WQ, "m2", {"filter_subjects": [f"2.orders.{HOLD_TOKEN}"]},
                         waiting=1)  # m2's instance pulls on it
    raced: list[bool] = []

    async def racing(stream: str, name: str, config: dict[str, Any],
                     action: str = "create") -> dict[str, Any]:
        info = await update(stream, name, config, action)
        _, held = member_consumer_filters(config.get("filter_subjects") or [])
        if name == MEMBER and 2 in held and not raced:
            group.server.consumers[(WQ, "m2")] = rival  # accepted at the same moment
            raced.append(True)
        return info

    a.js.create_consumer = racing  # type: ignore[method-assign]
    _set_members(group, "m1")
    await eventually(lambda: raced, 5, what="the two claims")
    for _ in range(30):  # 0.3 s
        real, held = await _filters(a)
        assert 2 not in real, "m1 delivers 2 while another consumer holds it"
        await asyncio.sleep(0.01)
    assert 2 not in held, "m1 lets its contested claim go"
    del group.server.consumers[(WQ, "m2")]

    async def took() -> bool:
        return await _filters(a) == ({0, 1, 2, 3}, set())

    await eventually(took, 5, what="m1 to take 2 and 3 once the other claim is gone")
    assert a.active and a.partitions == (0, 1, 2, 3)
