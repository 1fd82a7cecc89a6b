"""The one way tests wait for a condition they cannot await: poll it with a deadline, and
fail saying what was awaited, where, and what was seen last.

Await an event when there is one (an ``asyncio.Event``, a future, a process exit); poll
only what has no event (a server's state, a child's log, a metric). ``eventually`` is for
coroutines; ``eventually_blocking`` for code that must not use the event loop (Spark's
callbacks, threads, synchronous tests). ``within`` bounds an await (a stop, a queue's next
item, a child's line) in place of ``asyncio.wait_for``, which the linter bans: on Python 3.11
it can swallow a cancellation that arrives as its timeout fires (see cgroupd/core/tasks.py).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cgroupd.core.tasks import cancel_and_wait

__all__ = ["eventually", "eventually_blocking", "within"]

T = TypeVar("T")

#: How much of the last result a timeout message shows.
_SHOWN = 300


def _describe(check: Callable[..., Any]) -> str:
    """``check``'s name and where it was written, for a timeout without ``what``."""
    code = getattr(check, "__code__", None)
    name = getattr(check, "__qualname__", None) or repr(check)
    if code is None:
        return name
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


def _timed_out(check: Callable[..., Any], timeout: float, what: str | None, last: Any,
               error: BaseException | None,
               diagnostics: Callable[[], str] | None) -> AssertionError:
    shown = repr(last)
    if len(shown) > _SHOWN:
        shown = shown[:_SHOWN] + "..."
    message = (f"timed out after {timeout}s waiting for {what or _describe(check)}; "
               f"last: {shown}")
    if error is not None:
        message += f" (last error: {error!r})"
    if diagnostics is not None:
        message += f"\n{diagnostics()}"
    return AssertionError(message)


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
                     what: str | None = None, *, retry: tuple[type[BaseException], ...] = (),
                     diagnostics: Callable[[], str] | None = None) -> Any:
    """Call ``check`` (sync, or returning an awaitable) until its result is truthy and
    return that result. At the deadline, fail naming ``what`` (else ``check`` and where it
    was written), the last result, and ``diagnostics()`` (log tails, say). Exceptions of
    the ``retry`` types count as "not yet"; any other propagates at once."""
    loop = asyncio.get_running_loop()  # its time: virtual where the loop's is
    deadline = loop.time() + timeout
    last: Any = None
    error: BaseException | None = None
    while True:
        try:
            last = check()
            if inspect.isawaitable(last):
                last = await last
            error = None
        except retry as exc:
            last, error = None, exc
        if last:
            return last
        if loop.time() > deadline:
            raise _timed_out(check, timeout, what, last, error, diagnostics) from error
        await asyncio.sleep(interval)


def eventually_blocking(check: Callable[[], Any], timeout: float = 10.0,
                        interval: float = 0.05, what: str | None = None, *,
                        diagnostics: Callable[[], str] | None = None) -> Any:
    """:func:`eventually` for synchronous code: blocks the calling thread between calls."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(check, timeout, what, last, None, diagnostics)
        time.sleep(interval)


async def within(aw: Awaitable[T], timeout: float, what: str) -> T:
    """Await ``aw`` for at most ``timeout`` seconds and return its result. At the deadline
    (or when the caller is cancelled) ``aw`` is cancelled until it has ended, so an await
    that swallows one cancellation cannot hang the test; then TimeoutError names ``what``
    (a TimeoutError, as ``asyncio.wait_for`` raised, for callers that catch it)."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            await cancel_and_wait(task)
    if not done:
        # What it raised as it was cancelled (a failed cleanup, say) goes along as the cause.
        cause = None if task.cancelled() else task.exception()
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}") from cause
    return task.result()
