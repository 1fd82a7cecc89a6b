"""A newly pinned instance whose first proof of the pin gets a passing answer: in a rolling
restart the member consumer's new leader answered "consumer not found" for a moment. The
instance asks again, starting nothing meanwhile; giving up at once left the messages the pin
brought unacknowledged and not handed back, and at max_ack_pending nobody could be pinned
until their 30 s ack wait (a 32 s gap, local run of test_pinned_rolling_restart on
2026-11-27).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.fakes_pinned import PinnedJetStream
from tests.support.polling import eventually
from tests.unit.test_election_pinned_unit import MEMBER, WQ, Group

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time


class NewLeaderJetStream(PinnedJetStream):
    """Answers "not found" (None) to the first consumer infos asked once someone is
    pinned, as a consumer leader elected a moment ago did."""

    not_found = 3

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        if self.server.pinned_id(WQ, MEMBER) is not None and self.not_found > 0:
            self.not_found -= 1
            return None
        return await super().consumer_info(stream, name)


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group()
    yield g
    for m in g.members:
        await asyncio.wait_for(m.stop(), 10)


async def test_a_passing_not_found_does_not_cost_a_new_pin(
        group: Group, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.unit.test_election_pinned_unit.PinnedJetStream",
                        NewLeaderJetStream)
    holder = await group.start()
    await group.offer(2)
    await eventually(lambda: group.by(holder) == [1, 2], 5,
                     what="#1 and #2 run by the instance pinned first")
    assert holder.active and holder.reasons == []  # type: ignore[attr-defined]
    js = holder.js
    assert isinstance(js, NewLeaderJetStream) and js.not_found == 0, "the answers came"
