"""A newly pinned instance takes back what a dead holder left by resetting the member
consumer to its ack floor. These attack that reset when it fails, on the in-memory adapter
with priority groups (tests/support/fakes_pinned.py): a passing failure ("no responders" while a
server restarts, no answer while the consumer elects a leader; applied or not) is retried
with a bounded backoff, and only a definite refusal (nats-server < 2.14 has no reset API)
makes the holder wait for the previous holder's ack wait instead. Whatever happens, the new
holder starts nothing out of order and nothing twice. What real servers answer to a reset
they cannot serve: tests/integration/test_consumer_reset_answers.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from cgroupd.core.errors import ApiError, JetStreamNotEnabled, ServerUnreachable
from cgroupd.member import Member
from tests.support.fakes_pinned import PinnedJetStream, PinState
from tests.support.polling import eventually, within
from tests.unit.test_election_pinned_unit import MEMBER, SETTINGS, WQ, Group

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

#: The pin must outlive the quiet before a reset (a pull expiry and a quarter second
#: without pulls), as it does with the defaults (2 s against 1.25 s).
TTL = 0.8
QUIET = SETTINGS.pull_expires + 0.25
RESET_SETTINGS = dataclasses.replace(SETTINGS, pinned_ttl=TTL)

NO_RESPONDERS = JetStreamNotEnabled(
    "resetting consumer m1: no JetStream answered (is JetStream enabled for this account?)")
NO_ANSWER = ServerUnreachable("resetting consumer m1: the server did not answer in time")
#: What a server without the reset API answers from its API dispatcher (nats-server
#: 2.11-2.13 source: JSBadRequestErr for a subject no handler serves).
BAD_REQUEST = ApiError(400, 10003, "resetting consumer m1: bad request")


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


async def _dead_holder_left_one(group: Group) -> tuple[Member, Member, str | None]:
    """a runs #1, dies inside #2 (its connection gone); b is the standby. Two more
    messages are offered: the next pins b once the server unpinned a."""
    a = await group.start()
    await group.offer(1)
    await eventually(lambda: a.active and group.by(a) == [1], 5, what="a pinned, ran #1")
    b = await group.start()
    group.stuck.add(a.instance_id)
    await group.offer(1)
    await eventually(lambda: group.by(a) == [1, 2], 5, what="a stuck in #2")
    assert isinstance(a.js, PinnedJetStream)
    a.js.crash()
    old_pin = group.pin()
    await group.offer(2)
    return a, b, old_pin


async def test_a_reset_refused_once_with_no_responders_is_retried(group: Group) -> None:
    """The first reset gets "no responders" (a server restarting, JetStream not yet
    listening). The holder tries again a moment later instead of giving up and waiting
    out the dead holder's ack wait (30 s by default; the fake has none, so giving up
    would wait for ever): #2, #3, #4 run once each, in stream order, all on b, under the
    pin b got (it kept it while waiting to try again)."""
    group.server.reset_failures.append((NO_RESPONDERS, False))
    loop = asyncio.get_running_loop()
    _, b, old_pin = await _dead_holder_left_one(group)
    began = loop.time()
    await eventually(lambda: b.active, 5, what="b pinned")
    new_pin = group.pin()
    await eventually(lambda: group.by(b) == [2, 3, 4], 5, what="b to run #2, #3, #4")
    took = loop.time() - began
    assert group.by(b) == [2, 3, 4]
    state = _state(group)
    assert (state.failed_resets, state.resets) == (1, 1)
    assert new_pin not in (None, old_pin) and group.pin() == new_pin
    assert state.pins_given[-1] == new_pin and b.active
    # Pinned after a TTL, a TTL more before the first try, then the retry: a quarter
    # second of pulls, the quiet before a reset, and slack for a loaded machine.
    assert took < 2 * TTL + 0.25 + QUIET + 1.0, f"b recovered after {took:.2f}s"


async def test_a_reset_applied_whose_answer_was_lost_runs_nothing_twice(
        group: Group) -> None:
    """The reset is applied but its answer never comes (ServerUnreachable): the server
    delivers everything unacknowledged again, while b still holds #3 (maybe #4) from
    before. b must drop what it held and not start it beside the redelivery: each message
    runs once, in stream order."""
    group.server.reset_failures.append((NO_ANSWER, True))
    _, b, _ = await _dead_holder_left_one(group)
    await eventually(lambda: b.active, 5, what="b pinned")
    await eventually(lambda: len(group.by(b)) >= 3, 5, what="b to run three messages")
    await asyncio.sleep(3 * TTL)  # a duplicate would run by now
    assert group.by(b) == [2, 3, 4]
    state = _state(group)
    assert state.failed_resets == 1 and state.resets >= 1
    assert not state.pending and not state.ready, "everything acknowledged"


async def test_a_reset_failing_again_and_again_backs_off_and_keeps_the_pin(
        group: Group) -> None:
    """Four passing failures in a row (a consumer leader being elected for a while): b
    tries again with growing pauses (not in a tight loop, and not for ever at once), pulls
    between tries so the pin stays its own, starts nothing meanwhile, then runs #2, #3,
    #4 in order once a reset goes through."""
    failures = 4
    group.server.reset_failures.extend([(NO_RESPONDERS, False)] * failures)
    loop = asyncio.get_running_loop()
    _, b, _ = await _dead_holder_left_one(group)
    await eventually(lambda: b.active, 5, what="b pinned")
    pin = group.pin()
    began = loop.time()
    while _state(group).failed_resets < failures:
        assert group.by(b) == [], "nothing starts while the dead holder's #2 is out"
        assert group.pin() == pin, "b keeps the pin between tries"
        await asyncio.sleep(0.01)
    await eventually(lambda: group.by(b) == [2, 3, 4], 10, what="b to run #2, #3, #4")
    took = loop.time() - began
    assert group.pin() == pin and _state(group).resets == 1
    # Pauses of 0.25, 0.5, 1, 2 s (doubling) after the failures, each followed by the
    # quiet before a reset.
    pauses = 0.25 + 0.5 + 1 + 2
    assert took >= pauses, f"retried too eagerly ({took:.2f}s)"
    assert took < TTL + pauses + failures * QUIET + 2, f"too slow ({took:.2f}s)"


async def test_a_definite_refusal_waits_for_the_ack_wait_and_keeps_order(
        group: Group) -> None:
    """A server without the reset API refuses it (400 bad request): b gives up resetting
    and waits, starting nothing, until the dead holder's #2 comes back by its ack wait.
    Then #2 runs before #3 and #4, which b received long before it (same key)."""
    group.server.reset_failures.append((BAD_REQUEST, False))
    _, b, _ = await _dead_holder_left_one(group)
    await eventually(lambda: b.active, 5, what="b pinned")
    await eventually(lambda: _state(group).failed_resets == 1, 5, what="the refused reset")
    await asyncio.sleep(3 * TTL)
    assert group.by(b) == [], "nothing starts before the dead holder's #2 is back"
    assert _state(group).failed_resets == 1, "a definite refusal is not retried"
    assert b.active, "b waits as the holder"
    group.server.ack_wait_expired(WQ, MEMBER, [2])
    await eventually(lambda: len(group.by(b)) >= 3, 5, what="b to run three messages")
    await asyncio.sleep(2 * TTL)
    assert group.by(b) == [2, 3, 4]
    assert _state(group).resets == 0
