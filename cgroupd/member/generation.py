"""A generation: one period of activity of a member instance."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cgroupd.core.pinning import PinLease, SkipRules
from cgroupd.member.dispatch import Dispatcher
from cgroupd.member.state import StepDown
from cgroupd.nats.lease import Lease
from cgroupd.nats.pull import Puller


@dataclass(frozen=True)
class GenerationInfo:
    """What :attr:`Member.generation` shows of the current generation: a snapshot, read
    only, for operators' tools and for tests that watch the state machine from outside."""

    #: Counts this instance's generations from 1: a new number is a new generation (a
    #: step-down and a new election, or a takeover), the same number the same one.
    number: int
    #: The partitions it owns now, and those it is moving to (they differ while moving).
    partitions: tuple[int, ...]
    target: tuple[int, ...]
    #: Its data consumers, by name.
    consumers: tuple[str, ...]
    #: Messages its dispatcher holds (running or waiting their turn), and whether it
    #: starts none of them now (paused: taking over, a move's reset, a step-down).
    holding: int
    paused: bool
    #: It ended (a step-down runs or is done): it starts nothing more.
    ended: bool
    #: Pinned mode: the pin id the server gave this instance (a credential of sorts:
    #: kept out of ``repr``) and whether its lease on the pin is valid now.
    pin_id: str | None = field(default=None, repr=False)
    pin_valid: bool = False

    @property
    def moving(self) -> bool:
        """An incremental rebalance is moving partitions to or from this instance."""
        return self.target != self.partitions


#: The dispatcher hold kept while a delivery to us may be missing (pinned mode).
UNCHECKED = "deliveries unchecked"


@dataclass
class Generation:
    """One period of activity: its partitions, this instance's consumers, its tasks. It
    ends once (``ended``); an incremental rebalance changes its partitions in place.

    The one source of truth for the partitions of an active instance: ``partitions`` is
    what it owns now, ``target`` what it is moving to (they differ only while a rebalance
    runs), ``data`` which of its consumers serves which. ``Member.partitions`` is what the
    member last announced (after a completed move); with no generation, the config says
    what the member would own."""

    partitions: tuple[int, ...]
    #: This instance's count of generations when this one began (see GenerationInfo).
    number: int = 0
    #: This instance's data consumers and the partitions each serves. One at first; an
    #: incremental rebalance adds one for the partitions it gains (a consumer never
    #: rewinds when filters are added to it, so gained partitions need a fresh one).
    data: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pullers: list[Puller] = field(default_factory=list)
    dispatcher: Dispatcher | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    #: The data consumers' info at the last self-check, and deliveries received so far.
    data_info: dict[str, Any] | None = None
    received: int = 0
    #: Partitions the latest config gives us; differs from ``partitions`` while an
    #: incremental rebalance moves some of them.
    target: tuple[int, ...] = ()
    retarget: asyncio.Event = field(default_factory=asyncio.Event)
    rebalances: int = 0
    #: Pinned mode: this instance's lease on the pin (see :mod:`cgroupd.core.pinning`), when the
    #: first pinned delivery came, and the renewal in progress (one at a time).
    pin_lease: PinLease | None = None
    pinned_at: float = 0.0
    renewal: asyncio.Future[bool] | None = None
    #: Pinned mode: since when nobody is pinned after a consumer leader change.
    repin_since: float | None = None
    #: Taking back deliveries lost in a consumer leader change (a reset in place).
    taking_back: bool = False
    #: Pinned mode: events after which a delivery to us may have gone missing (the pin
    #: went with a consumer leader change, our connection dropped, a gap in the delivery
    #: numbers), and how many of them a renewal asked after them has cleared. Starts stay
    #: paused (hold :data:`UNCHECKED`) while any is not cleared (issue 29). Counted, not
    #: a flag: a renewal whose answer predates the latest event cannot clear it.
    doubts: int = 0
    doubts_cleared: int = 0
    #: Pinned mode: the member consumer's leader changed and no sign yet that a pull
    #: request of ours reached the new one (a request waiting there, or a delivery).
    requests_unseen: bool = False
    delivered_before: int = 0
    #: Pinned mode: renewals in a row that found us pinned, messages waiting, and nothing
    #: of ours at the leader (no request waiting, nothing unacknowledged).
    idle_renewals: int = 0
    #: Static groups: per partition, the stream sequence up to which it is processed
    #: (what a release records), and the messages redelivered that were processed.
    processed: dict[int, int] = field(default_factory=dict)
    skip: SkipRules = field(default_factory=SkipRules)
    #: The member consumer must be brought to the config again (see RESET_KEY).
    reconcile: bool = False
    #: Sync exclusivity: the right to start handlers (see :mod:`cgroupd.nats.lease`), when the
    #: synchronization consumer became ours, and the one self-check in flight.
    lease: Lease = field(default_factory=lambda: Lease(0.0))
    claimed_at: float = 0.0
    verifying: asyncio.Future[bool | None] | None = None

    #: The partitions the listener was told are ours (on_partitions_assigned) and not yet
    #: that they went: what a step-down revokes (or loses).
    announced: set[int] = field(default_factory=set)

    ended: asyncio.Future[tuple[StepDown, str]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    #: The reason reported for the end, when it differs from the first one given
    #: (a consumer lost with its group's record is reported as the group's deletion).
    reported: StepDown | None = None

    def __post_init__(self) -> None:
        self.target = self.partitions

    def info(self) -> GenerationInfo:
        """A read-only snapshot (see :attr:`Member.generation`)."""
        d, pin = self.dispatcher, self.pin_lease
        return GenerationInfo(
            self.number, self.partitions, self.target, tuple(self.data),
            holding=d.holding if d is not None else 0, paused=d is not None and d.paused,
            ended=self.ended.done(), pin_id=pin.pin_id if pin is not None else None,
            pin_valid=pin is not None and pin.valid)

    @property
    def in_doubt(self) -> bool:
        """Whether a delivery to us may be missing and no renewal has checked since."""
        return self.doubts_cleared < self.doubts

    def doubt_deliveries(self) -> None:
        """A delivery to us may have gone missing: start nothing until a renewal asked
        after now finds none missing (:meth:`deliveries_checked`)."""
        self.doubts += 1
        if self.dispatcher is not None:
            self.dispatcher.pause(UNCHECKED)

    def deliveries_checked(self, as_of: int) -> None:
        """A renewal asked when ``as_of`` doubts were counted found nothing missing (or
        took it back): starts resume unless a doubt came since."""
        self.doubts_cleared = max(self.doubts_cleared, as_of)
        if not self.in_doubt and self.dispatcher is not None:
            self.dispatcher.resume(UNCHECKED)

    def end(self, why: StepDown, detail: str = "") -> None:
        if not self.ended.done():
            self.ended.set_result((why, detail))

    def reason(self) -> StepDown:
        """Why the generation ended (it has)."""
        return self.reported or self.ended.result()[0]
