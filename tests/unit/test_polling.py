"""``within``, the tests' bounded await in place of ``asyncio.wait_for``: it returns what
was awaited, names what it waited for at the deadline, and ends an await that swallows a
cancellation (where Python 3.11's ``wait_for`` cancels once and then waits forever)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.cancellation import SwallowsOneCancellation
from tests.support.polling import within


async def test_within_returns_the_result_and_passes_errors_through() -> None:
    """In time, the awaited result comes back and its exception propagates unchanged."""
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fails() -> None:
        raise ValueError("boom")

    assert await within(answer(), 5, "the answer") == 42
    with pytest.raises(ValueError, match="boom"):
        await within(fails(), 5, "the failure")


async def test_a_timeout_names_what_was_awaited_and_cancels_it() -> None:
    """At the deadline the awaited coroutine is cancelled (its cleanup ran) and the
    TimeoutError says what the test waited for."""
    cleaned = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    with pytest.raises(TimeoutError, match=r"after 0\.05s waiting for the member to stop"):
        await within(forever(), 0.05, "the member to stop")
    assert cleaned.is_set()


async def test_an_await_that_swallows_a_cancellation_cannot_hang_the_test() -> None:
    """The awaited code swallows the first cancellation (as nats-py's ``wait_for`` on 3.11
    can): ``within`` cancels it again, so the test fails in time instead of hanging."""
    stubborn = SwallowsOneCancellation()
    began = time.monotonic()
    waiting = asyncio.ensure_future(within(stubborn.run(), 0.05, "the stubborn task"))
    await asyncio.wait({waiting}, timeout=5)
    assert waiting.done(), "within still waiting 5 s after its 0.05 s deadline"
    with pytest.raises(TimeoutError, match="the stubborn task"):
        waiting.result()
    assert stubborn.swallowed == 1 and time.monotonic() - began < 2


async def test_cancelling_the_caller_ends_what_it_awaited() -> None:
    """A test cancelled while it waits (a fixture's teardown, pytest's timeout) leaves no
    task behind: the awaited coroutine is cancelled before the cancellation goes on."""
    started, cleaned = asyncio.Event(), asyncio.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    waiting = asyncio.ensure_future(within(forever(), 60, "forever"))
    await started.wait()
    waiting.cancel()
    await asyncio.wait({waiting}, timeout=5)
    assert waiting.cancelled() and cleaned.is_set()
