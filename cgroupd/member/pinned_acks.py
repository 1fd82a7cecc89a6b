"""Acks on the shared member consumer (pinned mode)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from cgroupd.core.errors import AckNotConfirmed, AckOutcomeUnknown
from cgroupd.member.generation import Generation


class PinnedAcks:
    """Acks on a consumer shared by several instances count only while this instance
    provably holds the pin: the server applies and confirms them from anyone."""

    def __init__(self, renew: Callable[[Generation], Awaitable[bool]],
                 gen: Generation) -> None:
        self._renew = renew
        self._gen = gen

    async def _ours(self) -> bool:
        lease = self._gen.pin_lease
        return lease is not None and (lease.valid or await self._renew(self._gen))

    async def before_ack(self) -> None:
        if not await self._ours():
            raise AckNotConfirmed("this instance no longer holds the pin: the ack was not "
                                  "sent, the message goes to the instance holding it now")

    async def after_confirm(self) -> None:
        if not await self._ours():
            raise AckOutcomeUnknown(
                "the ack was confirmed only after this instance lost the pin: it may also "
                "be delivered to the new holder")
