"""Who may start handlers in sync exclusivity: the owner's lease and a standby's watch.

Crash detection and liveness are two different questions (issue 13 items 5 and 6, issue 19):

- **A process that died** closes its connection; the server then answers a request to the
  instance's presence subject with "no responders" at once. A standby probes the active
  instance's presence every ``presence_interval`` and replaces a dead one within
  milliseconds (:func:`probe`, :class:`OwnerWatch`). No server-side timer is involved, so
  those timers can be long.
- **An instance that is alive but silent** (host or network loss, a stalled event loop, a
  suspended process) gives no such answer. The owner then protects its partitions itself:
  it starts a handler only while its :class:`Lease` runs, ``lease`` seconds from the
  *sending* of its last ownership check that the server confirmed (a stall between sending
  and reading the reply only shortens it; a disconnection revokes it). A standby replaces a
  silent owner in two steps: after ``lease + takeover_margin`` without an answer it takes
  the synchronization consumer, so that every later check of the old owner fails; it takes
  the old owner's data consumers only ``lease`` after that (:meth:`OwnerWatch.may_reclaim`),
  when the old owner has stopped starting work whatever it heard last. A stall shorter than
  ``lease + takeover_margin`` costs a re-check, never a takeover.

"No responders" is the view of the prober's own server, not of the cluster (issue 29): a
cut between two servers of a cluster takes the owner's subscriptions out of the standby's
server while the owner goes on through another. So it is believed only when the consumer's
leader agrees: the active instance always holds a pull request on its consumers (renewed
every ``pull_expires / 2``), which the leader drops within milliseconds of the instance's
connection closing, wherever the two are. A leader that still holds one (``num_waiting``)
vouches for the instance (:func:`confirm_gone`, :meth:`OwnerWatch.vouch`). Silence (no
answer at all) is judged so only once a held request must be younger than the silence
(:func:`pulled_since_silent`): a stalled process's last request stays at the leader for up
to ``pull_expires``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from cgroupd.core.clock import LOOP_CLOCK
from cgroupd.core.naming import INSTANCE_KEY, MEMBER_KEY, PRESENCE_BY_MEMBER, PRESENCE_KEY


def presence_subject(key: str, member: str, instance: str) -> str:
    """Where an instance answers "I am alive" (its absence is the server's word):
    ``_CGROUPD.presence.<stream>.<group>.<member>.<instance>``. The member has a token
    of its own so that a NATS permission can let a member's user answer (subscribe) for
    its own instances only (``_CGROUPD.presence.<stream>.<group>.<member>.*``): nobody
    else can then fake an answer for them and delay a takeover."""
    return f"_CGROUPD.presence.{key}.{member}.{instance}"


def legacy_presence_subject(key: str, instance: str) -> str:
    """Where instances of versions before :func:`presence_subject` answer (no member
    token): probed only for consumers that lack :data:`PRESENCE_KEY` (an upgrade)."""
    return f"_CGROUPD.presence.{key}.{instance}"


def owner_presence_subject(key: str, metadata: Mapping[str, str]) -> str | None:
    """Where the instance that created a consumer with ``metadata`` answers, or None
    when the metadata names no instance."""
    instance = metadata.get(INSTANCE_KEY)
    if not instance:
        return None
    member = metadata.get(MEMBER_KEY)
    if metadata.get(PRESENCE_KEY) == PRESENCE_BY_MEMBER and member:
        return presence_subject(key, member, instance)
    return legacy_presence_subject(key, instance)


#: What an instance answers while it may run handlers on its consumers: the
#: :class:`cgroupd.member.MemberState` values ``active`` and ``stepping-down``, and
#: ``claiming`` (a standby that holds the synchronization consumer and is creating its
#: data consumer: not idle, though not active yet).
ACTIVE_STATES = ("active", "stepping-down", "claiming")


class Presence(Enum):
    """What a presence probe learned about an instance."""

    ALIVE = "alive"  # it answered
    GONE = "gone"  # "no responders": its connection is closed (the process died)
    SILENT = "silent"  # no answer in time: stalled, suspended, cut off, or we are


@dataclass(frozen=True)
class Answer:
    """One probe's outcome, and the state the instance reported (when it answered)."""

    presence: Presence
    state: str = ""


async def probe(nc: Client, subject: str, timeout: float, body: bytes = b"") -> Answer:
    """Ask once whether the instance answering on ``subject`` is alive."""
    try:
        reply = await nc.request(subject, body, timeout=timeout)
    except nats.errors.NoRespondersError:
        return Answer(Presence.GONE)
    except (nats.errors.TimeoutError, nats.errors.Error, TimeoutError):
        return Answer(Presence.SILENT)
    _, _, state = reply.data.decode(errors="replace").partition(" ")
    return Answer(Presence.ALIVE, state)


class Lease:
    """The active instance's right to start handlers.

    ``renew(sent_at)`` after the server confirmed ownership in answer to a request sent at
    ``sent_at``; ``revoke()`` when the connection drops (checks sent before that prove
    nothing any more). ``valid`` says whether a handler may start now.
    """

    def __init__(self, duration: float, clock: Callable[[], float] = LOOP_CLOCK.now) -> None:
        self.duration = duration
        self._clock = clock
        self._anchor = -math.inf
        self._floor = -math.inf

    def renew(self, sent_at: float) -> None:
        if sent_at >= self._floor and sent_at > self._anchor:
            self._anchor = sent_at

    def revoke(self) -> None:
        self._anchor = -math.inf
        self._floor = self._clock()

    @property
    def valid(self) -> bool:
        return self._clock() - self._anchor < self.duration

    @property
    def remaining(self) -> float:
        return max(0.0, self._anchor + self.duration - self._clock())


@dataclass
class OwnerWatch:
    """A standby's view of the instance that holds the member's synchronization consumer.

    ``heard`` is when it last answered (the watch's start counts as an answer: a standby
    never replaces an owner it has not watched for a whole lease and margin).
    """

    instance: str
    heard: float
    #: Where it answers presence probes (:func:`owner_presence_subject`).
    subject: str = ""
    #: It was seen gone ("no responders"): its consumers may be taken at once.
    gone: bool = False
    #: It answered that it is not active (a standby, stopped, or still acquiring): it runs
    #: no handler, so a synchronization consumer naming it is left over and may be taken.
    idle: bool = False
    #: It answered that it is stepping down: its claim is gone or about to be.
    stepping_down: bool = False
    probes: int = field(default=0)
    #: Our server's last word on it was "no responders": it sees no subscription of it.
    unseen: bool = False
    #: Until then the consumer's leader vouches for it (see :meth:`vouch`).
    vouched_until: float = -math.inf
    #: A silent instance is not judged again before then (see :meth:`defer`).
    recheck_at: float = -math.inf

    def update(self, answer: Answer, now: float) -> None:
        self.probes += 1
        if answer.presence is Presence.GONE:
            self.unseen = True
            self.gone = now >= self.vouched_until
        elif answer.presence is Presence.ALIVE:
            self.heard = now
            self.gone = self.unseen = False
            self.idle = answer.state not in ACTIVE_STATES
            self.stepping_down = answer.state == "stepping-down"
        else:
            self.unseen = False  # our server delivered the probe: it sees the instance

    def vouch(self, now: float, hold: float) -> None:
        """Our server says "no responders", yet the consumer's leader holds a pull request
        of the instance (its connection is open, as the cluster sees it): a cut between
        servers, not a death. Not gone, heard from now; while our server still cannot see
        it, the next such check is ``hold`` away (the vouch spaces the checks)."""
        self.gone = False
        self.heard = max(self.heard, now)
        self.vouched_until = now + hold

    def vouched(self, now: float) -> bool:
        return self.unseen and now < self.vouched_until

    def defer(self, until: float) -> None:
        """Silent, but the consumer's leader holds a pull request that it may have sent
        before it fell silent: judge it again at ``until``, when any such request has
        expired (see :func:`pulled_since_silent`)."""
        self.recheck_at = until

    def silent_for(self, now: float) -> float:
        return now - self.heard

    def replaceable(self, now: float, lease: float, margin: float) -> bool:
        """Gone, idle, or silent for longer than its lease and the margin; never while
        the consumer's leader vouches for it."""
        if self.vouched(now):
            return False
        if self.gone or self.idle:
            return True
        return self.silent_for(now) >= lease + margin and now >= self.recheck_at


#: Seconds allowed for a probe or a pull request to travel (see :func:`pulled_since_silent`).
TRAVEL_SLACK = 0.5


def pulled_since_silent(silent_for: float, pull_expires: float, presence_interval: float) -> bool:
    """Does a pull request that the consumer's leader holds now prove that a silent instance
    sent it *after* it fell silent (so it lives, and only our probes go unanswered)?

    It answered ``silent_for`` seconds ago and missed the probe one ``presence_interval``
    later, so a stall began before that probe reached it; a request still held was sent
    less than ``pull_expires`` ago. Once ``silent_for`` exceeds both together (and the
    travel slack), the request is younger than the silence: the instance pulls, it lives.
    Before that, it may be a stalled instance's last request, which proves nothing.
    """
    return silent_for >= pull_expires + presence_interval + TRAVEL_SLACK


def confirm_gone(answer: Answer, pulls_waiting: int) -> Answer:
    """``answer`` as the cluster sees it: "no responders" while the consumer's leader still
    holds ``pulls_waiting`` pull requests of the instance is silence, not death (its
    connection is open through another server: a cut between servers)."""
    if answer.presence is Presence.GONE and pulls_waiting > 0:
        return Answer(Presence.SILENT)
    return answer


def may_reclaim(answer: Answer, claimed_for: float, lease: float) -> bool:
    """May a new owner delete the data consumer of an instance that answered ``answer``,
    having held the member's synchronization consumer for ``claimed_for`` seconds?

    Gone: yes. Alive: only if it says it is neither active nor stepping down (a live
    instance releases its consumers itself once it sees it lost; one still draining its
    handlers is never robbed). Silent: once we have held the synchronization consumer for a
    whole lease, because any ownership check the silent instance sent after we took it
    failed, so its lease ran out by then.
    """
    if answer.presence is Presence.GONE:
        return True
    if answer.presence is Presence.ALIVE:
        return answer.state not in ACTIVE_STATES
    return claimed_for >= lease


#: The body of a probe that asks for no answer: only the server's "no responders" when
#: nobody listens (the instance died). Costs the server one delivery instead of three.
QUIET_PROBE = b"quiet"


class Prober:
    """Probes one instance's presence over and over, cheaply: one subscription, one publish
    per probe, answers handled as they come (no request future or timer per probe).

    Each answer updates ``watch``: an answer is an ALIVE (with the state it reports); the
    server's "no responders" status is GONE; no answer leaves ``watch.heard`` behind, which
    is what silence is measured by. With ``answer_every`` set, a probe asks for an answer
    only when the last one that did is that old (:data:`QUIET_PROBE` otherwise): a dead
    instance is still seen at the next probe, and silence at most that much later.
    """

    #: Seconds between probes that ask the instance to answer (0: every probe asks).
    answer_every: float = 0.0

    def __init__(self, nc: Client, subject: str, watch: OwnerWatch,
                 clock: Callable[[], float] = LOOP_CLOCK.now,
                 on_replaceable: Callable[[], None] | None = None) -> None:
        self.nc = nc
        self.subject = subject
        self.watch = watch
        self._clock = clock
        #: Called when an answer makes the instance replaceable at once (gone or idle).
        self._on_replaceable = on_replaceable
        self._inbox = ""
        self._sub: Subscription | None = None
        self._sent = 0
        self._asked = -math.inf

    async def send(self) -> None:
        """Probe once more (the answer arrives on its own)."""
        if self._sub is None:
            self._inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._answer)
        if self.nc.is_connected:
            now = self._clock()
            ask = now - self._asked >= self.answer_every
            # A reply subject of its own per probe: a server that lets the instance's user
            # publish only responses (``allow_responses``) lets it answer each subject
            # once (nats-server 2.16 refused every later answer to a reused one).
            self._sent += 1
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(self.subject, b"" if ask else QUIET_PROBE,
                                      reply=f"{self._inbox}.{self._sent}")
                if ask:
                    self._asked = now

    async def _answer(self, msg: Msg) -> None:
        status = (msg.headers or {}).get("Status")
        if status == "503":
            self.watch.update(Answer(Presence.GONE), self._clock())
        elif not status:
            _, _, state = msg.data.decode(errors="replace").partition(" ")
            self.watch.update(Answer(Presence.ALIVE, state), self._clock())
        if (self.watch.gone or self.watch.idle) and self._on_replaceable is not None:
            self._on_replaceable()

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
