"""``cgroupd join --handler tests.security.poison_handler:handle``: gives up on every
message at once (NonRetryable), so each becomes a dead letter."""

from __future__ import annotations

from cgroupd.core.errors import NonRetryable
from cgroupd.nats.message import Message


def handle(message: Message) -> None:
    raise NonRetryable(f"cannot handle {message.subject}")
