"""Sync exclusivity: winning the member's synchronization consumer, standing by while
watching the active instance (presence), taking over from one that is gone or silent,
and reclaiming a dead owner's data consumer (see :mod:`cgroupd.nats.lease`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from cgroupd.core.answers import judge_answer
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    ConsumerExists,
    InstanceIdInUse,
    ServerUnreachable,
    WorkQueueOverlap,
)
from cgroupd.core.naming import (
    DATA_SLOTS,
    HOLDER_KEY,
    INSTANCE_KEY,
    MEMBER_KEY,
    PRESENCE_BY_MEMBER,
    PRESENCE_KEY,
    TOKEN_KEY,
    data_consumer,
)
from cgroupd.core.partitions import (
    partition_filters,
    sync_filters,
)
from cgroupd.core.retrying import retried
from cgroupd.member.generation import Generation
from cgroupd.member.rebalance import contest_backoff, recheck_claim
from cgroupd.member.state import Phase, StepDown
from cgroupd.nats.lease import (
    TRAVEL_SLACK,
    OwnerWatch,
    confirm_gone,
    may_reclaim,
    owner_presence_subject,
    pulled_since_silent,
)
from cgroupd.nats.pull import Puller

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore
    from cgroupd.member.modes import SyncMode

#: A standby whose active instance answers tries to create the synchronization consumer
#: only this many retry intervals apart (it would fail: the consumer exists), unless
#: something happened: a consumer deleted, a config change, the owner gone, idle or silent.
#: (Each is an API request the server answers with an error: 16 standbys at 5 intervals
#: were a sixth of an idle group's API requests. An owner that lost its claim unseen
#: steps down and answers so: its standby needs no timer to notice.)
IDLE_ATTEMPT_EVERY = 15
#: First and longest pause (seconds) between checks of a new claim that the server did
#: not answer in time (see SyncElection._election_contested).
CHECK_RETRY_BASE = 0.25
CHECK_RETRY_CAP = 2.0
#: For this many leases after another instance took the member from us, a claim our own
#: server leads and whose holder it cannot see is handed to another leader before it is
#: taken, whatever its age (see SyncElection._nudge_claim_leader; issue 29, cause 5).
LOST_LATELY_LEASES = 2.0


def _files_lost(exc: CgroupdError) -> bool:
    return isinstance(exc, ApiError) and exc.files_lost


class SyncElection:
    """A job of the member's SyncMode (see the module docstring); a collaborator
    holding the member, not a mixin of it."""

    def __init__(self, member: MemberCore, mode: SyncMode) -> None:
        self.m = member
        self.mode = mode

    #: Whether the next attempt must reach the server (see IDLE_ATTEMPT_EVERY), and when
    #: the last one did.
    _attempt_due: bool = True
    _attempted_at: float = -math.inf
    #: When the watched claim was created (a claim taken again by the same instance is
    #: another claim: its owner is no longer idle).
    _watched_created: str | None = None
    #: The claim (its creation time) whose leader we last asked to step down.
    _nudged: object = None
    #: When a generation of ours last ended because another instance holds the claim.
    _lost_at: float = -math.inf

    def _attempt_pointless(self) -> bool:
        """A standby stood by its whole timeout while the active instance kept answering:
        the sync consumer is still the owner's (a deletion would have woken us), so a
        create would only cost the server an API request. Tried anyway now and then, and
        at every attempt while the owner says it is stepping down (its claim was deleted,
        or is about to be: without the deletion's wake-up, missed, the standby waited 15 s
        while an admin step-down's owner drained and then took the member back, CI on
        06c4b53: test_admin_step_down_lets_a_running_handler_finish[sync])."""
        s, watch, now = self.m.settings, self.m._watch, self.m._clock()
        return (watch is not None and not self._attempt_due and not watch.stepping_down
                and watch.silent_for(now) < s.lease
                and now - self._attempted_at < IDLE_ATTEMPT_EVERY * s.retry_interval)

    async def acquire_sync(self, partitions: tuple[int, ...]) -> Generation | None:
        """Sync exclusivity: try once to win the election; None means stay standby."""
        s = self.m.settings
        watch = self.m._watch
        if (watch is not None and watch.replaceable(self.m._clock(), s.lease, s.takeover_margin)
            and not await self._unseat(watch)):
            return None
        if self._attempt_pointless():
            return None
        self._attempt_due = False
        self._attempted_at = self.m._clock()
        inactive = int(s.inactive_threshold * 1e9)
        sync_cfg = self.m._consumer_config(sync_filters(partitions), inactive_threshold=inactive,
                                           metadata=self._instance_metadata(),
                                           max_ack_pending=1)
        sent = self.m._clock()
        # CLAIMING from the create on: the server may show the new claim (naming us) to a
        # standby before its reply reaches us, and a probe answered "standby" then made
        # that standby take a live claim for an idle one (issue 29, after a route cut's
        # heal). Back to WAITING, with no await, when the create is refused.
        self.m._enter(Phase.CLAIMING)
        try:
            try:
                await self.m.js.create_consumer(self.m._consume_stream, self.m.sync_consumer,
                                                sync_cfg)
            except BaseException:
                self.m._enter(Phase.WAITING)
                raise
        except ConsumerExists:
            if self.m._watch is None:
                await self._learn_owner()
            return None
        except WorkQueueOverlap:
            return None
        except CgroupdError as exc:
            self.m._log.warning("sync consumer create failed", error=str(exc))
            # Not an answer about the claim: the next attempt is never pointless (CI on
            # ab8d2b0: after a step-down the standby's create failed with a 500, and with
            # the old owner answering it waited 15 intervals; test_election_unit).
            self._attempted_at = -math.inf
            if _files_lost(exc):
                await self._drop_unstored_claim()
            return None
        # Still "claiming", not "standby": our new claim exists and is being checked (see
        # _election_contested), so we are not idle. (An instance that answered "standby"
        # then was taken for an idle owner and its claim deleted, CI on 728341b:
        # test_cluster_rolling_restart.)
        contested = True
        try:
            contested = await self._election_contested(partitions, sync_cfg)
        finally:
            if contested:
                self.m._enter(Phase.WAITING)
        if contested:
            return None
        self.m._watch = None
        await self.m._close_prober()
        gen = self.m._gen = self.m._generation(partitions)
        gen.ended.add_done_callback(self._ended)
        # Any ownership check the previous holder sent after this point fails: its lease
        # has run out a lease from now (see _reclaim_abandoned).
        gen.claimed_at = self.m._clock()
        gen.lease.renew(sent)
        # We hold the election from here on: keep the sync consumer alive while waiting
        # for the previous owner's data consumer to go (10100). A live previous owner
        # (draining after a step-down) is never robbed; an abandoned one is reclaimed.
        gen.pullers.append(await self.m._start_puller(gen, self.m.sync_consumer, 1,
                                                      StepDown.SYNC_LOST))
        try:
            await self._add_data_consumer(gen, partitions)
        except CgroupdError as exc:
            self.m._log.warning("data consumer create failed", error=str(exc))
            await self.m._releaser.release(gen)
            self.m._gen = None
            self.m._enter(Phase.WAITING)
            return None
        if self.m._stopping or self.m._deleted:
            # stop() came while we claimed (SIGTERM to every instance: the active one let
            # go and our create won): let go again without becoming active.
            await self.m._releaser.release(gen)
            self.m._gen = None
            self.m._enter(Phase.WAITING)
            return None
        return gen

    def _instance_metadata(self) -> dict[str, str]:
        """What every consumer this instance creates says about it: its member, id and
        process token, and that it answers presence on :func:`presence_subject`."""
        return {MEMBER_KEY: self.m.member, INSTANCE_KEY: self.m.instance_id,
                TOKEN_KEY: self.m._token, PRESENCE_KEY: PRESENCE_BY_MEMBER}

    async def _drop_unstored_claim(self, ours: bool = False) -> None:
        """Our create ran while the server removed the files of the claim of that name
        deleted just before (see :attr:`ApiError.files_lost`): the consumer it left
        names us but can store nothing, and every identical create fails the same way,
        so nobody could take the member over until its inactive threshold. Delete it if
        it is ours; the deletion's reply comes after its files are gone, so the next
        attempt creates a sound claim (CI on 0e2193e: a standby never took over).
        ``ours``: the caller knows it is (the claim it just made and checked)."""
        with contextlib.suppress(CgroupdError):
            if ours or await self.m._sync_is_ours():
                self.m._log.info("deleting our claim that the server could not store")
                await self.m.js.delete_consumer(self.m._consume_stream, self.m.sync_consumer)

    async def _election_contested(self, partitions: tuple[int, ...],
                                  config: dict[str, object]) -> bool:
        """Our new sync consumer claims ``partitions``: was another member's claim on some
        of them accepted at the same moment (the server's overlap check races an update:
        see :func:`recheck_claim`)? Then ours goes, and the next attempt comes after a
        random moment. (Two instances of one member compete by the consumer's name,
        which is a different lock.)

        The question is an update of our claim that changes nothing: one small request,
        where listing the stream's consumers costs as much as the fleet is large (issue
        27: 500 members started at once, every claim's list timed out and the claim was
        thrown away, for minutes). A check the server did not answer in time is asked
        again, later each time, while the claim is kept: nothing starts on it before the
        check, and a racing claimant's own check still sees it. It is let go once the
        checks took ``lease``."""
        try:
            contested = await retried(
                lambda: recheck_claim(self.m.js, self.m._consume_stream, self.m.sync_consumer,
                                      config),
                within=self.m.settings.lease, base=CHECK_RETRY_BASE, cap=CHECK_RETRY_CAP,
                retry_if=lambda exc: exc.retriable and not _files_lost(exc)
                and not (self.m._stopping or self.m._deleted),
                clock=self.m._clock, sleep=self.m._sleep)
        except CgroupdError as exc:
            if _files_lost(exc):
                # Made while the server removed the files of the claim of that name
                # deleted just before: it lives in memory but cannot be written (the
                # update says so). Made again at once.
                await self._drop_unstored_claim(ours=True)
                self._attempted_at = -math.inf
                self.m._wake.set()
                return True
            self.m._log.warning("could not check the new claim", error=str(exc))
        else:
            if not contested:
                return False
            self.m._log.info("claim contested; letting go and trying again",
                             partitions=list(partitions))
        with contextlib.suppress(CgroupdError):
            await self.m.js.delete_consumer(self.m._consume_stream, self.m.sync_consumer)
        await self.m._sleep(contest_backoff())
        return True

    async def _learn_owner(self) -> None:
        """Read who holds the member's synchronization consumer, to watch it."""
        try:
            info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
        except CgroupdError as exc:
            self.m._log.info("could not read the sync consumer's holder", error=str(exc))
            return
        if judge_answer([info], sent=self.m._clock(), lease=self.m.settings.lease).stale:
            # A server out of touch with its cluster (a node just back from a cut): its
            # answer may name a holder that is long gone, or this very process (the claim
            # another instance took from us), whose deletion below would be the new
            # holder's. Read again at the next attempt.
            self.m._log.info("sync consumer's holder read from a server out of touch with "
                             "its cluster; ignored",
                             holder=ConsumerInfo.of(info).meta(INSTANCE_KEY))
            return
        meta = ConsumerInfo.of(info).metadata
        owner = meta.get(INSTANCE_KEY)
        subject = owner_presence_subject(self.m._key, meta)
        if info is None or not owner or not subject or meta.get(HOLDER_KEY):
            # Gone already, or not a member instance (a Spark query's lease, which answers
            # no probe): nothing to watch; it ends by itself.
            self.m._watch = None
            return
        if owner == self.m.instance_id:
            if meta.get(TOKEN_KEY) != self.m._token:
                raise InstanceIdInUse(
                    f"another process holds member {self.m.member} of {self.m.stream}/"
                    f"{self.m.group} under this instance id ({self.m.instance_id!r}); give each "
                    "process its own id")
            # Ours, from an earlier period that could not delete it: drop it and compete.
            with contextlib.suppress(CgroupdError):
                await self.m.js.delete_consumer(self.m._consume_stream, self.m.sync_consumer)
            self.m._watch = None
            return
        if self.m._watch is None or self.m._watch.instance != owner \
                or self._watched_created != info.get("created"):
            self.m._watch = OwnerWatch(owner, heard=self.m._clock(), subject=subject)
            self._watched_created = info.get("created")

    async def stand_by(self, timeout: float) -> None:
        """Wait up to ``timeout`` (a wake ends it early) while watching the active
        instance: return at once when it is gone, idle, or silent for ``lease +
        takeover_margin``, so that the next attempt replaces it."""
        watch, s = self.m._watch, self.m.settings
        self._attempt_due = True  # unless the whole timeout passes with the owner answering
        if watch is None:
            await self.m._close_prober()
            await self.m._wait_wake(timeout)
            return
        prober = self.m._prober
        if prober is None or prober.watch is not watch:
            await self.m._close_prober()
            prober = self.m._prober = self.m.js.prober(watch.subject, watch, self.m._clock,
                                                       self.m._wake.set)
            prober.answer_every = s.presence_answer_every
        deadline = self.m._clock() + timeout
        while not self.m._wake.is_set():
            await prober.send()
            # A "no responders" answer, an advisory or a config change wakes us at once.
            await self.m._wait_wake(s.presence_interval)
            now = self.m._clock()
            if self.m._watch is not watch or watch.replaceable(now, s.lease, s.takeover_margin):
                return
            if now >= deadline:
                self._attempt_due = self.m._wake.is_set()
                return

    async def _unseat(self, watch: OwnerWatch) -> bool:
        """Delete the synchronization consumer of an active instance that is gone, idle, or
        silent for too long (if it still holds it); True: competing may go on."""
        s = self.m.settings
        if not watch.gone:
            # One last question before taking over from a silent or idle instance.
            answer = await self.m.js.probe(watch.subject, self.m._probe_timeout)
            watch.update(answer, self.m._clock())
            if not watch.replaceable(self.m._clock(), s.lease, s.takeover_margin):
                return False
            # Other standbys decided at about the same time: spread them out, so that one
            # is first and the others see it below (no such wait after a crash: speed).
            await self.m._sleep(random.uniform(0, 2 * s.presence_interval))
        # Read the holder right before deleting (another standby may have been quicker).
        try:
            info = await self.m.js.consumer_info(self.m._consume_stream, self.m.sync_consumer)
        except CgroupdError as exc:
            self.m._log.info("could not read the sync consumer's holder", error=str(exc))
            return False
        if judge_answer([info], sent=self.m._clock(), lease=self.m.settings.lease).stale:
            return False  # out of touch: the holder it names may not be the one deleted
        if info is None or ConsumerInfo(info).meta(INSTANCE_KEY) != watch.instance \
                or info.get("created") != self._watched_created:
            # Released meanwhile, or someone else holds it now: or the watched instance
            # itself took it again (a step-down for a membership change, then a new
            # claim: it was idle in between), which is not the claim we saw left over.
            self.m._watch = None
            return True
        view = ConsumerInfo(info)
        if not watch.idle and view.num_waiting:
            self._decline_while_it_pulls(watch, view.leader)
            return False
        age = view.age
        young = age is not None and age < s.lease
        # A claim this young may have no pull request yet: its owner pulls on it only
        # once its check of the claim is answered, which may take retries. "No
        # responders" from our server and none at the leader prove nothing until then
        # (issue 29: across a cut, the old owner took a fresh claim back that way).
        # Its data consumer is made after that pull started: once one is older than
        # a pull request's travel, the missing request means what it does for an old
        # claim (kill -9 of an owner a second after its takeover took 1.3 s, p50).
        # An older claim that took the member from us a moment ago is the same case
        # for the nudge: we were active, not standing by, while it was young.
        if watch.unseen and not watch.idle and (young or self._lost_lately()) \
                and await self._nudge_claim_leader(watch, view):
            # Time for its next create and a pull at the new leader (a pull lost on
            # the way is asked again within pull_expires / 2).
            watch.vouch(self.m._clock(), s.lease + s.pull_expires / 2)
            self.m.stats["takeovers_declined"] += 1
            return False
        if watch.unseen and not watch.idle and young and age is not None:
            pulling_for = await self._data_consumer_age(watch.instance)
            if pulling_for is None or pulling_for < TRAVEL_SLACK:
                wait = s.lease - age if pulling_for is None else TRAVEL_SLACK - pulling_for
                watch.vouch(self.m._clock(), min(s.lease - age, wait))
                self.m.stats["takeovers_declined"] += 1
                self.m._log.info("not taking over a claim made a moment ago",
                                 active=watch.instance, claim_age=round(age, 3),
                                 data_consumer_age=None if pulling_for is None
                                 else round(pulling_for, 3))
                return False
        why = "gone" if watch.gone else "idle" if watch.idle else "silent"
        silent = self.m._clock() - watch.heard
        self.m._log.warning("taking over from the active instance", active=watch.instance,
                            why=why, silent_for=round(silent, 3))
        self.m.stats["takeovers"] += 1
        try:
            await self.m.js.delete_consumer(self.m._consume_stream, self.m.sync_consumer)
            if watch.gone:
                # Dead: its data consumers can go now too (saves the successor a round
                # of "overlapping consumer" and presence checks; extra ones are reclaimed).
                for left in map(ConsumerInfo,
                                await self.m.js.list_consumers(self.m._consume_stream)):
                    if left.meta(INSTANCE_KEY) == watch.instance \
                            and left.meta(MEMBER_KEY) == self.m.member:
                        self.m._just_deleted.add(left.name)
                        await self.m.js.delete_consumer(self.m._consume_stream, left.name)
        except CgroupdError as exc:
            self.m._log.warning("could not delete the old owner's consumers", error=str(exc))
            return False
        self.m._watch = None
        return True

    def _ended(self, ended: asyncio.Future[tuple[StepDown, str]]) -> None:
        """A generation of ours ended: remember when, if another instance took the claim."""
        if not ended.cancelled() and ended.result()[0] is StepDown.SYNC_LOST:
            self._lost_at = self.m._clock()

    def _lost_lately(self) -> bool:
        """Whether another instance took the member from us less than
        :data:`LOST_LATELY_LEASES` leases ago."""
        return self.m._clock() - self._lost_at < LOST_LATELY_LEASES * self.m.settings.lease

    async def _nudge_claim_leader(self, watch: OwnerWatch, claim: ConsumerInfo) -> bool:
        """A young claim of an instance our server cannot see, led by our own server: ask
        that leader, once per claim, to hand its leadership to another peer; True if we
        asked. Also a claim of any age that took the member from us a moment ago (issue
        29, cause 5: across a route cut the new owner's claim got its first leader on our
        server while we were still active; we noticed our loss 2.7-3.4 s later, when the
        claim was older than a lease, and took it back 1 s after that, in 4 of 23 runs).

        Across a route cut (issue 29) the new owner's claim may get its first leader on
        our side (the meta leader picks it at random): its create, its checks and its pulls
        never reach that leader, so it never pulls, and we would take the member back a
        lease later. Only a client of the leader's own server can ask it to step down;
        any other peer is one the holder's server reaches (directly, or it is that
        server). Asked before the data consumer's age is looked at: that age proves a
        pull only where the leader could receive one. A holder that is dead costs the
        vouch's wait (a claim younger than a lease, led by our server, or one that took
        the member from us a moment ago: rare)."""
        ours = self.m.js.server_name
        created = claim.raw.get("created")
        if not ours or claim.leader != ours or self._nudged == created:
            return False
        self._nudged = created
        self.m._log.warning("not taking over: asking our server to hand on the claim's "
                            "leadership, which its holder's server may not reach",
                            active=watch.instance, leader=ours,
                            claim_age=claim.age)
        try:
            await self.m.js.step_down_consumer_leader(self.m._consume_stream,
                                                      self.m.sync_consumer)
        except CgroupdError as exc:
            self.m._log.info("the claim's leader did not step down", error=str(exc))
        return True

    async def _data_consumer_age(self, instance: str) -> float | None:
        """Seconds since ``instance`` made its newest data consumer of this member, as the
        server counts them; None if it holds none (or none could be read). One request
        per data slot: listing the stream's consumers costs as much as the fleet."""
        answers = await asyncio.gather(
            *(self.m.js.consumer_info(self.m._consume_stream, data_consumer(self.m.member, slot))
              for slot in range(DATA_SLOTS)), return_exceptions=True)
        ages = []
        for answer in answers:
            if isinstance(answer, BaseException):
                if not isinstance(answer, CgroupdError):
                    raise answer
                continue  # unread: counts as none (the wait goes on)
            view = ConsumerInfo(answer) if answer is not None else None
            if view is not None and view.meta(INSTANCE_KEY) == instance and view.age is not None:
                ages.append(view.age)
        return min(ages, default=None)

    def _decline_while_it_pulls(self, watch: OwnerWatch, leader: str) -> None:
        """The consumer's leader holds a pull request of the watched instance, which we
        were about to replace: it lives, or may (issue 29).

        "No responders" from our server while the leader holds its request: our server
        lost sight of it, the cluster did not (a cut between two servers). Silence: once
        the request must be younger than the silence, the instance pulls and only our
        probes are lost; before that it may be a stalled instance's last request, so it
        is judged again when that one has expired.
        """
        s, now = self.m.settings, self.m._clock()
        silent_for = watch.silent_for(now)
        if not watch.unseen and not pulled_since_silent(silent_for, s.pull_expires,
                                                        s.presence_interval):
            watch.defer(watch.heard + s.pull_expires + s.presence_interval + TRAVEL_SLACK)
            return
        watch.vouch(now, min(s.pull_expires, s.lease / 3))
        self.m.stats["takeovers_declined"] += 1
        say = self.m._log.warning if self.m.stats["takeovers_declined"] == 1 else self.m._log.info
        say("not taking over: the consumer's leader holds the active instance's pull request",
            active=watch.instance, leader=leader or None,
            our_server="no responders" if watch.unseen else "no answer",
            silent_for=round(silent_for, 3))

    async def _add_data_consumer(self, gen: Generation, partitions: tuple[int, ...],
                                 reclaim: Callable[[], Awaitable[object]] | None = None
                                 ) -> None:
        """Create a data consumer for ``partitions`` and pull from it.

        Its name is one of the member's :data:`DATA_SLOTS` (see :func:`data_consumer`):
        the next after the one this instance used last (never the one it just deleted,
        whose files the server may still be removing), skipping names that another
        consumer holds (the previous owner's, still draining or abandoned).
        Creation fails with 10100 while the previous owner's data consumer still holds
        some of them: retry until it lets go (reclaiming it if abandoned), up to a bound.
        ``reclaim`` replaces the reclaim of this member's abandoned consumers (an
        in-place move takes partitions from other members).
        """
        s = self.m.settings
        config = self.m._consumer_config(
            partition_filters(partitions), inactive_threshold=int(s.inactive_threshold * 1e9),
            metadata=self._instance_metadata())
        # Long enough for the previous owner to drain, or its lease to run out.
        deadline = self.m._clock() + max(s.drain_timeout, s.lease) + 2 * s.retry_interval
        taken = 0  # slots found held by other consumers in a row
        while True:
            name = data_consumer(self.m.member, self.m._data_slot)
            if name in self.m._just_deleted and taken < DATA_SLOTS - 1:
                # We deleted it a moment ago (a predecessor's): the server may still be
                # removing its files, and a consumer created under that name meanwhile
                # can store nothing (see _drop_unstored_claim).
                self.m._next_data_slot()
                taken += 1
                continue
            try:
                await self.m.js.create_consumer(self.m._consume_stream, name, config)
                break
            except ConsumerExists:
                # Another consumer has this name: try the next one; every one held
                # means left-over consumers of this member (reclaimed when abandoned).
                self.m._next_data_slot()
                taken += 1
                if taken < DATA_SLOTS:
                    continue
                taken = 0
                if s.reclaim_abandoned:
                    await self._reclaim_abandoned(gen)
                if self.m._clock() > deadline or gen.ended.done() or self.m._stopping:
                    raise
            except ServerUnreachable as exc:
                # Unanswered. A new clustered consumer's reply comes from its first leader,
                # which the meta leader picks at random among the peers: across a route cut
                # it can be a server out of our server's reach, and then so is every pull
                # (issue 29: giving up let the claim go, and the instance across the cut
                # took the member back). It may exist, naming us: delete it (the meta
                # leader applies that, even if the reply is lost too) and try the next name
                # (another random leader), keeping the claim.
                self.m._log.warning("data consumer create unanswered; deleting it and "
                                    "trying the next name", consumer=name, error=str(exc))
                with contextlib.suppress(CgroupdError):
                    await self.m.js.delete_consumer(self.m._consume_stream, name)
                self.m._just_deleted.add(name)
                self.m._next_data_slot()
                if self.m._clock() > deadline or gen.ended.done() or self.m._stopping:
                    raise
                continue
            except WorkQueueOverlap:
                if reclaim is not None:
                    await reclaim()
                elif s.reclaim_abandoned and await self._reclaim_abandoned(gen):
                    continue
                if self.m._clock() > deadline or gen.ended.done() or self.m._stopping:
                    raise
            await self.m._sleep(min(0.05, s.retry_interval))
        self.m._next_data_slot()
        self.m._just_deleted.clear()
        gen.data[name] = partitions
        gen.pullers.append(await self.m._start_puller(gen, name, s.max_in_flight,
                                                      StepDown.DATA_LOST, deliver=True))

    async def _reclaim_abandoned(self, gen: Generation) -> bool:
        """Delete data consumers of this member whose instance cannot be using them.

        The server keeps a consumer holding unacknowledged messages until their ack wait
        runs out, so a crashed owner would block its successor for ``ack_wait``. Every
        instance answers on its presence subject, with its state; the server itself says
        "no responders" when the instance's connection is gone. Reclaimed (see
        :func:`cgroupd.nats.lease.may_reclaim`): a gone instance's consumer at once; a silent
        one's once we have held the sync consumer for a whole lease (its lease has run out
        by then); one that answers it is no longer active. A live owner still draining
        answers, and is left alone: it deletes its consumer itself.
        """
        mine = set(gen.data) | {self.m.sync_consumer}
        reclaimed = False
        try:
            for info in map(ConsumerInfo, await self.m.js.list_consumers(self.m._consume_stream)):
                meta = info.metadata
                name, owner = info.name, meta.get(INSTANCE_KEY)
                if name in mine or meta.get(MEMBER_KEY) != self.m.member or not owner \
                        or name == self.m.sync_consumer:
                    continue
                subject = owner_presence_subject(self.m._key, meta)
                if subject is None:
                    continue
                answer = confirm_gone(await self.m.js.probe(subject, self.m._probe_timeout),
                                      info.num_waiting)
                held = self.m._clock() - gen.claimed_at
                if may_reclaim(answer, held, self.m.settings.lease) and not gen.ended.done():
                    self.m._log.warning("reclaiming abandoned data consumer", consumer=name,
                                        instance=owner, presence=answer.presence.value,
                                        state=answer.state or None)
                    self.m._just_deleted.add(name)
                    reclaimed |= await self.m.js.delete_consumer(self.m._consume_stream, name)
        except CgroupdError as exc:
            self.m._log.warning("could not inspect previous owner's consumer", error=str(exc))
        return reclaimed

    async def recheck_claim(self, gen: Generation, ended: Puller, detail: str) -> None:
        """Our claim's pull was told "consumer deleted": believe it only if a server in
        touch with its cluster agrees. After a cluster heal, the node that was cut off
        still runs the old claim of the same name until it catches up; deleting it, it
        answers every pull waiting on that name, the new owner's too (seen in the
        cluster-cut test: the new owner stepped down and the old instance took the
        member back). Meanwhile the lease still bounds what we start."""
        if not await self.m._sync_is_ours():
            gen.end(StepDown.SYNC_LOST, detail)
            return
        if gen.ended.done():
            return
        self.m._log.warning("claim reported deleted by a server out of touch; it is still "
                            "ours", detail=detail)
        fresh = await self.m._start_puller(gen, self.m.sync_consumer, 1, StepDown.SYNC_LOST)
        gen.pullers = [fresh if p is ended else p for p in gen.pullers]
        if gen.ended.done():
            await fresh.stop()
