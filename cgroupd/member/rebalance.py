"""Incremental rebalance (issue 9): apply a membership change in place, moving only the
partitions that change; sync exclusivity moves them between data consumers."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import (
    CgroupdError,
    ConsumerNotFound,
    WorkQueueOverlap,
)
from cgroupd.core.naming import (
    HOLDER_KEY,
    INSTANCE_KEY,
)
from cgroupd.core.partitions import (
    idle_filter,
    member_consumer_filters,
    partition_filters,
    sync_claimed,
    sync_filters,
)
from cgroupd.member.generation import Generation
from cgroupd.nats import jsapi
from cgroupd.nats.adapter import JetStreamPort
from cgroupd.nats.lease import (
    Presence,
    confirm_gone,
    owner_presence_subject,
)

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore
    from cgroupd.member.modes import SyncMode

#: Seconds between two attempts to claim partitions another member is releasing.
CLAIM_POLL = 0.05
#: Seconds between two looks for a gone previous owner's claim while claiming.
RECLAIM_EVERY = 0.25
#: Seconds (lowest, highest) a member waits, at random, before claiming again partitions
#: whose claim it let go because another member's claim raced it.
CONTEST_BACKOFF = (0.02, 0.15)


async def other_holders(js: JetStreamPort, stream: str, own: str, gained: Iterable[int],
                        held: Callable[[ConsumerInfo], set[int]]) -> list[ConsumerInfo]:
    """The consumers other than ``own`` that hold any of ``gained`` (``held``: what a
    consumer holds), as one consumer list reads them."""
    wanted = set(gained)
    return [info for info in map(ConsumerInfo, await js.list_consumers(stream))
            if info.name != own and held(info) & wanted]


async def claim_contested(js: JetStreamPort, stream: str, own: str, gained: Iterable[int],
                          held: Callable[[ConsumerInfo], set[int]]) -> bool:
    """After the server accepted our consumer ``own``'s claim on ``gained``: does another
    consumer hold any of them too (``held``: what a consumer holds)?

    nats-server checks a work queue's filter overlap without excluding a concurrent
    update, so a claim widened in place and another claim (update or create) made at the
    same moment can both be accepted (probe: tests/integration/test_workqueue_claim_race.py).
    Each claimant lists the consumers after its own claim was applied, so of two racing
    claims at least one sees the other: it lets go and tries again after a random
    ``CONTEST_BACKOFF``. One consumer list per claim."""
    return bool(await other_holders(js, stream, own, gained, held))


async def recheck_claim(js: JetStreamPort, stream: str, own: str,
                        config: dict[str, object]) -> bool:
    """After the server accepted our new consumer ``own`` (a claim made with ``config``):
    was another claim on some of its partitions accepted at the same moment? Asked as an
    update of ``own`` that changes nothing, which the server checks against the other
    consumers as they are now (probe: tests/integration/test_workqueue_claim_race.py).
    Sound for the same reason as :func:`claim_contested`: of two racing claims, the
    later applied one's check sees the earlier. One small request, whatever the number
    of consumers (issue 27). True: contested (refused as overlapping)."""
    try:
        await js.create_consumer(stream, own, dict(config), action="update")
    except WorkQueueOverlap:
        return True
    return False


def contest_backoff() -> float:
    """How long to wait before claiming again after letting a contested claim go."""
    return random.uniform(*CONTEST_BACKOFF)


def sync_claim(info: ConsumerInfo) -> set[int]:
    """The partitions a sync-mode member's synchronization consumer claims."""
    return sync_claimed(info.filters)


def claims_or_delivers(info: ConsumerInfo) -> set[int]:
    """The partitions a sync-mode consumer claims (sync) or delivers (data)."""
    return sync_claimed(info.filters) | member_consumer_filters(info.filters)[0]


