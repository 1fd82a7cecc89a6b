"""An asyncio event loop on virtual time that jumps ahead whenever every task waits on a
timer (Trio's ``MockClock(autojump_threshold=0)``, for asyncio).

The fake-adapter state-machine tests run a member through leases, TTLs and retry backoffs
measured in seconds; on the wall clock they spend most of their time asleep. Here
``loop.time()`` is a number this loop owns. When the loop would block in its selector with
a timeout (its next timer), it first polls the selector without blocking: if nothing is
ready it moves its time to that timer instead of sleeping. ``asyncio.sleep``, ``call_later``,
``asyncio.timeout`` and everything that reads :class:`cgroupd.core.clock.LoopClock` therefore
run virtually, in order, and a one-hour sleep takes microseconds.

Real readiness is kept: a ready socket or pipe is served first (the poll), and while a
thread started through ``run_in_executor`` (a sync handler, ``asyncio.to_thread``) is still
running the loop waits for it for real, moving its time by the real time waited, so a
thread is never overtaken by a jump.

Use it through the ``virtual_clock`` marker (``tests/unit/conftest.py``) or
:func:`new_virtual_loop` as a loop factory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["START", "VirtualClockLoop", "new_virtual_loop"]

T = TypeVar("T")

#: The virtual time a loop starts at: far from zero (code may treat 0.0 as "never") and
#: unlike ``time.monotonic()`` of a fresh machine, so a deadline computed from the wall
#: clock and compared with the loop's time is off by a lot and shows in a test.
START = 1_000_000.0


class _AutojumpSelector(selectors.BaseSelector):
    """The loop's real selector, except that a wait with a timeout and nothing ready
    moves the loop's virtual time instead of blocking."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualClockLoop) -> None:
        self._inner = inner
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._inner.select(0)
        if ready or timeout == 0:
            self._loop.follow_wall()
            return ready
        if self._loop.threads_running:
            # A thread whose end will wake us: wait for real (the loop's time follows
            # the wall clock while threads run).
            ready = self._inner.select(timeout)
            self._loop.follow_wall()
            return ready
        if timeout is None:
            # No timer to jump to: only I/O can wake us.
            began = time.monotonic()
            ready = self._inner.select(None)
            self._loop.advance(time.monotonic() - began)
            return ready
        self._loop.advance(timeout)
        return []

    def close(self) -> None:
        self._inner.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual and jumps to the next timer
    whenever nothing else can run (see the module docstring)."""

    def __init__(self) -> None:
        self._virtual_now = START
        self._threads: set[asyncio.Future[Any]] = set()
        #: While threads run: the wall-clock time the loop's time last caught up with.
        self._wall_mark: float | None = None
        super().__init__(_AutojumpSelector(selectors.DefaultSelector(), self))
        # Timers are due when ``when <= time() + resolution``; a jump lands exactly on
        # ``time() + timeout``, which float rounding may put one ulp short of ``when``.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move virtual time ``seconds`` ahead (never back)."""
        if seconds > 0:
            self._virtual_now += seconds

    def follow_wall(self) -> None:
        """While threads run (and since the first started), move the loop's time with the
        wall clock: a thread's ``time.sleep(0.2)`` takes 0.2 s of loop time too."""
        if self._wall_mark is None:
            return
        now = time.monotonic()
        self.advance(now - self._wall_mark)
        self._wall_mark = now if self._threads else None

    @property
    def threads_running(self) -> bool:
        """A thread started by :meth:`run_in_executor` has not finished yet."""
        return bool(self._threads)

    def run_in_executor(self, executor: concurrent.futures.Executor | None,
                        func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._wall_mark is None:
            self._wall_mark = time.monotonic()
        fut = super().run_in_executor(executor, func, *args)
        self._threads.add(fut)
        fut.add_done_callback(self._threads.discard)
        return fut


def new_virtual_loop() -> VirtualClockLoop:
    """A fresh :class:`VirtualClockLoop` (a loop factory for ``asyncio.Runner`` and
    pytest-asyncio)."""
    return VirtualClockLoop()
