"""cancel_and_wait ends a task that swallows a cancellation (what Python 3.11's wait_for
inside nats-py's request can do), where a single cancel and an await would hang."""

from __future__ import annotations

import asyncio

from cgroupd.core.tasks import cancel_and_wait
from tests.support.cancellation import SwallowsOneCancellation
from tests.support.polling import within


async def test_a_task_that_swallows_one_cancellation_still_ends() -> None:
    stubborn = SwallowsOneCancellation()
    task = asyncio.create_task(stubborn.run())
    await asyncio.sleep(0)
    # The single-cancel pattern does not end it ...
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done and stubborn.swallowed == 1
    # ... cancelling until it has ended does.
    await within(cancel_and_wait(task, retry=0.05), 5, "cancel_and_wait")
    assert task.cancelled()
