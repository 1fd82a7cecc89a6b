"""One object per exclusivity mode: what differs between sync and pinned exclusivity,
behind one small interface, chosen once when the member is made (issue 26).

The member asks its mode, never ``settings.exclusivity``: acquire the member's
partitions, run a generation, fence a handler start, move partitions in place, release.
Each mode owns its jobs as collaborators (objects holding the member, not mixins of it):

========  ==============================================  ===============================
mode      its jobs (modules)                              decides a takeover
========  ==============================================  ===============================
sync      :class:`~cgroupd.member.election_sync.SyncElection` (claim, standby watch,
          unseating a gone or silent holder), :class:`~cgroupd.member.rebalance.Rebalance`
          (moves between data consumers), :class:`~cgroupd.member.selfcheck.SelfCheck`
          (self-check, the lease every start waits for)
                                                          ``election_sync.py``:
                                                          ``SyncElection.acquire_sync``
                                                          (``_unseat`` replaces the holder)
pinned    :class:`~cgroupd.member.election_pinned.PinnedElection` (the pin, its lease,
          the takeover of a previous holder's messages),
          :class:`~cgroupd.member.rebalance_pinned.PinnedRebalance` (moves in place),
          :mod:`~cgroupd.member.pinned_reset` (the one hush/reset/retry loop)
                                                          ``election_pinned.py``:
                                                          ``PinnedElection.acquire_pinned``
                                                          (the server pins us), then
                                                          ``_take_over``
========  ==============================================  ===============================

What both share (config watch, release, the supervisor loop) lives in the member and its
other collaborators (:mod:`cgroupd.member.config_watch`, :mod:`cgroupd.member.release`).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from cgroupd.core.errors import CgroupdError
from cgroupd.core.pinning import step_down_subject
from cgroupd.core.settings import Exclusivity
from cgroupd.member.election_pinned import PinnedElection
from cgroupd.member.election_sync import SyncElection
from cgroupd.member.generation import Generation
from cgroupd.member.pinned_acks import PinnedAcks
from cgroupd.member.rebalance import Rebalance
from cgroupd.member.rebalance_pinned import PinnedRebalance
from cgroupd.member.selfcheck import SelfCheck
from cgroupd.member.state import MemberState, Phase, StepDown
from cgroupd.nats.pull import PullEnd, Puller

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore


class ExclusivityMode(ABC):
    """The interface (and what both modes share); see the module docstring."""

    #: The phase an instance of this mode is in once it becomes active.
    first_phase = Phase.RUNNING
    #: A closing dispatcher hands its unstarted messages back (pinned: to the next
    #: holder of the shared consumer) rather than leaving them to time out.
    hand_back_on_close = False
    #: The member's instances share one consumer (pinned): it is never deleted, so every
    #: membership change is a move in place (even to no partition), and a move that
    #: stopped half-way is tried again from the consumer as it is.
    shared_consumer = False

    def __init__(self, member: MemberCore) -> None:
        self.m = member
        #: When the current move finished each of its steps (logged with "rebalanced").
        self.move_steps: dict[str, float] = {}

    async def open(self) -> None:  # noqa: B027 - most modes have nothing to open
        """On start, once the member answers on its presence subject."""

    @abstractmethod
    async def acquire(self, partitions: tuple[int, ...]) -> Generation | None:
        """Try once to become the active instance; None means stay standby."""

    @abstractmethod
    def run(self, gen: Generation) -> None:
        """The generation is ACTIVE (the listener heard its partitions): start its work."""

    @abstractmethod
    async def fence(self, gen: Generation) -> bool:
        """Before a handler starts (or a failed one is retried): may this instance still
        touch its messages?"""

    @abstractmethod
    async def move(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """Bring the generation's partitions to ``target`` in place; False: not done."""

    @abstractmethod
    async def release(self, gen: Generation, began: float) -> None:
        """Give up what the generation holds (its tasks are stopped; ``began``: when the
        release started)."""

    @abstractmethod
    def incremental(self, new: tuple[int, ...]) -> bool:
        """Can a membership change to ``new`` be applied by moving only what changes?"""

    async def stand_by(self, timeout: float) -> None:
        """Wait as a standby, up to ``timeout`` (a wake ends it early)."""
        await self.m._close_prober()
        await self.m._wait_wake(timeout)

    def acks(self, gen: Generation) -> PinnedAcks | None:
        """How the generation's acks are confirmed (None: the dispatcher's own way)."""
        return None

    def prepare(self, gen: Generation) -> None:  # noqa: B027 - most modes need nothing
        """The generation's dispatcher was made (paused, not started)."""

    def pulls_overlap(self, consumer: str) -> bool:
        """Whether pull requests on ``consumer`` overlap (see MemberCore._start_puller)."""
        return True

    def pull_ended(self, gen: Generation, puller: Puller, why: PullEnd, detail: str,
                   lost: StepDown) -> None:
        """One of the generation's pullers ended (``lost``: the reason its consumer's loss
        gives, chosen by whoever started it): a delivery lost on the way is a stall; any
        other end but our own stop ends the generation."""
        if why is PullEnd.DELIVERY_LOST:
            gen.end(StepDown.STALLED, detail)
        elif why is not PullEnd.STOPPED:
            gen.end(lost, detail)

    def step_down(self, why: StepDown, detail: str = "", gen: Generation | None = None) -> None:
        """End ``gen`` (default: the current generation, if any) for a reason that comes
        from outside the mode's jobs: a stop, the group deleted, a membership change that
        cannot be moved to, a background task's crash. The mode and its jobs are the only
        code that ends a generation, so this is where to look for why one ended."""
        gen = gen if gen is not None else self.m._gen
        if gen is not None:
            gen.end(why, detail)

    def connection_lost(self, gen: Generation) -> None:  # noqa: B027
        """Our connection went away (checks sent before it prove nothing any more)."""

    def connection_back(self, gen: Generation) -> None:  # noqa: B027
        """Reconnected."""

    def move_to(self, target: tuple[int, ...]) -> bool:
        """Apply a membership change in place: the active generation moves its partitions
        to ``target``, run by its rebalance loop (:meth:`rebalance_loop`, one move at a
        time; a newer target supersedes a move under way). The config watch calls it when
        :meth:`incremental` allows; ``Member.generation.target`` shows it at once, and
        ``partitions`` (and ``on_rebalance``) once the move is done. False, changing
        nothing, while this instance is not active."""
        gen = self.m._gen
        if gen is None or not self.m.active:
            return False
        gen.target = target
        gen.retarget.set()
        return True

    async def rebalance_loop(self, gen: Generation) -> None:
        """Apply membership changes in place: release lost partitions once their messages
        are settled, then claim gained ones as soon as their previous owner let go."""
        m = self.m
        retry_until: float | None = None
        while not gen.ended.done():
            await gen.retarget.wait()
            gen.retarget.clear()
            target = gen.target
            if target == gen.partitions and not gen.reconcile:
                retry_until = None
                continue
            gen.reconcile = False
            started = m._clock()
            self.move_steps = {}
            if m.state is MemberState.ACTIVE and m.phase is Phase.RUNNING:
                m._enter(Phase.MOVING)  # (not once the generation ended)
            try:
                done = await self.move(gen, target)
            except CgroupdError as exc:
                m._log.warning("rebalance step failed", error=str(exc))
                done = False
            finally:
                if m.state is MemberState.ACTIVE and m.phase is Phase.MOVING:
                    m._enter(Phase.RUNNING)
            if not done:
                # Say so: a move that stopped half-way leaves no other trace in the log.
                m._log.info("rebalance attempt stopped", target=list(target),
                            superseded=gen.target != target)
                if gen.target != target:
                    # Superseded: the loop goes again. A shared consumer's move may have
                    # stopped half-way (lost partitions held, gained ones claimed): the
                    # next one starts from the consumer as it is, even if the new target
                    # is what this generation had before (else it would stay half-way).
                    if self.shared_consumer:
                        gen.reconcile = True
                        gen.retarget.set()
                    continue
                if self.shared_consumer:
                    # Every attempt starts from the member consumer as it is: one that
                    # met a passing conflict (another member mid-move) is tried again.
                    if retry_until is None:
                        retry_until = started + m.settings.drain_timeout
                    if m._clock() < retry_until:
                        gen.reconcile = True
                        gen.retarget.set()
                        await m._sleep(0.1)
                        continue
                gen.end(StepDown.CONFIG_CHANGED, "incremental rebalance not possible")
                continue
            retry_until = None
            m.partitions = gen.partitions
            m.stats["rebalances"] += 1
            if not gen.partitions:
                gen.end(StepDown.CONFIG_CHANGED, "this member owns no partition any more")
                continue
            elapsed = m._clock() - started
            # When each step ended, from the start: where a slow move spent its time.
            steps = {k: round(t - started, 3) for k, t in self.move_steps.items()}
            m._log.info("rebalanced", partitions=list(gen.partitions),
                        seconds=round(elapsed, 3), steps=steps)
            if m.on_rebalance is not None:
                await m._callback(m.on_rebalance, (gen.partitions, elapsed))


