"""Tunables of a member instance: crash failover in a fraction of a second, stalls of a few
seconds survived without a takeover.

One unit everywhere: seconds as float. The CLI is the only place that reads argv or the
environment; everything below it receives a :class:`MemberSettings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from cgroupd.core.errors import ConfigError
from cgroupd.core.ordering import Ordering


class Exclusivity(Enum):
    """How the instances of one member decide which of them consumes."""

    #: The ADR's design: a synchronization consumer named after the member, created with
    #: ``action: create`` and the instance id in its metadata, plus an instance-specific
    #: data consumer. Works on any server >= 2.10.
    SYNC = "sync"
    #: Priority groups (server >= 2.11): one consumer per member, ``pinned_client``
    #: policy; the server pins one instance. Interoperates with the Go reference.
    PINNED = "pinned"


#: Priority group name used by pinned mode, as the Go reference uses it.
PRIORITY_GROUP = "PCG"
#: Pinned mode: deliveries the member consumer allows beyond what its holder asks for
#: (``max_ack_pending`` is ``max_in_flight`` plus this). The server pins only with a
#: delivery, so a holder stopped or killed with a full window (``max_in_flight``
#: unacknowledged) left nobody pinnable until their ack wait ran out: 30 s (CI on 039a510,
#: test_stall_attacks pinned-sigstop-10s). With one spare, the standby is pinned with
#: the next message and takes the rest back at its takeover's reset.
PIN_SPARE = 1
#: Pinned mode: how much longer than a pull's expiry a new holder stays quiet before it
#: resets the member consumer (no delivery made before the reset may still be on its way).
RESET_QUIET_MARGIN = 0.25

#: Default max in flight, every ordering: the server sends ahead while the dispatcher keeps
#: the order (bench.throughput: partition ordering at 1 ran the peer's speed, one server
#: round trip per message; at 8, 32, 256 it ran 2.5x, 3.2-3.5x, 3.7-4.3x the peer).
DEFAULT_CONCURRENCY = 256
#: Most messages in flight: a typo must not ask the server for 10**8 messages at once.
MAX_IN_FLIGHT = 100_000
#: Longest duration setting (a week): more is a unit mistake, and overflows timers.
MAX_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class MemberSettings:
    """How a member instance competes, consumes and steps down."""

    #: Order kept within the member (see :mod:`cgroupd.core.ordering`,
    #: :mod:`cgroupd.member.dispatch`).
    ordering: Ordering = Ordering.PARTITION
    #: Messages a data consumer may have unacknowledged (held: running or waiting their
    #: turn, in order); 0 picks the default, :data:`DEFAULT_CONCURRENCY`. Handlers run at
    #: once: at most this many, and one per partition (``partition``), per key (``key``),
    #: one in all (``stream``).
    max_in_flight: int = 0
    #: What makes messages "the same key" in ``key`` ordering (see partitions.key_function).
    key: str = "auto"
    #: Server redelivers a message not acked within this time (kept alive while a handler
    #: runs by ``in_progress``).
    ack_wait: float = 30.0
    #: Standby retry and active self-check period (the ADR uses 5 s; we react faster).
    #: Each successful self-check renews the active instance's lease.
    retry_interval: float = 1.0
    #: How long the active instance may start handlers after sending its last ownership
    #: check the server confirmed. Once it has run out (cut off from the server, event loop
    #: stalled) the instance starts no handler and retries none until a new check confirms
    #: it still owns its consumers. Sync exclusivity.
    lease: float = 3.0
    #: A standby replaces an active instance that is alive but silent (no answer, but no
    #: "no responders" either: host or network loss, a stall) once it has not heard from it
    #: for ``lease + takeover_margin``; it takes that instance's data consumers another
    #: ``lease`` later, when the silent instance has certainly stopped starting work. A
    #: stall shorter than ``lease + takeover_margin`` never causes a takeover.
    takeover_margin: float = 1.0
    #: How often a standby probes the active instance's presence. An instance that died
    #: (its connection closed: the server answers "no responders") is replaced at once, so
    #: this bounds crash detection; most probes ask for no answer (only the server's, when
    #: nobody listens), one each ``presence_answer_every`` does (silence is measured by
    #: those). Measured (bench.scale, 16 members x 2): 0.125 s with an answer to every
    #: probe was half of the server's idle work.
    presence_interval: float = 0.25
    presence_answer_every: float = 1.0
    #: The server deletes a consumer nobody pulled on for this long. Not the crash detector
    #: (standbys probe presence): it cleans up after instances that had no standby, and is
    #: long enough that a stall the lease survives never costs the owner its consumers
    #: (at least ``lease + takeover_margin + pull_expires``).
    inactive_threshold: float = 10.0
    #: Lifetime of one pull request, and the server's idle heartbeat within it (three
    #: missed ones: the request is taken as lost and made again). 0 picks the exclusivity's
    #: default: sync 5 s and 2.5 s (crash detection is the presence probe's, a reconnect
    #: re-pulls at once, a leadership change answers 409: the heartbeat only finds a
    #: request lost otherwise, and every request and heartbeat is idle work for the
    #: server and a wakeup of the member; sync pullers ask again when a request ends,
    #: without overlapping requests); pinned 1 s and 0.25 s (pulls keep the pin: they
    #: must come well within ``pinned_ttl``).
    pull_expires: float = 0.0
    heartbeat: float = 0.0
    #: After stepping down, wait this long before competing again (ADR: "a second").
    rejoin_delay: float = 1.0
    #: Transition delays on a membership change (ADR "Transitioning").
    transition_delay: float = 0.5
    transition_jitter: float = 0.1
    #: How long a stopping or stepping-down instance lets running handlers finish before
    #: cancelling async ones. Its consumers are released only once no handler runs any more
    #: (a sync handler's thread cannot be cancelled: it is waited for), so a webhook's
    #: timeout must not exceed it (``cgroupd join`` refuses that).
    drain_timeout: float = 15.0
    #: Retry backoff after a handler raises: base * 2**(deliveries-1), capped.
    retry_backoff: float = 0.1
    retry_backoff_max: float = 10.0
    exclusivity: Exclusivity = Exclusivity.SYNC
    #: Delete a previous owner's data consumer that nobody pulls from any more, instead of
    #: waiting for the server to drop it after its unacked messages' ack wait.
    reclaim_abandoned: bool = True
    #: On a membership change, move only the partitions that change owner (consumer filter
    #: updates) instead of the ADR's drop-everything-and-rejoin. Sync exclusivity only.
    incremental_rebalance: bool = True
    #: Pinned mode: the server unpins an instance that did not pull for this long.
    pinned_ttl: float = 2.0
    #: The longest a partition listener hook (``on_partitions_assigned`` / ``_revoked`` /
    #: ``_lost``) is waited for; one still running then is logged, counted and left
    #: behind, so a hanging hook delays a hand-over by at most this (see
    #: :mod:`cgroupd.member.listener`).
    listener_timeout: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        if self.max_in_flight == 0:
            object.__setattr__(self, "max_in_flight", DEFAULT_CONCURRENCY)
        sync = self.exclusivity is Exclusivity.SYNC
        #: The fields given as 0 ("the exclusivity's default"), for with_exclusivity.
        chosen = tuple(n for n in ("pull_expires", "heartbeat") if getattr(self, n) == 0)
        object.__setattr__(self, "_chosen_by_default", chosen)
        if self.pull_expires == 0:
            object.__setattr__(self, "pull_expires", 5.0 if sync else 1.0)
        if self.heartbeat == 0:
            object.__setattr__(self, "heartbeat", self.pull_expires / 2 if sync
                               else min(0.25, self.pull_expires / 2))
        if self.max_in_flight < 1 or self.max_in_flight > MAX_IN_FLIGHT:
            problems.append(f"max_in_flight must be at least 1 and at most {MAX_IN_FLIGHT}, "
                            f"not {self.max_in_flight}")
        # NaN passes every comparison and infinity every bound, then breaks the
        # nanosecond conversions and sleeps at run time: refuse them here.
        for name in ("ack_wait", "retry_interval", "inactive_threshold", "pull_expires",
                     "heartbeat", "pinned_ttl", "lease", "presence_interval",
                     "presence_answer_every", "listener_timeout"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                problems.append(f"{name} must be positive and finite (seconds), not {value}")
            elif value > MAX_SECONDS:
                problems.append(f"{name} must be at most {MAX_SECONDS:g} seconds, not {value}")
        for name in ("rejoin_delay", "transition_delay", "transition_jitter",
                     "drain_timeout", "retry_backoff", "retry_backoff_max", "takeover_margin"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                problems.append(f"{name} must not be negative, and finite (seconds), "
                                f"not {value}")
            elif value > MAX_SECONDS:
                problems.append(f"{name} must be at most {MAX_SECONDS:g} seconds, not {value}")
        if self.heartbeat * 2 > self.pull_expires:
            problems.append("heartbeat must be at most half of pull_expires")
        if self.lease <= self.retry_interval:
            problems.append(f"lease ({self.lease:g}s) must be longer than retry_interval "
                            f"({self.retry_interval:g}s), which renews it")
        quiet = self.pull_expires + RESET_QUIET_MARGIN
        if self.exclusivity is Exclusivity.PINNED and self.pinned_ttl <= quiet:
            problems.append(
                f"pinned_ttl ({self.pinned_ttl:g}s) must be longer than pull_expires + "
                f"{RESET_QUIET_MARGIN:g}s ({quiet:g}s): a new holder goes quiet that long "
                "before it resets the member consumer, and would lose its pin meanwhile")
        floor = self.lease + self.takeover_margin + self.pull_expires
        if self.exclusivity is Exclusivity.SYNC and self.inactive_threshold < floor:
            problems.append(
                f"inactive_threshold ({self.inactive_threshold:g}s) must be at least lease + "
                f"takeover_margin + pull_expires ({floor:g}s): otherwise the server deletes "
                "the consumers of an instance whose stall the lease survives")
        if problems:
            raise ConfigError(problems)

    def with_exclusivity(self, exclusivity: Exclusivity) -> MemberSettings:
        """These settings under another exclusivity, with that one's defaults for what
        was left to the default here."""
        defaults: dict[str, Any] = dict.fromkeys(getattr(self, "_chosen_by_default", ()),
                                                   0.0)
        return replace(self, exclusivity=exclusivity, **defaults)

    def backoff(self, deliveries: int) -> float:
        """Delay before redelivering a message that failed ``deliveries`` times."""
        return float(min(self.retry_backoff * 2 ** max(0, deliveries - 1),
                         self.retry_backoff_max))
