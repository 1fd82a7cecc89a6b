"""Pinned exclusivity: the shared member consumer, being pinned by the server, the lease
on the pin, and the takeover of what a previous holder left (see :mod:`cgroupd.core.pinning`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from cgroupd.core.answers import judge_answer
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    ConsumerExists,
    ConsumerNotFound,
    WorkQueueOverlap,
)
from cgroupd.core.naming import (
    RELEASED_KEY,
    RESET_KEY,
    SKIP_KEY,
)
from cgroupd.core.partitions import member_consumer_filters
from cgroupd.core.pinning import PinLease, SkipRules
from cgroupd.core.settings import PRIORITY_GROUP, RESET_QUIET_MARGIN
from cgroupd.member.core import MemberCore
from cgroupd.member.generation import Generation
from cgroupd.member.state import MemberState, Phase, StepDown

#: Pulls between a failed consumer reset and the next try (they keep the pin ours), doubled
#: after each failure up to the maximum. Each try adds a pull expiry without pulls.
RESET_RETRY_FIRST = 0.25
RESET_RETRY_MAX = 4.0


def reset_unsupported(exc: CgroupdError) -> bool:
    """Whether a failed consumer reset is a definite refusal (the server has no reset API,
    or refuses the request as such) rather than a passing failure worth retrying: a 4xx
    API error. "No responders", no answer in time, 5xx and a missing consumer (its
    leader being elected; a deleted one is seen by the next check) are passing."""
    return (isinstance(exc, ApiError) and not exc.retriable
            and not isinstance(exc, ConsumerNotFound))


class PinnedElection(MemberCore):
    """One job of :class:`cgroupd.member.Member` (see the module docstring)."""

    async def _acquire_pinned(self, partitions: tuple[int, ...]) -> Generation | None:
        """Pinned mode: ensure the shared member consumer exists, pull until pinned.

        Only the pinned instance changes the consumer (:meth:`_move_pinned` brings its
        filters to the config); a standby that finds it with other filters leaves it be.
        Nothing starts before :meth:`_take_over` opens the dispatcher."""
        s = self.settings
        name = self.sync_consumer
        extra: dict[str, Any] = {
            "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "pinned_client",
            "priority_timeout": int(s.pinned_ttl * 1e9),
        }
        if self.static:
            extra["durable_name"] = name
        else:
            extra["inactive_threshold"] = int(max(s.ack_wait, s.inactive_threshold) * 1e9)
        cfg = self._consumer_config(self._member_filters(set(partitions), set()), **extra)
        if self.static:
            # A new durable starts each partition where its previous owners left it
            # (issue 13 item 4), and not before they let it go (no conflict tells us).
            try:
                starts, busy = await self._previous_owners(set(partitions))
            except CgroupdError as exc:
                self._log.warning("could not read previous owners", error=str(exc))
                return None
            if busy:
                return None
            cfg["metadata"][SKIP_KEY] = SkipRules(
                {p: (done, frozenset()) for p, done in starts.items() if done}).to_json()
        try:
            await self.js.create_consumer(self._consume_stream, name, cfg)
        except WorkQueueOverlap:
            with contextlib.suppress(CgroupdError):
                await self._previous_owners(set(partitions))  # reclaims abandoned ones
            return None
        except ConsumerExists:
            # It exists (made by another instance, maybe the reference's): share it.
            info = await self.js.consumer_info(self._consume_stream, name)
            if PRIORITY_GROUP not in ConsumerInfo.of(info).priority_groups:
                self._log.warning("member consumer exists without priority group",
                                  consumer=name)
                return None
            if not await self._retarget_unpinned(info or {}, partitions):
                return None
        except CgroupdError as exc:
            self._log.warning("member consumer create failed", error=str(exc))
            return None
        gen = self._gen = self._generation(partitions)
        self._enter(Phase.CLAIMING)
        if self._stopping or self._deleted:  # stop() came while we were creating it
            gen.end(StepDown.STOPPING)
        gen.pin_lease = PinLease(s.pinned_ttl, self._clock)
        assert gen.dispatcher is not None
        gen.dispatcher.pause()
        pinned = asyncio.get_running_loop().create_future()
        gen.pullers.append(await self._start_puller(
            gen, name, s.max_in_flight, StepDown.PIN_LOST, deliver=True, pinned=pinned))
        # Standby until the server pins us: the first message carries our pin id.
        done, _ = await asyncio.wait({pinned, gen.ended}, return_when=asyncio.FIRST_COMPLETED)
        if pinned in done and not gen.ended.done():
            return gen
        await self._release(gen)
        self._gen = None
        self._enter(Phase.WAITING)
        return None

    def _step_down_requested(self, body: bytes) -> str | None:
        """An operator asked the holder of our member's pin to step down (the body names
        the pin they saw; see :func:`cgroupd.core.pinning.step_down_subject`). Only that
        holder answers: it steps down as on a graceful stop (running handlers finish
        while the pin stays its own), unpins and hands back the rest; the standbys' pulls
        have waited longer than its next one (``rejoin_delay`` later), so the server pins
        one of them. One already stepping down says so too: an unpin would cut its drain
        short."""
        gen = self._gen
        lease = gen.pin_lease if gen is not None else None
        if gen is None or lease is None or lease.pin_id is None \
                or body.decode(errors="replace") != lease.pin_id \
                or self.state not in (MemberState.ACTIVE, MemberState.STEPPING_DOWN):
            return None
        if not gen.ended.done():
            self._log.info("step-down requested")
            gen.end(StepDown.REQUESTED, "asked on the member's step-down subject")
        return f"{self.instance_id} {MemberState.STEPPING_DOWN.value}"

    async def _hold_pin(self, gen: Generation) -> None:
        """Pinned mode, while active: take over, then renew the lease every quarter of
        the pinned TTL (so handlers never wait for it) and apply membership changes."""
        if not await self._take_over(gen):
            return
        self._spawn(gen, self._rebalance_loop(gen), "_rebalance_loop")
        period = self.settings.pinned_ttl / 4
        while not gen.ended.done():
            await self._sleep(period)
            if not await self._renew(gen):
                gen.end(StepDown.PIN_LOST, "the pin could not be proven ours any more")

    async def _renew(self, gen: Generation) -> bool:
        """Prove the pin is still ours and extend the lease; one renewal at a time."""
        if gen.renewal is None or gen.renewal.done():
            gen.renewal = asyncio.ensure_future(self._renew_once(gen))
        return await asyncio.shield(gen.renewal)

    async def _renew_once(self, gen: Generation) -> bool:
        """A pull carrying our pin id, a round trip proving the server read it, then the
        consumer info showing our pin id still (see :mod:`cgroupd.core.pinning`)."""
        lease = gen.pin_lease
        puller = next((p for p in gen.pullers if p.delivers), None)
        if lease is None or lease.lost or puller is None:
            return False
        pin = puller.pin_id
        if pin is None or puller.ended.done():
            lease.lose()
            return False
        await puller.pull_one()
        sent = puller.pin_pulled_at
        try:
            await self.js.flush(self.settings.pull_expires)
            info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        except (CgroupdError, TimeoutError) as exc:
            self._log.info("pin lease not renewed: no answer", error=repr(exc))
            return lease.valid
        holder = ConsumerInfo.of(info).pinned_client(PRIORITY_GROUP)
        if info is None or holder != pin:
            lease.lose()
            return False
        # As in sync mode's self-check: a clustered consumer's leader cut off from its
        # replicas still names us pinned while the majority side pins someone else. Its
        # answer proves the pin only as of when it last heard from a quorum.
        judged = judge_answer([info], sent=sent, lease=lease.ttl)
        lease.renewed(pin, judged.as_of)
        if not lease.valid:
            self.stats["stale_checks"] += 1
            self._log.warning("pin confirmed by a server out of touch with its cluster; "
                              "starting nothing", quorum_heard_ago=round(judged.age, 3))
            return False
        if ConsumerInfo(info).meta(RESET_KEY):
            gen.reconcile = True  # a standby retargeted it before we held the pin
            gen.retarget.set()
        return lease.valid

    async def _take_over(self, gen: Generation) -> bool:
        """A newly pinned instance starts nothing while the member consumer holds messages
        delivered to someone else: a previous holder's, unfinished or being handed back.
        Handed back, they come to us and wait in stream order among their keys. If they do
        not come, then one pinned TTL after we were pinned, when no previous holder can
        trust an ack any more, we reset the consumer to its ack floor: everything not
        acknowledged is delivered again, in stream order (issue 13 item 1)."""
        s = self.settings
        assert gen.dispatcher is not None
        if not await self._renew(gen):
            gen.end(StepDown.PIN_LOST, "pinned, but could not prove it")
            return False
        puller = next(p for p in gen.pullers if p.delivers)
        deadline = gen.pinned_at + s.pinned_ttl
        # Before a reset no pull of ours may be open, or a delivery made before it could
        # arrive after it and run ahead of (and twice with) its redelivery. So requests
        # stop one pull expiry before the reset; the pin stays ours a TTL past the last.
        quiet = s.pull_expires + RESET_QUIET_MARGIN
        hush_at = max(gen.pinned_at, deadline - quiet)
        can_reset = True
        retry_in = RESET_RETRY_FIRST
        try:
            while not gen.ended.done():
                try:
                    info = await self.js.consumer_info(self._consume_stream,
                                                       self.sync_consumer)
                    if info is None:
                        gen.end(StepDown.PIN_LOST, "member consumer deleted")
                        return False
                    if self.static:
                        self._load_static_state(gen, info)
                    foreign = int(info.get("num_ack_pending", 0)) - gen.dispatcher.holding
                    if foreign <= 0:
                        break
                    now = self._clock()
                    if now >= hush_at and can_reset:
                        puller.hush()
                    if now >= deadline and puller.outstanding == 0 and can_reset:
                        self._log.info("taking back messages a previous holder left "
                                       "unfinished", count=foreign)
                        try:
                            await self._reset_pinned(gen)
                        except CgroupdError as exc:
                            puller.hush(False)  # pull meanwhile: it keeps the pin ours
                            if reset_unsupported(exc):
                                # No consumer reset (nats-server < 2.14): they come back
                                # once their ack wait runs out; nothing starts before.
                                self._log.error("consumer reset unavailable; waiting for "
                                                "the previous holder's messages to time "
                                                "out", error=str(exc), count=foreign)
                                can_reset = False
                                continue
                            # A passing failure (no responders while a server restarts,
                            # no answer while the consumer elects a leader): try again.
                            # Applied or not (a lost reply), nothing we hold may start:
                            # the next reset delivers it again, in order.
                            gen.dispatcher.discard_unstarted()
                            self._log.warning("consumer reset failed; retrying",
                                              error=str(exc), retry_in=retry_in)
                            hush_at = self._clock() + retry_in
                            deadline = hush_at + quiet
                            retry_in = min(2 * retry_in, RESET_RETRY_MAX)
                            continue
                        break
                except CgroupdError as exc:
                    self._log.info("takeover check failed; retrying", error=str(exc))
                await self._sleep(0.02)
        finally:
            puller.hush(False)
        if gen.ended.done():
            return False
        # The consumer may have the filters of another config, or have been retargeted by
        # a standby (RESET_KEY): bring it to ours before anything starts.
        try:
            moved = await self._move_pinned(gen, gen.target)
        except CgroupdError as exc:
            self._log.warning("could not bring the member consumer to this config",
                              error=str(exc))
            moved = False
        if not moved:
            gen.end(StepDown.CONFIG_CHANGED, "member consumer not brought to the config")
            return False
        self.partitions = gen.partitions
        gen.dispatcher.resume()
        if self.state is MemberState.ACTIVE and self.phase is Phase.TAKING_OVER:
            self._enter(Phase.RUNNING)  # (not if the generation ended meanwhile)
        return True

    async def _retarget_unpinned(self, info: dict[str, Any],
                                 partitions: tuple[int, ...]) -> bool:
        """A standby found the member consumer with other filters than its config gives.
        While an instance holds the pin, that one moves them (:meth:`_move_pinned`). While
        nobody does, no message may pin anyone (pinning takes a delivery), so the standby
        sets them, marking the consumer so the next holder resets it at a quiet point
        before running anything. False: not now, try again later."""
        view = ConsumerInfo(info)
        real, held = member_consumer_filters(view.filters)
        if real == set(partitions) and not held:
            return True
        holder = view.pinned_client(PRIORITY_GROUP)
        if holder:
            return True  # the holder applies the config; we wait for the pin
        meta = {RESET_KEY: "1"}
        if self.static:
            starts, busy = await self._previous_owners(set(partitions) - real)
            if busy:
                return False
            skip = SkipRules.from_json(view.meta(SKIP_KEY))
            for p, done in starts.items():
                if done:
                    skip.processed_through(p, done)
            floor = view.ack_floor_stream_seq
            released = view.json_map(RELEASED_KEY)
            for p in real - set(partitions):
                released[str(p)] = max(floor, int(released.get(str(p), 0)))
            meta[SKIP_KEY] = skip.to_json()
            meta[RELEASED_KEY] = json.dumps(released, separators=(",", ":"), sort_keys=True)
        try:
            await self._update_config(self.sync_consumer,
                                      self._member_filters(set(partitions), set()), meta)
        except ApiError as exc:
            if isinstance(exc, WorkQueueOverlap):
                await self._previous_owners(set(partitions) - real)  # reclaims abandoned
            self._log.info("member consumer not retargeted yet", error=str(exc))
            return False
        return True

    def _load_static_state(self, gen: Generation, info: dict[str, Any]) -> None:
        """Static group, on taking over: what the consumer says was processed."""
        view = ConsumerInfo(info)
        floor = view.ack_floor_stream_seq
        for p in gen.partitions:
            gen.processed[p] = max(gen.processed.get(p, 0), floor)
        text = view.meta(SKIP_KEY)
        gen.skip.rules = SkipRules.from_json(text).rules

    async def _reset_pinned(self, gen: Generation, seq: int = 0) -> None:
        """Reset the member consumer to ``seq`` (0: past its ack floor) and forget what we
        hold: all of it is delivered again, in stream order. Call with no pull of ours
        open (nothing delivered before the reset may still be on its way)."""
        assert gen.dispatcher is not None
        info = await self.js.reset_consumer(self._consume_stream, self.sync_consumer, seq)
        gen.dispatcher.last_settled = None  # acks before a reset need no proof after it
        dropped = gen.dispatcher.discard_unstarted()
        self._log.info("member consumer reset", seq=info.get("reset_seq"),
                       dropped=len(dropped))
