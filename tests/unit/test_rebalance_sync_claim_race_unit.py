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

from cgroupd.core.config import (
    ELASTIC_BUCKET,
    ElasticGroupConfig,
    PartitioningFilter,
    group_key,
)
from cgroupd.core.partitions import partition_filters, sync_filters
from cgroupd.member import Member
from cgroupd.member.generation import Generation
from cgroupd.member.modes import SyncMode
from cgroupd.member.rebalance import Rebalance
from tests.support.fakes import FakeJetStream, FakeServer
from tests.support.polling import eventually
from tests.unit.test_election_unit import SETTINGS, handler

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

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


def _moves(m: Member) -> Rebalance:
    """The sync mode's moves (:class:`cgroupd.member.rebalance.Rebalance`), driven directly."""
    assert isinstance(m.mode, SyncMode)
    return m.mode.rebalance


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
    results = await asyncio.gather(_moves(m1)._claim(m1._gen, (0, FREE), (FREE,)),
                                   _moves(m2)._claim(m2._gen, (1, FREE), (FREE,)),
                                   return_exceptions=True)
    assert two.holding(sync_filters([FREE])) in (["m1"], ["m2"]), results
    assert sorted(r is True for r in results) == [False, True], results


async def test_two_moves_that_keep_nothing_leave_one_claim_and_one_consumer(
        two: Two) -> None:
    """The cost of the race where nothing waits for the other's claim to go: a move that
    keeps no partition (m1 0 -> 2, m2 1 -> 2: every partition moves, as when as many
    members are added as there are) deletes its data consumer first, then claims, then
    creates a data consumer. On main a080bcb both claims are accepted; the data consumers
    are creates, which the server checks one after the other, so only one member consumes
    partition 2 (exclusivity holds), but the other keeps claiming 2 while it retries its
    create for the whole data-consumer deadline. Now one claim, one consumer."""
    m1, m2 = await two.start()
    _aim(m1, (FREE,))
    _aim(m2, (FREE,))
    assert m1._gen is not None and m2._gen is not None
    results = await asyncio.gather(m1.mode.move(m1._gen, (FREE,)),
                                   m2.mode.move(m2._gen, (FREE,)),
                                   return_exceptions=True)
    assert len(two.holding(partition_filters([FREE]))) == 1, results
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
    moves = [asyncio.create_task(m1.mode.move(m1._gen, (0, FREE))),
             asyncio.create_task(m2.mode.move(m2._gen, (1, FREE)))]
    await asyncio.sleep(0.2)  # both claims made (or one retrying); then m2 learns
    _aim(m2, (1,))
    results = await asyncio.gather(*moves, return_exceptions=True)
    assert results[0] is True, results
    gen = m1.generation
    assert gen is not None
    assert two.holding(partition_filters([FREE])) == list(gen.consumers), results
    assert two.holding(sync_filters([FREE])) == ["m1"], results
    assert gen.partitions == (0, FREE)


async def test_an_election_and_a_claim_at_the_same_moment_leave_one_claim(
        two: Two) -> None:
    """The election claims too: a member's new sync consumer (a create) claims its
    partitions by filter overlap, and races another member's claim widened in place (an
    update): a full rejoin after a config change, while another member's view still gives
    it the same partition. x1 (outside the config, so idle) is made to elect for
    partition 2 while m1 claims it. On main a080bcb both claims are accepted. Now one
    stays, and at most one data consumer delivers partition 2."""
    m1, _ = await two.start()
    x1 = Member(FakeJetStream(two.server), "ORDERS", "g", "x1", handler,  # type: ignore[arg-type]
                SETTINGS)
    await x1.start()
    two.members.append(x1)
    _aim(m1, (0, FREE))
    assert m1._gen is not None
    claimed, gen = await asyncio.gather(_moves(m1)._claim(m1._gen, (0, FREE), (FREE,)),
                                        x1.mode.acquire((FREE,)), return_exceptions=True)
    try:
        assert len(two.holding(sync_filters([FREE]))) == 1, (claimed, gen)
        assert len(two.holding(partition_filters([FREE]))) <= 1, (claimed, gen)
        assert (claimed is True) != isinstance(gen, Generation), (claimed, gen)
    finally:
        if isinstance(gen, Generation):
            await x1._releaser.release(gen)
