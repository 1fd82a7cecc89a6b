"""The active instance's starvation check (cgroupd/member/selfcheck.py) against the
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
from tests.support.fakes import FakeJetStream, FakeMsg, data_puller
from tests.support.polling import eventually, within
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
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


async def active(group: Group, reasons: list[str] | None = None) -> Member:
    m = Member(FakeJetStream(group.server), "ORDERS", "g", "m1", handler,
               SETTINGS, instance_id="a",
               on_standby=reasons.append if reasons is not None else None)
    await m.start()
    group.members.append(m)
    await eventually(lambda: m.state is MemberState.ACTIVE, 2, what="m active")
    return m


def waiting_and_none_unacked(group: Group, m: Member) -> None:
    """What a check sees at an unlucky moment of steady traffic: a message published and
    not yet delivered, nothing delivered and unacknowledged."""
    gen = m.generation
    assert gen is not None
    for name in gen.consumers:
        group.server.consumers[(WQ, name)].num_pending = 1


async def test_delivering_consumer_is_not_stalled(group: Group) -> None:
    reasons: list[str] = []
    m = await active(group, reasons)
    gen = m.generation
    assert gen is not None
    await eventually(lambda: data_puller(m) is not None and data_puller(m).inbox,  # type: ignore[union-attr]
                     5, what="a pulling")
    waiting_and_none_unacked(group, m)

    async def deliveries() -> None:
        seq = 0
        while True:  # a delivery between any two checks, each settled at once
            puller = data_puller(m)
            if puller is not None:
                seq += 1
                await m.js.nc.deliver(puller.inbox, FakeMsg(  # type: ignore[attr-defined]
                    subject="0.orders.k", data=b"m", consumer_seq=seq,
                    reply=f"$JS.ACK.{WQ}.{puller.consumer}.1.{seq}.{seq}.0.0"))
            await asyncio.sleep(0.01)

    flowing = asyncio.create_task(deliveries())
    try:
        # 20 checks, each finding "waiting, nothing unacknowledged, nothing held".
        await asyncio.sleep(20 * SETTINGS.retry_interval)
    finally:
        flowing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flowing
    assert not reasons, f"stepped down while delivering: {reasons}"
    now = m.generation
    assert m.state is MemberState.ACTIVE and now is not None and now.number == gen.number


async def test_starved_consumer_steps_down(group: Group) -> None:
    """Messages wait, none unacknowledged, nothing arrives: replaced after three checks."""
    reasons: list[str] = []
    m = await active(group, reasons)
    waiting_and_none_unacked(group, m)
    await eventually(lambda: reasons, 20 * SETTINGS.retry_interval, what="a step-down")
    assert reasons[0] == StepDown.STALLED.value
