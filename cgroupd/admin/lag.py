"""How far behind each partition of a group is: unprocessed messages and the age of the
oldest one (kafka-lag-exporter's lag and lag-in-time, for consumer groups on JetStream).

A partition's unprocessed messages are, on an elastic group's work-queue stream, every
message of ``<partition>.>`` still stored (acknowledged ones are removed); on a static
group's stream, those of the partition's subjects after its member consumer's ack floor.
One batched direct get per partition and subject filter answers both numbers: the first
such message (its store time gives the lag in seconds) and how many follow it. The cost
is one small request per partition, whatever the number of messages or subjects (a
stream-info subject listing grows with the number of distinct subjects instead).

A static stream without ``allow_direct`` falls back to the message-get API for the age
and to the stream's per-subject counts for the messages (then every stored message of
the partition counts, processed or not, unless nothing was acknowledged yet).

An elastic group's messages reach its work-queue stream through the server's sourcing
from the origin, which the partition lag does not see: while sourcing stalls (around a
restart of the origin's leader: nats-server 2.15 notices a dead source only after 10 s,
stream.go ``sourceHealthCheckInterval``, then retries; issue 29), nothing reaches the
partitions and their lag reads 0.
:func:`read_source_lag` reads the group stream's ``sources[]`` entry for the origin
instead (one stream info).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from cgroupd.core.config import GroupConfig, StaticGroupConfig
from cgroupd.core.errors import DirectGetUnavailable
from cgroupd.nats.groupstreams import StreamInfo
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.streamread import FirstMatch

#: Direct gets in flight at once while reading many partitions.
CONCURRENCY = 64


@dataclass(frozen=True)
class PartitionLag:
    """What waits in one partition."""

    partition: int
    #: Unprocessed messages (delivered but unacknowledged ones included).
    messages: int
    #: Store time (Unix seconds) and sequence of the oldest unprocessed message.
    oldest_time: float | None = None
    oldest_seq: int | None = None
    #: Delivered to the active instance and not acknowledged yet (None: not read).
    in_flight: int | None = None
    #: False when ``messages`` could only be estimated (no direct get on the stream).
    exact: bool = True

    def seconds(self, now: float | None = None) -> float:
        """Age of the oldest unprocessed message; 0 when none waits. Clamped at 0 (the
        server's clock may run ahead of ours)."""
        if not self.messages or self.oldest_time is None:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - self.oldest_time)


def partition_subjects(config: GroupConfig, partition: int) -> list[str]:
    """The subject filters that hold ``partition``'s messages in the consumed stream."""
    if isinstance(config, StaticGroupConfig) and config.filters:
        return [f"{partition}.{f}" for f in dict.fromkeys(config.filters)]
    return [f"{partition}.>"]


def _merge(partition: int, parts: list[FirstMatch]) -> PartitionLag:
    count = sum(p.count for p in parts)
    firsts = [p for p in parts if p.count and p.seq]
    oldest = min(firsts, key=lambda p: p.seq or 0) if firsts else None
    return PartitionLag(partition, count, oldest.time if oldest else None,
                        oldest.seq if oldest else None)


async def read_lag(js: JetStream, stream: str, config: GroupConfig,
                   partitions: Iterable[int], floors: Mapping[int, int] | None = None,
                   delivered: Mapping[int, int] | None = None,
                   concurrency: int = CONCURRENCY) -> dict[int, PartitionLag]:
    """Lag of ``partitions`` of the group consuming ``stream``.

    ``floors`` gives, per partition, the stream sequence up to which everything is
    processed (a static member consumer's ack floor; 0 or absent: from the start).
    ``delivered`` gives, per partition, the last stream sequence delivered to its active
    instance: the messages up to it are the partition's ``in_flight`` (one more request
    per partition that has any).
    """
    parts = list(partitions)
    floors = floors or {}
    queries: list[tuple[int, str, int]] = [
        (p, subject, floors.get(p, 0) + 1 if floors.get(p, 0) > 0 else 0)
        for p in parts for subject in partition_subjects(config, p)]
    try:
        answers = await js.first_matches(stream, [(s, n) for _, s, n in queries],
                                         concurrency=concurrency)
    except DirectGetUnavailable:
        return await _without_direct_get(js, stream, config, parts, floors)
    by_partition: dict[int, list[FirstMatch]] = {p: [] for p in parts}
    for (p, _, _), answer in zip(queries, answers, strict=True):
        by_partition[p].append(answer)
    out = {p: _merge(p, answers) for p, answers in by_partition.items()}
    if delivered:
        out = await _with_in_flight(js, stream, config, out, delivered, concurrency)
    return out


