"""What the member runtime needs from JetStream: the seam between them.

:class:`cgroupd.nats.jetstream.JetStream` (nats-py) implements it; a fake can implement it to
test the runtime's state machine without a server. The runtime (:mod:`cgroupd.member`,
:mod:`cgroupd.member`) sees only this: no nats-py import, no raw ``$JS.API`` subject.
Errors are :mod:`cgroupd.core.errors` (``ConsumerExists``, ``WorkQueueOverlap``, ...).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from cgroupd.nats.jetstream import Record
from cgroupd.nats.lease import Answer, OwnerWatch, Prober
from cgroupd.nats.pull import Puller, PullOptions


class Subscription(Protocol):
    """A subscription the runtime ends when it stops."""

    async def unsubscribe(self, limit: int = 0) -> None: ...


class JetStreamPort(Protocol):
    """Consumers, the group record, presence, pulls: everything a member instance does."""

    #: The connection messages are settled on: the runtime only hands it to
    #: :class:`cgroupd.nats.message.Deliveries` (the dispatcher never touches it).
    nc: Any

    # -- consumers (errors: ConsumerExists, WorkQueueOverlap, ConsumerNotFound, ...) ------
    async def create_consumer(self, stream: str, name: str, config: dict[str, Any],
                              action: str = "create") -> dict[str, Any]: ...

    async def delete_consumer(self, stream: str, name: str) -> bool: ...

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None: ...

    async def list_consumers(self, stream: str) -> list[dict[str, Any]]: ...

    async def step_down_consumer_leader(self, stream: str, name: str) -> None: ...

    @property
    def server_name(self) -> str: ...

    async def reset_consumer(self, stream: str, consumer: str,
                             seq: int = 0) -> dict[str, Any]: ...

    async def unpin(self, stream: str, consumer: str, group: str) -> None: ...

    async def puller(self, stream: str, consumer: str, options: PullOptions,
                     on_message: Callable[[Any], None] | None = None,
                     capacity: Callable[[], int] | None = None) -> Puller: ...

    # -- the group record ------------------------------------------------------------
    def watch_record(self, bucket: str, key: str) -> AsyncIterator[Record]: ...

    async def get_record(self, bucket: str, key: str) -> Record | None: ...

    # -- the connection, presence, notifications -------------------------------------
    def on_connection(self, lost: Callable[[], None],
                      back: Callable[[], None]) -> Callable[[], None]: ...

    @property
    def connected(self) -> bool: ...

    async def notify(self, subject: str,
                     callback: Callable[[], Awaitable[None] | None]) -> Subscription: ...

    async def watch_deletion(self, stream: str, consumer: str,
                             callback: Callable[[str], Awaitable[None] | None]
                             ) -> Subscription: ...

    async def serve(self, subject: str,
                    respond: Callable[[bytes], str | None]) -> Subscription: ...

    async def answer(self, subject: str,
                     text: Callable[[], str | None]) -> Subscription: ...

    async def probe(self, subject: str, timeout: float, body: bytes = b"") -> Answer: ...

    def prober(self, subject: str, watch: OwnerWatch, clock: Callable[[], float],
               on_replaceable: Callable[[], None] | None = None) -> Prober: ...

    async def confirm_ack(self, reply: str, timeout: float) -> bool: ...

    async def message_stored(self, stream: str, seq: int) -> bool: ...

    async def flush(self, timeout: float) -> None: ...
