"""The active instance's self-check (ADR: its consumers still exist and name it) and the
fence every handler start passes: sync mode's lease, pinned mode's lease on the pin."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from cgroupd.core.answers import judge_answer
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import CgroupdError
from cgroupd.core.naming import (
    INSTANCE_KEY,
    TOKEN_KEY,
)
from cgroupd.member.generation import Generation
from cgroupd.member.state import StepDown

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore
    from cgroupd.member.modes import SyncMode

#: The longest pause between two self-checks of an idle active instance (seconds).
IDLE_CHECK_MAX = 16.0


class SelfCheck:
    """A job of the member's SyncMode (see the module docstring); a collaborator
    holding the member, not a mixin of it."""

    def __init__(self, member: MemberCore, mode: SyncMode) -> None:
        self.m = member
        self.mode = mode

    #: The last self-check was answered by a server out of touch with its cluster, or too
    #: late to renew the lease: one warning per episode.
    _out_of_touch = False
    #: Self-checks in a row that got no answer: one warning per outage, not one per try.
    _unanswered = 0

    async def verify_loop(self, gen: Generation) -> None:
        """ADR: the active instance checks its consumers still exist and name it; each
        confirmed check renews its lease.

        It also notices a data consumer that starves us, at three checks in a row: the
        server holds messages for it, none is unacknowledged and we hold none (a
        nats-server killed with SIGKILL can come back with consumer state that no longer
        matches its stream), or the server counts more unacknowledged deliveries than we
        hold or nak'ed with a delay still to run out (a delivery lost in a reconnect). A new
        data consumer starts cleanly from what the work-queue stream still holds.
        """
        starved = received = 0
        idle = 0  # checks in a row that found nothing arriving, held or waiting
        while not gen.ended.done():
            await self.m._sleep(self._check_pause(idle))
            gen.data_info = None
            if await self._check(gen) is not True or gen.data_info is None:
                continue
            info = gen.data_info
            dispatcher = gen.dispatcher
            holding = dispatcher.holding if dispatcher is not None else 0
            # A message nak'ed with a delay stays unacknowledged on the server until it is
            # redelivered, while we hold nothing of it: not a lost delivery (item 10).
            delayed = dispatcher.delayed() if dispatcher is not None else 0
            unacked = int(info.get("num_ack_pending", 0))
            waiting = int(info.get("num_pending", 0)) > 0
            quiet = gen.received == received and holding == 0
            # Starved: messages wait for us and nothing is unacknowledged, yet nothing
            # came since the last check (under steady traffic a check often finds one
            # message published and not yet delivered, and none unacknowledged: that is
            # no stall); or, with nothing arriving and nothing held, the server still
            # counts deliveries unacknowledged (lost in a reconnect): they would sit out
            # their ack wait.
            if (waiting and unacked == 0 and quiet) or (quiet and unacked > delayed):
                starved += 1
            else:
                starved = 0
            idle = idle + 1 if (quiet and not waiting and unacked == 0 and not delayed) \
                else 0
            received = gen.received
            if starved >= 3:
                gen.end(StepDown.STALLED, "data consumer stopped delivering pending messages")

    def _check_pause(self, idle: int) -> float:
        """Seconds until the next self-check, after ``idle`` idle checks in a row.

        Busy: every ``retry_interval``, so the lease never runs out while messages come.
        Idle: the pause doubles from ``lease - retry_interval`` up to :data:`IDLE_CHECK_MAX`
        (issue 27: self-checks were nearly all of an idle fleet's JetStream API requests,
        one a second per member). The lease then runs out while nothing comes, which costs
        the first message after the quiet one check's round trip before it starts
        (:meth:`hold_lease`); a lost claim is still heard at once (its deletion ends our
        pull on it), and a data consumer that starves us within ``IDLE_CHECK_MAX``.
        """
        s = self.m.settings
        if idle == 0:
            return s.retry_interval
        first = max(s.retry_interval, s.lease - s.retry_interval)
        return max(first, min(IDLE_CHECK_MAX, first * 2.0 ** min(idle - 1, 16)))

    async def _check(self, gen: Generation) -> bool | None:
        """One self-check at a time per generation, shared by everyone who asks (a
        generation whose lease ran out has every handler slot waiting for it)."""
        task = gen.verifying
        if task is None or task.done():
            task = gen.verifying = asyncio.ensure_future(self._verify(gen))
        return await asyncio.shield(task)

    async def _verify(self, gen: Generation) -> bool | None:
        """Do we still own the member? True (and the lease renewed from when the check was
        sent), False (the generation ends), None (no answer: the lease runs out meanwhile)."""
        sent = self.m._clock()
        names = list(gen.data)
        try:
            # At once, not one after the other: the answers come back together (one
            # wakeup of an idle member, not one per consumer).
            # Every answer is awaited, so a second failure is not left unretrieved.
            answers = await asyncio.gather(
                self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer),
                *(self.m.js.consumer_info(self.m._consume_stream, name) for name in names),
                return_exceptions=True)
            infos: list[dict[str, Any] | None] = []
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
                infos.append(answer)
            sync, *data = infos
        except CgroupdError as exc:
            if not self._unanswered:
                self.m._log.warning("self-check could not reach the server", error=str(exc))
            self._unanswered += 1
            return None
        if self._unanswered:
            self.m._log.info("self-check reached the server again",
                             unanswered_checks=self._unanswered)
            self._unanswered = 0
        # A clustered consumer's leader answers even when cut off from its replicas (and
        # from the meta leader that records a takeover): the answer proves the state it
        # shows only as of when it last heard from a quorum. An isolated node's answers thus
        # stop renewing the lease at once, while the majority side takes the member over.
        # An answer older than a whole lease proves nothing either way: right after a heal
        # the node that was cut off still answers for a moment with the consumers it led
        # before the cut (the previous owner's sync consumer, under the same name), and
        # believing it would end the new owner's generation for nothing (issue 13).
        judged = judge_answer((sync, *data), sent=sent, lease=self.m.settings.lease)
        meta = ConsumerInfo.of(sync).metadata
        if judged.stale:
            self._stale(judged.age, meta.get(INSTANCE_KEY))
            return None
        if sync is None or meta.get(INSTANCE_KEY) != self.m.instance_id \
                or meta.get(TOKEN_KEY) != self.m._token:
            gen.end(StepDown.SYNC_LOST, "sync consumer missing or owned by another instance"
                    f" ({meta.get(INSTANCE_KEY) if sync is not None else 'missing'})")
            return False
        # A consumer a rebalance replaced meanwhile is not missing.
        if any(info is None and name in gen.data for name, info in zip(names, data,
                                                                        strict=True)):
            gen.end(StepDown.DATA_LOST, "data consumer missing")
            return False
        data = [info for name, info in zip(names, data, strict=True) if name in gen.data]
        gen.data_info = {
            key: sum(int((info or {}).get(key, 0)) for info in data)
            for key in ("num_pending", "num_ack_pending")}
        gen.lease.renew(judged.as_of)
        if not gen.lease.valid:
            if judged.age > 0:
                self._stale(judged.age)
            elif not self._out_of_touch:
                # Answered, but after the lease it would renew had run out: an overloaded
                # server (issue 27's mass start), not one cut off from its cluster.
                self.m.stats["stale_checks"] += 1
                self.m._log.warning("self-check answered after the lease ran out (the server"
                                    " is slow); starting nothing until one is answered in "
                                    "time", answered_after=round(self.m._clock() - sent, 3))
                self._out_of_touch = True
            return None
        self._out_of_touch = False
        return True

    def _stale(self, age: float, owner: object = None) -> None:
        """A self-check answered by a server that last heard a quorum ``age`` s ago."""
        self.m.stats["stale_checks"] += 1
        if not self._out_of_touch:
            self.m._log.warning("self-check answered by a server out of touch with its "
                                "cluster; starting nothing", quorum_heard_ago=round(age, 3),
                                owner=owner)
        self._out_of_touch = True

    async def hold_lease(self, gen: Generation) -> bool:
        """Sync exclusivity: start only under a running lease. Once it has run out (cut
        off, stalled, disconnected), wait until a self-check confirms we still own the
        member (True) or shows we do not (False: the generation has ended)."""
        pause = min(0.1, self.m.settings.retry_interval)
        while not gen.ended.done():
            if gen.lease.valid and self.m.js.connected:
                return True
            self.m.stats["lease_checks"] += 1
            if await self._check(gen) is None:
                # A server that fails fast (503 while its cluster heals) is asked again
                # with a growing pause, up to half a second: not twenty times a second.
                await self.m._sleep(pause)
                pause = min(pause * 2, 0.5, self.m.settings.retry_interval)
        return False