class SyncMode(ExclusivityMode):
    """Sync exclusivity: a synchronization consumer elects the holder; its own data
    consumers deliver; a lease bounds every handler start."""

    def __init__(self, member: MemberCore) -> None:
        super().__init__(member)
        self.election = SyncElection(member, self)
        self.rebalance = Rebalance(member, self)
        self.checks = SelfCheck(member, self)
        #: One swap of data consumers at a time: a move, or the renewal of one that lost
        #: a delivery (:meth:`_renew_data_consumer`).
        self._swapping = asyncio.Lock()

    async def acquire(self, partitions: tuple[int, ...]) -> Generation | None:
        return await self.election.acquire_sync(partitions)

    def run(self, gen: Generation) -> None:
        m = self.m
        # Paused since the generation began: the listener has heard its partitions.
        assert gen.dispatcher is not None
        if not gen.ended.done():
            gen.dispatcher.resume()
        m._spawn(gen, self.rebalance_loop(gen), "rebalance_loop")
        m._spawn(gen, self.checks.verify_loop(gen), "verify_loop")

    async def fence(self, gen: Generation) -> bool:
        """Only under a running lease (see SelfCheck.hold_lease)."""
        return await self.checks.hold_lease(gen)

    async def move(self, gen: Generation, target: tuple[int, ...]) -> bool:
        async with self._swapping:
            return await self.rebalance.move_partitions(gen, target)

    async def release(self, gen: Generation, began: float) -> None:
        m = self.m
        # Our own data consumers: ask for nothing more while handlers finish (what still
        # arrives stays unacknowledged, for the next owner).
        for puller in gen.pullers:
            if puller.delivers:
                await puller.pause()
        if gen.dispatcher is not None:
            await gen.dispatcher.drain(m.settings.drain_timeout)
        await m._releaser.release_sync(gen, m._clock() - began)

    def incremental(self, new: tuple[int, ...]) -> bool:
        # Also when no partition is kept (adding as many members as there are moves every
        # partition to another block): releasing and claiming in place skips the step-down,
        # the transition hold and the new election (issue 15: 16 -> 32 members).
        return self.m.settings.incremental_rebalance and bool(new)

    async def stand_by(self, timeout: float) -> None:
        await self.election.stand_by(timeout)

    def pulls_overlap(self, consumer: str) -> bool:
        # The sync consumer's request never ends early (it matches nothing): overlapping
        # ones keep one always waiting, which is how a standby asks the leader whether
        # we live (issue 29; a standby once read the moment between two and took over).
        return consumer == self.m.sync_consumer

    def pull_ended(self, gen: Generation, puller: Puller, why: PullEnd, detail: str,
                   lost: StepDown) -> None:
        # Our claim's pull told "consumer deleted" is believed only once a server in
        # touch with its cluster agrees (SyncElection.recheck_claim).
        if (why is PullEnd.CONSUMER_GONE and puller.consumer == self.m.sync_consumer
                and not gen.ended.done()):
            self.m._spawn(gen, self.election.recheck_claim(gen, puller, detail),
                          "-claim-recheck")
            return
        if (why is PullEnd.DELIVERY_LOST and puller.consumer in gen.data
                and not gen.ended.done()):
            self.m._spawn(gen, self._renew_data_consumer(gen, puller.consumer, detail),
                          "-data-renewal")
            return
        super().pull_ended(gen, puller, why, detail, lost)

    async def _renew_data_consumer(self, gen: Generation, name: str, detail: str) -> None:
        """A delivery of our data consumer ``name`` never arrived: replace that consumer
        and keep the member (see :meth:`Rebalance.renew_data_consumer`); a stall, as
        before, when it cannot be done."""
        m = self.m
        m._log.warning("a delivery never arrived; replacing the data consumer, keeping "
                       "the claim", consumer=name, detail=detail)
        try:
            async with self._swapping:
                done = await self.rebalance.renew_data_consumer(gen, name)
        except CgroupdError as exc:
            m._log.warning("could not replace the data consumer", error=str(exc))
            done = False
        if done:
            m.stats["data_consumers_renewed"] += 1
        else:
            gen.end(StepDown.STALLED, detail)


