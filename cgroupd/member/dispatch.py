"""Running the handler for one period of activity: in order per key, concurrent across keys.

Ordering modes (``MemberSettings.ordering``):

- ``partition``, ``key`` and ``stream``: messages with the same key (the partition, the
  key function's value, or one key for the whole member) run one after another in stream
  order; different keys run at once, up to ``max_in_flight``. Up to ``max_in_flight``
  messages are held (the server sends ahead), so ``stream`` runs one handler at a time
  without a server round trip per message. A failing message is retried *in place* with
  backoff, so no later message of its key can overtake it; its ``delivery_count`` grows
  with each attempt, so a dead-letter wrapper sees the attempts. Everything held is kept
  from timing out with ``in_progress``. A server redelivery of a message still held
  (same stream sequence) is recognised and not run twice.
- ``none``: every message runs as soon as a slot is free; a failure is nak'ed with backoff.

A handler that returns acks its message (unless it settled it itself); one that raises is
retried, and so is one that returns after its ``double_ack`` failed (it swallowed the
:class:`~cgroupd.core.errors.AckNotConfirmed`: acking now could delete a message whose work was
rolled back). Messages not started when the period ends stay unacknowledged, and the server
gives them to the next owner in stream order (or, on a consumer shared by several
instances, :meth:`Dispatcher.hand_back` naks them in stream order).

The member can close a *gate* (:meth:`Dispatcher.pause`): held messages then wait, kept
alive, until it opens again; meanwhile :meth:`Dispatcher.discard_unstarted` can drop them
(the consumer is about to deliver them again, e.g. after a consumer reset). Within a key,
messages wait in stream order even when a redelivery arrives after later messages.

Acks are published without waiting; :mod:`cgroupd.member.settlements` keeps them from being lost
silently (issue 13 item 9). Calling the handler (sync ones in a tracked thread):
:mod:`cgroupd.member.calling`; which queue a message waits in: :mod:`cgroupd.member.keyqueues`.

Draining (:meth:`Dispatcher.drain`) never returns while a handler may still run: async
handlers still running at the drain timeout are cancelled, but a sync handler's thread
cannot be, so it is waited for (issue 13 item 7).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from cgroupd.core.clock import LOOP_CLOCK, Clock
from cgroupd.core.errors import (  # re-exported: handler wrappers import them from here
    HandlerRaised as HandlerRaised,
)
from cgroupd.core.errors import (
    HandlerReturnedGenerator as HandlerReturnedGenerator,
)
from cgroupd.core.ordering import Ordering as Ordering  # re-exported: callers import it from here
from cgroupd.core.tasks import cancel_and_wait, nap
from cgroupd.member.calling import (
    Threads,
    call_handler,
    call_in_thread,
    handler_failure,
    is_async,
    settle_result,
)
from cgroupd.member.calling import (
    run_in_thread as run_in_thread,
)
from cgroupd.member.keyqueues import KeyOf, insert_in_order, queue_key
from cgroupd.member.settlements import Completed as Completed
from cgroupd.member.settlements import Settlements, send_logged
from cgroupd.nats.message import Deliveries, Delivery, Message, Outcome

Handler = Callable[[Message], Awaitable[None] | None]
#: The stats counter of each outcome.
_COUNTED = {Outcome.ACK: "acked", Outcome.NAK: "naked", Outcome.TERM: "termed"}
__all__ = ["Completed", "Dispatcher", "Handler", "HandlerRaised", "HandlerReturnedGenerator",
           "Ordering", "call_in_thread", "handler_failure", "is_async", "run_in_thread",
           "settle_result"]


class Dispatcher:
    """Holds the messages of one generation and runs the handler on them."""

    def __init__(
        self,
        deliveries: Deliveries,
        handler: Handler,
        *,
        ordering: Ordering,
        max_in_flight: int,
        ack_wait: float,
        backoff: Callable[[int], float],
        key_of: KeyOf,
        before_start: Callable[[], Awaitable[bool]],
        on_settled: Callable[[], Awaitable[None]],
        log: Any,
        stats: dict[str, int],
        hand_back_on_close: bool = True,
        completed: Completed | None = None,
        confirm_interval: float = 0.5,
        confirm_timeout: float = 2.0,
        reconnects: Callable[[], int] | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        self._clock = clock
        self._deliveries = deliveries
        self._handler = handler
        self._handler_is_async = is_async(handler)
        self._ordering = ordering
        self._key_of = queue_key(ordering, key_of)
        self._backoff = backoff
        self._before_start = before_start
        self._on_settled = on_settled
        self._log = log
        self._stats = stats
        self._ack_wait = ack_wait
        self._slots = asyncio.Semaphore(max_in_flight)
        self._held: dict[int, Message] = {}
        self._keys: dict[str, deque[Message]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        self._keepalive: asyncio.Task[None] | None = None
        #: Set while handlers may start; cleared by pause().
        self._open = asyncio.Event()
        self._open.set()
        self._holds: set[str] = set()
        #: Messages whose handler is running now (by stream sequence).
        self._running: dict[int, Message] = {}
        #: Handlers cut off by the drain timeout: their work may still go on elsewhere.
        self._abandoned: set[int] = set()
        #: Keep deliveries that arrive while closing (to hand them back in order) instead
        #: of naking them at once.
        self._hold_late = False
        #: Partitions whose messages are taken (None: all). A delivery of another partition
        #: is a late one for a partition this instance gave away: never run, and acked
        #: only with ``ack_not_owned`` (a static group's consumer: the ack clears it from
        #: our consumer alone; on a work queue it would delete the next owner's message).
        self.accept: set[int] | None = None
        self.ack_not_owned = False
        #: Messages processed already (a static group's consumer after a reset): acked
        #: without running.
        self.skip: Callable[[Message], bool] | None = None
        #: Highest stream sequence delivered per partition, and the last message acked or
        #: termed (its ack confirmed again proves every earlier one applied).
        self.highest: dict[int, int] = {}
        self.last_settled: Message | None = None
        #: Deliveries arriving once closing: nak them (another instance reads the same
        #: consumer) or ignore them (our own consumer hands them to the next owner).
        self._hand_back = hand_back_on_close
        self._settlements = Settlements(
            deliveries.nc, log, stats, self._closing, completed, confirm_interval=confirm_interval,
            confirm_timeout=confirm_timeout, reconnects=reconnects, clock=clock)
        #: Sequences nak'ed with a delay, and when the server will offer them again: they
        #: count as unacknowledged on the server while we hold nothing of them.
        self._delayed: dict[int, float] = {}
        self._threads = Threads()

    def start(self) -> None:
        """Begin keeping held messages alive; paired with :meth:`drain`."""
        self._keepalive = asyncio.create_task(self._keep_alive(), name="cgroupd-keepalive")
        self._settlements.start()

    @property
    def holding(self) -> int:
        """Messages delivered to us and not yet settled."""
        return len(self._held)

    @property
    def running(self) -> int:
        """Handlers running now."""
        return len(self._running)

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self, hold: str = "") -> None:
        """Start no handler until every ``hold`` put on is resumed; held messages wait
        (kept alive). Holds are named so that one owner's resume cannot lift another's:
        a move's resume once let starts run while deliveries lost in a reconnect were
        still being checked."""
        self._holds.add(hold)
        self._open.clear()

    def resume(self, hold: str = "") -> None:
        self._holds.discard(hold)
        if not self._holds:
            self._open.set()

    def held_by(self, hold: str) -> bool:
        """Whether ``hold`` keeps starts paused."""
        return hold in self._holds

    async def idle(self, timeout: float) -> bool:
        """Wait until no handler runs (after :meth:`pause`); False after ``timeout``."""
        deadline = self._clock.now() + timeout
        while self._running:
            if self._clock.now() > deadline:
                return False
            await self._clock.sleep(0.002)
        return True

    def held(self) -> list[Message]:
        """Every message delivered to us and not yet settled (running or not)."""
        return list(self._held.values())

    def unstarted(self) -> list[Message]:
        """Every held message whose handler is not running, in stream order (kept)."""
        return sorted((m for seq, m in self._held.items() if seq not in self._running),
                      key=lambda m: m.stream_sequence)

    def discard_unstarted(self) -> list[Message]:
        """Forget every held message whose handler is not running (the consumer will
        deliver them again); returned in stream order. Use while paused."""
        dropped = self.unstarted()
        for m in dropped:
            del self._held[m.stream_sequence]
        for queue in self._keys.values():
            kept = [m for m in queue if m.stream_sequence in self._held
                    and self._held[m.stream_sequence] is m]
            queue.clear()
            queue.extend(kept)
        return dropped

    async def hand_back(self) -> int:
        """After :meth:`drain`: nak every held message no handler is working on, in stream
        order, so the next holder of a shared consumer gets them back at once and in
        order. Returns how many."""
        back = sorted((m for seq, m in self._held.items()
                       if seq not in self._running and seq not in self._abandoned
                       and m.outcome is None), key=lambda m: m.stream_sequence)
        for m in back:
            await send_logged(m.nak(), self._log)
            self._held.pop(m.stream_sequence, None)
        self._stats["naked"] += len(back)
        return len(back)

    @property
    def running_threads(self) -> int:
        """Sync handlers whose thread is still running (cancelled or not)."""
        return self._threads.count

    def delayed(self) -> int:
        """Messages nak'ed with a delay whose redelivery is still to come: the server counts
        them as unacknowledged (``num_ack_pending``) while this dispatcher holds nothing."""
        now = self._clock.now()
        for seq, due in list(self._delayed.items()):
            if due < now:
                del self._delayed[seq]
        return len(self._delayed)

    @property
    def unconfirmed(self) -> int:
        return self._settlements.unconfirmed

    def connection_back(self) -> None:
        """The connection was re-established: settlements may have been lost with the
        old one; have them sent again and confirmed now, not at the next start."""
        self._settlements.connection_back()

    async def confirm(self, resend: bool = False) -> bool:
        """Have the server confirm every settlement sent so far (see
        :meth:`Settlements.confirm`); True once it has."""
        return await self._settlements.confirm(resend)

    async def settle(self, partitions: set[int], timeout: float) -> bool:
        """Wait until no message of ``partitions`` is held; False if that takes too long."""
        deadline = self._clock.now() + timeout
        while any(m.partition in partitions for m in self._held.values()):
            if self._clock.now() > deadline or self._closing.is_set():
                return False
            await self._clock.sleep(0.005)
        return True

    def submit(self, raw: Delivery) -> None:
        """Take a delivery from the data consumer (called from the puller's callback)."""
        if self._closing.is_set() and self._hold_late:
            # Closing on a shared consumer: keep it, hand_back() returns it in order.
            with contextlib.suppress(Exception):
                late = self._deliveries.message(raw)
                self._held.setdefault(late.stream_sequence, late)
            return
        if self._closing.is_set():
            # Not ours to start any more. On a shared consumer, hand it back now rather
            # than after the ack wait; on our own, a nak would only bring it back to us at
            # once (and again, in a hot loop): leave it for the next owner.
            if raw.reply and self._hand_back:
                self._spawn(send_logged(self._deliveries.nak(raw), self._log))
            return
        try:
            message = self._deliveries.message(raw)
        except Exception as exc:  # noqa: BLE001 - not a JetStream delivery: nothing to ack
            self._log.warning("ignored a message that is not a JetStream delivery",
                              subject=raw.subject, error=repr(exc))
            self._stats["not_jetstream"] = self._stats.get("not_jetstream", 0) + 1
            return
        seq = message.stream_sequence
        if self.accept is not None and message.partition not in self.accept:
            # A late delivery of a partition given away: its new owner runs it.
            self._stats["not_owned"] = self._stats.get("not_owned", 0) + 1
            if self.ack_not_owned:
                self._spawn(send_logged(message.ack(), self._log))
            return
        if message.partition is not None and seq > self.highest.get(message.partition, 0):
            self.highest[message.partition] = seq
        if self.skip is not None and seq not in self._held and self.skip(message):
            self._stats["skipped"] = self._stats.get("skipped", 0) + 1
            self._spawn(send_logged(message.ack(), self._log))
            return
        if seq in self._held:
            # The server redelivered a message we still hold (ack wait passed while it ran
            # or waited): the held copy settles it, running it twice would break order.
            self._stats["duplicates"] += 1
            return
        self._delayed.pop(seq, None)
        again = self._settlements.resettle(message)
        if again is not None:
            # We completed it already; its settlement was lost (a reconnect) or is late.
            # Settle it again: running it again, behind later messages of its key, would
            # break order.
            self._spawn(again)
            return
        self._held[seq] = message
        self._stats["delivered"] += 1
        if self._ordering is Ordering.NONE:
            self._spawn(self._run_unordered(message))
            return
        key = self._key_of(message.subject, message.headers, message.partition)
        queue = self._keys.get(key)
        if queue is not None:
            insert_in_order(queue, message, self._running)
            return
        self._keys[key] = deque([message])
        self._spawn(self._run_key(key))

    async def drain(self, timeout: float, hold_late: bool = False,
                    warn_every: float = 10.0) -> None:
        """Start nothing new; let running handlers finish for up to ``timeout``, then
        cancel the async ones. Returns only once no handler runs any more: a sync
        handler's thread cannot be cancelled, so it is waited for (and its message settled
        as usual): whoever releases the consumers afterwards must not let the next owner
        run its message meanwhile.

        ``hold_late``: deliveries arriving from now on are kept for :meth:`hand_back`
        instead of being nak'ed at once."""
        self._hold_late = hold_late
        self._closing.set()
        self._open.set()  # let parked workers see the closing and end
        tasks = set(self._workers)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            self._abandoned.update(self._running)
            threads = {t for t in late if t in self._threads.tasks}
            cancelled = late - threads
            if cancelled:
                self._log.warning("handlers still running after the drain timeout were "
                                  "cancelled; their messages will be redelivered",
                                  count=len(cancelled))
                await asyncio.gather(*(cancel_and_wait(task) for task in cancelled))
            while threads:
                self._log.warning("sync handlers still running after the drain timeout; "
                                  "their partitions are kept until they return",
                                  count=len(threads))
                _, threads = await asyncio.wait(threads, timeout=warn_every)
        while self._threads.count:  # a thread whose awaiting task was cancelled anyway
            await nap(warn_every, self._threads.done)
        if self._keepalive is not None:
            await cancel_and_wait(self._keepalive)
        for background in (self._keepalive, await self._settlements.stop()):
            if background is not None and not background.cancelled() \
                    and background.exception() is not None:
                self._log.warning("dispatcher task failed", error=repr(background.exception()))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._workers.add(task)
        task.add_done_callback(self._workers.discard)

    async def _run_key(self, key: str) -> None:
        """Run one key's messages in order, each until it is settled."""
        queue = self._keys[key]
        self._threads.enter()  # this task's context: run_in_thread finds its threads
        try:
            while queue and not self._closing.is_set():
                if not self._open.is_set():
                    # Paused (a new holder taking over): a message of this key delivered
                    # again (its ack wait ran out) can still arrive ahead of the head.
                    await self._open.wait()
                    continue
                message = queue[0]
                while not await self._invoke(message):
                    if self._closing.is_set():
                        return
                    delay = self._backoff(message.delivery_count)
                    self._stats["retries"] += 1
                    await nap(delay, self._closing)
                    if self._closing.is_set():
                        return
                    message.delivery_count += 1
                if queue and queue[0] is message:
                    queue.popleft()
                if self._held.get(message.stream_sequence) is message:
                    del self._held[message.stream_sequence]
                await self._on_settled()
        finally:
            if self._keys.get(key) is queue:
                del self._keys[key]

    async def _run_unordered(self, message: Message) -> None:
        self._threads.enter()
        if not await self._invoke(message) and not self._closing.is_set():
            await send_logged(message.nak(self._backoff(message.delivery_count)), self._log)
            self._settled(message)
            self._count(message.outcome)
        if self._held.get(message.stream_sequence) is message:
            del self._held[message.stream_sequence]
        await self._on_settled()

    async def _invoke(self, message: Message) -> bool:
        """Run the handler once. True when the message is settled (acked, termed, nak'ed)."""
        async with self._slots:
            if not self._open.is_set():
                await self._open.wait()
            if self._held.get(message.stream_sequence) is not message:
                return True  # discarded while it waited: the consumer delivers it again
            if not self._closing.is_set() and self._settlements.stale:
                await self._settlements.fence()
            if self._closing.is_set() or not await self._before_start():
                self._closing.set()
                return False
            seq = message.stream_sequence
            if self._held.get(seq) is not message:
                return True  # discarded while the start was being checked
            if self.skip is not None and self.skip(message):
                self._stats["skipped"] = self._stats.get("skipped", 0) + 1
                await send_logged(message.ack(), self._log)
                self._settled(message)
                return True
            self._running[seq] = message
            message.ack_failed = False
            try:
                await call_handler(self._handler, message, self._handler_is_async,
                                   self._threads.run)
            except BaseException as exc:  # a handler failure never kills us
                if not handler_failure(exc):
                    raise
                self._log.warning("handler failed; retrying", subject=message.subject,
                                  seq=message.stream_sequence,
                                  deliveries=message.delivery_count, error=repr(exc))
                if message.outcome is None:
                    return False
            else:
                if message.outcome is None:
                    if message.ack_failed:
                        # It was told the ack did not go through and returned anyway: its
                        # work was rolled back (or is in doubt). Acking now could delete
                        # the message with nothing done: treat it as a failure.
                        self._stats["swallowed"] = self._stats.get("swallowed", 0) + 1
                        self._log.warning("handler returned after its double_ack failed; "
                                          "not acking, retrying", subject=message.subject,
                                          seq=message.stream_sequence)
                        return False
                    await send_logged(message.ack(), self._log)
            finally:
                self._running.pop(seq, None)
        if message.outcome in (Outcome.ACK, Outcome.TERM):
            self.last_settled = message
        self._settled(message)
        self._count(message.outcome)
        return True

    def _settled(self, message: Message) -> None:
        """Remember a settled message until the server confirmed its settlement."""
        seq = message.stream_sequence
        if message.outcome is Outcome.NAK:
            if message.nak_delay:
                self._delayed[seq] = self._clock.now() + message.nak_delay
            return
        if message.outcome is not None:
            self._settlements.remember(message)

    def _count(self, outcome: Outcome | None) -> None:
        if outcome is not None:
            self._stats[_COUNTED[outcome]] += 1

    async def _keep_alive(self) -> None:
        """Every held message, running or waiting its turn, is kept from redelivery."""
        while True:
            await self._clock.sleep(self._ack_wait / 3)
            for message in list(self._held.values()):
                if message.outcome is None:
                    await send_logged(message.in_progress(), self._log)
