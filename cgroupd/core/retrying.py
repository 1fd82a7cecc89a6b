"""How long to wait before trying a transient failure again.

Many instances fail at once when the server is overloaded or restarts (a mass start, a
rolling upgrade): retrying in lock-step at a fixed interval keeps the server busy with the
same burst (issue 27). Each retry waits an exponentially growing, capped, jittered time,
so the retries of a fleet spread out and thin as the failures go on.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from cgroupd.core.errors import CgroupdError

T = TypeVar("T")

#: The longest pause between two attempts, whatever the attempt number.
RETRY_CAP = 10.0


def retry_delay(attempt: int, base: float, cap: float = RETRY_CAP,
                rand: random.Random | None = None) -> float:
    """The pause before retry number ``attempt`` (0 for the first retry): ``base * 2**attempt``
    capped at ``cap``, then scaled by a random factor in [0.5, 1.0] ("equal jitter": never
    zero, so a failing fleet cannot spin, and never above the cap)."""
    if attempt < 0 or base < 0 or cap < 0:
        raise ValueError("attempt, base and cap must not be negative")
    step: float = min(cap, base * 2.0 ** min(attempt, 32))
    factor: float = (rand or random).uniform(0.5, 1.0)
    return step * factor


async def retried(call: Callable[[], Awaitable[T]], *, within: float, base: float, cap: float,
                  retry_if: Callable[[CgroupdError], bool], clock: Callable[[], float],
                  sleep: Callable[[float], Awaitable[None]]) -> T:
    """``call``, tried again after :func:`retry_delay` while it fails with an error that
    ``retry_if`` accepts and the next try would still begin within ``within`` seconds of
    the first; otherwise its error is raised. The one retry loop of the admin's record
    writes and the sync claim's check (``clock`` and ``sleep`` injected: virtual time in
    the state-machine tests)."""
    give_up = clock() + within
    attempt = 0
    while True:
        try:
            return await call()
        except CgroupdError as exc:
            pause = retry_delay(attempt, base, cap)
            if not retry_if(exc) or clock() + pause > give_up:
                raise
        attempt += 1
        await sleep(pause)
