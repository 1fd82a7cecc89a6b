"""Prometheus metrics of one member instance, on a registry of its own.

A dedicated :class:`~prometheus_client.CollectorRegistry` (not the global one) keeps the
output to what this instance knows and lets several instances live in one process (tests,
the demo). Every series carries ``stream``, ``group`` and ``member`` labels.

The daemon feeds it from the member runtime's callbacks (``on_active``, ``on_standby``,
``on_rebalance``),
from the handler wrapper (outcomes, durations, in-flight) and from a periodic group status
read (unowned partitions: the ADR's "partitions nobody consumes" alert), and from a
periodic lag read of the partitions this instance consumes while it is active (each
partition is measured by its one active instance, so a fleet makes one request per
partition per interval; ``max by (stream, group)`` over the partition series is the
group's lag, see deploy/monitoring/) and, for an elastic group, of how its work-queue
stream hears from the origin (one stream info per interval, by the active instance of
partition 0 alone), and at scrape time from the runtime's counts of
bad input it ignored (``cgroupd_ignored_input_total``).

prometheus_client is imported only when a series is needed (``exported``, the default,
or a scrape): an instance without a metrics server (``--metrics-port 0``) never loads it
(~1.5 MB resident, with the HTTP modules it pulls in; issue 15's RSS target).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

PREFIX = "cgroupd_"
LABELS = ("stream", "group", "member")
#: Message outcomes counted by ``cgroupd_messages_processed_total``.
OUTCOMES = ("ack", "nak", "term", "dead_letter")
#: Step-down reason that starts a rebalance (the member runtime's ``StepDown`` value).
REBALANCE_REASON = "config-changed"

#: Bad input the member runtime ignores (and logs each time), by the ``kind`` label of
#: ``cgroupd_ignored_input_total``, from the runtime's stats key that counts it.
IGNORED_INPUT = {
    # the group record does not decode or validate: the last good config stays in force
    "invalid_group_record": "invalid_group_records",
    # an elastic group record whose shape (partitions, filters) changed under a running
    # member, i.e. the group was replaced: ignored, the last good config stays
    "replaced_group_record": "replaced_group_records",
    # a delivery that is not a JetStream message (no ack reply subject to parse)
    "not_jetstream_message": "not_jetstream",
}

_HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_REBALANCE_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class _IgnoredInput:
    """``cgroupd_ignored_input_total`` read at scrape time from the runtime's counts (a
    collector by shape: prometheus_client's registry only calls ``collect``)."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._labels = list(labels.values())
        self.counts: Callable[[], Mapping[str, int]] = dict

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            PREFIX + "ignored_input", "Bad input ignored (and logged) by the member "
            "runtime, by kind: invalid_group_record, replaced_group_record, "
            "not_jetstream_message.", labels=[*LABELS, "kind"])
        counts = self.counts()
        for kind, key in IGNORED_INPUT.items():
            family.add_metric([*self._labels, kind], counts.get(key, 0))
        yield family
        # From the same runtime counts: settlements that did not take effect.
        resent = CounterMetricFamily(
            PREFIX + "acks_not_applied", "Messages delivered to this instance again after "
            "it had acked (or termed) them: the settlement did not take effect (sent again; "
            "a user without publish permission on $JS.ACK.>, or acks lost on the way).",
            labels=list(LABELS))
        resent.add_metric(self._labels, counts.get("resettled", 0))
        yield resent
        takeovers = CounterMetricFamily(
            PREFIX + "takeovers", "This standby's decisions to replace its member's active "
            "instance: taken (it was gone, idle or silent too long), declined (our server "
            "had no responders for it or heard nothing, yet the consumer's leader held its "
            "pull request: a cut between servers, not a death).",
            labels=[*LABELS, "outcome"])
        takeovers.add_metric([*self._labels, "taken"], counts.get("takeovers", 0))
        takeovers.add_metric([*self._labels, "declined"], counts.get("takeovers_declined", 0))
        yield takeovers
        restarted = CounterMetricFamily(
            PREFIX + "pulls_restarted", "Pinned holder's pull loops started afresh because "
            "it held the pin, messages waited, and none of its requests was at the leader for "
            "several renewals (the warning 'pinned with messages waiting and no request of "
            "ours at the leader' says what the puller waited on).",
            labels=list(LABELS))
        restarted.add_metric(self._labels, counts.get("pulls_restarted", 0))
        yield restarted


