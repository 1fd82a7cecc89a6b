"""Stepping down: stop taking messages, let running handlers finish (bounded), confirm
settlements, then give up this instance's consumers (sync) or the pin (pinned)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from cgroupd.core.errors import CgroupdError
from cgroupd.core.settings import PRIORITY_GROUP
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.member.generation import Generation
from cgroupd.member.state import StepDown
from cgroupd.nats import jsapi
from cgroupd.nats.message import Outcome
from cgroupd.nats.pull import Puller

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore

#: Step-downs without a clean hand-over: the listener hears ``on_partitions_lost``.
#: (Our consumer or pin was taken or deleted, our lease lapsed, the group went, a bug.)
LOST = frozenset({StepDown.SYNC_LOST, StepDown.DATA_LOST, StepDown.PIN_LOST,
                  StepDown.STALLED, StepDown.GROUP_DELETED, StepDown.ERROR})


class Release:
    """A job of every member (see the module docstring); a collaborator holding the
    member, not a mixin of it."""

    def __init__(self, member: MemberCore) -> None:
        self.m = member

    async def release(self, gen: Generation) -> None:
        """Stop taking messages, let running handlers finish (bounded), drop consumers."""
        self.m.mode.step_down(StepDown.STOPPING, gen=gen)
        began = self.m._clock()
        if gen.verifying is not None:
            gen.verifying.cancel()
        # Every one of them ended, for certain (see cgroupd.core.tasks).
        await asyncio.gather(*(cancel_and_wait(task) for task in gen.tasks
                               if task is not asyncio.current_task()))
        await self.m.mode.release(gen, began)

    async def release_sync(self, gen: Generation, drained: float = 0.0) -> None:
        """Sync exclusivity, once no handler runs any more: confirm our settlements, drop
        our data consumers (never skipped silently), then our claim if it is still ours.
        Logs how long each step took (``drained``: the handlers' drain before): the
        successor waits for all of it (issue 15: a SIGTERM handover within 50 ms)."""
        began = self.m._clock()
        # Settlements first: once the server confirmed them, deleting a data consumer
        # cannot hand a message we finished to the next owner.
        if gen.dispatcher is not None and gen.dispatcher.unconfirmed:
            deadline = self.m._clock() + 2 * jsapi.API_TIMEOUT
            while not await gen.dispatcher.confirm():
                if self.m._clock() > deadline:
                    self.m._log.warning("settlements not confirmed before release; the next "
                                        "owner may run those messages again",
                                        count=gen.dispatcher.unconfirmed)
                    break
                await self.m._sleep(0.05)
        await self._wait_removed(gen)
        confirmed = self.m._clock()
        await self._hand_over(gen)
        claims = [p for p in gen.pullers if not p.delivers]
        for puller in gen.pullers:
            if puller.delivers:
                await puller.stop()
        # Data consumers first: their unacked messages become available to the next owner,
        # who can only create its data consumer once ours are gone. Their deletion is not
        # awaited before the claim's: the server removes a consumer from its stream before
        # it deletes its files and replies (tens of ms on a busy disk), and the next owner
        # creates its data consumer only after winning the claim (two round trips after
        # ours went out), so waiting for that reply only delayed the successor.
        await asyncio.gather(*(self._delete_own(name) for name in list(gen.data)),
                             self._drop_claim(gen, claims))
        for puller in claims:
            await puller.stop()
        self.m._log.info("released", drain_ms=round(drained * 1e3, 1),
                         confirm_ms=round((confirmed - began) * 1e3, 1),
                         delete_ms=round((self.m._clock() - confirmed) * 1e3, 1))

    async def _wait_removed(self, gen: Generation) -> None:
        """A confirmed ack proves that the consumer recorded it, not that the work-queue
        stream removed the message: its leader does that, later, and a stream without a
        leader (a cluster node cut, its heal) removes it only once one is elected, and only
        for consumers that still exist then (nats-server 2.15.1: 40 acks confirmed, the
        consumer deleted, a new one got all 40 again; issue 13). So our data consumer goes
        only once the stream no longer holds the last message we acked (its leader applies
        removals in ack order), or after ``drain_timeout``, said loudly."""
        dispatcher = gen.dispatcher
        last = dispatcher.last_settled if dispatcher is not None else None
        # (Sync mode only: a static group is always pinned, see MemberCore.__init__.)
        if (dispatcher is None or dispatcher.unconfirmed or last is None
                or last.outcome not in (Outcome.ACK, Outcome.TERM)):
            return  # (an ack not confirmed may never remove it: waiting would be in vain)
        deadline = self.m._clock() + self.m.settings.drain_timeout
        # R3: the removal commits about one round trip after the ack did; a healthy
        # stream needs no more than a few short pauses (issue 15: a quick handover).
        pause, waited = 0.005, False
        while True:
            try:
                if not await self.m.js.message_stored(self.m._consume_stream,
                                                      last.stream_sequence):
                    break
            except CgroupdError:
                pass  # no stream leader (503) or no answer: not removed yet, as far as we know
            if self.m._clock() > deadline:
                self.m._log.warning("the work-queue stream still holds the last message we "
                                    "acked; the next owner may run acked messages again",
                                    seq=last.stream_sequence)
                return
            waited = True
            await self.m._sleep(pause)
            pause = min(pause * 2, 0.1)
        if waited:
            self.m._log.info("acked messages removed by the stream", seq=last.stream_sequence)

    async def _drop_claim(self, gen: Generation, claims: list[Puller]) -> None:
        """Delete the member's sync consumer, only if nothing says it went to someone
        else: our sync puller would have been told of its deletion, and the info must
        still name this process (read after our data consumers' deletion was sent, so
        that it goes to the server first)."""
        def intact() -> bool:
            return (gen.ended.result()[0] is not StepDown.SYNC_LOST
                    and not any(p.ended.done() for p in claims))

        if intact() and await self.m._sync_is_ours() and intact():
            with contextlib.suppress(CgroupdError):
                await self.m.js.delete_consumer(self.m._consume_stream, self.m.sync_consumer)

    async def _hand_over(self, gen: Generation) -> None:
        """Nothing more starts and our settlements are confirmed; our consumers (or the
        pin) are still ours: the listener hears its partitions go, then on_handover."""
        await self.m._gone(gen, gen.announced, lost=gen.reason() in LOST)
        if self.m.on_handover is not None:
            await self.m._callback(self.m.on_handover, gen.reason().value)

    async def _delete_own(self, name: str, attempts: int = 3) -> None:
        """Delete one of our consumers, retrying; say so loudly if it cannot be done (the
        next owner then reclaims it: we answer that we are no longer active)."""
        for attempt in range(attempts):
            try:
                await self.m.js.delete_consumer(self.m._consume_stream, name)
                return
            except CgroupdError as exc:
                if attempt + 1 == attempts:
                    self.m._log.error("could not delete our data consumer", consumer=name,
                                      error=str(exc))
                    return
                # Each retry delays the successor by its sleep (a SIGTERM handover took
                # 0.109 s instead of ~0.01 s once, silently): say why.
                self.m._log.info("retrying our data consumer's deletion", consumer=name,
                                 attempt=attempt + 1, error=str(exc))
            await self.m._sleep(0.1 * (attempt + 1))

    async def release_pinned(self, gen: Generation,
                             renew: Callable[[Generation], Awaitable[bool]]) -> None:
        """Pinned mode: the member consumer is shared by every instance and outlives us.

        Running handlers finish while we keep pulling (so the pin stays ours); what
        arrives meanwhile is kept, not started. Then we give up the pin and hand back
        every message not started, in stream order: the next holder gets them before
        anything later of their keys (issue 13 item 2). Handing back is safe only within
        one pinned TTL of the unpin: the next holder takes back what we still hold by a
        consumer reset no earlier than that (see :meth:`_take_over`).
        """
        s = self.m.settings
        if gen.dispatcher is not None:
            await gen.dispatcher.drain(s.drain_timeout, hold_late=True)
        await self._hand_over(gen)
        asked = self.m._clock()
        unpinned = await self._unpin(gen, renew)
        lease = gen.pin_lease
        safe_until = asked + s.pinned_ttl - (lease.margin if lease is not None else 0.0)
        if not unpinned and lease is not None and lease.repinning and lease.valid:
            # The pin went with a leader change and nobody holds it: our lease bounds
            # any next holder's reset, as an unpin's TTL does (issue 29).
            unpinned, safe_until = True, lease.until
        if unpinned and gen.dispatcher is not None and self.m._clock() < safe_until:
            back = await gen.dispatcher.hand_back()
            if back:
                self.m._log.info("handed back messages not started", count=back)
        for puller in gen.pullers:
            if unpinned and puller.delivers:
                # Deliveries already on their way are nak'ed as they come.
                await puller.retire(min(0.2, max(0.0, safe_until - self.m._clock())))
            await puller.stop()

    async def _unpin(self, gen: Generation,
                     renew: Callable[[Generation], Awaitable[bool]]) -> bool:
        """Give up the pin at once so the server picks a standby without waiting for the
        pinned TTL; only while the pin is provably ours: unpinning after losing it would
        unpin the new holder (issue 13)."""
        lease = gen.pin_lease
        if lease is None or lease.lost or not gen.ended.done() \
                or gen.ended.result()[0] is StepDown.PIN_LOST:
            return False
        if lease.remaining() < 2 * lease.margin and not await renew(gen):
            return False
        try:
            await self.m.js.unpin(self.m._consume_stream, self.m.sync_consumer, PRIORITY_GROUP)
        except CgroupdError as exc:
            self.m._log.info("could not unpin", error=str(exc))
            return False
        lease.lose()
        return True
