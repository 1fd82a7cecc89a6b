"""How long a pinned instance provably holds its pin (pinned exclusivity).

The server tracks acks per consumer, not per pin: an instance that lost its pin (it was
suspended past the pinned TTL, cut off, or unpinned) still gets its acks applied and its
``double_ack`` confirmed. So a pinned instance needs its own proof of ownership before it
starts a handler or trusts a confirmation. The server unpins a client that sent no pull
carrying its pin id for the pinned TTL, and resets that timer on every such pull it
accepts. Hence a *lease*:

- a pull carrying our pin id, sent at ``t`` (our monotonic clock), that the server read
  (a PING/PONG round trip after it proves that), while the pin was still ours (consumer
  info shows our pin id after that round trip: pin ids are never reused, so the pin was
  ours throughout), keeps the pin ours until at least ``t + ttl``, unless someone unpins
  explicitly;
- the lease runs until ``t + ttl - margin`` (the margin covers the server's queueing of
  the pull between reading and applying it); renewing it every ``ttl / 4`` keeps a
  healthy instance's lease always valid, so handlers never wait for it.

An explicit unpin (the reference implementation's step-down, ``nats consumer unpin``,
``cgroupd step-down`` when the holder does not answer) is seen by the next
renewal's consumer info, so a lease never outlives the moment the pin moved by more than
one ``ttl`` (``lease.until < pinned_at_of_successor + ttl``): a successor that waits one
``ttl`` before taking back messages someone else holds is never overtaken by a
confirmation the old holder trusts (see ``Member._takeover``).

A consumer leader change is the exception nats-server 2.15 makes to "the pin stays ours
until ``t + ttl``": the pin id lives only in the leader's memory (``setLeader`` forgets it,
without an advisory), so the new leader starts unpinned and pins the first pull that
carries no pin id, answering ours with ``423 Nats-Wrong-Pin-Id``. Nobody holds the pin
then, and whoever gets it next waits one ``ttl`` before taking back what we hold (as
after any pin move). So consumer info sent at ``t`` that shows *no* pin and a new leader
also keeps the lease until ``t + ttl - margin``, and the next pin id the server gives us
continues the lease (:meth:`PinLease.vanished`): the holder rides the leader change
instead of stepping down, and standbys leave it that ``ttl`` to do so (issue 29).

Pure: the clock is injected and the member does the I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable

from cgroupd.core.clock import LOOP_CLOCK


def step_down_subject(key: str, member: str) -> str:
    """Where the instance holding ``member``'s pin takes a step-down request
    (``cgroupd step-down``; the body is the pin id the operator saw). An unpin moves the
    pin at once, whatever the holder still runs; asked instead, the holder finishes its
    running handlers while the pin stays its own, then unpins and hands back the rest,
    as on a graceful stop."""
    return f"_CGROUPD.stepdown.{key}.{member}"


class PinLease:
    """The pin id this instance holds and until when the pin is provably its own."""

    def __init__(self, ttl: float, clock: Callable[[], float] = LOOP_CLOCK.now) -> None:
        self.ttl = ttl
        #: Server-side delay between reading a pull and applying it, and timer slack.
        self.margin = min(0.25, ttl / 4)
        self._clock = clock
        self.pin_id: str | None = None
        #: Monotonic time until which the pin is ours (``-inf``: not established).
        self.until = -math.inf
        #: Set once the pin is known to have moved: no renewal brings it back.
        self.lost = False
        #: The consumer leader that last confirmed the pin ours (None: not clustered).
        self.leader: str | None = None
        #: The pin vanished with a leader change: the next pin id we get continues it.
        self.repinning = False

    @property
    def held(self) -> bool:
        """Whether this lease has held a pin and not lost it (a standby's has none)."""
        return self.pin_id is not None and not self.lost

    @property
    def valid(self) -> bool:
        """Whether the pin is provably ours right now."""
        return not self.lost and self._clock() < self.until

    def remaining(self) -> float:
        """Seconds the lease still runs (negative once it ran out)."""
        return -math.inf if self.lost else self.until - self._clock()

    def renewed(self, pin_id: str, pulled_at: float, pinned_at: float | None = None) -> None:
        """The server read a pull carrying ``pin_id`` sent at ``pulled_at`` while the pin
        was ours: the lease runs at least until ``pulled_at + ttl - margin``.

        ``pinned_at``: when the delivery that brought a new ``pin_id`` reached us (the
        server pinned us before). Being pinned again continues the lease if that came
        while the lease ran, however late the answer proving it (a new leader busy after
        a restart answered after the lease ran out: the holder stepped down and its 64
        unacknowledged messages held the member still for the 30 s ack wait)."""
        if self.lost:
            return
        if self.pin_id is not None and pin_id != self.pin_id:
            when = self._clock() if pinned_at is None else pinned_at
            if not (self.repinning and when < self.until):
                return
            self.repinning = False  # pinned again while nobody else could have been
        self.pin_id = pin_id
        self.until = max(self.until, pulled_at + self.ttl - self.margin)

    def vanished(self, leader: str | None, checked_at: float, quiet: bool = True) -> bool:
        """Consumer info asked at ``checked_at`` shows nobody pinned. If its leader is not
        the one that last confirmed our pin, the pin went with the old leader (not moved
        to anyone): the lease runs on to ``checked_at + ttl - margin`` and the next pin id
        we are given continues it; True. Otherwise (the same leader: an unpin, or the
        pin's TTL ran out) the lease is over; False.

        ``quiet``: the consumer delivered nothing since our newest delivery. A lease that
        already ran out (no answer while the leader moved) comes back only then: nobody
        else can have been pinned meanwhile, as the server pins a client only with a
        delivery.

        Already waiting to be pinned again, any leader is a new one: leadership can move
        back to the leader that last confirmed the pin (n1, n2, n1 in a rolling restart)
        before a message pins anyone, and that leader no longer holds it either (the holder
        stepped down, and the standby's messages waited 30 s at max_ack_pending)."""
        same_leader = leader == self.leader and not self.repinning
        if self.lost or leader is None or self.leader is None or same_leader \
                or not (quiet or self.valid):
            self.lose()
            return False
        self.repinning = True
        self.until = max(self.until, checked_at + self.ttl - self.margin)
        return self.valid

    def adopt(self, pin_id: str, pulled_at: float) -> None:
        """Pinned again only after the lease ran out (see :meth:`renewed`): a lease on the
        new pin, for a holder that takes the member over as a newly pinned one would."""
        self.pin_id = pin_id
        self.repinning = False
        self.until = max(self.until, pulled_at + self.ttl - self.margin)

    def lose(self) -> None:
        """The pin moved (or the consumer went): the lease is over for good."""
        self.lost = True
        self.until = -math.inf


class SkipRules:
    """Messages a static group's member consumer delivers again that were processed
    already: after a consumer reset (to take partitions another member released), the
    consumer redelivers from the lowest sequence anyone still needs.

    Per partition: every message at or below ``upto`` was processed, except the stream
    sequences in ``pending`` (delivered to us but handed back or not started then). Rules
    only ever describe work done, so an outdated rule may let a message run twice after
    a crash, never skip one that was not processed. Stored in the consumer's metadata so a
    successor applies them too.
    """

    def __init__(self, rules: dict[int, tuple[int, frozenset[int]]] | None = None) -> None:
        self.rules: dict[int, tuple[int, frozenset[int]]] = dict(rules or {})

    def covers(self, partition: int | None, seq: int) -> bool:
        """Whether message ``seq`` of ``partition`` was processed already."""
        rule = self.rules.get(partition) if partition is not None else None
        return rule is not None and seq <= rule[0] and seq not in rule[1]

    def processed_through(self, partition: int, upto: int,
                          pending: Iterable[int] = ()) -> None:
        """Everything of ``partition`` up to ``upto`` is done but ``pending``; merged with
        what was known (a rule's old exceptions above ``upto`` still hold)."""
        old_upto, old_pending = self.rules.get(partition, (0, frozenset()))
        keep = {s for s in old_pending if s > upto}
        self.rules[partition] = (max(upto, old_upto), frozenset({*pending, *keep}))

    def lowest_needed(self, partitions: Iterable[int]) -> int:
        """The first stream sequence a reset must go back to for these partitions."""
        low = None
        for p in partitions:
            upto, pending = self.rules.get(p, (0, frozenset()))
            first = min([upto + 1, *pending])
            low = first if low is None else min(low, first)
        return low or 1

    def to_json(self) -> str:
        return json.dumps({str(p): [u, sorted(e)] for p, (u, e) in sorted(self.rules.items())},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> SkipRules:
        """Rules stored by :meth:`to_json`; none for anything unreadable."""
        try:
            raw = json.loads(text or "{}")
            return cls({int(p): (int(v[0]), frozenset(int(x) for x in v[1]))
                        for p, v in raw.items()})
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return cls()
