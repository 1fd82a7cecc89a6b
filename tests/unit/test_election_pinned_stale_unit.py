"""A pinned holder whose consumer's leader is cut off from its replicas (issue 13, the
cluster node cut, in pinned mode): the isolated leader keeps answering that our client is
pinned, from before the cut, while the majority side elects a leader that pins the
standby. Like sync mode's self-check, the pin's lease is renewed only from when the
answering leader last heard from a quorum: a stale "still pinned" starts nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cgroupd.member import MemberState
from tests.support.fakes_pinned import PinnedJetStream
from tests.support.polling import eventually, within
from tests.unit.test_election_pinned_unit import Group

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

#: What nats-server 2.15.1's isolated leader answered 10 s into a cut (measured by
#: tests/faults/test_cluster_node_cut.py): itself leader, replicas last heard 10 s ago.
CUT_OFF = {"leader": "n2", "replicas": [{"name": "n0", "current": True, "active": 10 * 10**9},
                                        {"name": "n1", "current": True, "active": 10 * 10**9}]}
#: A healthy R3 consumer: both replicas heard within the last 50 ms (the pinned TTL of
#: these tests is 0.4 s).
HEALTHY = {"leader": "n2", "replicas": [{"name": "n0", "current": True, "active": 5 * 10**7},
                                        {"name": "n1", "current": True, "active": 10**7}]}


class ClusteredJetStream(PinnedJetStream):
    """Consumer info as an R3 consumer's leader answers it, healthy or cut off."""

    cluster: dict[str, Any] = HEALTHY

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        info = await super().consumer_info(stream, name)
        return None if info is None else {**info, "cluster": self.cluster}


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group()
    yield g
    for m in g.members:
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


async def test_a_stale_pin_confirmation_starts_nothing(group: Group,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.unit.test_election_pinned_unit.PinnedJetStream",
                        ClusteredJetStream)
    holder = await group.start()
    await group.offer(1)
    await eventually(lambda: holder.active and group.by(holder) == [1], 5,
                     what="pinned, #1 run")
    for n in (2, 3):  # healthy confirmations renew the pin's lease: across lease periods
        await asyncio.sleep(0.5)  # longer than the lease (TTL 0.4 s), not a synchronisation
        await group.offer(1)
        await eventually(lambda n=n: group.by(holder) == list(range(1, n + 1)), 5,
                         what=f"#{n} run under a healthy confirmation")
    js = holder.js
    assert isinstance(js, ClusteredJetStream)
    js.cluster = CUT_OFF
    gen = holder.generation
    assert gen is not None and gen.pin_valid
    await eventually(lambda: (info := holder.generation) is None or info.number != gen.number
                     or not info.pin_valid, 5,
                     what="the pin's lease to run out (stale confirmations must not renew it)")
    await group.offer(1)  # #4
    await eventually(lambda: getattr(holder, "reasons", []), 5, what="the holder to step down")
    assert holder.reasons == ["pin-lost"]  # type: ignore[attr-defined]
    assert group.by(holder) == [1, 2, 3], "a stale confirmation must not start #4"
    assert holder.stats["stale_checks"] >= 1
    now = holder.generation
    assert holder.state is not MemberState.ACTIVE or now is None or now.number != gen.number
