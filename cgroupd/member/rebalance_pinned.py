"""Incremental rebalance in pinned mode: the pinned instance brings the shared member
consumer to the config in place (issue 13 items 3 and 4)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import ApiError, CgroupdError, WorkQueueOverlap
from cgroupd.core.naming import (
    MEMBER_KEY,
    RELEASED_KEY,
    RESET_KEY,
    SKIP_KEY,
)
from cgroupd.core.partitions import (
    group_subjects,
    hold_filters,
    idle_filter,
    member_consumer_filters,
    member_filters,
    member_partitions,
    reference_filters,
)
from cgroupd.member.generation import Generation
from cgroupd.member.pinned_reset import Reset, reset_when_quiet
from cgroupd.member.rebalance import claim_contested, contest_backoff
from cgroupd.member.state import StepDown
from cgroupd.nats.pull import Puller

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore
    from cgroupd.member.modes import PinnedMode


class PinnedRebalance:
    """A job of the member's PinnedMode (see the module docstring); a collaborator
    holding the member, not a mixin of it."""

    def __init__(self, member: MemberCore, mode: PinnedMode) -> None:
        self.m = member
        self.mode = mode

    async def move_pinned(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """Bring the member consumer to ``target`` in place (issue 13 items 3 and 4); False
        means fall back to a rejoin. Only the pinned instance changes the consumer.

        Losing: the lost partitions are *held* (a filter that claims them but delivers
        nothing), what was delivered of them is finished, our acks confirmed, and only then
        are they let go (a static group records how far they were processed). Gaining:
        claim them (held) once their previous owner let go, then, at a quiet point (nothing
        running, nothing of ours in flight), take them and reset the consumer so it
        delivers their messages from where the previous owner left off (a work queue holds
        exactly what is left; a static group skips what was processed, see SkipRules).
        """
        info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
        if info is None or gen.dispatcher is None:
            return False
        view = ConsumerInfo(info)
        real, held = member_consumer_filters(view.filters)
        if view.meta(RESET_KEY) \
                and not await self._quiet_reset(gen, real):
            return False
        want = set(target)
        lost, gained = real - want, want - real
        if not lost and not gained and not held:
            gen.partitions = tuple(sorted(want))
            gen.dispatcher.accept = want
            return True
        # Held and not wanted any more: an earlier attempt that failed half-way (its
        # first step holds them) may have left messages of them in the dispatcher.
        if (lost or held - gained) and not await self._release_partitions(
                gen, real & want, lost | (held - gained), held & gained):
            return False
        if gained and not await self._take_partitions(gen, real & want, gained):
            return False
        gen.partitions = tuple(sorted(want))
        gen.dispatcher.accept = want
        return True

    def _member_filters(self, real: set[int], held: set[int]) -> list[str]:
        """The member consumer's filters: the reference's for the partitions it delivers
        (it shares this consumer and rewrites one whose filters differ from its own), and
        hold filters for those it claims without delivering."""
        assert self.m.config is not None
        if real == set(member_partitions(self.m.config, self.m.member)):
            delivered = member_filters(self.m.config, self.m.member)
        else:
            delivered = reference_filters(self.m.config, sorted(real))
        subjects = group_subjects(self.m.config)
        filters = delivered + hold_filters(sorted(held - real), subjects)
        return filters or [idle_filter(self.m.member)]

    async def _release_partitions(self, gen: Generation, kept: set[int], lost: set[int],
                                  claiming: set[int]) -> bool:
        """Stop delivering ``lost``, finish what we hold of them, then let them go."""
        s = self.m.settings
        assert gen.dispatcher is not None
        puller = next(p for p in gen.pullers if p.delivers)
        reply = await self.m._update_config(self.m.sync_consumer, self._member_filters(
            kept, lost | claiming))
        delivered = ConsumerInfo(reply).delivered_consumer_seq
        # Every delivery of a lost partition is numbered at most `delivered`: take them all
        # in before settling, or one arriving late would run beside its next owner.
        if not await puller.received_through(delivered, s.drain_timeout):
            return False
        if not await gen.dispatcher.settle(lost, s.drain_timeout):
            return False
        if not await self.m._acks_confirmed(gen):
            return False
        meta: dict[str, str] = {}
        if self.m.static:
            released = ConsumerInfo(reply).json_map(RELEASED_KEY)
            for p in lost:
                done = max(gen.processed.get(p, 0), gen.dispatcher.highest.get(p, 0))
                released[str(p)] = max(done, int(released.get(str(p), 0)))
            meta[RELEASED_KEY] = json.dumps(released, separators=(",", ":"), sort_keys=True)
        gen.dispatcher.accept = set(kept)
        await self.m._gone(gen, lost)  # settled, confirmed; still held by our filters
        await self.m._update_config(self.m.sync_consumer, self._member_filters(kept, claiming),
                                    meta)
        return True

    async def _take_partitions(self, gen: Generation, kept: set[int], gained: set[int]) -> bool:
        """Claim ``gained`` once free, then take them at a quiet point (see move_pinned)."""
        starts = await self._claim_partitions(gen, kept, gained)
        if starts is None:
            return False
        await self.m._assigned(gen, gained)  # the reset below makes them deliver
        return await self._quiet_reset(gen, kept, starts)

    async def _quiet_reset(self, gen: Generation, kept: set[int],
                           starts: dict[int, int] | None = None) -> bool:
        """At a quiet point (nothing running, our acks applied, no pull of ours open) set
        the filters to ``kept`` plus the partitions in ``starts`` (how far each was
        processed) and reset the consumer so it delivers what is left of them, in order.
        A work queue holds exactly what is left; a static group's consumer goes back to
        the lowest sequence still needed and skips what was processed (SkipRules).

        Nothing held is dropped before the reset went through: a message dropped while
        the consumer goes on delivering (a step that failed, then resumed) would not come
        back before its ack wait, and later messages of its key would run first. Once the
        filters changed, nothing may start before a reset either (a gained partition's
        older messages lie behind the consumer's position): a failed reset is retried
        and, if it never goes through, the generation ends, paused."""
        s = self.m.settings
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        starts = starts or {}
        partitions = kept | set(starts)
        puller = next(p for p in gen.pullers if p.delivers)
        was_open = not dispatcher.paused
        puller.hush()
        dispatcher.pause()
        try:
            if not await dispatcher.idle(s.drain_timeout):
                return False
            if not await self.m._acks_confirmed(gen):
                return False
            if not await self._no_pull_open(puller):
                return False
            meta: dict[str, str] = {RESET_KEY: ""}
            seq = 1  # a work queue holds exactly what is left to do
            if self.m.static:
                pending = dispatcher.unstarted()
                info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
                upto = ConsumerInfo.of(info).delivered_stream_seq
                for p in kept:
                    gen.skip.processed_through(
                        p, upto, (m.stream_sequence for m in pending if m.partition == p))
                for p, done in starts.items():
                    gen.skip.processed_through(p, done)
                    gen.processed[p] = done
                meta[SKIP_KEY] = gen.skip.to_json()
                seq = gen.skip.lowest_needed(partitions)
            applied = True
            try:
                await self.m._update_config(self.m.sync_consumer,
                                            self._member_filters(partitions, set()), meta)
            except ApiError:
                raise  # refused: nothing changed, and what we hold runs on where it is
            except CgroupdError as exc:
                # No answer: applied or not. Either way a reset makes the consumer deliver
                # what is left under its filters, in order; then start over from them.
                self.m._log.info("member consumer update unanswered; resetting anyway",
                                 error=str(exc))
                applied = False
            dispatcher.accept = partitions
            if not await self._reset_until_done(gen, puller, seq):
                was_open = False  # ended: nothing starts before the release
                return False
            return applied
        finally:
            puller.hush(False)
            if was_open:
                dispatcher.resume()

    async def _no_pull_open(self, puller: Puller) -> bool:
        """Wait (hushed) until no pull of ours can bring anything more; False if one is
        still open after its expiry and a margin."""
        deadline = self.m._clock() + self.m.settings.pull_expires + 1.0
        while puller.outstanding > 0 and self.m._clock() < deadline:
            await self.m._sleep(0.01)
        return puller.outstanding == 0

    async def _reset_until_done(self, gen: Generation, puller: Puller, seq: int) -> bool:
        """Reset the member consumer (paused, hushed, the filters already changed); a
        passing failure is retried, pulling in between so the pin stays ours (what those
        pulls bring is held, not started, and dropped by the reset). False, with the
        generation ended, when it does not go through within the drain timeout."""
        m = self.m
        s = m.settings
        outcome = await reset_when_quiet(
            puller, lambda: self.mode.election._reset_pinned(gen, seq), gen.ended,
            clock=m._clock, sleep=m._sleep, log=m._log, hush_at=m._clock(),
            reset_at=m._clock(), quiet_within=s.pull_expires + 1.0,
            give_up=m._clock() + s.drain_timeout,
            heed_end=False)
        if outcome.how is Reset.DONE:
            return True
        if outcome.error is not None:
            self.m._log.warning("member consumer not reset after a filter change; "
                                "stepping down", error=str(outcome.error))
        gen.end(StepDown.CONFIG_CHANGED, "member consumer could not be reset")
        return False

    async def _claim_partitions(self, gen: Generation, kept: set[int],
                                gained: set[int]) -> dict[int, int] | None:
        """Hold ``gained`` as soon as no other consumer has them; for a static group, also
        how far each was processed (the previous owners' release records). None if they
        are not free in time."""
        s = self.m.settings
        deadline = self.m._clock() + s.drain_timeout + 2 * s.retry_interval
        while not gen.ended.done() and gained <= set(gen.target):
            starts, busy = await self._previous_owners(gained)
            if not busy:
                try:
                    await self.m._update_config(self.m.sync_consumer,
                                                self._member_filters(kept, gained))
                    if not await self._claim_contested(gained):
                        return starts
                    # nats-server checks a work queue's filter overlap without excluding
                    # a concurrent update: two claims made at the same moment can both be
                    # accepted (probe: tests/integration/test_workqueue_claim_race.py).
                    # Whoever sees the other lets go and tries again a moment later; at
                    # least one of two racing claims sees the other.
                    self.m._log.info("claim contested; letting go and trying again",
                                     partitions=sorted(gained))
                    await self.m._update_config(self.m.sync_consumer,
                                                self._member_filters(kept, set()))
                    await self.m._sleep(contest_backoff())
                    continue
                except WorkQueueOverlap:
                    pass
            if self.m._clock() > deadline:
                self.m._log.info("partitions not released in time", partitions=sorted(gained),
                                 held_by=sorted(busy))
                return None
            await self.m._sleep(0.05)
        return None

    async def _claim_contested(self, gained: set[int]) -> bool:
        """After our claim on ``gained`` was accepted: does another consumer deliver or
        hold any of them too? (A static stream's partitions never conflict.)"""
        if self.m.static:
            return False

        def held(info: ConsumerInfo) -> set[int]:
            real, hold = member_consumer_filters(info.filters)
            return real | hold

        return await claim_contested(self.m.js, self.m._consume_stream, self.m.sync_consumer,
                                     gained, held)

    async def _previous_owners(self, gained: set[int]) -> tuple[dict[int, int], set[str]]:
        """How far each of ``gained`` was processed (static release records), and the
        other consumers that still deliver or hold any of them (reclaimed if nobody has
        pulled on them for a while: their member is gone)."""
        starts = {p: 0 for p in gained}
        busy: set[str] = set()
        for raw in await self.m.js.list_consumers(self.m._consume_stream):
            info = ConsumerInfo(raw)
            name = info.name
            owner = info.meta(MEMBER_KEY)
            # A static stream may carry other groups' consumers: ours are named after
            # their member (as admin reads them; the Go reference's carry no metadata).
            ours = name == f"{self.m.group}-{owner}" or (
                owner is None and name.startswith(f"{self.m.group}-"))
            if name == self.m.sync_consumer or (self.m.static and not ours):
                continue
            if self.m.static:
                for key, done in info.json_map(RELEASED_KEY).items():
                    if key.isdigit() and int(key) in starts:
                        starts[int(key)] = max(starts[int(key)], int(done))
            real, held = member_consumer_filters(info.filters)
            if (real | held) & gained:
                if await self._reclaim_member_consumer(info):
                    for p in (real | held) & gained:
                        floor = info.ack_floor_stream_seq
                        starts[p] = max(starts[p], floor)
                    continue
                busy.add(name)
        return starts, busy

    async def _reclaim_member_consumer(self, info: ConsumerInfo) -> bool:
        """Another member's consumer that holds partitions now ours, and nobody pulls on
        it: all its instances are gone (issue 13 item 12). On a work queue it is deleted
        (its unacknowledged messages stay in the stream for us); on a static stream it is
        left alone (partitions do not conflict there) and we start after its ack floor."""
        name = info.name

        def abandoned(view: ConsumerInfo) -> bool:
            # No pull waiting (a standby or the holder would have one), and no holder: a
            # live holder may pause its pulls for a moment, but keeps its pin.
            return view.num_waiting == 0 and not view.anyone_pinned

        if not abandoned(info):
            return False
        await self.m._sleep(self.m.settings.pull_expires)  # a live instance pulls by then
        again = await self.m.js.consumer_info(self.m._consume_stream, name)
        if again is None:
            return True
        if not abandoned(ConsumerInfo(again)):
            return False
        self.m._log.warning("taking partitions from a member consumer nobody pulls on",
                            consumer=name)
        if not self.m.static:
            await self.m.js.delete_consumer(self.m._consume_stream, name)
        return True
