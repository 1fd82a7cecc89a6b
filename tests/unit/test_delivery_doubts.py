"""Pinned mode's doubts about deliveries (:class:`cgroupd.member.generation.Generation`):
starts stay paused while a delivery to us may be missing, and only a check asked after the
latest doubt lifts the pause (issue 29)."""

from __future__ import annotations

from typing import Any

from cgroupd.member.generation import UNCHECKED, Generation
from tests.unit.test_dispatch_unit import FakeConnection, dispatcher


async def _noop(msg: Any) -> None:
    return None


async def test_a_check_asked_before_a_doubt_does_not_clear_it() -> None:
    d, _ = dispatcher(FakeConnection(), _noop)
    gen = Generation(partitions=(0,), dispatcher=d)
    gen.doubt_deliveries()  # our connection dropped
    asked = gen.doubts  # a renewal asks, on the new connection
    gen.doubt_deliveries()  # a delivery's number skips before its answer comes
    gen.deliveries_checked(asked)  # its answer finds nothing missing
    assert gen.in_doubt and d.paused and d.held_by(UNCHECKED)
    gen.deliveries_checked(gen.doubts)  # a renewal asked after the gap
    assert not gen.in_doubt and not d.paused
    await d.drain(1)


async def test_a_late_check_never_takes_back_a_newer_clearance() -> None:
    d, _ = dispatcher(FakeConnection(), _noop)
    gen = Generation(partitions=(0,), dispatcher=d)
    gen.doubt_deliveries()
    gen.doubt_deliveries()
    gen.deliveries_checked(2)
    gen.deliveries_checked(1)  # an older renewal's answer, coming last
    assert not gen.in_doubt and not d.paused
    await d.drain(1)
