"""States of a member instance, why an active one steps down, and small helpers the
runtime shares (see :mod:`cgroupd.member`)."""

from __future__ import annotations

import asyncio
import inspect
import secrets
from collections.abc import Awaitable, Callable
from enum import Enum

ActiveCallback = Callable[[tuple[int, ...]], Awaitable[None] | None]
StandbyCallback = Callable[[str], Awaitable[None] | None]
#: Called with (partitions now owned, seconds the move took) after an in-place rebalance.
RebalanceCallback = Callable[[tuple[tuple[int, ...], float]], Awaitable[None] | None]


class MemberState(Enum):
    JOINING = "joining"  # reading the group config for the first time
    STANDBY = "standby"  # not consuming: competing, waiting to compete, or not a member
    ACTIVE = "active"  # owns this member's consumers and delivers messages
    STEPPING_DOWN = "stepping-down"  # finishing in-flight handlers, releasing consumers
    STOPPED = "stopped"  # done for good


ALLOWED = {
    MemberState.JOINING: {MemberState.STANDBY, MemberState.STOPPED},
    MemberState.STANDBY: {MemberState.ACTIVE, MemberState.STOPPED, MemberState.STANDBY},
    MemberState.ACTIVE: {MemberState.STEPPING_DOWN},
    MemberState.STEPPING_DOWN: {MemberState.STANDBY, MemberState.STOPPED},
    MemberState.STOPPED: set(),
}


class StepDown(Enum):
    """Why an active instance stopped being active (metric label, callback argument)."""

    CONFIG_CHANGED = "config-changed"
    SYNC_LOST = "sync-consumer-lost"
    DATA_LOST = "data-consumer-lost"
    PIN_LOST = "pin-lost"
    REQUESTED = "step-down-requested"  # pinned mode: asked on its step-down subject
    STALLED = "stalled"
    GROUP_DELETED = "group-deleted"
    STOPPING = "stopping"
    ERROR = "error"


def new_instance_id() -> str:
    """A short random id, unique per running instance."""
    return secrets.token_hex(6)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Wake(asyncio.Event):
    """An event that can be waited on with a timeout cheaply (a future and a timer, not
    ``wait_for``'s extra task): a standby waits on it several times a second."""

    def __init__(self) -> None:
        super().__init__()
        self._naps: set[asyncio.Future[None]] = set()

    def set(self) -> None:
        super().set()
        for fut in list(self._naps):
            _resolve(fut)

    async def nap(self, timeout: float) -> None:
        """Return when set, or after ``timeout`` seconds (yielding to the loop either way)."""
        if self.is_set():
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._naps.add(fut)
        timer = loop.call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._naps.discard(fut)


async def maybe_await(value: Awaitable[None] | None) -> None:
    if inspect.isawaitable(value):
        await value
