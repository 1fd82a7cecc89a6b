"""Pinned mode's hush/reset/retry loop, written once. Three steps reset the member
consumer this way: the takeover of what a previous holder left
(:meth:`~cgroupd.member.election_pinned.PinnedElection._take_over`), the take-back of
deliveries lost in a consumer leader change (``_take_back``, same module), and an
in-place move (:meth:`~cgroupd.member.rebalance_pinned.PinnedRebalance._quiet_reset`).

A reset makes the consumer deliver again, in stream order, everything not acknowledged.
No pull of ours may be open when it goes through, or a delivery made before it could
arrive after it and run ahead of (and twice with) its redelivery: so requests stop
("hush") and the reset waits until none is outstanding. A passing failure (no responders
while a server restarts, no answer while the consumer elects a leader) is retried after a
doubling pause during which we pull again: the pulls keep the pin ours.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from cgroupd.core.errors import ApiError, CgroupdError, ConsumerNotFound

#: Pulls between a failed consumer reset and the next try (they keep the pin ours), doubled
#: after each failure up to the maximum. Each try adds a pull expiry without pulls.
RESET_RETRY_FIRST = 0.25
RESET_RETRY_MAX = 4.0
#: How often the loop looks again while it waits for its moment (seconds).
POLL = 0.02


def reset_unsupported(exc: CgroupdError) -> bool:
    """Whether a failed consumer reset is a definite refusal (the server has no reset API,
    or refuses the request as such) rather than a passing failure worth retrying: a 4xx
    API error. "No responders", no answer in time, 5xx and a missing consumer (its
    leader being elected; a deleted one is seen by the next check) are passing."""
    return (isinstance(exc, ApiError) and not exc.retriable
            and not isinstance(exc, ConsumerNotFound))


class Hushable(Protocol):
    """What the loop needs of a :class:`cgroupd.nats.pull.Puller`."""

    @property
    def outstanding(self) -> int: ...

    def hush(self, on: bool = True) -> None: ...


class Reset(Enum):
    """How :func:`reset_when_quiet` ended."""

    DONE = "done"  # ``reset()`` returned
    NOT_NEEDED = "not-needed"  # ``needed`` said it is not needed (any more)
    UNSUPPORTED = "unsupported"  # refused as such (see reset_unsupported): not retried
    GAVE_UP = "gave-up"  # failed too often, or too late (``give_up``, ``attempts``)
    NOT_QUIET = "not-quiet"  # a pull of ours still open ``quiet_within`` after the hush
    ENDED = "ended"  # the generation ended meanwhile


@dataclass(frozen=True)
class ResetOutcome:
    """What :func:`reset_when_quiet` returns: how it ended and the last reset failure."""

    how: Reset
    error: CgroupdError | None = None


async def reset_when_quiet(
    puller: Hushable,
    reset: Callable[[], Awaitable[None]],
    ended: asyncio.Future[Any],
    *,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
    log: Any,
    hush_at: float,
    reset_at: float,
    settle: float = 0.0,
    quiet_within: float = math.inf,
    give_up: float = math.inf,
    attempts: float = math.inf,
    needed: Callable[[], Awaitable[bool | None]] | None = None,
    on_retry: Callable[[], object] | None = None,
    on_unsupported: Callable[[CgroupdError], object] | None = None,
    heed_end: bool = True,
) -> ResetOutcome:
    """Hush ``puller`` from ``hush_at``; from ``reset_at``, once no pull of ours is open,
    ``reset()``. A passing failure is retried: the puller pulls again (``on_retry`` is
    called), is hushed again after a doubling pause and the next try comes ``settle``
    later. Gives up after ``attempts`` tries, or when the next would pass ``give_up``.

    ``needed`` is asked each round first: False ends the loop (NOT_NEEDED), None means
    it could not tell (nothing else happens that round). A refusal (see
    :func:`reset_unsupported`) ends it, unless ``on_unsupported`` is given: then it is
    called and the loop goes on waiting, without resetting, until ``needed`` says no.
    A pull still open ``quiet_within`` after ``reset_at`` ends it (NOT_QUIET).
    The generation's end (``ended``) is looked at after each pause (unless ``heed_end``
    is False: a move whose filters changed must still reset), never before the first
    try; after a failed try it ends the retries. The puller is left hushed; the caller
    un-hushes."""
    retry_in = RESET_RETRY_FIRST
    tries = 0
    can_reset = True
    while True:
        if needed is not None:
            wanted = await needed()
            if wanted is False:
                return ResetOutcome(Reset.NOT_NEEDED)
        else:
            wanted = True
        now = clock()
        if wanted and can_reset:
            if now >= hush_at:
                puller.hush()
            if now >= reset_at and puller.outstanding == 0:
                try:
                    await reset()
                    return ResetOutcome(Reset.DONE)
                except CgroupdError as exc:
                    puller.hush(False)  # pull meanwhile: it keeps the pin ours
                    tries += 1
                    if reset_unsupported(exc):
                        if on_unsupported is None:
                            return ResetOutcome(Reset.UNSUPPORTED, exc)
                        on_unsupported(exc)
                        can_reset = False
                        continue
                    if ended.done() or tries >= attempts or clock() + retry_in > give_up:
                        return ResetOutcome(Reset.GAVE_UP, exc)
                    if on_retry is not None:
                        on_retry()
                    log.warning("consumer reset failed; retrying", error=str(exc),
                                retry_in=retry_in)
                    hush_at = clock() + retry_in
                    reset_at = hush_at + settle
                    retry_in = min(2 * retry_in, RESET_RETRY_MAX)
                    continue
            if now >= reset_at + quiet_within and puller.outstanding > 0:
                return ResetOutcome(Reset.NOT_QUIET)
        await sleep(POLL)
        if heed_end and ended.done():
            return ResetOutcome(Reset.ENDED)