class _Series:
    """Every Prometheus series of one instance (built on first use: imports
    prometheus_client)."""

    def __init__(self, labels: dict[str, str], registry: CollectorRegistry | None,
                 since_last_message: Callable[[], float], ignored: _IgnoredInput) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.labels = labels
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, LABELS, registry=r)

        self.active = gauge("member_active", "1 while this instance is its member's "
                            "active instance, else 0.")
        self.owned = gauge("partitions_owned", "Partitions this instance consumes now.")
        self.in_flight = gauge("messages_in_flight", "Messages being handled now.")
        self.connected = gauge("nats_connected", "1 while connected to NATS, else 0.")
        self.answer_timeout = gauge("api_answer_timeout_seconds", "How long a JetStream API "
                                    "answer is waited for now: the base while the server "
                                    "answers promptly; more while it is slow only where "
                                    "learning is on (off by default).")
        self.unowned = gauge("group_unowned_partitions", "Partitions of the group that no "
                             "active instance consumes (refreshed periodically).")
        self.idle = gauge("seconds_since_last_message", "Seconds since this instance "
                          "finished a message (since start if none yet).")
        self.processed = Counter(PREFIX + "messages_processed", "Handler runs, by outcome "
                                 "(nak: failed, will be retried).", (*LABELS, "outcome"),
                                 registry=r)
        self.duration = Histogram(PREFIX + "handler_duration_seconds", "Time spent "
                                  "handling one message.", LABELS, registry=r,
                                  buckets=_HANDLER_BUCKETS)
        self.step_downs = Counter(PREFIX + "step_downs", "Times this instance stopped "
                                  "being active, by reason.", (*LABELS, "reason"),
                                  registry=r)
        self.rebalances = Counter(PREFIX + "rebalances", "Membership changes that moved "
                                  "this instance's partitions.", LABELS, registry=r)
        self.rebalance_seconds = Histogram(PREFIX + "rebalance_duration_seconds",
                                           "How long moving partitions took: an in-place "
                                           "move, or a config-changed step-down until "
                                           "active again.", LABELS, registry=r,
                                           buckets=_REBALANCE_BUCKETS)
        self.status_errors = Counter(PREFIX + "status_errors", "Failed group status reads "
                                     "(for the unowned-partitions gauge).", LABELS,
                                     registry=r)
        self.startup_retries = Counter(PREFIX + "startup_retries", "Transient failures "
                                       "(timeouts, 503s) retried while joining, by step.",
                                       (*LABELS, "step"), registry=r)
        # Children created up front so every series shows from the first scrape.
        for child in (self.active, self.owned, self.in_flight, self.connected,
                      self.unowned):
            child.labels(**labels).set(0)
        # Per-message series are bound once: ``labels()`` costs more than the update.
        self.processed_by = {outcome: self.processed.labels(**labels, outcome=outcome)
                             for outcome in OUTCOMES}
        self.duration_child = self.duration.labels(**labels)
        self.in_flight_child = self.in_flight.labels(**labels)
        self.rebalances.labels(**labels)
        self.rebalance_seconds.labels(**labels)
        self.status_errors.labels(**labels)
        # Lag of the partitions this instance consumes (kafka-lag-exporter's names).
        self.lag_messages = Gauge(PREFIX + "partition_lag_messages", "Unprocessed "
                                  "messages of a partition this instance consumes.",
                                  (*LABELS, "partition"), registry=r)
        self.lag_seconds = Gauge(PREFIX + "partition_lag_seconds", "Age of the oldest "
                                 "unprocessed message of a partition this instance "
                                 "consumes (0 when none waits).", (*LABELS, "partition"),
                                 registry=r)
        self.lag_partitions: set[str] = set()
        self.lag_read = gauge("lag_read_duration_seconds", "How long the last lag read "
                              "of this instance's partitions took.")
        self.lag_errors = Counter(PREFIX + "lag_read_errors", "Failed lag reads (of the "
                                  "partitions, or of the group stream's source).", LABELS,
                                  registry=r)
        self.lag_errors.labels(**labels)
        # An elastic group stream's sourcing from the origin, exported by one instance
        # per group (the active instance of partition 0), not created up front.
        self.source_silent = gauge(
            "group_stream_source_silent_seconds", "Seconds since the group's work-queue "
            "stream last heard from its origin stream (its source sends a heartbeat every "
            "second, so more than a few seconds means the sourcing is stalled: nothing new "
            "reaches the partitions, whose lag then reads 0). Elastic groups only, exported "
            "by the active instance that consumes partition 0.")
        self.source_lag = gauge(
            "group_stream_source_lag_messages", "Origin messages not yet copied into the "
            "group's work-queue stream, as of the last message the source delivered: stale "
            "(not growing) while the source is silent. Elastic groups only, exported by the "
            "active instance that consumes partition 0.")
        self.events = Counter(PREFIX + "events_published", "Group events (advisories) "
                              "this instance published, by kind.", (*LABELS, "kind"),
                              registry=r)
        self.denials = Counter(PREFIX + "permission_violations", "Operations the NATS "
                               "server refused this instance (its 'Permissions Violation' "
                               "errors), by operation (publish, subscribe) and kind of "
                               "subject (ack, control, api, inbox, dead_letter, other).",
                               (*LABELS, "operation", "kind"), registry=r)
        for operation in ("publish", "subscribe"):
            self.denials.labels(**labels, operation=operation, kind="ack")
        self.dead_letter_ids_taken = Counter(
            PREFIX + "dead_letter_ids_taken", "Dead letters whose id another message held "
            "already (a decoy in the dead-letter stream: republished under a new id).",
            LABELS, registry=r)
        self.dead_letter_ids_taken.labels(**labels)
        self.http_dropped = Counter(PREFIX + "http_connections_dropped", "Connections to "
                                    "the metrics/health port closed unanswered, by reason "
                                    "(timeout: request not sent in time; limit: the "
                                    "oldest unfinished one closed for a new one; invalid).",
                                    (*LABELS, "reason"), registry=r)
        for reason in ("timeout", "limit", "invalid"):
            self.http_dropped.labels(**labels, reason=reason)
        self.idle.labels(**labels).set_function(since_last_message)
        r.register(ignored)  # a collector by shape


