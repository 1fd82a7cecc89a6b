"""The one retry loop (:func:`cgroupd.core.retrying.retried`), on a virtual clock: what
it retries, for how long, and what it gives up on at once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from cgroupd.core.errors import CgroupdError, ConflictError, ServerUnreachable
from cgroupd.core.retrying import retried


class Time:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, pause: float) -> None:
        self.slept.append(pause)
        self.now += pause


def failing(times: int, error: CgroupdError) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return calls, call


def retriable(exc: CgroupdError) -> bool:
    return exc.retriable


async def test_a_passing_failure_is_retried_with_growing_jittered_pauses() -> None:
    t = Time()
    calls, call = failing(3, ServerUnreachable("no answer"))
    assert await retried(call, within=10, base=0.1, cap=1.0, retry_if=retriable,
                         clock=t.clock, sleep=t.sleep) == "done"
    assert len(calls) == 4 and len(t.slept) == 3
    for attempt, pause in enumerate(t.slept):
        assert 0.5 * min(1.0, 0.1 * 2 ** attempt) <= pause <= min(1.0, 0.1 * 2 ** attempt)


async def test_it_gives_up_when_the_next_try_would_begin_too_late() -> None:
    t = Time()
    calls, call = failing(1000, ServerUnreachable("no answer"))
    with pytest.raises(ServerUnreachable):
        await retried(call, within=3, base=0.1, cap=1.0, retry_if=retriable,
                      clock=t.clock, sleep=t.sleep)
    assert t.now <= 3 and len(calls) == len(t.slept) + 1 > 3


async def test_an_error_it_does_not_accept_is_raised_at_once() -> None:
    t = Time()
    calls, call = failing(1, ConflictError("wrong last sequence"))
    with pytest.raises(ConflictError):
        await retried(call, within=10, base=0.1, cap=1.0,
                      retry_if=lambda e: e.retriable and not isinstance(e, ConflictError),
                      clock=t.clock, sleep=t.sleep)
    assert len(calls) == 1 and t.slept == []
