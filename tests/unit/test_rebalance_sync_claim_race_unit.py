"""Two sync-mode members claim the same partition at the same moment (issue 13). The
in-memory server here checks a work queue's filter overlap the way nats-server does:
without excluding a concurrent update, so both claims can be accepted (the server does
so in 297 of 300 tries: tests/integration/test_workqueue_claim_race.py). A claim must not
trust the refusal alone. Members m1 and m2 run; m3's partition 2 is free, and both take it
(their views of the config differ for a moment while it changes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cgroupd.config import (
    ELASTIC_BUCKET,
    ElasticGroupConfig,
    PartitioningFilter,
    group_key,
)
from cgroupd.member import Member
from cgroupd.partitions import partition_filters, sync_filters
from tests.support.fakes import FakeJetStream, FakeServer
from tests.support.polling import eventually
from tests.unit.test_election_unit import SETTINGS, handler

FREE = 2  # m3's partition: m3 never starts


class Two:
    """m1 (partition 0) and m2 (partition 1) active on one in-memory server."""

    def __init__(self) -> None:
        self.server = FakeServer()
        config = ElasticGroupConfig(
            max_members=3, partitioning_filters=(PartitioningFilter("orders.*", (1,)),),
            members=("m1", "m2", "m3"))
        self.server.records[(ELASTIC_BUCKET, group_key("ORDERS", "g"))] = config.to_json()
        self.members: list[Member] = []

    async def start(self) -> tuple[Member, Member]:
        for name in ("m1", "m2"):
            m = Member(FakeJetStream(self.server), "ORDERS", "g", name, handler,  # type: ignore[arg-type]
                       SETTINGS)
            await m.start()
            self.members.append(m)
        m1, m2 = self.members
        await eventually(lambda: m1.active and m2.active, 5, what="m1 and m2 active")
        self.server.racy_overlap_check = True
        return m1, m2

    def holding(self, filters: list[str]) -> list[str]:
        """Consumers whose filters include any of ``filters``."""
        return sorted(name for (_, name), c in self.server.consumers.items()
                      if set(c.config.get("filter_subjects") or []) & set(filters))


@pytest.fixture
async def two() -> AsyncIterator[Two]:
    t = Two()
    yield t
    t.server.racy_overlap_check = False
    for m in t.members:
        await asyncio.wait_for(m.stop(), 10)


def _aim(m: Member, target: tuple[int, ...]) -> None:
    """What a config change does to the generation, without waking the rebalance loop:
    the test runs the move itself."""
    assert m._gen is not None
    m._gen.target = target


async def test_two_claims_at_the_same_moment_leave_one_holder(two: Two) -> None:
    """Both claims pass the overlap check before either is applied. On main a080bcb both
    are accepted and both members' sync consumers claim partition 2; now the claim is
    checked after it is accepted, and whoever sees the other lets go: one holder."""
    m1, m2 = await two.start()
    _aim(m1, (0, FREE))
    _aim(m2, (1, FREE))
    assert m1._gen is not None and m2._gen is not None
    results = await asyncio.gather(m1._claim(m1._gen, (0, FREE), (FREE,)),
                                   m2._claim(m2._gen, (1, FREE), (FREE,)),
                                   return_exceptions=True)
    assert two.holding(sync_filters([FREE])) in (["m1"], ["m2"]), results
    assert sorted(r is True for r in results) == [False, True], results


async def test_two_moves_that_keep_nothing_never_both_consume_the_partition(
        two: Two) -> None:
    """The cost of the race: a move that keeps no partition (m1 0 -> 2, m2 1 -> 2: every
    partition moves, as when as many members are added as there are) deletes its data
    consumer first, so nothing waits for the other's claim to go: after a doubly accepted
    claim, both create a data consumer for partition 2 at the same moment, and on main
    a080bcb both are accepted: two members run partition 2's messages side by side. Now
    one member holds the partition, and only its data consumer delivers it."""
    m1, m2 = await two.start()
    _aim(m1, (FREE,))
    _aim(m2, (FREE,))
    assert m1._gen is not None and m2._gen is not None
    results = await asyncio.gather(m1._move_partitions(m1._gen, (FREE,)),
                                   m2._move_partitions(m2._gen, (FREE,)),
                                   return_exceptions=True)
    consuming = two.holding(partition_filters([FREE]))
    assert len(consuming) == 1, (consuming, results)
    assert len(two.holding(sync_filters([FREE]))) == 1, results


async def test_a_claim_superseded_after_a_race_lets_the_partition_go(two: Two) -> None:
    """Both claim partition 2 at the same moment while keeping their own partition; then
    m2's view catches up with the config (2 is not m2's). On main a080bcb m1 went on
    (the consumer list before its swap did not show m2's claim yet) while m2 saw m1's
    claim and waited; m2's move then ended as superseded with its sync consumer still
    claiming 2, and nothing lets that go (m2 consumes what its new target wants): the
    next member given partition 2 waits for it in vain. Now m1 consumes 2, and only m1's
    sync consumer claims it."""
    m1, m2 = await two.start()
    _aim(m1, (0, FREE))
    _aim(m2, (1, FREE))
    assert m1._gen is not None and m2._gen is not None
    moves = [asyncio.create_task(m1._move_partitions(m1._gen, (0, FREE))),
             asyncio.create_task(m2._move_partitions(m2._gen, (1, FREE)))]
    await asyncio.sleep(0.2)  # both claims made (or one retrying); then m2 learns
    _aim(m2, (1,))
    results = await asyncio.gather(*moves, return_exceptions=True)
    assert results[0] is True, results
    assert two.holding(partition_filters([FREE])) == list(m1._gen.data), results
    assert two.holding(sync_filters([FREE])) == ["m1"], results
    assert m1._gen.partitions == (0, FREE)


async def test_two_elections_at_the_same_moment_leave_one_claim(two: Two) -> None:
    """The election claims too: a member's new sync consumer claims its partitions by
    filter overlap (a full rejoin after a config change, while another member's view
    still gives it the same partition). x1 and x2 (outside the config, so idle) are made
    to elect for partition 2 at the same moment. On main a080bcb both sync consumers and
    then both data consumers are accepted: two members consume partition 2. Now one of
    them lets go before creating its data consumer."""
    await two.start()
    racers = []
    for name in ("x1", "x2"):
        x = Member(FakeJetStream(two.server), "ORDERS", "g", name, handler,  # type: ignore[arg-type]
                   SETTINGS)
        await x.start()
        two.members.append(x)
        racers.append(x)
    gens = await asyncio.gather(*(x._acquire_sync((FREE,)) for x in racers))
    try:
        assert len(two.holding(sync_filters([FREE]))) == 1, gens
        assert len(two.holding(partition_filters([FREE]))) == 1, gens
        assert sum(g is not None for g in gens) == 1, gens
    finally:
        for x, gen in zip(racers, gens, strict=True):
            if gen is not None:
                await x._release(gen)