class Metrics:
    """The metrics of one member instance; methods are the events that move them.

    ``exported`` (True unless the owner says nothing reads them: the daemon without a
    metrics server) decides whether the Prometheus series are kept; what the instance
    itself reports (in flight, time since the last message, a rebalance's duration) is
    kept either way.
    """

    def __init__(self, stream: str, group: str, member: str,
                 clock: Callable[[], float] = time.monotonic,
                 registry: CollectorRegistry | None = None) -> None:
        self._registry = registry
        self._clock = clock
        self._labels = {"stream": stream, "group": group, "member": member}
        self._started = clock()
        self._last_message: float | None = None
        self._rebalance_started: float | None = None
        self._holding = 0
        self._ignored = _IgnoredInput(self._labels)
        self._built: _Series | None = None
        #: Whether anything reads the series (a metrics server runs): when not, nothing
        #: but what the instance info needs is kept, and prometheus_client is not loaded.
        self.exported = True

    def _series(self) -> _Series:
        if self._built is None:
            self._built = _Series(self._labels, self._registry,
                                  self.seconds_since_last_message, self._ignored)
        return self._built

    @property
    def _s(self) -> _Series | None:
        """The series to update, when they are exported."""
        return self._series() if self.exported else None

    @property
    def registry(self) -> CollectorRegistry:
        return self._series().registry

    @property
    def content_type(self) -> str:
        from prometheus_client import CONTENT_TYPE_LATEST

        return str(CONTENT_TYPE_LATEST)

