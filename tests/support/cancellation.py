"""A coroutine that swallows a cancellation, as Python 3.11's ``asyncio.wait_for`` inside
nats-py's ``request`` can: what ``cancel_and_wait`` and ``within`` must still end."""

from __future__ import annotations

import asyncio


class SwallowsOneCancellation:
    """``run()`` sleeps until cancelled twice: the first cancellation is swallowed (and
    counted in ``swallowed``), the second ends it."""

    def __init__(self) -> None:
        self.swallowed = 0

    async def run(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if self.swallowed:
                    raise
                self.swallowed += 1  # as a racing wait_for does: carry on
