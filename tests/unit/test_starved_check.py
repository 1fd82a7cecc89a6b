"""The active instance's starvation check (cgroupd/runtime/selfcheck.py) against the
in-memory adapter: a data consumer that keeps delivering is never "stalled", however
often a check finds a message not yet delivered and none unacknowledged (issue 15: under
1,000 msg/s several actives stepped down as stalled while their partitions flowed); one
that holds messages and delivers none is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from cgroupd.member import Member, MemberState, StepDown
from tests.support.fakes import FakeJetStream
from tests.unit.test_election_unit import SETTINGS as ELECTION
from tests.unit.test_election_unit import WQ, Group, handler

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

#: Checks every 0.05 s: three in a row take 0.15 s.
SETTINGS = ELECTION


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group()
    yield g
    for m in g.members:
        await asyncio.wait_for(m.stop(), 10)


async def active(group: Group) -> Member:
    m = Member(FakeJetStream(group.server), "ORDERS", "g", "m1", handler,
               SETTINGS, instance_id="a")
    await m.start()
    group.members.append(m)
    for _ in range(200):
        if m.state is MemberState.ACTIVE:
            return m
        await asyncio.sleep(0.01)
    raise AssertionError("never became active")


def waiting_and_none_unacked(group: Group, m: Member) -> None:
    """What a check sees at an unlucky moment of steady traffic: a message published and
    not yet delivered, nothing delivered and unacknowledged."""
    assert m._gen is not None
    for name in m._gen.data:
        group.server.consumers[(WQ, name)].num_pending = 1


async def test_delivering_consumer_is_not_stalled(group: Group) -> None:
    m = await active(group)
    gen = m._gen
    assert gen is not None
    waiting_and_none_unacked(group, m)

    async def deliveries() -> None:
        while True:  # a delivery between any two checks, each settled at once
            gen.received += 1
            await asyncio.sleep(0.01)

    flowing = asyncio.create_task(deliveries())
    try:
        # 20 checks, each finding "waiting, nothing unacknowledged, nothing held".
        await asyncio.sleep(20 * SETTINGS.retry_interval)
    finally:
        flowing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flowing
    assert not gen.ended.done(), f"stepped down while delivering: {gen.ended.result()}"
    assert m.state is MemberState.ACTIVE


async def test_starved_consumer_steps_down(group: Group) -> None:
    """Messages wait, none unacknowledged, nothing arrives: replaced after three checks."""
    m = await active(group)
    gen = m._gen
    assert gen is not None
    waiting_and_none_unacked(group, m)
    why, _ = await asyncio.wait_for(asyncio.shield(gen.ended), 20 * SETTINGS.retry_interval)
    assert why is StepDown.STALLED
