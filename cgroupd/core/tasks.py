"""Ending asyncio tasks for certain.

Python 3.11's ``asyncio.wait_for`` (which nats-py's ``request`` and ``flush`` use) can
swallow a cancellation that arrives as its timeout fires: the task goes on as if nothing
happened. A task cancelled once and then awaited may so never end, and a member's release
waited forever on such a task (a silent step-down that never finished). Cancel until it
has ended instead.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any], retry: float = 0.1) -> None:
    """Cancel ``task`` and return once it has ended (its result or error is left on it);
    cancelled again every ``retry`` seconds while it goes on."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry)


async def nap(seconds: float, unless: asyncio.Event) -> None:
    """Sleep ``seconds``, but not past ``unless`` being set. (Not ``wait_for`` on the
    event: on Python 3.11 it can swallow a cancellation that arrives as the event is set.)"""
    if unless.is_set():
        return
    waiter = asyncio.ensure_future(unless.wait())
    try:
        await asyncio.wait({waiter}, timeout=seconds)
    finally:
        waiter.cancel()
