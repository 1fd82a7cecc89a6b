"""The message a handler receives: the original subject, its partition, and acks.

Acks are sent on the JetStream reply subject of the delivery, so they reach the data
consumer that delivered the message: after a takeover that consumer is gone and
``double_ack`` raises :class:`~cgroupd.errors.AckNotConfirmed`, which is what the ADR's
exactly-once pattern relies on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd import jsapi
from cgroupd.errors import AckNotConfirmed, AckOutcomeUnknown
from cgroupd.partitions import strip_partition


class AckGuard(Protocol):
    """Ownership checks around acks, for consumers shared by several instances (pinned
    mode), where the server applies and confirms acks from any of them."""

    async def before_ack(self) -> None:
        """Raise AckNotConfirmed when this instance can no longer prove it owns the message
        (nothing is sent then: the message stays with its owner)."""

    async def after_confirm(self) -> None:
        """Raise AckOutcomeUnknown when a confirmation cannot be trusted."""


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
    _guard: AckGuard | None = field(default=None, repr=False)

    @classmethod
    def from_msg(cls, nc: Client, msg: Msg, guard: AckGuard | None = None) -> Message:
        """Wrap a JetStream delivery (its reply subject carries sequence and count)."""
        partition, subject = strip_partition(msg.subject)
        meta = msg.metadata
        return cls(
            subject=subject,
            partition=partition,
            data=msg.data,
            headers=dict(msg.headers or {}),
            stream_sequence=meta.sequence.stream,
            delivery_count=meta.num_delivered,
            _nc=nc,
            _reply=msg.reply,
            _guard=guard,
        )

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
        await self._nc.publish(self._reply, payload)

    async def ack(self) -> None:
        """Acknowledge: the message is done and leaves the work-queue stream."""
        await self._send(b"+ACK", Outcome.ACK)

    async def double_ack(self, timeout: float = 2.0) -> None:
        """Acknowledge and wait for the server to confirm it.

        Raises AckNotConfirmed when the server does not confirm, for example because this
        instance lost its data consumer to a takeover: roll back side effects then.
        """
        if self.outcome is not None and self.outcome is not Outcome.ACK:
            raise AckNotConfirmed(f"message already {self.outcome.value}ed")
        if self._guard is not None:
            await self._guard.before_ack()
        try:
            reply = await self._nc.request(self._reply, b"+ACK", timeout=timeout)
        except nats.errors.TimeoutError as exc:
            # The ack may have been applied and only its reply lost (or late): in doubt.
            raise AckOutcomeUnknown(
                f"ack of stream sequence {self.stream_sequence}: no reply ({exc!r}); it may "
                "or may not have been applied") from exc
        except nats.errors.NoRespondersError as exc:
            raise AckNotConfirmed(
                f"ack of stream sequence {self.stream_sequence} was not confirmed: {exc!r}"
            ) from exc
        except (nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError) as exc:
            raise AckNotConfirmed(f"not connected, ack not confirmed: {exc!r}") from exc
        status = jsapi.server_status(reply)
        if status is not None and status.code != "200":
            raise AckNotConfirmed(f"server refused the ack: status {status.code} "
                                  f"{status.description}".rstrip())
        self.outcome = Outcome.ACK
        if self._guard is not None:
            await self._guard.after_confirm()

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery, after ``delay`` seconds if given."""
        payload = b"-NAK"
        if delay:
            payload += b" " + json.dumps({"delay": int(delay * 1e9)}).encode()
        await self._send(payload, Outcome.NAK)

    async def term(self, reason: str = "") -> None:
        """Never redeliver this message."""
        payload = b"+TERM" + (b" " + reason.encode() if reason else b"")
        await self._send(payload, Outcome.TERM)

    async def in_progress(self) -> None:
        """Still working: reset the server's ack timer (may be sent many times)."""
        await self._send(b"+WPI", None)
