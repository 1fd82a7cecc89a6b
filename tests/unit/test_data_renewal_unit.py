"""A data consumer that lost a delivery on the way is replaced in place (cgroupd/member/
modes.py ``SyncMode._renew_data_consumer``, cgroupd/member/rebalance.py
``renew_data_consumer``), on the in-memory adapter.

Issue 29: after a route cut's heal, the node that was cut off forced a new election of the
new owner's data consumer, one delivery never reached the owner, and the owner ended its
generation as stalled, letting its claim go: the standby across the heal took the member, a
second owner change. The owner now swaps the data consumer for a fresh one at a quiet point
and keeps the claim and the generation. Nothing the old consumer delivers after the gap
runs: it would overtake the lost message of its key (cause 4 of the leaders-on-B runs).
"""

from __future__ import annotations

from typing import Any

import pytest

from cgroupd.member import MemberState
from tests.support.fakes import FakeMsg, data_puller
from tests.support.polling import eventually
from tests.unit.test_election_unit import WQ, Group, group  # noqa: F401 - fixture

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time


def _delivery(consumer: str, seq: int, number: int) -> FakeMsg:
    """Stream sequence ``seq`` of partition 0, the consumer's delivery ``number``."""
    return FakeMsg(subject="0.orders.k0", data=b"m", consumer_seq=number,
                   reply=f"$JS.ACK.{WQ}.{consumer}.1.{seq}.{number}.0.0")


async def test_a_lost_delivery_replaces_the_data_consumer_and_keeps_the_member(
        group: Group) -> None:  # noqa: F811 - the fixture imported above
    """Deliveries 1 and 3 arrive, 2 never does: the owner keeps its claim and its
    generation, its data consumer is replaced by a fresh one (which delivers what is left
    in stream order), and the standby never gets the member."""
    a = await group.start(instance_id="a")
    await eventually(lambda: a.active and data_puller(a) is not None, 5, what="a pulling")
    b = await group.start(instance_id="b")
    await eventually(lambda: b.state is MemberState.STANDBY, 5, what="b standing by")
    gen, puller = a.generation, data_puller(a)
    assert gen is not None and puller is not None
    old = puller.consumer
    nc: Any = a.js.nc
    await nc.deliver(puller.inbox, _delivery(old, 1, 1))
    await nc.deliver(puller.inbox, _delivery(old, 3, 3))  # 2 was lost on the way
    await eventually(lambda: a.stats["data_consumers_renewed"] == 1, 5,
                     what="the data consumer replaced")
    now = a.generation
    assert now is not None and now.number == gen.number and not now.ended
    assert old not in now.consumers and len(now.consumers) == 1
    assert group.server.names(WQ) == {"m1", *now.consumers}
    assert group.holder() == "a" and a.active and a.stats["step_downs"] == 0
    assert b.state is MemberState.STANDBY and b.stats["takeovers"] == 0


async def test_nothing_delivered_after_the_gap_runs_before_the_lost_message(
        group: Group) -> None:  # noqa: F811 - the fixture imported above
    """Issue 29, cause 4 of the route cut's leaders-on-B failures: delivery 2 never
    arrives (committed at the consumer's leader, which lost its leadership before sending
    it), 3 reveals the gap, and 4 and 5 follow it without one (the server sends a whole
    batch). All are of one partition, so of one key: 4 and 5 must not run before 2, which
    only the fresh consumer brings back. On the code before, the puller withheld 3 only,
    handed on 4 and 5, and their handlers started before the renewal paused the
    dispatcher (a live run: two completions out of their key's order)."""
    ran: list[int] = []

    async def record(msg: Any) -> None:
        ran.append(msg.stream_sequence)

    a = await group.start(instance_id="a", on_message=record)
    await eventually(lambda: a.active and data_puller(a) is not None, 5, what="a pulling")
    puller = data_puller(a)
    assert puller is not None
    old = puller.consumer
    nc: Any = a.js.nc
    await nc.deliver(puller.inbox, _delivery(old, 1, 1))
    await eventually(lambda: ran == [1], 5, what="the first delivery run")
    for number in (3, 4, 5):  # 2 was lost on the way; 3, 4, 5 come as one batch
        await nc.deliver(puller.inbox, _delivery(old, number, number))
    await eventually(lambda: a.stats["data_consumers_renewed"] == 1, 5,
                     what="the data consumer replaced")
    assert ran == [1], "a message past the lost one ran before it"
