"""Kafka's rebalance listener (``ConsumerRebalanceListener``) for one member instance.

Three hooks, each called with the partitions concerned (a sorted tuple, never empty):

- ``on_partitions_assigned``: these are now this instance's; called before the first of
  their messages starts a handler (when the instance becomes active, and when an
  incremental rebalance gives it more).
- ``on_partitions_revoked``: these are going in a clean hand-over; called after the last
  of their messages this instance started is settled (and its ack confirmed by the
  server), and before another instance can get them (before this instance deletes its
  consumers, narrows its claim, or unpins).
- ``on_partitions_lost``: ownership went without a clean hand-over (the consumer was
  deleted under us, another instance took the member over after our lease lapsed, the pin
  was taken, the group was deleted): another instance may already process them; nothing
  is promised about what was settled. Called instead of ``revoked``.

A hook is a sync or async callable. A sync one runs in a worker thread (like a sync
handler), an async one on the event loop. The runtime waits for a hook at most
``timeout`` seconds (:attr:`MemberSettings.listener_timeout`): a hook that raises or is
still running then is logged and counted (``stats``), never retried, and the hand-over
goes on, so a hanging hook delays a hand-over by at most that long. An async hook still
running at the timeout is cancelled; a sync one cannot be (its thread runs to its end).
Hooks of one instance never overlap: each is awaited (or abandoned) before the next.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cgroupd.member.calling import is_async

#: A hook: called with a sorted tuple of partitions; may return an awaitable.
PartitionsCallback = Callable[[tuple[int, ...]], Awaitable[None] | None]
#: The hooks' names, as the daemon's handler module and webhook events use them.
ASSIGNED, REVOKED, LOST = "assigned", "revoked", "lost"
#: Hooks left running at their timeout (referenced until they end).
_abandoned: set[asyncio.Future[None]] = set()


@dataclass
class PartitionListener:
    """The three hooks of one instance, called through :meth:`call`."""

    on_partitions_assigned: PartitionsCallback | None = None
    on_partitions_revoked: PartitionsCallback | None = None
    on_partitions_lost: PartitionsCallback | None = None
    timeout: float = 5.0
    #: ``<kind>``: calls; ``<kind>_failed``: raised; ``<kind>_timed_out``: abandoned.
    stats: Counter[str] = field(default_factory=Counter)

    def hook(self, kind: str) -> PartitionsCallback | None:
        return {ASSIGNED: self.on_partitions_assigned, REVOKED: self.on_partitions_revoked,
                LOST: self.on_partitions_lost}[kind]

    async def call(self, kind: str, partitions: Iterable[int], log: Any) -> None:
        """Call the ``kind`` hook with ``partitions`` (nothing when empty or no hook),
        waiting at most :attr:`timeout`; never raises (but for cancellation)."""
        parts = tuple(sorted(set(partitions)))
        cb = self.hook(kind)
        if cb is None or not parts:
            return
        self.stats[kind] += 1
        task = asyncio.ensure_future(_run(cb, parts))
        done, _ = await asyncio.wait({task}, timeout=self.timeout)
        if not done:
            self.stats[f"{kind}_timed_out"] += 1
            log.error("partition listener did not return in time; going on",
                      hook=f"on_partitions_{kind}", partitions=list(parts),
                      timeout=self.timeout)
            # Cancelled once, not waited for: a hook that ignores cancellation must not
            # hold the hand-over (kept referenced until it ends).
            task.cancel()
            _abandoned.add(task)
            task.add_done_callback(_forget)
            return
        exc = task.exception()
        if exc is not None:
            self.stats[f"{kind}_failed"] += 1
            log.error("partition listener raised; going on", hook=f"on_partitions_{kind}",
                      partitions=list(parts), error=repr(exc))


def _forget(task: asyncio.Future[None]) -> None:
    _abandoned.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: it was logged as timed out already


async def _run(cb: PartitionsCallback, parts: tuple[int, ...]) -> None:
    if is_async(cb):
        result: Any = cb(parts)
    else:
        result = await asyncio.to_thread(cb, parts)
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result
