"""The message a handler receives: the original subject, its partition, and acks.

Acks are sent on the JetStream reply subject of the delivery, so they reach the data
consumer that delivered the message: after a takeover that consumer is gone and
``double_ack`` raises :class:`~cgroupd.core.errors.AckNotConfirmed`, which is what the ADR's
exactly-once pattern relies on.

``double_ack`` tells "not applied" from "unknown" (issue 13 item 8). When no reply comes,
it asks again: a consumer applies the acks it receives in order, so a confirmed repeat
proves the ack applied. When the consumer turns out to be gone, it looks the message up in
the work-queue stream: still stored means the ack was not applied (and never will be: the
consumer it was addressed to no longer exists); gone means either our ack deleted it or the
next owner processed it, which nobody can tell apart: :class:`AckOutcomeUnknown`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import NoReturn, Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd.core.errors import AckNotConfirmed, AckOutcomeUnknown, CgroupdError
from cgroupd.core.partitions import strip_partition
from cgroupd.nats import jsapi

#: Requests a ``double_ack`` sends at most when replies do not come.
ACK_ATTEMPTS = 2


def ack_subject_fields(reply: str | None) -> tuple[str, str, int, int]:
    """Stream, consumer, delivery count and stream sequence from a JetStream ack subject
    (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>``, or the
    longer form with domain and account hash); ValueError if it is not one. (What nats-py's
    ``Msg.metadata`` gives, without its per-message datetime and dataclasses: this runs
    for every delivery.)"""
    tokens = reply.split(".") if reply and reply.startswith("$JS.ACK.") else ()
    if len(tokens) == 9:
        at = 2
    elif len(tokens) >= 11:
        at = 4
    else:
        raise ValueError(f"not a JetStream ack subject: {reply!r}")
    delivered, sequence = tokens[at + 2], tokens[at + 3]
    if not (delivered.isascii() and delivered.isdigit()
            and sequence.isascii() and sequence.isdigit()):
        raise ValueError(f"not a JetStream ack subject: {reply!r}")
    return tokens[at], tokens[at + 1], int(delivered), int(sequence)


class AckGuard(Protocol):
    """Ownership checks around acks, for consumers shared by several instances (pinned
    mode), where the server applies and confirms acks from any of them."""

    async def before_ack(self) -> None:
        """Raise AckNotConfirmed when this instance can no longer prove it owns the message
        (nothing is sent then: the message stays with its owner)."""

    async def after_confirm(self) -> None:
        """Raise AckOutcomeUnknown when a confirmation cannot be trusted."""


class Delivery(Protocol):
    """A delivery as a pull hands it over (nats-py's ``Msg``): what the runtime may read of
    it before :meth:`Deliveries.message` wraps it."""

    subject: str
    reply: str
    data: bytes
    headers: dict[str, str] | None


class Outcome(Enum):
    """What happened to a message; the first acknowledgement wins."""

    ACK = "ack"
    NAK = "nak"
    TERM = "term"


@dataclass
class Message:
    """One delivered message. ``subject`` has the partition token stripped."""

    subject: str
    partition: int | None
    data: bytes
    headers: Mapping[str, str]
    stream_sequence: int
    delivery_count: int
    _nc: Client = field(repr=False)
    _reply: str = field(repr=False)
    outcome: Outcome | None = None
    #: The stream and consumer that delivered it (from the delivery's reply subject).
    stream: str = ""
    consumer: str = ""
    #: The settlement sent (``+ACK``, ``+TERM ...``), and whether the server confirmed it.
    settlement: bytes = field(default=b"", repr=False)
    confirmed: bool = False
    #: A ``double_ack`` raised: the handler was told the ack did not go through.
    ack_failed: bool = False
    #: Seconds a ``nak`` asked the server to wait before redelivering (None: at once).
    nak_delay: float | None = None
    _guard: AckGuard | None = field(default=None, repr=False)

    @classmethod
    def from_msg(cls, nc: Client, msg: Msg, guard: AckGuard | None = None) -> Message:
        """Wrap a JetStream delivery (its reply subject carries sequence and count);
        ValueError if it is not one."""
        return Deliveries(nc, guard).message(msg)

    @property
    def acknowledged(self) -> bool:
        return self.outcome is not None

    @property
    def reply(self) -> str:
        """The delivery's JetStream reply subject (where acks go)."""
        return self._reply

    async def _send(self, payload: bytes, outcome: Outcome | None) -> None:
        if outcome is not None:
            if self.outcome is not None:
                return
            if self._guard is not None and outcome is not Outcome.NAK:
                await self._guard.before_ack()
            self.outcome = outcome
            self.settlement = payload
        await self._nc.publish(self._reply, payload)

    async def ack(self) -> None:
        """Acknowledge: the message is done and leaves the work-queue stream. (What
        ``_send`` does, inlined: this runs for nearly every message.)"""
        if self.outcome is not None:
            return
        if self._guard is not None:
            await self._guard.before_ack()
        self.outcome = Outcome.ACK
        self.settlement = b"+ACK"
        await self._nc.publish(self._reply, b"+ACK")

    async def double_ack(self, timeout: float = 2.0) -> None:
        """Acknowledge and wait for the server to confirm that it applied the ack.

        Returns once applied: commit side effects then. Raises
        :class:`~cgroupd.core.errors.AckNotConfirmed` when the ack was not applied (this
        instance lost its data consumer to a takeover: roll back), and its subclass
        :class:`~cgroupd.core.errors.AckOutcomeUnknown` when no reply came and the outcome
        cannot be known: the message is in doubt (see the error's documentation). Waits
        up to ``timeout`` for each of at most :data:`ACK_ATTEMPTS` requests.
        """
        if self.outcome is not None and self.outcome is not Outcome.ACK:
            self.ack_failed = True
            raise AckNotConfirmed(f"message already {self.outcome.value}ed")
        try:
            if self._guard is not None:
                await self._guard.before_ack()
            await self._confirm(b"+ACK", timeout)
            self.outcome = Outcome.ACK
            self.settlement = b"+ACK"
            self.confirmed = True
            if self._guard is not None:
                await self._guard.after_confirm()
        except AckNotConfirmed:
            self.ack_failed = True
            raise

    async def _confirm(self, payload: bytes, timeout: float) -> None:
        seq = self.stream_sequence
        last: BaseException | None = None
        for _ in range(ACK_ATTEMPTS):
            try:
                reply = await self._nc.request(self._reply, payload, timeout=timeout)
            except nats.errors.NoRespondersError as exc:
                # Nobody listens for acks of this consumer: it is gone. An earlier attempt
                # of ours reached the server before this one did (one connection, in
                # order), so it was applied or dropped by now: the stream tells which.
                if last is None:
                    raise AckNotConfirmed(
                        f"ack of stream sequence {seq} not applied: the consumer that "
                        "delivered it is gone (another instance owns the partition now)"
                    ) from exc
                await self._after_consumer_gone(last)
            except (nats.errors.TimeoutError, TimeoutError,
                    nats.errors.ConnectionReconnectingError,
                    nats.errors.ConnectionClosedError) as exc:
                last = exc
                continue
            status = jsapi.server_status(reply)
            if status is not None and status.code != "200":
                raise AckNotConfirmed(f"server refused the ack of stream sequence {seq}: "
                                      f"status {status.code} {status.description}".rstrip())
            return
        raise AckOutcomeUnknown(
            f"ack of stream sequence {seq}: no reply to {ACK_ATTEMPTS} attempts ({last!r}); "
            "it may or may not have been applied")

    async def _after_consumer_gone(self, cause: BaseException) -> NoReturn:
        """An unanswered ack, and its consumer is gone: applied or not?"""
        seq = self.stream_sequence
        try:
            stored = await jsapi.message_stored(self._nc, self.stream, seq)
        except (CgroupdError, nats.errors.Error) as exc:
            raise AckOutcomeUnknown(
                f"ack of stream sequence {seq} unanswered ({cause!r}), its consumer is gone "
                f"and the stream could not be asked: {exc}") from exc
        if stored:
            raise AckNotConfirmed(
                f"ack of stream sequence {seq} not applied: unanswered ({cause!r}), its "
                "consumer is gone and the message is still in the stream")
        raise AckOutcomeUnknown(
            f"ack of stream sequence {seq} unanswered ({cause!r}) and its consumer is gone; "
            "the message has left the stream, by this ack or by the next owner's")

    async def confirm_settlement(self, timeout: float) -> bool | None:
        """Send this message's settlement again and wait for the server's reply: True
        once applied (with every settlement sent before it to the same consumer, which
        applies them in order), False when the consumer is gone, None when no reply came."""
        try:
            reply = await self._nc.request(self._reply, self.settlement or b"+ACK",
                                           timeout=timeout)
        except nats.errors.NoRespondersError:
            return False
        except (nats.errors.Error, TimeoutError):
            return None
        status = jsapi.server_status(reply)
        return None if status is not None and status.code != "200" else True

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery, after ``delay`` seconds if given."""
        payload = b"-NAK"
        if delay:
            payload += b" " + json.dumps({"delay": int(delay * 1e9)}).encode()
            if self.outcome is None:
                self.nak_delay = delay
        await self._send(payload, Outcome.NAK)

    async def term(self, reason: str = "") -> None:
        """Never redeliver this message."""
        payload = b"+TERM" + (b" " + reason.encode() if reason else b"")
        await self._send(payload, Outcome.TERM)

    async def in_progress(self) -> None:
        """Still working: reset the server's ack timer (may be sent many times)."""
        await self._send(b"+WPI", None)


class Deliveries:
    """The wire side of one generation's messages: wraps each delivery as a
    :class:`Message` that settles on ``nc`` (checked by ``guard``), and hands back a
    delivery it will not wrap. The dispatcher gets this instead of a nats-py client."""

    __slots__ = ("guard", "nc")

    def __init__(self, nc: Client, guard: AckGuard | None = None) -> None:
        #: The connection settlements are published on (a
        #: :class:`cgroupd.member.settlements.Publisher`).
        self.nc = nc
        self.guard = guard

    def message(self, delivery: Delivery) -> Message:
        """Wrap a JetStream delivery (its reply subject carries sequence and count);
        ValueError if it is not one. Runs for every delivery."""
        partition, subject = strip_partition(delivery.subject)
        stream, consumer, delivered, sequence = ack_subject_fields(delivery.reply)
        headers = delivery.headers
        return Message(
            subject=subject,
            partition=partition,
            data=delivery.data,
            headers=dict(headers) if headers else {},
            stream_sequence=sequence,
            delivery_count=delivered,
            _nc=self.nc,
            _reply=delivery.reply,
            stream=stream,
            consumer=consumer,
            _guard=self.guard,
        )

    def nak(self, delivery: Delivery) -> Awaitable[None]:
        """Ask for redelivery of a delivery without wrapping it (its reply subject must be
        set): hands it back to a consumer shared with other instances at once."""
        return self.nc.publish(delivery.reply, b"-NAK")
