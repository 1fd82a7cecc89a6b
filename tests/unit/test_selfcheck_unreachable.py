"""A self-check against a server that fails fast (cgroupd/member/selfcheck.py): after a
cluster heals, a node answers 503 at once for a while. The active instance waiting for its
lease asked again every 0.1 s with a warning each time (143 lines in one cluster-cut run);
it now backs off to half a second and warns once per outage, and resumes at the first
answer after the heal. A server that answers after the lease ran out (an overloaded one) is
named as such, not as a cluster cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from cgroupd.core.errors import ServerUnreachable
from cgroupd.member import Member, MemberState
from tests.support.fakes import FakeJetStream, FakeMsg, FakeServer, data_puller
from tests.support.polling import eventually, within
from tests.unit.test_election_unit import SETTINGS as ELECTION
from tests.unit.test_election_unit import WQ, Group

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
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


async def _active_recording(group: Group, js: FakeJetStream) -> tuple[Member, list[int]]:
    """Member m1's one instance on ``js``, active and pulling; the stream sequences its
    handler ran, in order."""
    ran: list[int] = []

    async def recording(msg: Any) -> None:
        ran.append(msg.stream_sequence)

    m = Member(js, "ORDERS", "g", "m1", recording, SETTINGS, instance_id="a")
    await m.start()
    group.members.append(m)
    await eventually(lambda: m.state is MemberState.ACTIVE and data_puller(m) is not None,
                     3, what="a active and pulling")
    return m, ran


async def test_unanswered_self_checks_back_off_and_warn_once(group: Group) -> None:
    """The server stops answering for longer than the lease: a message delivered then
    waits (no handler starts without a check that proves ownership); the checks it waits
    for back off, one warning for the outage; the first answer after the heal starts it."""
    js = FailingJetStream(group.server)
    m, ran = await _active_recording(group, js)
    gen = m.generation
    puller = data_puller(m)
    assert gen is not None and puller is not None
    loop = asyncio.get_running_loop()
    with capture_logs() as logged:
        js.failing = True
        await asyncio.sleep(SETTINGS.lease + 0.5)  # past the lease: an outage, not a sync
        before = js.failed
        await js.nc.deliver(puller.inbox, FakeMsg(
            subject="0.orders.k", data=b"m", consumer_seq=1,
            reply=f"$JS.ACK.{WQ}.{puller.consumer}.1.1.1.0.0"))
        await asyncio.sleep(2.0)  # the outage's length, not a synchronisation
        assert not ran, "no handler may start without an answer"
        # 0.1 + 0.2 + 0.4 + 0.5 + 0.5 ... and the 1 s checks: about eight (twenty-two before).
        tries = js.failed - before
        js.failing = False
        healed = loop.time()
        await eventually(lambda: ran, 2.0, 0.005, what="the held message to run")
        resumed = loop.time() - healed
    warnings = [e for e in logged if e["event"] == "self-check could not reach the server"]
    assert 3 <= tries <= 10, f"{tries} checks in a 2 s outage"
    assert len(warnings) == 1, warnings
    assert any(e["event"] == "self-check reached the server again" for e in logged)
    assert resumed < 0.6, f"resumed {resumed:.2f} s after the heal"
    now = m.generation
    assert now is not None and now.number == gen.number and not now.ended


class SlowJetStream(FakeJetStream):
    """Consumer info answers ``delay`` seconds late while ``slow`` is set, as a server
    whose API queue is longer than the lease does (issue 27's mass start)."""

    def __init__(self, server: FakeServer) -> None:
        super().__init__(server)
        self.slow = False
        self.delay = 0.0

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        if self.slow:
            await asyncio.sleep(self.delay)
        return await super().consumer_info(stream, name)


async def test_self_checks_answered_after_the_lease_start_nothing_and_say_why(
        group: Group) -> None:
    """Each answer comes after the lease it would renew ran out (it runs from the check's
    sending): nothing starts, and the one warning names a slow server, not a cluster cut."""
    js = SlowJetStream(group.server)
    m, ran = await _active_recording(group, js)
    puller = data_puller(m)
    assert puller is not None
    with capture_logs() as logged:
        js.slow, js.delay = True, SETTINGS.lease + 0.5
        await asyncio.sleep(SETTINGS.lease + 0.5)  # the lease of the last prompt check ran out
        await js.nc.deliver(puller.inbox, FakeMsg(
            subject="0.orders.k", data=b"m", consumer_seq=1,
            reply=f"$JS.ACK.{WQ}.{puller.consumer}.1.1.1.0.0"))
        await asyncio.sleep(3 * js.delay)  # three late answers, not a synchronisation
        assert not ran, "no handler may start on an answer that came after its lease"
        js.slow = False
        await eventually(lambda: ran, 2 * js.delay, 0.005, what="the held message to run")
    late = [e for e in logged if e["event"].startswith("self-check answered after the lease")]
    assert len(late) == 1, late
    assert late[0]["answered_after"] >= SETTINGS.lease
    assert not any("out of touch" in e["event"] for e in logged)
