"""Pinned exclusivity: the shared member consumer, being pinned by the server, the lease
on the pin, and the takeover of what a previous holder left (see :mod:`cgroupd.core.pinning`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from cgroupd.core.answers import judge_answer
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    ConsumerExists,
    WorkQueueOverlap,
)
from cgroupd.core.naming import (
    RELEASED_KEY,
    RESET_KEY,
    SKIP_KEY,
)
from cgroupd.core.partitions import member_consumer_filters
from cgroupd.core.pinning import PinLease, SkipRules
from cgroupd.core.settings import PIN_SPARE, PRIORITY_GROUP, RESET_QUIET_MARGIN
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.member.generation import Generation
from cgroupd.member.pinned_reset import Reset, reset_when_quiet
from cgroupd.member.state import MemberState, Phase, StepDown
from cgroupd.nats.pull import Puller, delivery_number

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore
    from cgroupd.member.modes import PinnedMode

#: Tries of a take-back's consumer reset before the holder steps down (pauses of 0.25,
#: 0.5, 1, 2 and 4 s between them: see :mod:`cgroupd.member.pinned_reset`).
RESET_ATTEMPTS_TAKE_BACK = 6
#: Pinned TTLs past its lease that a holder nobody answers waits for an answer before it
#: steps down (issue 29: a node restart costs a reconnect and a leader election).
UNANSWERED_HOLD = 3.0
#: Renewals (a quarter TTL apart) that see the holder pinned and idle with messages
#: waiting before it asks again (see PinnedElection._not_pulling).
IDLE_RENEWALS = 4


class PinnedElection:
    """A job of the member's PinnedMode (see the module docstring); a collaborator
    holding the member, not a mixin of it."""

    def __init__(self, member: MemberCore, mode: PinnedMode) -> None:
        self.m = member
        self.mode = mode

    async def acquire_pinned(self, partitions: tuple[int, ...]) -> Generation | None:
        """Pinned mode: ensure the shared member consumer exists, pull until pinned.

        Only the pinned instance changes the consumer (:meth:`move_pinned` brings its
        filters to the config); a standby that finds it with other filters leaves it be.
        Nothing starts before :meth:`_take_over` opens the dispatcher."""
        s = self.m.settings
        name = self.m.sync_consumer
        extra: dict[str, Any] = {
            "max_ack_pending": s.max_in_flight + PIN_SPARE,
            "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "pinned_client",
            "priority_timeout": int(s.pinned_ttl * 1e9),
        }
        if self.m.static:
            extra["durable_name"] = name
        else:
            extra["inactive_threshold"] = int(max(s.ack_wait, s.inactive_threshold) * 1e9)
        moves = self.mode.rebalance
        cfg = self.m._consumer_config(moves._member_filters(set(partitions), set()), **extra)
        if self.m.static:
            # A new durable starts each partition where its previous owners left it
            # (issue 13 item 4), and not before they let it go (no conflict tells us).
            try:
                starts, busy = await self.mode.rebalance._previous_owners(set(partitions))
            except CgroupdError as exc:
                self.m._log.warning("could not read previous owners", error=str(exc))
                return None
            if busy:
                return None
            cfg["metadata"][SKIP_KEY] = SkipRules(
                {p: (done, frozenset()) for p, done in starts.items() if done}).to_json()
        try:
            await self.m.js.create_consumer(self.m._consume_stream, name, cfg)
        except WorkQueueOverlap:
            with contextlib.suppress(CgroupdError):
                await moves._previous_owners(set(partitions))  # reclaims abandoned ones
            return None
        except ConsumerExists:
            # It exists (made by another instance, maybe the reference's): share it.
            info = await self.m.js.consumer_info(self.m._consume_stream, name)
            if PRIORITY_GROUP not in ConsumerInfo.of(info).priority_groups:
                self.m._log.warning("member consumer exists without priority group",
                                    consumer=name)
                return None
            if not await self._retarget_unpinned(info or {}, partitions):
                return None
        except CgroupdError as exc:
            self.m._log.warning("member consumer create failed", error=str(exc))
            return None
        gen = self.m._gen = self.m._generation(partitions)
        self.m._enter(Phase.CLAIMING)
        if self.m._stopping or self.m._deleted:  # stop() came while we were creating it
            gen.end(StepDown.STOPPING)
        gen.pin_lease = PinLease(s.pinned_ttl, self.m._clock)
        assert gen.dispatcher is not None
        gen.dispatcher.pause()
        pinned = asyncio.get_running_loop().create_future()
        puller = await self.m._start_puller(
            gen, name, s.max_in_flight, StepDown.PIN_LOST, deliver=True, pinned=pinned)
        gen.pullers.append(puller)
        puller.on_pin_news = lambda: self._pin_news(gen)
        puller.on_gap = lambda expected, got: self._delivery_gap(gen, expected, got)
        puller.hush()  # until the gate has looked (it runs before the puller's first pull)
        gate = asyncio.ensure_future(self._gate_pulls(gen, puller, pinned))
        # Standby until the server pins us: the first message carries our pin id.
        try:
            done, _ = await asyncio.wait({pinned, gen.ended},
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(gate)
        puller.hush(False)
        if pinned in done and not gen.ended.done():
            return gen
        await self.m._releaser.release(gen)
        self.m._gen = None
        self.m._enter(Phase.WAITING)
        return None

    async def _gate_pulls(self, gen: Generation, puller: Puller,
                          pinned: asyncio.Future[None]) -> None:
        """A standby pulls (competes for the pin) only while nobody holds it.

        nats-server pins the first waiting pull without a pin id once the pin is free,
        and a consumer leader change frees it (the pin lives in the old leader's memory
        only): a standby's waiting pull would take the member from a live holder. So
        while consumer info names a pinned client the standby asks for nothing; when the
        pin is gone under the same leader (the holder's TTL ran out, or an unpin) it
        competes at once; when it went with a leader change, the holder asks to be
        pinned again (:meth:`_renew_once`), and the standby competes only if messages
        then wait one pinned TTL with nobody pinned. A standby that never saw a holder
        while the consumer holds delivered messages waits the same way. Polls every
        eighth of the TTL."""
        s = self.m.settings
        seen_under: str | None = None  # the leader under which a holder was last seen
        waiting_since: float | None = None
        missing_since: float | None = None
        compete = False  # decided: pull until pinned or a holder shows up
        while not pinned.done():
            try:
                info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
            except CgroupdError:
                info = {}  # no answer: keep doing what we did
            else:
                view = ConsumerInfo.of(info)
                leader = view.leader or None  # None: not clustered
                now = self.m._clock()
                if info is not None:
                    missing_since = None
                if info is None:
                    # "Not found" also comes from a consumer leader elected a moment ago
                    # (a rolling restart): one pull of ours sent then took the pin from a
                    # holder being pinned again. Gone for a pinned TTL, it is gone (its
                    # inactive threshold ran out while its holder was dead and we were
                    # hushed): join again, which creates it. Pulling on a consumer that is
                    # gone only ever gets "no responders" (interop test under load: the
                    # standby stood still 60 s).
                    missing_since = now if missing_since is None else missing_since
                    if now - missing_since >= s.pinned_ttl:
                        self.m._log.info("member consumer gone while standing by; joining "
                                         "again")
                        gen.end(StepDown.PIN_LOST, "member consumer gone")
                        return
                elif view.pinned_client(PRIORITY_GROUP):
                    seen_under, waiting_since, compete = leader, None, False
                    puller.hush()
                elif seen_under is not None and leader is None:
                    pass  # clustered, answered with no leader (an election): as we did
                elif compete or not (
                        (seen_under is not None and leader not in (None, seen_under))
                        # Never saw a holder, but someone holds messages: one may have
                        # been pinned just before a leader change we did not see.
                        or (seen_under is None and leader is not None
                            and int(view.raw.get("num_ack_pending", 0)) > 0)):
                    if not compete and seen_under is not None:
                        self.m._log.info("nobody pinned under the leader that pinned the "
                                         "holder; competing", leader=leader)
                    seen_under, compete = None, True
                    puller.hush(False)
                else:
                    # Messages waiting for a holder (one we never saw: its held ones too).
                    held = int(view.raw.get("num_ack_pending", 0)) if seen_under is None else 0
                    if int(view.raw.get("num_pending", 0)) + held == 0:
                        waiting_since = None
                    elif waiting_since is None:
                        waiting_since = now
                    if waiting_since is not None and now - waiting_since >= s.pinned_ttl:
                        self.m._log.info("pin not taken back after a consumer leader "
                                         "change; competing", leader=leader)
                        seen_under, compete = None, True
                        puller.hush(False)
                    else:
                        puller.hush()
            await self.m._sleep(s.pinned_ttl / 8)

    def _step_down_requested(self, body: bytes) -> str | None:
        """An operator asked the holder of our member's pin to step down (the body names
        the pin they saw; see :func:`cgroupd.core.pinning.step_down_subject`). Only that
        holder answers: it steps down as on a graceful stop (running handlers finish
        while the pin stays its own), unpins and hands back the rest; the standbys' pulls
        have waited longer than its next one (``rejoin_delay`` later), so the server pins
        one of them. One already stepping down says so too: an unpin would cut its drain
        short."""
        gen = self.m._gen
        lease = gen.pin_lease if gen is not None else None
        if gen is None or lease is None or lease.pin_id is None \
                or body.decode(errors="replace") != lease.pin_id \
                or self.m.state not in (MemberState.ACTIVE, MemberState.STEPPING_DOWN):
            return None
        if not gen.ended.done():
            self.m._log.info("step-down requested")
            gen.end(StepDown.REQUESTED, "asked on the member's step-down subject")
        return f"{self.m.instance_id} {MemberState.STEPPING_DOWN.value}"

    async def hold_pin(self, gen: Generation) -> None:
        """Pinned mode, while active: take over, then renew the lease every quarter of
        the pinned TTL (so handlers never wait for it) and apply membership changes."""
        if not await self._take_over(gen):
            return
        self.m._spawn(gen, self.mode.rebalance_loop(gen), "rebalance_loop")
        period = self.m.settings.pinned_ttl / 4
        while not gen.ended.done():
            await self.m._sleep(period)
            if not await self.renew(gen) and not self.pin_unanswered(gen):
                gen.end(StepDown.PIN_LOST, "the pin could not be proven ours any more")

    def pin_unanswered(self, gen: Generation) -> bool:
        """The lease ran out only because nobody answered (a restart of our server, or of
        the member consumer's leader, with a reconnect and an election to wait for):
        hold on to the partitions for up to :data:`UNANSWERED_HOLD` pinned TTLs more,
        starting and acknowledging nothing, until an answer proves the pin ours again
        or shows it moved (see :meth:`cgroupd.core.pinning.PinLease.vanished`)."""
        lease = gen.pin_lease
        s = self.m.settings
        return (lease is not None and not lease.lost and not gen.ended.done()
                and self.m._clock() < lease.until + UNANSWERED_HOLD * s.pinned_ttl)

    async def renew(self, gen: Generation) -> bool:
        """Prove the pin is still ours and extend the lease; one renewal at a time."""
        if gen.renewal is None or gen.renewal.done():
            gen.renewal = asyncio.ensure_future(self._renew_once(gen))
        return await asyncio.shield(gen.renewal)

    def renew_now(self, gen: Generation) -> None:
        """Reconnected: a renewal asked on the old connection waits out its timeout for
        an answer that will not come; ask again at once on the new one (the holder's
        server restarted: its chance to be pinned again before a standby competes). Only a
        lease that held a pin: a standby's has none to renew, and asking lost it for good
        (pinned later, the standby could not prove it and stepped down holding the pin's
        messages: 32 s and 66 s gaps in rolling restarts)."""
        lease = gen.pin_lease
        if lease is not None and lease.held and not gen.ended.done():
            gen.renewal = asyncio.ensure_future(self._renew_once(gen))

    def _pin_news(self, gen: Generation) -> None:
        """Our puller saw the pin change (our pin id refused, or a new one delivered)
        while we hold the member: check it now. After a consumer leader change that is
        the step that asks to be pinned again, and the one that resumes starts once we
        are (each waited up to a renewal period: a 3.01 s gap in a rolling restart)."""
        self.renew_now(gen)

    def _delivery_gap(self, gen: Generation, expected: int, got: int) -> None:
        """A delivery's number skipped: one before it may be lost on its way (our server
        went away between the consumer leader and us, and the leader counts it delivered)
        and running the later ones first breaks their key's order. Start nothing until a
        renewal asked from now on finds none missing, or takes them back. The check
        made on a reconnect alone missed some (CI on 869b290, static group: 32 messages
        came back at their ack wait, after later ones of their keys; the run's logs were
        not kept, so which event lost them is not known)."""
        lease = gen.pin_lease
        if lease is not None and lease.held:
            self.mode.doubt(gen, "a delivery number skipped", expected=expected, got=got)
            self.renew_now(gen)

    async def _renew_once(self, gen: Generation) -> bool:
        """A pull carrying our pin id, a round trip proving the server read it, then the
        consumer info showing our pin id still (see :mod:`cgroupd.core.pinning`)."""
        lease = gen.pin_lease
        puller = next((p for p in gen.pullers if p.delivers), None)
        if lease is None or lease.lost or puller is None:
            return False
        pin, pinned_at = puller.pin_id, puller.pinned_at
        if (pin is None and not lease.repinning) or puller.ended.done():
            self.m._log.info("pin lease lost: no pin id, or our pulls ended",
                           pulls_ended=puller.ended.done())
            lease.lose()
            return False
        if pin is not None and not puller.pin_refused:
            await puller.pull_one()
        sent = puller.pin_pulled_at
        asked = self.m._clock()
        doubts = gen.doubts  # what this answer can clear: the doubts raised before it
        try:
            await self.m.js.flush(self.m.settings.pull_expires)
            info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
        except (CgroupdError, TimeoutError) as exc:
            self.m._log.info("pin lease not renewed: no answer", error=repr(exc))
            return lease.valid
        newer = gen.renewal
        if newer is not None and newer is not asyncio.current_task() and not newer.done():
            # Overtaken by a renewal asked since (on news of the pin, or a reconnect):
            # its answer is the newer view, ours may predate the change.
            return await asyncio.shield(newer)
        view = ConsumerInfo.of(info)
        holder = view.pinned_client(PRIORITY_GROUP)
        # As in sync mode's self-check: a clustered consumer's leader cut off from its
        # replicas still names us pinned while the majority side pins someone else. Its
        # answer proves the pin only as of when it last heard from a quorum.
        judged = judge_answer([info], sent=sent, lease=lease.ttl)
        age = judged.age
        if info is None:
            # "Consumer not found" also comes from a consumer leader just elected in a
            # rolling restart: a passing answer. A deleted consumer ends our pulls (409),
            # and an unanswered lease runs out within UNANSWERED_HOLD anyway.
            self.m._log.info("pin lease not renewed: the member consumer was not found")
            return lease.valid
        if not holder:
            # Nobody pinned: after a consumer leader change (the pin stays with the old
            # leader) we hold on and ask to be pinned again; otherwise it is over.
            quiet = view.delivered_consumer_seq <= puller.last_delivery
            if not lease.vanished(view.leader or None, asked - age, quiet):
                self.m._log.info("nobody pinned and the pin is not coming back (an unpin, "
                                 "its TTL ran out, or word of a new leader came too late)",
                                 leader=view.leader, quiet=quiet)
                return False
            if puller.pin_id is not None or puller.pin_refused:
                self.m._log.info("pin went with the member consumer's old leader; asking "
                                 "to be pinned again", leader=view.leader)
                puller.repin()
            if gen.dispatcher is not None and not gen.in_doubt:
                gen.doubt_deliveries()
            now = self.m._clock()
            if gen.repin_since is None:
                gen.repin_since = now
            elif now - gen.repin_since > self.m.settings.pinned_ttl and lease.valid \
                    and gen.dispatcher is not None and gen.dispatcher.unstarted():
                # Not pinned again (what we hold may fill max_ack_pending, and the server
                # pins only with a delivery): hand it all back while the lease still
                # covers it (see _release_pinned), so whoever is pinned next gets it.
                # Holding nothing that waits, we wait: nobody can be pinned before a
                # message comes (the group stream's sourcing stood still 8-15 s after an
                # origin leader change), and the first one pins us, the only one asking
                # (standbys wait a TTL of messages waiting); stepping down then was a
                # coin toss between us and a standby.
                gen.end(StepDown.PIN_LOST, "not pinned again after a leader change")
                return True
            if view.num_pending > 0 and view.num_waiting == 0:
                puller.reconnected()  # our request is not at the new leader: ask again
            return lease.valid
        if pin is None:
            # Being pinned again, and someone is: us, if the delivery that carries our
            # new pin id is still on its way. Not proof either way: the lease is not
            # extended, and the next renewal (or its running out) decides.
            self.m._log.info("someone is pinned; our new pin id not yet delivered",
                             holder=holder[:6], waiting=view.num_waiting,
                             pending=view.num_pending, outstanding=puller.outstanding,
                             hushed=puller.hushed, refused=puller.pin_refused)
            return lease.valid
        if holder != pin:
            self.m._log.info("the member consumer pins another client", holder=holder[:6])
            lease.lose()
            return False
        puller.pin_refused = False
        gen.repin_since = None
        lost = 0
        if (lease.repinning or gen.in_doubt) and gen.dispatcher is not None:
            # Pinned again after a leader change. A delivery the old leader sent us may
            # have been lost on the way (its server stopping: 37 at once in one run): it
            # stays unacknowledged, and running later messages of its key would break
            # their order. What the consumer delivered just before this answer may still
            # be on its way to us, or waiting in our subscription's queue (the news of the
            # pin came with the first of a batch): wait for it first. (The numbers alone
            # cannot tell: a new leader that never heard of the old one's last deliveries
            # numbers its own from where it knew; 63 of a batch counted as lost once.)
            await puller.flush_received()
            if view.delivered_consumer_seq > puller.last_delivery:
                await puller.received_through(view.delivered_consumer_seq,
                                              self.m.settings.pull_expires)
            lost = self._missing(gen, view.num_ack_pending, view.delivered_consumer_seq)
            if lost <= 0:
                if gen.in_doubt:
                    self.m._log.info("no delivery missing", doubts=gen.doubts,
                                     cleared=doubts, ack_pending=view.num_ack_pending)
                gen.deliveries_checked(doubts)
        self._ask_again_at_a_new_leader(gen, puller, view, lease.leader)
        self._not_pulling(gen, puller, view)
        lease.renewed(pin, judged.as_of, pinned_at)
        if lease.pin_id != pin:  # pinned again only after our lease ran out
            return self._pinned_late(gen, pin, judged.as_of, pinned_at, view)
        lease.leader = view.leader or None
        if not lease.valid:
            self.m.stats["stale_checks"] += 1
            self.m._log.warning("pin confirmed by a server out of touch with its cluster; "
                                "starting nothing", quorum_heard_ago=round(judged.age, 3))
            return False
        if ConsumerInfo(info).meta(RESET_KEY):
            gen.reconcile = True  # a standby retargeted it before we held the pin
            gen.retarget.set()
        if lost > 0 and not gen.taking_back:
            gen.taking_back = True
            self.m._spawn(gen, self._take_back(gen, puller, lost), "_take_back")
        return lease.valid

    def _pinned_late(self, gen: Generation, pin: str, as_of: float, pinned_at: float,
                     view: ConsumerInfo) -> bool:
        """Pinned again, but only after our lease ran out (our renewals went unanswered
        for seconds while a node restarted, and the pin came with the next message).
        Another instance may have been pinned in between, so nothing we hold may start.
        Stepping down cost the member 6.2 s (a rejoin delay, then a pinned TTL for our
        own unfinished messages) and could hand it to the standby, which is no better
        placed: so we take it over in place, as a newly pinned instance would
        (:meth:`_take_over`): what waits unstarted is dropped, and unless the consumer
        holds nothing we do not, it is reset once no previous holder can trust an ack."""
        lease = gen.pin_lease
        assert lease is not None
        late_by = round(pinned_at - lease.until, 3)
        if gen.dispatcher is None or gen.taking_back or self.m.phase is not Phase.RUNNING:
            self.m._log.info("pinned again only after our lease ran out; not ours to keep",
                             late_by=late_by)
            lease.lose()
            return False
        self.m._log.info("pinned again only after our lease ran out; taking the member "
                         "over in place", late_by=late_by)
        lease.adopt(pin, as_of)
        lease.leader = view.leader or None
        gen.pinned_at = pinned_at
        gen.taking_back = True
        gen.dispatcher.pause()  # lifted by _take_over
        gen.dispatcher.discard_unstarted()
        self.m._enter(Phase.TAKING_OVER)
        self.m._spawn(gen, self._retake(gen), "_retake")
        return lease.valid

    async def _retake(self, gen: Generation) -> None:
        """:meth:`_take_over` in place (see :meth:`_pinned_late`). Its check is asked after
        every doubt raised so far, and it resets the consumer unless nothing is missing:
        either way those doubts are cleared."""
        doubts = gen.doubts
        try:
            if await self._take_over(gen):
                gen.deliveries_checked(doubts)
        finally:
            gen.taking_back = False

    def _ask_again_at_a_new_leader(self, gen: Generation, puller: Puller, view: ConsumerInfo,
                                   confirmed_under: str | None) -> None:
        """Pinned under a new consumer leader: the pull requests we count went with the
        old one, so while messages wait and none of ours is waiting there, forget them and
        ask again (a renewal 0.5 s apart) until a request of ours is seen at the new
        leader or brings a delivery. Never otherwise: under the same leader "messages
        waiting, none of our requests waiting" is a moment between two requests, and
        forgetting one still open let it deliver after an in-place move's quiet point
        (the toggle test's per-key reorders, CI on 60bcecc and b8f56d5)."""
        leader = view.leader or None
        if confirmed_under is not None and leader != confirmed_under:
            gen.requests_unseen = True
            gen.delivered_before = gen.received
        elif gen.requests_unseen and (view.num_waiting > 0
                                      or gen.received > gen.delivered_before):
            gen.requests_unseen = False
        if gen.requests_unseen and view.num_pending > 0 and view.num_waiting == 0 \
                and not puller.hushed:
            puller.reconnected()

    def _not_pulling(self, gen: Generation, puller: Puller, view: ConsumerInfo) -> None:
        """Pinned, messages waiting, and for :data:`IDLE_RENEWALS` renewals in a row no
        request of ours at the leader and nothing of ours unacknowledged: the requests we
        count are gone (none is open where nothing waits and nothing is in flight), so
        forget them and ask again, saying why. A holder once stood still 60 s like this
        with its pin kept (CI on 5632d62, rolling restart; cause not found): the log
        carries the puller's state for the next one."""
        stuck = (view.num_pending > 0 and view.num_waiting == 0
                 and view.num_ack_pending == 0 and not puller.hushed
                 and not puller.pin_refused and not gen.taking_back)
        gen.idle_renewals = gen.idle_renewals + 1 if stuck else 0
        if gen.idle_renewals == IDLE_RENEWALS:
            self.m.stats["pulls_restarted"] += 1
            self.m._log.warning("pinned with messages waiting and no request of ours at the "
                                "leader; asking again", pending=view.num_pending,
                                **puller.describe())
            puller.reconnected()

    def _missing(self, gen: Generation, ack_pending: int, delivered: int) -> int:
        """Deliveries the consumer counted unacknowledged in its answer (``ack_pending``,
        numbered up to ``delivered``) that we do not hold. Deliveries made after that
        answer reach us meanwhile and must not hide a lost one (a count of everything
        held did once: a per-key reorder at the ack wait), so only those numbered up to
        ``delivered`` count. One numbered otherwise (a new leader numbers from what it
        knew) counts as missing: a needless take-back, never a reorder."""
        assert gen.dispatcher is not None
        ours = sum(1 for m in gen.dispatcher.held()
                   if (delivery_number(m.reply) or delivered + 1) <= delivered)
        return ack_pending - ours

    async def _take_back(self, gen: Generation, puller: Puller, lost: int) -> None:
        """Pinned again after a leader change, the consumer holds deliveries that never
        reached us. Our lease ran on through the change (nobody else was pinned), so they
        were ours: with no pull of ours open, reset the consumer to its ack floor, and
        everything unacknowledged comes again in stream order (what we completed is
        settled again, not run). Starts stay paused until then. Stepping down instead
        left them to the ack wait: max_ack_pending stayed full, nobody could be pinned,
        the member stood still 34.8 s and changed owner."""
        s = self.m.settings
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        self.m._log.warning("messages delivered before the leader change did not reach "
                            "us; taking them back", count=lost)
        cleared: int | None = None

        async def reset() -> None:
            nonlocal cleared
            lease = gen.pin_lease
            if gen.ended.done():
                return
            if lease is None or not (lease.valid or await self.renew(gen)):
                gen.end(StepDown.PIN_LOST, "the pin could not be proven ours any more")
                return
            doubts = gen.doubts  # no pull of ours open: the reset covers them all
            await self._reset_pinned(gen)
            cleared = doubts

        try:
            # Passing failures (a server restarting): pull meanwhile, which keeps the pin
            # ours; applied or not, nothing we hold may start before a reset.
            outcome = await reset_when_quiet(
                puller, reset, gen.ended, clock=self.m._clock, sleep=self.m._sleep,
                log=self.m._log, hush_at=self.m._clock(), reset_at=self.m._clock(),
                quiet_within=2 * (s.pull_expires + RESET_QUIET_MARGIN),
                attempts=RESET_ATTEMPTS_TAKE_BACK,
                on_retry=dispatcher.discard_unstarted)
            if outcome.how is Reset.NOT_QUIET:
                gen.end(StepDown.PIN_LOST, "our pull requests did not end; "
                        "cannot take back deliveries lost in a leader change")
            elif outcome.error is not None:
                gen.end(StepDown.PIN_LOST,
                        f"could not take back lost deliveries: {outcome.error}")
        finally:
            puller.hush(False)
            gen.taking_back = False
        # The reset delivered again whatever went missing before it; a doubt raised
        # since waits for a renewal of its own.
        if cleared is not None:
            gen.deliveries_checked(cleared)

    async def _prove_pinned(self, gen: Generation) -> bool:
        """Renew until the server proves the pin it gave us ours, or shows it is not. An
        unanswered or passing answer (a consumer leader elected a moment ago) is asked
        again for up to :data:`UNANSWERED_HOLD` pinned TTLs: nothing starts meanwhile.
        Giving up at the first one left the messages the pin brought unacknowledged and
        not handed back (no provable pin, no unpin): at max_ack_pending nobody could be
        pinned until their 30 s ack wait (a rolling restart, 32 s gap)."""
        s = self.m.settings
        give_up = self.m._clock() + UNANSWERED_HOLD * s.pinned_ttl
        while not await self.renew(gen):
            lease = gen.pin_lease
            if lease is None or lease.lost or gen.ended.done() or self.m._clock() > give_up:
                return False
            await self.m._sleep(s.pinned_ttl / 8)
        return True

    async def _take_over(self, gen: Generation) -> bool:
        """A newly pinned instance starts nothing while the member consumer holds messages
        delivered to someone else: a previous holder's, unfinished or being handed back.
        Handed back, they come to us and wait in stream order among their keys. If they do
        not come, then one pinned TTL after we were pinned, when no previous holder can
        trust an ack any more, we reset the consumer to its ack floor: everything not
        acknowledged is delivered again, in stream order (issue 13 item 1)."""
        s = self.m.settings
        assert gen.dispatcher is not None
        if not await self._prove_pinned(gen):
            gen.end(StepDown.PIN_LOST, "pinned, but could not prove it")
            return False
        puller = next(p for p in gen.pullers if p.delivers)
        deadline = gen.pinned_at + s.pinned_ttl
        # Before a reset no pull of ours may be open, or a delivery made before it could
        # arrive after it and run ahead of (and twice with) its redelivery. So requests
        # stop one pull expiry before the reset; the pin stays ours a TTL past the last.
        quiet = s.pull_expires + RESET_QUIET_MARGIN
        foreign = 0

        async def needed() -> bool | None:
            """Whether the consumer holds messages delivered to someone else."""
            nonlocal foreign
            assert gen.dispatcher is not None
            try:
                info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
                if info is None:
                    gen.end(StepDown.PIN_LOST, "member consumer deleted")
                    return False
                if self.m.static:
                    self._load_static_state(gen, info)
            except CgroupdError as exc:
                self.m._log.info("takeover check failed; retrying", error=str(exc))
                return None
            # Only what we held as of the answer counts against it: a delivery that came
            # after it (we pull until the hush) hid a discarded one, the check said "not
            # needed", and the discarded message came back at its ack wait, after later
            # ones of its key (CI with a CPU hog on f786b00: pinned rolling restart).
            view = ConsumerInfo(info)
            foreign = self._missing(gen, view.num_ack_pending, view.delivered_consumer_seq)
            return foreign > 0

        async def reset() -> None:
            self.m._log.info("taking back messages a previous holder left unfinished",
                             count=foreign)
            await self._reset_pinned(gen)

        def unsupported(exc: CgroupdError) -> None:
            # No consumer reset (nats-server < 2.14): they come back once their ack
            # wait runs out; nothing starts before.
            self.m._log.error("consumer reset unavailable; waiting for the previous "
                              "holder's messages to time out", error=str(exc), count=foreign)

        if not gen.ended.done():
            try:
                # A passing failure (no responders while a server restarts, no answer
                # while the consumer elects a leader) is tried again. Applied or not (a
                # lost reply), nothing we hold may start: the next reset delivers it
                # again, in order.
                await reset_when_quiet(
                    puller, reset, gen.ended, clock=self.m._clock, sleep=self.m._sleep,
                    log=self.m._log, hush_at=max(gen.pinned_at, deadline - quiet),
                    reset_at=deadline, settle=quiet, needed=needed,
                    on_retry=gen.dispatcher.discard_unstarted, on_unsupported=unsupported)
            finally:
                puller.hush(False)
        if gen.ended.done():
            return False
        # The consumer may have the filters of another config, or have been retargeted by
        # a standby (RESET_KEY): bring it to ours before anything starts.
        try:
            moved = await self.mode.rebalance.move_pinned(gen, gen.target)
        except CgroupdError as exc:
            self.m._log.warning("could not bring the member consumer to this config",
                                error=str(exc))
            moved = False
        if not moved:
            gen.end(StepDown.CONFIG_CHANGED, "member consumer not brought to the config")
            return False
        self.m.partitions = gen.partitions
        gen.dispatcher.resume()
        if self.m.state is MemberState.ACTIVE and self.m.phase is Phase.TAKING_OVER:
            self.m._enter(Phase.RUNNING)  # (not if the generation ended meanwhile)
        return True

    async def _retarget_unpinned(self, info: dict[str, Any],
                                 partitions: tuple[int, ...]) -> bool:
        """A standby found the member consumer with other filters than its config gives.
        While an instance holds the pin, that one moves them (:meth:`move_pinned`). While
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
        if self.m.static:
            starts, busy = await self.mode.rebalance._previous_owners(set(partitions) - real)
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
            await self.m._update_config(
                self.m.sync_consumer, self.mode.rebalance._member_filters(set(partitions), set()),
                meta)
        except ApiError as exc:
            if isinstance(exc, WorkQueueOverlap):
                # Reclaims abandoned ones.
                await self.mode.rebalance._previous_owners(set(partitions) - real)
            self.m._log.info("member consumer not retargeted yet", error=str(exc))
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
        info = await self.m.js.reset_consumer(self.m._consume_stream, self.m.sync_consumer, seq)
        gen.dispatcher.last_settled = None  # acks before a reset need no proof after it
        # Deliveries are numbered afresh from the reset (from 1 after one to the ack
        # floor): neither a gap to doubt nor a number already received.
        numbered = ConsumerInfo(info).delivered_consumer_seq
        for puller in gen.pullers:
            puller.last_delivery = numbered
        dropped = gen.dispatcher.discard_unstarted()
        self.m._log.info("member consumer reset", seq=info.get("reset_seq"),
                         dropped=len(dropped))

