"""Pinned mode's hush/reset/retry loop (:func:`cgroupd.member.pinned_reset.reset_when_quiet`),
written once for the takeover, the take-back and the in-place move; on virtual time, no
server: the loop's whole contract is when it hushes, resets, retries and gives up."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from cgroupd.core.errors import ApiError, ServerUnreachable
from cgroupd.member.pinned_reset import (
    RESET_RETRY_FIRST,
    Reset,
    ResetOutcome,
    reset_when_quiet,
)

pytestmark = pytest.mark.virtual_clock


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, event: str, **_: Any) -> None:
        self.lines.append(event)


class _Puller:
    """Records when it was hushed and un-hushed; one pull of ours stays open until ``ends``
    (loop time)."""

    def __init__(self, ends: float = 0.0) -> None:
        self._ends = ends
        self.hushed = False
        self.log: list[tuple[float, bool]] = []

    @property
    def outstanding(self) -> int:
        return 0 if _now() >= self._ends else 1

    def hush(self, on: bool = True) -> None:
        if on != self.hushed:
            self.log.append((round(_now(), 2), on))
        self.hushed = on


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _run(puller: _Puller, failures: list[Exception], resets: list[float],
               ended: asyncio.Future[None] | None = None, **kw: Any) -> ResetOutcome:
    async def reset() -> None:
        resets.append(round(_now(), 2))
        if failures:
            raise failures.pop(0)

    if ended is None:
        ended = asyncio.get_running_loop().create_future()
    return await reset_when_quiet(puller, reset, ended, clock=_now, sleep=asyncio.sleep,
                                  log=_Log(), **kw)


async def test_hushes_then_resets_once_quiet_and_retries_a_passing_failure() -> None:
    """Hushed at 1.0, reset from 1.5 but only once our open pull ends (at 1.7); a passing
    failure un-hushes (pulls keep the pin ours), hushes again after the pause and tries
    a settle later."""
    t0 = _now()
    puller = _Puller(ends=t0 + 1.7)
    resets: list[float] = []
    retried: list[float] = []
    outcome = await _run(puller, [ServerUnreachable("no responders")], resets,
                         hush_at=t0 + 1.0, reset_at=t0 + 1.5, settle=0.5,
                         on_retry=lambda: retried.append(_now()))
    assert outcome.how is Reset.DONE
    assert len(resets) == 2 and resets[0] >= round(t0 + 1.7, 2)
    assert resets[1] - resets[0] >= RESET_RETRY_FIRST + 0.5
    assert [on for _, on in puller.log] == [True, False, True] and puller.hushed
    assert puller.log[0][0] >= round(t0 + 1.0, 2)
    assert len(retried) == 1


async def test_a_refusal_ends_it_unless_told_to_wait_and_retries_are_bounded() -> None:
    """A 4xx refusal is not retried; retries stop at ``attempts`` and at ``give_up``."""
    refused = ApiError(400, 10003, "bad request")
    resets: list[float] = []
    outcome = await _run(_Puller(), [refused], resets, hush_at=0.0, reset_at=0.0)
    assert outcome.how is Reset.UNSUPPORTED and outcome.error is refused and len(resets) == 1

    resets = []
    outcome = await _run(_Puller(), [ServerUnreachable("x")] * 10, resets,
                         hush_at=0.0, reset_at=0.0, attempts=6)
    assert outcome.how is Reset.GAVE_UP and len(resets) == 6
    # The pauses between the tries double: 0.25, 0.5, 1, 2, 4.
    gaps = [b - a for a, b in itertools.pairwise(resets)]
    assert all(p <= g < p + 0.05 for g, p in zip(gaps, [0.25, 0.5, 1, 2, 4], strict=True)), gaps

    resets = []
    outcome = await _run(_Puller(), [ServerUnreachable("x")] * 10, resets,
                         hush_at=0.0, reset_at=0.0, give_up=_now() + 1.0)
    assert outcome.how is Reset.GAVE_UP and 1 < len(resets) < 10


async def test_a_refusal_with_on_unsupported_waits_until_no_longer_needed() -> None:
    """The takeover's case (nats-server < 2.14): no reset, wait for the previous holder's
    messages to come back by themselves (``needed`` turns False)."""
    t0 = _now()
    told: list[Exception] = []

    async def needed() -> bool | None:
        return _now() < t0 + 3.0

    resets: list[float] = []
    outcome = await _run(_Puller(), [ApiError(400, 10003, "no reset API")], resets,
                         hush_at=t0, reset_at=t0, needed=needed, on_unsupported=told.append)
    assert outcome.how is Reset.NOT_NEEDED and len(resets) == 1 and len(told) == 1
    assert _now() >= t0 + 3.0


async def test_not_needed_or_unknown_never_resets() -> None:
    """``needed`` None (no answer) does nothing that round; False ends it unreset."""
    answers = iter([None, None, False])

    async def needed() -> bool | None:
        return next(answers)

    resets: list[float] = []
    outcome = await _run(_Puller(), [], resets, hush_at=0.0, reset_at=0.0, needed=needed)
    assert outcome.how is Reset.NOT_NEEDED and resets == []


async def test_a_pull_that_never_ends_and_the_generations_end() -> None:
    """A pull of ours still open ``quiet_within`` after the reset was due: NOT_QUIET. The
    generation's end stops the wait, unless ``heed_end`` is off (a move must reset)."""
    t0 = _now()
    resets: list[float] = []
    outcome = await _run(_Puller(ends=t0 + 100), [], resets, hush_at=t0, reset_at=t0,
                         quiet_within=2.0)
    assert outcome.how is Reset.NOT_QUIET and resets == []
    assert 2.0 <= _now() - t0 < 2.1

    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.5, ended.set_result, None)
    outcome = await _run(_Puller(ends=_now() + 1.0), [], resets, ended,
                         hush_at=_now(), reset_at=_now())
    assert outcome.how is Reset.ENDED and resets == []

    t1 = _now()
    outcome = await _run(_Puller(ends=t1 + 1.0), [], resets, ended,
                         hush_at=t1, reset_at=t1, heed_end=False)
    assert outcome.how is Reset.DONE and resets == [round(t1 + 1.0, 2)]