class Rebalance:
    """A job of the member's SyncMode (see the module docstring); a collaborator
    holding the member, not a mixin of it."""

    def __init__(self, member: MemberCore, mode: SyncMode) -> None:
        self.m = member
        self.mode = mode

    #: The consumer list made right after our last accepted claim showed no other
    #: consumer with any of the gained partitions (no previous owner's to wait for).
    _claimed_free: bool = False

    async def move_partitions(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """One incremental rebalance; False means fall back to a full rejoin.

        Losing: the data consumer's filters drop the lost partitions; every delivery made
        before (numbered at most what the update answers) is taken in and finished, our
        acks are confirmed applied, and only then does the sync consumer let them go, so
        the next owner never gets a message we still hold or finished. Late deliveries of
        them are never run (issue 13 item 11). Gaining: once the sync consumer holds them,
        the member's data consumer is replaced, at a quiet point, by one fresh consumer
        for all its partitions, so the member keeps one consumer and its in-flight limit
        (max in flight 1 keeps the member in stream order)."""
        s = self.m.settings
        assert gen.dispatcher is not None
        kept = tuple(p for p in gen.partitions if p in target)
        lost = set(gen.partitions) - set(target)
        if not kept and gen.partitions:
            if not await self._release_all(gen):
                return False
        elif lost:
            for name, parts in list(gen.data.items()):
                left = tuple(p for p in parts if p not in lost)
                if left == parts:
                    continue
                if not left:
                    return False  # a consumer of lost partitions only: rejoin instead
                reply = await self.m._update_filters(name, partition_filters(left))
                delivered = ConsumerInfo(reply).delivered_consumer_seq
                puller = next((p for p in gen.pullers if p.consumer == name), None)
                if puller is None or not await puller.received_through(
                        delivered, s.drain_timeout):
                    return False
                gen.data[name] = left
            if not await gen.dispatcher.settle(lost, s.drain_timeout):
                return False
            if not await self.m._acks_confirmed(gen):
                return False
            gen.dispatcher.accept = set(kept)
            await self.m._gone(gen, lost)  # settled, confirmed; still claimed by us
            await self.m._update_filters(self.m.sync_consumer, sync_filters(kept))
            gen.partitions = kept
            self.mode.move_steps["released"] = self.m._clock()
        gained = tuple(p for p in target if p not in gen.partitions)
        if gained:
            claimed = await self._claim(gen, target, gained)
            if claimed is not True:
                return claimed is None  # None: superseded, the loop goes again
            self.mode.move_steps["claimed"] = self.m._clock()
            # Claimed: the previous owners are done with them, but an abandoned data
            # consumer may still hold them; only then pause for the swap (a move that
            # kept nothing has no consumer to swap: its create finds out).
            deadline = self.m._clock() + s.drain_timeout + 2 * s.retry_interval
            free = self._claimed_free  # the claim's own consumer list: nothing to wait for
            while gen.data and not free and not await self._reclaim_released(gen, set(gained)):
                if gen.ended.done():
                    return False
                if gen.target != target:
                    # Superseded: nothing else would ever let go of the claim on
                    # ``gained`` (the next move starts from ``gen.partitions``).
                    await self._let_claim_go(gen)
                    return True
                if self.m._clock() > deadline:
                    return False
                await self.m._sleep(0.05)
            await self.m._assigned(gen, gained)  # before their consumer delivers any
            if not gen.data:
                await self._claim_data_consumer(gen, target)
            elif not await self._replace_data_consumer(gen, target):
                return False
            gen.partitions = target
            self.mode.move_steps["consuming"] = self.m._clock()
        return True

    async def _claim(self, gen: Generation, target: tuple[int, ...],
                     gained: tuple[int, ...]) -> bool | None:
        """Widen our claim (the sync consumer) to ``target``, waiting while previous
        owners finish with ``gained``; None when superseded by another change.

        A refused update costs the server one request (the config is read once): the
        previous owners let go within a few tenths of a second of each other, and
        every one of them waits for nothing but its own handlers, so polling finds each
        partition soon after it is released. A claim whose holder is gone (a killed
        member) is reclaimed, checked every ``RECLAIM_EVERY``: listing the stream's
        consumers is dear with many members."""
        s = self.m.settings
        deadline = self.m._clock() + s.drain_timeout + 2 * s.retry_interval
        info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
        if info is None:
            raise ConsumerNotFound(404, jsapi.ERR_CONSUMER_NOT_FOUND,
                                   f"consumer {self.m.sync_consumer} disappeared")
        config = dict(info["config"])
        config.pop("filter_subject", None)
        config["filter_subjects"] = sync_filters(target)
        next_reclaim = self.m._clock() + RECLAIM_EVERY
        while True:
            if gen.ended.done() or gen.target != target:
                return None if gen.target != target else False
            try:
                await self.m.js.create_consumer(self.m._consume_stream, self.m.sync_consumer,
                                                config, action="update")
            except WorkQueueOverlap:
                if self.m._clock() > deadline:
                    raise
            else:
                others = await other_holders(self.m.js, self.m._consume_stream,
                                             self.m.sync_consumer, gained, claims_or_delivers)
                if not any(sync_claim(info) & set(gained) for info in others):
                    self._claimed_free = not others
                    return True
                # Accepted together with another member's claim (see claim_contested).
                self.m._log.info("claim contested; letting go and trying again",
                                 partitions=list(gained))
                await self._let_claim_go(gen)
                await self.m._sleep(contest_backoff())
                if self.m._clock() > deadline:
                    return False
                continue
            if self.m._clock() >= next_reclaim:
                # Still claimed: by a previous owner finishing (wait), or by a dead one
                # whose claim nobody will release (reclaimed).
                await self._reclaim_released(gen, set(gained))
                next_reclaim = self.m._clock() + RECLAIM_EVERY
            await self.m._sleep(CLAIM_POLL)

    async def _let_claim_go(self, gen: Generation) -> None:
        """Narrow our claim (the sync consumer) back to the partitions we consume."""
        await self.m._update_filters(self.m.sync_consumer, sync_filters(gen.partitions)
                                     if gen.partitions else [idle_filter(self.m.member)])

    async def _release_all(self, gen: Generation) -> bool:
        """Let every partition go while staying the member's active instance (none is
        kept): at a quiet point (nothing running, our acks applied) drop the data
        consumer(s), then narrow the claim to a filter that overlaps nothing, so that
        the next owners can take them while we wait for ours. Held, unstarted messages
        go back with the consumer, in stream order, to the next owner."""
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        dispatcher.pause()
        try:
            if not await self._drop_data_consumers(gen):
                return False
            dispatcher.accept = set()
            self.mode.move_steps["deleted"] = self.m._clock()
            await self.m._gone(gen, gen.partitions)  # settled, confirmed; still claimed
            await self.m._update_filters(self.m.sync_consumer, [idle_filter(self.m.member)])
            gen.partitions = ()
            self.mode.move_steps["released"] = self.m._clock()
            return True
        finally:
            dispatcher.resume()

    async def _drop_data_consumers(self, gen: Generation) -> bool:
        """With the dispatcher paused: stop pulling from our data consumer(s), wait for a
        quiet point (nothing running, our acks applied), then delete them. Held,
        unstarted messages go back with them, in stream order. False: no quiet point
        came within the drain timeout, or our acks could not be confirmed."""
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        old = list(gen.data)
        for puller in [p for p in gen.pullers if p.consumer in old]:
            await puller.stop()  # nothing of the old consumer arrives any more
        gen.pullers = [p for p in gen.pullers if p.consumer not in old]
        if not await dispatcher.idle(self.m.settings.drain_timeout):
            return False
        dispatcher.discard_unstarted()
        self.mode.move_steps["idle"] = self.m._clock()
        if not await self.m._acks_confirmed(gen):
            return False
        self.mode.move_steps["acks_confirmed"] = self.m._clock()
        for name in old:
            del gen.data[name]  # first: a self-check must not miss it as "lost"
            await self.m.js.delete_consumer(self.m._consume_stream, name)
        dispatcher.last_settled = None
        return True

    async def _claim_data_consumer(self, gen: Generation, target: tuple[int, ...]) -> None:
        """After :meth:`_release_all`: the claim holds ``target``; a data consumer of a
        previous owner that is gone may still hold some (reclaimed), a live one is about
        to let go (its claim went after its data consumer): create ours, retrying."""
        gen.rebalances += 1
        gen.dispatcher.accept = set(target)  # type: ignore[union-attr]
        await self.mode.election._add_data_consumer(
            gen, target, reclaim=lambda: self._reclaim_released(gen, set(target)))

    async def _replace_data_consumer(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """At a quiet point (nothing running, our acks applied), swap the data consumer(s)
        for one fresh consumer of ``target``: it delivers what is left of every partition
        in stream order. What we held but had not started goes back with the old one."""
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        dispatcher.pause()
        try:
            if not await self._drop_data_consumers(gen):
                return False
            dispatcher.accept = set(target)
            gen.rebalances += 1
            await self.mode.election._add_data_consumer(gen, target)
            return True
        finally:
            dispatcher.resume()

    async def renew_data_consumer(self, gen: Generation, name: str) -> bool:
        """Our data consumer ``name`` lost a delivery on the way (a consumer leader change:
        after a route cut's heal the node that was cut off forces a new election): swap it
        for a fresh one at a quiet point, keeping the claim. The missing message is still
        in the work-queue stream, and the fresh consumer delivers it, and everything after
        it, in stream order. Ending the generation instead let the claim go, and a standby
        took the member (issue 29: a second owner change, back across the cut). False: no
        quiet point, or our acks could not be confirmed (the caller ends the generation).
        Runs under the mode's swap lock (one swap at a time, moves included)."""
        if gen.ended.done() or name not in gen.data:
            return True  # ended meanwhile, or a move swapped it already
        return await self._replace_data_consumer(gen, gen.partitions)

    async def _reclaim_released(self, gen: Generation, partitions: set[int]) -> bool:
        """Consumers of *other* members that still hold partitions we now own, whose
        instance is gone (issue 13 item 12): a member killed and then dropped leaves its
        synchronization consumer (until the server's inactive threshold) and its data
        consumer (kept for its unacknowledged messages' ack wait). One whose instance the
        server says is gone is deleted; any other (a live previous owner still finishing,
        a Spark query's lease) is waited for. True when none is left."""
        wanted = set(partition_filters(sorted(partitions))) | set(
            sync_filters(sorted(partitions)))
        free = True
        try:
            for info in map(ConsumerInfo, await self.m.js.list_consumers(self.m._consume_stream)):
                meta = info.metadata
                name = info.name
                subject = owner_presence_subject(self.m._key, meta)
                filters = set(info.filters)
                if name in gen.data or name == self.m.sync_consumer or not filters & wanted:
                    continue
                if meta.get(HOLDER_KEY):
                    free = False  # a lease held by something other than a member: it ends
                    continue
                # Only an instance the server says is gone (no responders): one slow to
                # answer under load may be alive and finishing.
                answer = confirm_gone(await self.m.js.probe(subject, self.m._probe_timeout),
                                      info.num_waiting) if subject else None
                gone = answer is not None and answer.presence is Presence.GONE
                if gone and not gen.ended.done():
                    self.m._log.warning("reclaiming a released member's abandoned data "
                                        "consumer", consumer=name, instance=meta.get(INSTANCE_KEY))
                    await self.m.js.delete_consumer(self.m._consume_stream, name)
                else:
                    free = False
        except CgroupdError as exc:
            self.m._log.warning("could not inspect a previous owner's consumer", error=str(exc))
            return False
        return free