async def _with_in_flight(js: JetStream, stream: str, config: GroupConfig,
                          lags: dict[int, PartitionLag], delivered: Mapping[int, int],
                          concurrency: int) -> dict[int, PartitionLag]:
    """In flight = unprocessed messages at or below the last delivered sequence."""
    queries = [(p, subject, delivered[p] + 1) for p, lag in lags.items()
               if lag.messages and lag.oldest_seq is not None and p in delivered
               and delivered[p] >= lag.oldest_seq
               for subject in partition_subjects(config, p)]
    answers = await js.first_matches(stream, [(s, n) for _, s, n in queries],
                                     concurrency=concurrency)
    after: dict[int, int] = {}
    for (p, _, _), answer in zip(queries, answers, strict=True):
        after[p] = after.get(p, 0) + answer.count
    out = {}
    for p, lag in lags.items():
        flight = max(0, lag.messages - after[p]) if p in after else 0
        out[p] = PartitionLag(p, lag.messages, lag.oldest_time, lag.oldest_seq, flight,
                              lag.exact)
    return out


async def _without_direct_get(js: JetStream, stream: str, config: GroupConfig,
                              parts: list[int], floors: Mapping[int, int]
                              ) -> dict[int, PartitionLag]:
    counts = await js.subject_counts(stream)
    out: dict[int, PartitionLag] = {}
    for p in parts:
        start = floors.get(p, 0) + 1 if floors.get(p, 0) > 0 else 0
        firsts = [m for m in [await js.get_message(stream, start, s)
                              for s in partition_subjects(config, p)] if m is not None]
        oldest = min(firsts, key=lambda m: m.seq) if firsts else None
        stored = sum(n for subject, n in counts.items()
                     if subject.split(".", 1)[0] == str(p))
        out[p] = PartitionLag(p, stored if oldest else 0, oldest.time if oldest else None,
                              oldest.seq if oldest else None, exact=not floors.get(p))
    return out


def max_lag(lags: Iterable[PartitionLag], now: float | None = None) -> tuple[int, float]:
    """The largest lag in messages and in seconds among ``lags`` (0, 0.0 when empty)."""
    now = time.time() if now is None else now
    items = list(lags)
    return (max((x.messages for x in items), default=0),
            max((x.seconds(now) for x in items), default=0.0))


@dataclass(frozen=True)
class SourceLag:
    """How an elastic group's work-queue stream hears from its origin: the server's
    ``sources[]`` entry for the origin, answered by the group stream's leader."""

    #: Seconds since the group stream last heard from the source, its 1 s heartbeats
    #: included; None when it never has since the source was set up (the server's -1: a
    #: stream leader that just took over, or a source consumer not created yet).
    silent: float | None
    #: Origin messages not sourced yet, as the source's last message said: stale while
    #: the source is silent (it does not grow however much the origin receives meanwhile).
    messages: int
    #: The server's error for the source (e.g. the origin was not found), if any.
    error: str | None = None


def source_lag(info: StreamInfo, origin: str) -> SourceLag | None:
    """The ``sources[]`` entry of ``origin`` in a group stream's info; None when the
    stream does not source it (a replay removes the source for a moment)."""
    for source in info.sources or []:
        if source.name != origin:
            continue
        active = source.active
        silent = None if active is None or active < 0 else active / 1e9
        error = source.error
        text = None if not error else str(error.get("description") or error)
        return SourceLag(silent, max(0, int(source.lag or 0)), text)
    return None


async def read_source_lag(js: JetStream, group_stream: str, origin: str) -> SourceLag | None:
    """How ``group_stream`` hears from ``origin``: one stream info (None when the group
    stream is gone or does not source ``origin``)."""
    info = await js.stream_info(group_stream)
    return None if info is None else source_lag(info, origin)


class SourceSilence:
    """Seconds a group stream has not heard from its source, over successive reads: the
    server's count, or, while the server says it never heard from it (a source set up
    afresh, e.g. on a new stream leader, whose consumer cannot be created while the
    origin is unreachable), the time since the first read that said so, not 0: a source
    that never comes up is as dead as one that went quiet."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._never_since: float | None = None

    def seconds(self, lag: SourceLag) -> float:
        if lag.silent is not None:
            self._never_since = None
            return lag.silent
        now = self._clock()
        if self._never_since is None:
            self._never_since = now
        return now - self._never_since

    def reset(self) -> None:
        """Forget a "never" run (this instance stopped reading the source)."""
        self._never_since = None
