"""A self-check against a server that fails fast (cgroupd/runtime/selfcheck.py): after a
cluster heals, a node answers 503 at once for a while. The active instance waiting for its
lease asked again every 0.1 s with a warning each time (143 lines in one cluster-cut run);
it now backs off to half a second and warns once per outage, and resumes at the first
answer after the heal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from cgroupd.errors import ServerUnreachable
from cgroupd.member import Member, MemberState
from tests.support.fakes import FakeJetStream, FakeServer
from tests.unit.test_election_unit import SETTINGS as ELECTION
from tests.unit.test_election_unit import Group, handler

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time

#: Checks every second (the default), so the backoff's cap (0.5 s) is what limits retries.
SETTINGS = dataclasses.replace(ELECTION, retry_interval=1.0, lease=3.0, takeover_margin=0.5,
                               pull_expires=5.0, heartbeat=1.0, inactive_threshold=30)


class FailingJetStream(FakeJetStream):
    """Consumer info fails at once while ``failing`` is set, as a healing node's 503 does."""

    def __init__(self, server: FakeServer) -> None:
        super().__init__(server)
        self.failing = False
        self.failed = 0

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        if self.failing:
            self.failed += name == "m1"  # one per check: the claim's info
            raise ServerUnreachable("no responders (503)")
        return await super().consumer_info(stream, name)


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group()
    yield g
    for m in g.members:
        await asyncio.wait_for(m.stop(), 10)


async def test_unanswered_self_checks_back_off_and_warn_once(group: Group) -> None:
    js = FailingJetStream(group.server)
    m = Member(js, "ORDERS", "g", "m1", handler, SETTINGS, instance_id="a")
    await m.start()
    group.members.append(m)
    for _ in range(300):
        if m.state is MemberState.ACTIVE:
            break
        await asyncio.sleep(0.01)
    gen = m._gen
    assert gen is not None and m.state is MemberState.ACTIVE
    with capture_logs() as logged:
        js.failing = True
        gen.lease.revoke()  # a handler now waits for a check that proves ownership
        waiting = asyncio.ensure_future(m._hold_lease(gen))
        await asyncio.sleep(2.0)  # the outage's length, not a synchronisation
        assert not waiting.done(), "no lease may be granted without an answer"
        # 0.1 + 0.2 + 0.4 + 0.5 + 0.5 ... and the 1 s checks: about eight (twenty-two before).
        tries = js.failed
        js.failing = False
        healed = time.monotonic()
        assert await asyncio.wait_for(waiting, 2.0) is True
        resumed = time.monotonic() - healed
    warnings = [e for e in logged if e["event"] == "self-check could not reach the server"]
    assert 3 <= tries <= 10, f"{tries} checks in a 2 s outage"
    assert len(warnings) == 1, warnings
    assert any(e["event"] == "self-check reached the server again" for e in logged)
    assert resumed < 0.6, f"resumed {resumed:.2f} s after the heal"
    assert not gen.ended.done()