# -- membership ---------------------------------------------------------------------
    def became_active(self, partitions: Sequence[int]) -> float | None:
        """This instance is active; returns the rebalance duration if one just ended."""
        if (s := self._s) is not None:
            s.active.labels(**self._labels).set(1)
            s.owned.labels(**self._labels).set(len(partitions))
        if self._rebalance_started is None:
            return None
        took = self._clock() - self._rebalance_started
        self._rebalance_started = None
        if s is not None:
            s.rebalance_seconds.labels(**self._labels).observe(took)
        return took

    def stepped_down(self, reason: str) -> bool:
        """This instance stopped being active; True when that starts a rebalance."""
        if (s := self._s) is not None:
            s.active.labels(**self._labels).set(0)
            s.owned.labels(**self._labels).set(0)
            s.step_downs.labels(**self._labels, reason=reason).inc()
        if reason != REBALANCE_REASON:
            return False
        if s is not None:
            s.rebalances.labels(**self._labels).inc()
        self._rebalance_started = self._clock()
        return True

    def rebalanced(self, partitions: Sequence[int], seconds: float) -> None:
        """An in-place (incremental) rebalance moved partitions without a step-down."""
        if (s := self._s) is not None:
            s.owned.labels(**self._labels).set(len(partitions))
            s.rebalances.labels(**self._labels).inc()
            s.rebalance_seconds.labels(**self._labels).observe(seconds)

    # -- messages -----------------------------------------------------------------------
    def message_started(self) -> None:
        self._holding += 1
        if self.exported:
            self._series().in_flight_child.inc()

    def message_finished(self, outcome: str, seconds: float) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self._holding -= 1
        self._last_message = self._clock()
        if self.exported:  # ~5 us a message of Prometheus locks: only when scraped
            s = self._series()
            s.in_flight_child.dec()
            s.processed_by[outcome].inc()
            s.duration_child.observe(seconds)

    def in_flight(self) -> int:
        """Messages being handled now."""
        return self._holding

    def seconds_since_last_message(self) -> float:
        since = self._last_message if self._last_message is not None else self._started
        return max(0.0, self._clock() - since)

    # -- connection and group -----------------------------------------------------------
    def set_connected(self, connected: bool) -> None:
        if (s := self._s) is not None:
            s.connected.labels(**self._labels).set(1 if connected else 0)

    def follow_answer_timeout(self, seconds: Callable[[], float]) -> None:
        """Report ``seconds()`` (the JetStream adapter's current API wait) at each scrape."""
        if (s := self._s) is not None:
            s.answer_timeout.labels(**self._labels).set_function(seconds)

    def set_unowned_partitions(self, count: int) -> None:
        if (s := self._s) is not None:
            s.unowned.labels(**self._labels).set(count)

    def status_failed(self) -> None:
        # The gauge keeps its last known value; the error counter says it is stale.
        if (s := self._s) is not None:
            s.status_errors.labels(**self._labels).inc()

    def startup_retried(self, step: str) -> None:
        if (s := self._s) is not None:
            s.startup_retries.labels(**self._labels, step=step).inc()

    # -- lag ----------------------------------------------------------------------------
    def set_lag(self, lags: Mapping[int, tuple[int, float]], took: float) -> None:
        """The lag (messages, seconds) of exactly the partitions this instance consumes
        now; series of partitions it no longer consumes are removed, so a moved
        partition is reported by its new owner alone."""
        if (s := self._s) is None:
            return
        current = {str(p) for p in lags}
        for gone in s.lag_partitions - current:
            for gauge in (s.lag_messages, s.lag_seconds):
                try:
                    gauge.remove(*self._labels.values(), gone)
                except KeyError:
                    pass
        for p, (messages, seconds) in lags.items():
            s.lag_messages.labels(**self._labels, partition=str(p)).set(messages)
            s.lag_seconds.labels(**self._labels, partition=str(p)).set(seconds)
        s.lag_partitions = current
        s.lag_read.labels(**self._labels).set(took)

    def clear_lag(self) -> None:
        self.set_lag({}, 0.0)

    def set_source(self, silent: float, messages: int) -> None:
        """How the group stream hears from its source (this instance reports it)."""
        if (s := self._s) is not None:
            s.source_silent.labels(**self._labels).set(silent)
            s.source_lag.labels(**self._labels).set(messages)

    def clear_source(self) -> None:
        """This instance no longer reports the source: its series go (another instance,
        the new active one of partition 0, reports them)."""
        if (s := self._built) is None:
            return
        for gauge in (s.source_silent, s.source_lag):
            try:
                gauge.remove(*self._labels.values())
            except KeyError:
                pass

    def lag_failed(self) -> None:
        if (s := self._s) is not None:
            s.lag_errors.labels(**self._labels).inc()

    def count_ignored_input(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export the member runtime's counts of ignored bad input (its ``stats``), read
        at each scrape; the keys are the values of :data:`IGNORED_INPUT`."""
        self._ignored.counts = counts

    def permission_violation(self, operation: str, kind: str) -> None:
        """The server refused an operation of this instance (see :mod:`cgroupd.join.daemon`)."""
        if (s := self._s) is not None:
            s.denials.labels(**self._labels, operation=operation, kind=kind).inc()

    def dead_letter_id_taken(self) -> None:
        if (s := self._s) is not None:
            s.dead_letter_ids_taken.labels(**self._labels).inc()

    def http_dropped(self, reason: str) -> None:
        if (s := self._s) is not None:
            s.http_dropped.labels(**self._labels, reason=reason).inc()

    def event_published(self, kind: str) -> None:
        if (s := self._s) is not None:
            s.events.labels(**self._labels, kind=kind).inc()

    def render(self) -> bytes:
        """The text exposition format of every metric in this registry."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
