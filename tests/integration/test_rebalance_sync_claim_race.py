"""Two sync-mode members take the same partition at the same moment, on a real server
(issue 13). nats-server checks a work queue's filter overlap without excluding a
concurrent create or update (tests/integration/test_workqueue_claim_race.py), so both
claims can be accepted, and then both data consumers. Whether a claim made at the same
moment as another still leaves one member consuming the partition is asked of the real
server here; the unit attacks (tests/unit/test_rebalance_sync_claim_race_unit.py) cover
the same paths on an in-memory server that lets the race happen every time."""

from __future__ import annotations

import asyncio

import pytest

from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.partitions import partition_filters, partition_of, sync_filters
from cgroupd.core.settings import MemberSettings
from cgroupd.member import Member
from cgroupd.nats.jetstream import JetStream
from tests.support.groups import Fleet, make_group, publish_keyed
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

FREE = 2  # m3's partition: m3 never starts
SETTINGS = MemberSettings(drain_timeout=1.0)


async def test_two_members_moving_onto_one_partition_at_once_leave_one_claim(
        fleet: Fleet, jetstream: JetStream) -> None:
    """m1 (partition 0) and m2 (partition 1) each move to m3's partition 2 at the same
    moment, keeping nothing (as when as many members are added as there are): each drops
    its data consumer, claims 2 (a sync consumer update), then creates a data consumer.
    On main a080bcb both claims were accepted in 3 of 3 runs; the server refused the
    second data consumer (creates are checked one after the other), so one member ran
    partition 2, while the other held its claim for its whole data-consumer deadline.
    Now one claim stays, and partition 2's messages run on one instance."""
    config = await make_group(jetstream, partitions=3, members=("m1", "m2", "m3"))
    m1 = await fleet.add("m1", SETTINGS)
    m2 = await fleet.add("m2", SETTINGS)
    await eventually(lambda: m1.active and m2.active, 10, what="m1 and m2 active")
    sent = await publish_keyed(jetstream, 60, keys=30)
    of = {n: partition_of(subject, config.partitioning_filters, 3) for subject, n in sent}
    mine = {n for n, p in of.items() if p != FREE}
    free = {n for n, p in of.items() if p == FREE}
    assert mine and free
    await eventually(lambda: mine <= {e["n"] for e in fleet.record.ends()}, 10,
                     what="partitions 0 and 1 consumed")
    members: list[Member] = [m1, m2]
    for m in members:
        assert m._gen is not None
        m._gen.target = (FREE,)  # a config view that gives it partition 2 (no wake-up)
    results = await asyncio.gather(*(m.mode.move(m._gen, (FREE,))  # type: ignore[arg-type]
                                     for m in members), return_exceptions=True)
    infos = [ConsumerInfo(c) for c in await jetstream.list_consumers(m1._consume_stream)]
    claims = [i.name for i in infos if set(i.filters) & set(sync_filters([FREE]))]
    data = [i.name for i in infos if set(i.filters) & set(partition_filters([FREE]))]
    assert len(claims) == 1, (claims, results)
    assert len(data) == 1, (data, results)
    await eventually(lambda: free <= {e["n"] for e in fleet.record.ends()}, 10,
                     what="partition 2 consumed")
    runners = {e["instance"] for e in fleet.record.events
               if e.get("partition") == FREE and e["event"] == "start"}
    assert len(runners) == 1, runners
