"""A member that cannot read its group record at first because the server is too busy to
answer (issue 27: 38 of 250 processes of a mass start on 2 cores exited with "watching
elastic-consumer-groups/...: the server did not answer in time") keeps trying, with a
jittered, growing pause, and joins once the server answers. A failure that retrying
cannot mend still ends the start at once."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from cgroupd.core.errors import ApiError, CgroupdError, PermissionDenied, ServerUnreachable
from cgroupd.core.retrying import RETRY_CAP, retry_delay
from cgroupd.member import Member, MemberState
from cgroupd.nats.jetstream import Record
from tests.support.fakes import FakeJetStream, FakeServer
from tests.support.polling import eventually
from tests.unit.test_election_unit import SETTINGS, Group, handler

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time


class BusyJetStream(FakeJetStream):
    """The first ``fail`` watches of the group record fail with ``error``."""

    def __init__(self, server: FakeServer, fail: int, error: CgroupdError) -> None:
        super().__init__(server)
        self.fail = fail
        self.error = error
        self.attempts = 0

    async def watch_record(self, bucket: str, key: str) -> AsyncIterator[Record]:
        self.attempts += 1
        if self.attempts <= self.fail:
            raise self.error
        async for record in super().watch_record(bucket, key):
            yield record


@pytest.mark.parametrize("error", [
    ServerUnreachable("watching elastic-consumer-groups/ORDERS.g: the server did not "
                      "answer in time"),
    ApiError(503, 10008, "JetStream system temporarily unavailable"),
])
async def test_a_first_read_that_times_out_is_retried_until_the_member_joins(
        error: CgroupdError) -> None:
    """Three failed first reads, then the member joins and becomes active; each failure
    is counted, and while they last ``waiting_for`` says what the start waits for."""
    group = Group()
    js = BusyJetStream(group.server, fail=3, error=error)
    member = Member(js, "ORDERS", "g", "m1", handler, SETTINGS)  # type: ignore[arg-type]
    try:
        await member.start()
        assert js.attempts == 4
        assert member.stats["watch_failures"] == 3
        assert member.waiting_for is None
        await eventually(lambda: member.state is MemberState.ACTIVE)
    finally:
        await member.stop()


async def test_waiting_for_names_the_failure_while_the_start_retries() -> None:
    """During the retries the member says why it has not joined yet (the daemon's /readyz
    shows it)."""
    group = Group()
    js = BusyJetStream(group.server, fail=10**6, error=ServerUnreachable("busy server"))
    member = Member(js, "ORDERS", "g", "m1", handler, SETTINGS)  # type: ignore[arg-type]
    starting = asyncio.ensure_future(member.start())
    try:
        await eventually(lambda: js.attempts >= 2)
        assert not starting.done()
        assert member.waiting_for is not None and "busy server" in member.waiting_for
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await member.stop()


async def test_a_failure_retrying_cannot_mend_ends_the_start() -> None:
    """No permission to read the bucket: retrying would never help, so start() raises it."""
    group = Group()
    js = BusyJetStream(group.server, fail=1, error=PermissionDenied("no permission"))
    member = Member(js, "ORDERS", "g", "m1", handler, SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(PermissionDenied):
        await member.start()
    assert js.attempts == 1
    await member.stop()


def test_retry_delays_grow_are_capped_and_spread() -> None:
    """Pauses double from the base, never exceed the cap, never fall below half the step
    (no spinning), and differ between instances (a fleet's retries spread out)."""
    rand = random.Random(7)
    for attempt in range(40):
        step = min(RETRY_CAP, 0.5 * 2 ** attempt)
        delay = retry_delay(attempt, 0.5, rand=rand)
        assert step / 2 <= delay <= step
    spread = {round(retry_delay(3, 0.5, rand=rand), 6) for _ in range(50)}
    assert len(spread) > 40
    with pytest.raises(ValueError):
        retry_delay(-1, 0.5)
