"""Continuous pulling from one consumer (ADR-13 pull internals, ADR-37 ``consume``).

A :class:`Puller` keeps pull requests outstanding on a consumer so that it never looks
idle to the server, refills when fewer than half of the requested messages remain pending,
re-pulls after missed heartbeats or a reconnect, and turns the server's terminal statuses
into an outcome: the consumer was deleted (409 / no responders) or the pin was lost (423).
It is used for both the synchronization consumer (which never delivers a message: it only
proves liveness) and the data consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from cgroupd.core import logs
from cgroupd.core.answers import PullStatus, classify_pull_status
from cgroupd.core.clock import LOOP_CLOCK, Clock
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.nats import jsapi

log = logs.get_logger("cgroupd.pull")

PENDING_MSGS = "Nats-Pending-Messages"
#: Least byte budget of one pull request (see Puller._max_bytes).
PULL_MAX_BYTES = 8 << 20
PIN_ID = "Nats-Pin-Id"


def delivery_number(reply: str) -> int | None:
    """The consumer delivery sequence in a JetStream ack subject
    (``$JS.ACK.<stream>.<consumer>.<count>.<sseq>.<dseq>.<ts>.<pending>``, or the longer
    form with domain and account hash); None if it is not one."""
    if not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    if len(tokens) == 9:
        dseq = tokens[6]
    elif len(tokens) >= 11:
        dseq = tokens[8]
    else:
        return None
    return int(dseq) if dseq.isdigit() else None


class PullEnd(Enum):
    """Why a puller stopped for good."""

    CONSUMER_GONE = "consumer-gone"  # deleted, or no longer exists (409 / 503)
    PIN_LOST = "pin-lost"  # 423: another client is pinned now
    DELIVERY_LOST = "delivery-lost"  # a delivery went missing: replace the consumer
    STOPPED = "stopped"  # stop() was called
    FAILED = "failed"  # a status that no re-pull can fix (400, bad config)


@dataclass(frozen=True)
class PullOptions:
    """How a puller asks for messages. Seconds throughout."""

    batch: int = 1
    expires: float = 1.0
    heartbeat: float = 0.25
    #: Priority group to pull in (pinned mode), and whether a pin id is tracked.
    group: str | None = None
    #: This client is the consumer's only reader and the consumer is fresh: every
    #: delivery number must arrive, in order (not for consumers shared with others).
    check_gaps: bool = False
    #: Ask again half-way to the newest request's expiry, so that one is always waiting
    #: (pinned mode: pulls keep the pin). Off: ask again when a request ends (its 408),
    #: which halves an idle consumer's requests, heartbeats and expiries; a consumer
    #: with no waiting request for a round trip is still far from its inactive threshold.
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError("batch must be at least 1")
        if not 0 < self.heartbeat * 2 <= self.expires:
            raise ValueError("heartbeat must be positive and at most half of expires")


class Puller:
    """Keeps pull requests outstanding on one consumer; delivers its messages to a queue.

    ``ended`` resolves with a :class:`PullEnd` and a description when the puller stops for
    good; ``last_seen`` is the monotonic time of the last sign of life from the server.
    """

    def __init__(
        self,
        nc: Client,
        stream: str,
        consumer: str,
        options: PullOptions,
        on_message: Callable[[Msg], None] | None = None,
        clock: Clock = LOOP_CLOCK,
        capacity: Callable[[], int] | None = None,
    ) -> None:
        self._nc = nc
        self._capacity = capacity
        self._stream = stream
        self._consumer = consumer
        self._opts = options
        self._on_message = on_message
        self._clock = clock.now
        self._sleep = clock.sleep
        self._subject = jsapi.pull_subject(stream, consumer, jsapi.api(nc))
        self._inbox = ""
        self._sub: Subscription | None = None
        self._pending = 0
        self._pulled_at = 0.0
        self._retiring = False
        self._hushed = False
        #: A delivery went missing (see :meth:`_lost_delivery`): nothing more is handed on
        #: or asked for.
        self._gapped = False
        self._paused = False
        self._quiet_until = 0.0
        self._task: asyncio.Task[None] | None = None
        #: Pull requests sent and held back, and the newest status, for :meth:`describe`.
        self._sent = 0
        self._held_back = 0
        self._last_status = ""
        self._wake = asyncio.Event()
        self.pin_id: str | None = None
        #: The server answered our pin id with 423 "Nats-Wrong-Pin-Id": ask for nothing
        #: until the member says whether the pin moved (over) or went with its consumer
        #: leader (:meth:`repin`).
        self.pin_refused = False
        #: Called when the pin changes under us (a 423 refused our pin id, or a delivery
        #: brought a new one): the member checks the pin at once rather than at its next
        #: renewal (issue 29: each renewal period waited cost a rolling restart 0.4 s).
        self.on_pin_news: Callable[[], None] | None = None
        #: When the delivery that brought ``pin_id`` arrived (the server pinned us before).
        self.pinned_at = -math.inf
        #: When the newest pull carrying ``pin_id`` was sent (pinned mode: the lease).
        self.pin_pulled_at = -math.inf
        #: Called before a delivery is handed on whose number does not follow the last
        #: one's (pinned mode, where a gap may be benign: a new consumer leader numbers
        #: from what it knew, a reset): one in between may have been lost on its way, and
        #: the member checks before it starts anything more.
        self.on_gap: Callable[[int, int], None] | None = None
        #: Consumer delivery sequence of the newest delivery handed to the callback.
        self.last_delivery = 0
        self.last_seen = clock.now()
        self.ended: asyncio.Future[tuple[PullEnd, str]] = (
            asyncio.get_running_loop().create_future()
        )

    @property
    def consumer(self) -> str:
        return self._consumer

    @property
    def inbox(self) -> str:
        """Where the server delivers this puller's messages ("" before :meth:`start`)."""
        return self._inbox

    @property
    def delivers(self) -> bool:
        """Whether messages from this consumer are handled (it has a capacity)."""
        return self._capacity is not None

    async def start(self) -> None:
        """Subscribe the inbox and begin pulling."""
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._receive)
        self._task = asyncio.create_task(self._run(), name=f"pull:{self._consumer}")

    async def stop(self) -> None:
        """Stop pulling and drop the inbox; idempotent."""
        self._end(PullEnd.STOPPED, "stopped")
        await self._end_task()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def pause(self) -> None:
        """Ask for nothing more, but keep receiving what earlier requests bring (a member
        that drains before releasing its own consumer: nothing new to start, and no naks
        that the server would answer with the same message again at once)."""
        self._paused = True
        await self._end_task()

    def reconnected(self) -> None:
        """The connection was re-established: requests made before it are gone with the
        old connection, so forget them and ask again now rather than after the
        missed-heartbeat watchdog's timeout."""
        self._pending = 0
        self._pulled_at = 0.0
        self._quiet_until = 0.0
        self.last_seen = self._clock()
        self._wake.set()

    async def retire(self, timeout: float) -> None:
        """Stop asking, but listen until the requests we made are answered (or timeout).

        A message the server still hands to one of them is nak'ed at once, so another
        client gets it now rather than after the ack wait. Pinned mode needs this: after
        an unpin the server may pick a request of ours that is still waiting.
        """
        self._retiring = True
        await self._end_task()
        deadline = self._clock() + timeout
        while self._pending > 0 and self._clock() < deadline:
            await self._sleep(0.01)
        await self.stop()

    async def flush_received(self) -> None:
        """Return once every message the server sent before now has reached the callback.

        A reply received on this connection after a change (a consumer update) follows
        every delivery the server sent before it; those sit in this subscription's queue
        until its task hands them to the callback.
        """
        # nats-py offers no event for an emptied subscription queue: poll it.
        while self._sub is not None and self._sub.pending_msgs > 0:
            await self._sleep(0.001)
        await asyncio.sleep(0)

    async def received_through(self, delivery: int, timeout: float) -> bool:
        """Wait until the delivery numbered ``delivery`` (or a later one) reached the
        callback; False after ``timeout``. After a consumer update, every delivery of the
        old filters is numbered at most the ``delivered.consumer_seq`` it answers with."""
        deadline = self._clock() + timeout
        while self.last_delivery < delivery:
            if self._clock() > deadline or self.ended.done():
                return False
            await self._sleep(0.001)
        return True

    async def _end_task(self) -> None:
        """Stop the pull loop. Python 3.11's wait_for can swallow a cancellation that
        races with its timeout (its loop then goes on): cancel until it has ended."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    def _end(self, why: PullEnd, description: str) -> None:
        if not self.ended.done():
            self.ended.set_result((why, description))
        self._wake.set()

    def _wanted(self) -> int:
        """Messages to ask for now: refill once half the batch is used up. With a
        ``capacity`` (free handler slots), ask only for what can be taken at once: the
        server serves a request that arrives after an ack faster than one that waited
        for the ack."""
        want = self._free() - self._pending
        return want if want > 0 and want >= (self._opts.batch + 1) // 2 else 0

    @property
    def outstanding(self) -> int:
        """Messages our pull requests may still bring (0: nothing can be in flight)."""
        return self._pending

    def repin(self) -> None:
        """The pin went with the consumer's old leader (nats-server keeps it in the
        leader's memory only): ask without a pin id, so the new leader pins us again."""
        self.pin_id = None
        self.pin_refused = False
        self._wake.set()

    @property
    def hushed(self) -> bool:
        """Whether pull requests are held back (see :meth:`hush`)."""
        return self._hushed

    def hush(self, hushed: bool = True) -> None:
        """Send no pull request while hushed (requests already made run their course)."""
        self._hushed = hushed
        if not hushed:
            self._wake.set()

    async def pull_one(self) -> None:
        """Send one more pull request now (pinned mode: it renews the pin's TTL), one that
        brings no message: the server resets the pin's timer when it reads a request and
        ends this one (409 Message Size Exceeds MaxBytes) before it would deliver. A
        renewal that brought one took the member consumer's spare delivery
        (:data:`cgroupd.core.settings.PIN_SPARE`) from a full window, and a holder stopped
        then left nobody pinnable until the ack wait."""
        if self._task is not None and not self._retiring:
            await self._pull(1, renew_only=True)

    @property
    def room(self) -> int:
        """Messages :meth:`refill` would ask for now (0: it would send nothing). A plain
        check, so the per-message paths await no coroutine when nothing is due."""
        return self._wanted() if self._asking else 0

    @property
    def _asking(self) -> bool:
        return self._task is not None and not (self._retiring or self._paused or self._gapped)

    def _free(self) -> int:
        """Messages we could take now (the batch, or the free handler slots)."""
        return self._opts.batch if self._capacity is None else self._capacity()

    async def refill(self) -> None:
        """Ask for more if there is room (the dispatcher calls this as messages settle)."""
        want = self.room
        if want:
            await self._pull(want)

    async def _run(self) -> None:
        """Pull whenever there is room, when the newest request is half-way to expiry,
        or when the server went quiet."""
        opts = self._opts
        quiet_limit = opts.heartbeat * 3
        while not self.ended.done() and not self._retiring:
            want = self._wanted()
            if want:
                await self._pull(want)
            elif opts.overlap and self._clock() - self._pulled_at >= opts.expires / 2:
                # Overlap requests so one with interest is always waiting: the server keeps
                # a consumer with a waiting request alive, so a stall shorter than half the
                # expiry plus the inactive threshold never costs us our consumers.
                await self._pull(1)
            self._wake.clear()
            # Not wait_for: on Python 3.11 it can swallow a cancellation that races with
            # its timeout, and this loop would go on after stop() or pause().
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=opts.heartbeat)
            finally:
                waiter.cancel()
            if self._clock() - self.last_seen > quiet_limit:
                # Missed heartbeats (ADR-37): the request is lost (server restart,
                # reconnect, partition); forget it and ask again.
                self._pending = 0
                self.last_seen = self._clock()

    async def _pull(self, batch: int, renew_only: bool = False) -> None:
        if batch <= 0 or self._hushed or self.pin_refused or not self._nc.is_connected \
                or self._clock() < self._quiet_until:
            self._held_back += batch > 0
            return
        pin = self.pin_id
        body = jsapi.pull_body(batch, self._opts.expires, self._opts.heartbeat,
                               self._opts.group, pin, 1 if renew_only else self._max_bytes())
        sent = self._clock()
        try:
            await self._nc.publish(self._subject, body, reply=self._inbox)
        except Exception:  # noqa: BLE001 - reconnecting/closed: the watchdog retries
            return
        self._sent += 1
        self._pending += batch
        self._pulled_at = self._clock()
        if pin is not None and pin == self.pin_id:
            self.pin_pulled_at = sent

    async def _receive(self, msg: Msg) -> None:
        self.last_seen = self._clock()
        status = jsapi.server_status(msg)
        if status is None:
            self._pending = max(0, self._pending - 1)
            if self._gapped:
                # Past a lost delivery (see _lost_delivery): later ones follow the first
                # after the gap without a gap of their own, and handing them on let them
                # overtake the lost message of their key (issue 29: two completions out
                # of order). They stay unacknowledged and go with this consumer; the one
                # that replaces it delivers from the lost message on, in stream order.
                return
            number = delivery_number(msg.reply or "")
            if number is not None:
                previous, self.last_delivery = self.last_delivery, number
                if number != previous + 1 and previous and self.on_gap is not None \
                        and not self._retiring:
                    self.on_gap(previous + 1, number)
                if self._opts.check_gaps and not self._retiring \
                        and self._lost_delivery(previous, number):
                    return
            if self._retiring:
                with contextlib.suppress(Exception):
                    await self._nc.publish(msg.reply, b"-NAK")
                return
            newly_pinned = False
            if self._opts.group:
                pin = msg.headers.get(PIN_ID) if msg.headers else None
                if pin:
                    newly_pinned = pin != self.pin_id
                    if newly_pinned:
                        self.pinned_at = self._clock()
                    self.pin_id = pin
            if self._on_message is not None:
                self._on_message(msg)
            if newly_pinned and self.on_pin_news is not None:
                self.on_pin_news()
            want = self.room
            if newly_pinned and self._asking:
                # Requests we sent before the pin carry no pin id (or an old one), and the
                # server may serve them no more: a previous holder's handed-back messages
                # waited a whole pinned TTL for the consumer reset. Ask again, with it.
                # The old ones stay counted until they end: they may still bring a
                # delivery, and a reset waits for ``outstanding`` (forgetting them cost
                # per-key order in the 50-toggle test).
                want = max(want, self._free())
            if want:
                await self._pull(want)
            return
        self._status(status.code, status.description, msg)

    def _max_bytes(self) -> int:
        """Bytes one request may bring: enough for two messages of the largest size, and
        little enough that our few overlapping requests stay well under what the server
        lets pile up for one client (64 MiB by default) before it drops the connection as
        a slow consumer (a burst of 1 MiB messages to 256 slots did)."""
        return max(PULL_MAX_BYTES, 2 * (self._nc.max_payload or 0))

    def _lost_delivery(self, previous: int, delivery: int) -> bool:
        """Deliveries are numbered: a gap means one never reached us (a reconnect, a
        server restart, or a consumer leader change: nats-server 2.15 sends a replicated
        consumer's delivery once its delivered state is applied, a leader that steps down
        drops the ones it has not sent yet, and the next leader numbers after them). Its
        message stays unacknowledged on the server, and handling this one or any later
        one first could break per-key order, so none is handed on (see :meth:`_receive`)
        and this consumer must be replaced. (A message that is not a JetStream delivery
        has no number: the dispatcher says so.)"""
        expected = previous + 1
        if delivery != expected:
            self._gapped = True  # neither this one nor any later one is handed on
            self._end(PullEnd.DELIVERY_LOST,
                      f"delivery {expected} never arrived (got {delivery})")
            return True
        return False

    def describe(self) -> dict[str, object]:
        """The puller's state for a log line (no pin id: only whether one is held)."""
        task = self._task
        return {"outstanding": self._pending, "hushed": self._hushed,
                "refused": self.pin_refused, "pinned": self.pin_id is not None,
                "running": task is not None and not task.done(),
                "connected": self._nc.is_connected, "requests_sent": self._sent,
                "requests_held_back": self._held_back, "last_status": self._last_status,
                "quiet_for": round(self._clock() - self.last_seen, 3),
                "asked_ago": round(self._clock() - self._pulled_at, 3)}

    def _status(self, status: str, description: str, msg: Msg) -> None:
        headers = msg.headers or {}
        kind = classify_pull_status(status, description)
        if kind is PullStatus.HEARTBEAT:
            return  # idle heartbeat (or flow control, not used by pulls): just liveness
        self._last_status = f"{status} {description}"
        log.debug("pull status", consumer=self._consumer, status=status, description=description,
                 pending=headers.get(PENDING_MSGS))
        if kind in (PullStatus.REQUEST_DONE, PullStatus.ASK_AGAIN):
            # The request ended (or a passing 409: leadership change, max waiting, batch
            # completed): what it did not bring is asked for again.
            left = headers.get(PENDING_MSGS)
            self._pending = max(0, self._pending - int(left)) if left else 0
            self._wake.set()
        elif kind is PullStatus.CONSUMER_DELETED:
            self._end(PullEnd.CONSUMER_GONE, f"consumer deleted ({description})")
        elif kind is PullStatus.REJECTED:
            self._end(PullEnd.FAILED, f"pull rejected: {description}")
        elif kind in (PullStatus.PIN_LOST, PullStatus.WRONG_PIN_ID):
            left = headers.get(PENDING_MSGS)
            self._pending = max(0, self._pending - (int(left) if left else self._opts.batch))
            if kind is PullStatus.WRONG_PIN_ID and self._opts.group:
                # A request carrying a pin id that is not (or no longer) the leader's: it
                # moved to another client, or went with a consumer leader change. The
                # member's next renewal tells which; no request until then, so we are not
                # pinned again after an unpin. With no pin id now (being pinned again),
                # it is an older request of ours answered: nothing more to learn.
                if self.pin_id is not None and not self.pin_refused:
                    log.info("pin id refused; waiting for the pin check",
                             consumer=self._consumer, description=description)
                    self.pin_refused = True
                    if self.on_pin_news is not None:
                        self.on_pin_news()
                self._wake.set()
                return
            self.pin_id = None
            self._end(PullEnd.PIN_LOST, f"pin lost ({description})")
        elif kind is PullStatus.NO_RESPONDERS:
            # No responder for the pull: the consumer is gone, or (in a cluster) it is
            # electing a new leader. Not ours to decide: ask again a little later; the
            # member's self-check asks the server whether the consumer still exists.
            self._pending = 0
            self._quiet_until = self._clock() + self._opts.heartbeat
        else:
            self._end(PullEnd.FAILED, f"pull failed: status {status} {description}")