class PinnedMode(ExclusivityMode):
    """Pinned exclusivity: one shared member consumer; the server pins one instance; a
    lease on the pin bounds every handler start (see :mod:`cgroupd.core.pinning`)."""

    first_phase = Phase.TAKING_OVER
    hand_back_on_close = True
    shared_consumer = True

    def __init__(self, member: MemberCore) -> None:
        super().__init__(member)
        self.election = PinnedElection(member, self)
        self.rebalance = PinnedRebalance(member, self)

    async def open(self) -> None:
        m = self.m
        m._step_down_sub = await m.js.serve(step_down_subject(m._key, m.member),
                                            self.election._step_down_requested)

    async def acquire(self, partitions: tuple[int, ...]) -> Generation | None:
        return await self.election.acquire_pinned(partitions)

    def run(self, gen: Generation) -> None:
        # The dispatcher stays paused until the takeover is done (hold_pin).
        self.m._spawn(gen, self.election.hold_pin(gen), "hold_pin")

    async def fence(self, gen: Generation) -> bool:
        """Only within the lease on the pin (renewed here if it ran out)."""
        m, election = self.m, self.election
        lease = gen.pin_lease
        while lease is not None and not lease.valid and not await election.renew(gen):
            if not election.pin_unanswered(gen):
                break
            await m._sleep(m.settings.pinned_ttl / 8)  # no answer: ask again
        if lease is None or not lease.valid:
            gen.end(StepDown.PIN_LOST, "cannot prove the pin is still ours")
            return False
        return not gen.ended.done()

    async def move(self, gen: Generation, target: tuple[int, ...]) -> bool:
        return await self.rebalance.move_pinned(gen, target)

    async def release(self, gen: Generation, began: float) -> None:
        await self.m._releaser.release_pinned(gen, self.election.renew)

    def incremental(self, new: tuple[int, ...]) -> bool:
        # The member consumer is shared and never deleted (issue 13 item 3): the pinned
        # instance moves partitions in place, even to none.
        return True

    def acks(self, gen: Generation) -> PinnedAcks | None:
        return PinnedAcks(self.election.renew, gen)

    def prepare(self, gen: Generation) -> None:
        if self.m.static:
            assert gen.dispatcher is not None
            gen.dispatcher.ack_not_owned = True
            gen.dispatcher.skip = lambda msg: gen.skip.covers(msg.partition,
                                                              msg.stream_sequence)

    def doubt(self, gen: Generation, why: str, **info: object) -> None:
        """A delivery may have been lost on its way to us while the consumer leader counts
        it delivered (``why``): later messages of its key must not run before it. Start
        nothing until a renewal asked from now on finds nothing missing, or takes it back
        (see PinnedElection._renew_once). A standby has nothing delivered to doubt: once
        pinned, its takeover checks what the consumer holds."""
        if gen.pin_lease is None or gen.pin_lease.pin_id is None or gen.dispatcher is None:
            return
        self.m._log.info(f"{why}; starting nothing until the consumer shows none missing",
                         **info)
        gen.doubt_deliveries()

    def connection_lost(self, gen: Generation) -> None:
        # A delivery on its way when our server went away is lost, yet the consumer
        # leader (elsewhere in the cluster) counts it delivered to us: later messages of
        # its key would run before it comes back at its ack wait (a rolling restart,
        # static group: #2367 of orders.k31 ran 15 s after #4191).
        self.doubt(gen, "disconnected")

    def connection_back(self, gen: Generation) -> None:
        self.election.renew_now(gen)


MODES: dict[Exclusivity, type[ExclusivityMode]] = {
    Exclusivity.SYNC: SyncMode, Exclusivity.PINNED: PinnedMode}
