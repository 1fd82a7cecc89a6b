"""Acks that the server has not confirmed yet, and messages the member completed.

Acks are published without waiting (a round trip per message would halve throughput), so
a key's next message may start while the previous ack is only buffered (issue 13 item 9).
What keeps order is that acks are never lost silently: settled messages are remembered
until the server confirms their consumer applied them (one confirmed settlement per
consumer confirms every earlier one: a consumer applies acks in order); after a reconnect,
before anything new starts, unconfirmed settlements are sent again and confirmed
(:meth:`Settlements.fence`); a redelivery of a message this member already completed is
settled again, not run again (:meth:`Settlements.resettle`); and a release confirms
before its consumers are deleted (:meth:`Settlements.confirm`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cgroupd.core.clock import LOOP_CLOCK, Clock
from cgroupd.core.tasks import cancel_and_wait, nap
from cgroupd.nats.message import Message, Outcome

#: Stream sequences a member completed (acked or termed), with the settlement sent.
Completed = OrderedDict[int, bytes]
#: Completed sequences remembered, so a redelivery is settled again rather than run again.
COMPLETED_MEMORY = 8192
#: Unconfirmed settlements that make the confirmer run at once, not after its interval.
CONFIRM_BATCH = 1024


class Publisher(Protocol):
    """The part of the connection settlements are sent on."""

    async def publish(self, subject: str, payload: bytes = b"") -> None: ...


async def send_logged(op: Awaitable[None], log: Any) -> None:
    """Await a settlement's publish; a failure is logged (the message is redelivered)."""
    try:
        await op
    except Exception as exc:  # noqa: BLE001 - an ack lost here is a redelivery later
        log.warning("ack could not be sent", error=repr(exc))


class Settlements:
    """One generation's unconfirmed settlements (per consumer) and the member's memory of
    completed messages, with a background task that confirms them."""

    def __init__(self, nc: Publisher, log: Any, stats: dict[str, int],
                 closing: asyncio.Event, completed: Completed | None = None, *,
                 confirm_interval: float = 0.5, confirm_timeout: float = 2.0,
                 reconnects: Callable[[], int] | None = None,
                 clock: Clock = LOOP_CLOCK) -> None:
        self._clock = clock
        self._nc = nc
        self._log = log
        self._stats = stats
        self._closing = closing
        self.completed: Completed = completed if completed is not None else OrderedDict()
        #: Per consumer: settled messages whose settlement the server has not confirmed.
        self._unconfirmed: dict[str, dict[int, Message]] = {}
        self._interval = confirm_interval
        self._timeout = confirm_timeout
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reconnects = reconnects or (
            lambda: int((getattr(nc, "stats", None) or {}).get("reconnects", 0)))
        self._epoch = self._reconnects()

    def start(self) -> None:
        self._task = asyncio.create_task(self._confirm_loop(), name="cgroupd-confirm")

    async def stop(self) -> asyncio.Task[None] | None:
        """Stop confirming in the background; returns the task (to report its failure)."""
        task, self._task = self._task, None
        if task is not None:
            # Cancelled until it ended: a confirmation request (nats-py's wait_for) can
            # swallow one cancellation, and its loop would go on (cgroupd.core.tasks).
            await cancel_and_wait(task)
        return task

    @property
    def unconfirmed(self) -> int:
        return sum(len(v) for v in self._unconfirmed.values())

    @property
    def stale(self) -> bool:
        """The connection was re-established since settlements were last confirmed: some
        sent before may be lost (:meth:`fence` before anything new starts)."""
        return self._reconnects() != self._epoch

    def connection_back(self) -> None:
        """Have unconfirmed settlements sent again and confirmed now, not at the next start."""
        self._wake.set()

    def remember(self, message: Message) -> None:
        """A message was acked or termed: remember it until its settlement is confirmed,
        and as completed (a redelivery is settled again, never run again)."""
        seq = message.stream_sequence
        completed = self.completed
        if seq in completed:
            completed.move_to_end(seq)
        completed[seq] = message.settlement or b"+ACK"
        while len(completed) > COMPLETED_MEMORY:
            completed.popitem(last=False)
        if not message.confirmed:
            pending = self._unconfirmed.get(message.consumer)
            if pending is None:
                pending = self._unconfirmed[message.consumer] = {}
            pending[seq] = message
            if not self._wake.is_set():
                self._wake.set()

    def resettle(self, message: Message) -> Awaitable[None] | None:
        """If ``message`` was completed already (its settlement lost with a reconnect, or
        late), mark it settled the same way and return the publish that settles it again;
        None if it was not."""
        done = self.completed.get(message.stream_sequence)
        if done is None:
            return None
        self._stats["resettled"] = self._stats.get("resettled", 0) + 1
        message.outcome = Outcome.TERM if done.startswith(b"+TERM") else Outcome.ACK
        message.settlement = done
        self._unconfirmed.setdefault(message.consumer, {})[message.stream_sequence] = message
        self._wake.set()
        return send_logged(self._nc.publish(message.reply, done), self._log)

    async def confirm(self, resend: bool = False) -> bool:
        """Have the server confirm every settlement sent so far; True once it has.

        Per consumer, the newest settlement is sent again as a request: its reply means
        the consumer applied it and every one sent before it. ``resend`` first publishes
        every unconfirmed settlement again (after a reconnect: some may be lost). A
        consumer that is gone has nothing left to confirm (its messages went, or go, to
        the next owner).
        """
        async with self._lock:
            epoch = self._reconnects()
            if epoch != self._epoch:
                resend = True
            ok = True
            for consumer, pending in list(self._unconfirmed.items()):
                batch = list(pending.values())
                if not batch:
                    continue
                if resend:
                    for message in batch:
                        await send_logged(self._nc.publish(message.reply, message.settlement),
                                          self._log)
                result = await batch[-1].confirm_settlement(self._timeout)
                if result is None:
                    ok = False
                    continue
                for message in batch:
                    if pending.get(message.stream_sequence) is message:
                        del pending[message.stream_sequence]
                if not pending:
                    self._unconfirmed.pop(consumer, None)
            if ok:
                self._epoch = epoch
            return ok

    async def fence(self) -> None:
        """Before anything new starts after a reconnect: settlements sent before it may be
        lost, and the server would redeliver them after later messages of their key."""
        if not self.stale:
            return
        if not self._unconfirmed:
            self._epoch = self._reconnects()
            return
        self._stats["ack_fences"] = self._stats.get("ack_fences", 0) + 1
        while not await self.confirm(resend=True) and not self._closing.is_set():
            await nap(0.05, self._closing)  # no reply yet (reconnecting): ask again shortly

    async def _confirm_loop(self) -> None:
        """Confirm settlements in the background (bounded memory, quick releases), until
        the dispatcher closes: a release confirms what is left itself. Ending then, and
        not only when cancelled, matters: a confirmation request can swallow the
        cancellation (nats-py's ``wait_for`` on Python 3.11), and the next one comes 0.1 s
        later (one SIGTERM handover in 20-40 took 0.11 s instead of 0.01)."""
        while not self._closing.is_set():
            await self._wake.wait()
            if self.unconfirmed < CONFIRM_BATCH:
                await nap(self._interval, self._closing)
            self._wake.clear()
            if not await self.confirm():
                await self._clock.sleep(self._interval)
                self._wake.set()
