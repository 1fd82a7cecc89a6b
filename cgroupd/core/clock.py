"""The one clock of the member runtime: where the member, its generations, the dispatcher,
the pullers, the settlements and the leases read the time and sleep.

The default, :data:`LOOP_CLOCK`, reads the running event loop's time (``loop.time()``,
``time.monotonic()`` on a standard loop) and sleeps with ``asyncio.sleep``, so every part
agrees with the loop's own timers (``call_later``, ``asyncio.timeout``, :class:`Wake`).
A test that runs the loop on virtual time (tests/support/virtualclock.py) thereby runs
all of the runtime on it, leases, TTLs and retry backoffs included. Never mix in
``time.monotonic()`` or ``time.time()`` for a deadline in the runtime: read the clock.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["LOOP_CLOCK", "Clock", "LoopClock"]


class Clock(Protocol):
    """A monotonic time in seconds and a way to wait some of it."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return after ``seconds`` of this clock's time (cancellable)."""
        ...


class LoopClock:
    """The running event loop's time: what its timers use, real or virtual."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


#: The default clock of every runtime object.
LOOP_CLOCK: Clock = LoopClock()
