"""A standby whose active instance answers, after a membership change (issue 15, idle
cost and scale): its member's partitions move in place, so the claim stays its owner's
and a create is refused. Each standby still tried every 0.1 s for 5 s after any change,
and was woken into a create by every consumer deletion of the moves (with 16 members,
about 160 refused requests a second). It now waits for its own claim's deletion, as
between changes, and still takes over at once when the owner does step down.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cgroupd.core.config import ELASTIC_BUCKET, ElasticGroupConfig, PartitioningFilter, group_key
from cgroupd.member import Member, MemberState
from tests.support.fakes import FakeJetStream, FakeServer
from tests.support.polling import eventually, within
from tests.unit.test_election_unit import SETTINGS as ELECTION
from tests.unit.test_election_unit import WQ, Group, handler

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

#: A retry interval of 0.2 s: a standby with an answering owner tries a create at most
#: every IDLE_ATTEMPT_EVERY (5) intervals, once a second.
SETTINGS = dataclasses.replace(ELECTION, retry_interval=0.2, lease=1.0, takeover_margin=0.2)


class CountingJetStream(FakeJetStream):
    def __init__(self, server: FakeServer) -> None:
        super().__init__(server)
        self.claims = 0

    async def create_consumer(self, stream: str, name: str, config: dict[str, Any],
                              action: str = "create") -> dict[str, Any]:
        if name == "m1" and action == "create":
            self.claims += 1
        return await super().create_consumer(stream, name, config, action)


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group()
    yield g
    for m in g.members:
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


def _members(group: Group, *members: str) -> None:
    config = ElasticGroupConfig(
        max_members=4, partitioning_filters=(PartitioningFilter("orders.*", (1,)),),
        members=members)
    group.server.records[(ELASTIC_BUCKET, group_key("ORDERS", "g"))] = config.to_json()
    group.server.changed.set()


async def test_a_standby_of_an_answering_owner_stays_quiet_after_a_change(
        group: Group) -> None:
    a = Member(FakeJetStream(group.server), "ORDERS", "g", "m1", handler, SETTINGS,
               instance_id="a")
    await a.start()
    group.members.append(a)
    await eventually(lambda: a.active, 5, what="a active")
    js = CountingJetStream(group.server)
    b = Member(js, "ORDERS", "g", "m1", handler, SETTINGS, instance_id="b")
    await b.start()
    group.members.append(b)
    await eventually(lambda: b.state is MemberState.STANDBY and js.claims >= 1, 5,
                     what="b standby")
    before = js.claims
    _members(group, "m1", "m2")  # m1 gives half its partitions away, in place
    await eventually(lambda: len(a.partitions) == 2, 5, what="a's move")
    other = FakeJetStream(group.server)
    for i in range(20):  # other members' moves delete consumers meanwhile, for 2 s
        name = f"m2-x{i}"
        await other.create_consumer(WQ, name, {"filter_subjects": [f"other.{i}"]})
        await other.delete_consumer(WQ, name)
        await asyncio.sleep(0.1)  # the moves' pace, not a synchronisation
    tries = js.claims - before
    assert a.active and b.state is MemberState.STANDBY
    # Before: every 0.1 s and at each deletion, about 20 in 2 s; now about one a second.
    assert tries <= 4, f"{tries} refused creates in 2 s by a standby of a live owner"
    await a.stop()
    await eventually(lambda: b.active, 2, what="b takes over at once when a stops")
