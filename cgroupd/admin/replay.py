"""Replay ("reset offsets"): move where a group's partitions resume, as Kafka's
``kafka-consumer-groups --reset-offsets`` does for a consumer group's offsets.

A plan first (per partition: where it is now, where it will resume, what is processed
again or skipped), executed only when asked, and never while the group's instances run
(they would race the change; a running standby would take over at once). The exact
meaning of every target, next to Kafka's, is in ``docs/replay.md``.

A partition's *position* is the stream sequence of the next message it will process
(Kafka's committed offset: the next record to read). A position one past the stream's
last sequence is "at the end": nothing waits.

Static groups (consumers on the origin stream): a member's partitions share its
consumer ``<group>-<member>``, whose position is its ack floor + 1. It is moved with the
consumer-reset API (``$JS.API.CONSUMER.RESET.<stream>.<consumer>``, nats-server >= 2.14;
its pending deliveries are forgotten, its ack floor becomes the target - 1). One position
per member: a per-partition target (``--shift-by``) moves the member to the earliest of
its partitions' targets, and the plan counts each partition exactly.

Elastic groups (a work-queue stream sourcing the origin; acked messages are deleted
from it): a partition's position is the origin sequence of its oldest message still
waiting in the work-queue stream, or the end when none waits. The work-queue stream is
re-sourced from the earliest target: its source is removed (a placeholder subject keeps
the stream valid meanwhile), the stream is purged, and the source is put back with
``opt_start_seq`` (on an empty stream the server starts a returning source there).
Partitions whose own target is later have their re-sourced messages before it purged
(by subject ``<partition>.>`` below the work-queue sequence of their first kept message,
each checked by its ``Nats-Stream-Source`` header before). What was still waiting is
dropped and sourced again in origin order, so each message is processed once more, in
order. A replay interrupted between those steps is finished by running it again (from
its exported plan for per-partition targets).
"""

from __future__ import annotations

import asyncio
import json
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from cgroupd import admin
from cgroupd.admin import ConsumerView, StoredGroup
from cgroupd.admin.lag import partition_subjects, read_lag
from cgroupd.core.config import ElasticGroupConfig, GroupConfig
from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    JetStreamNotEnabled,
    ReplayRefused,
    ServerUnreachable,
)
from cgroupd.core.partitions import assignment, owners, partition_of
from cgroupd.nats.events import discover
from cgroupd.nats.groupstreams import StreamInfo, is_work_queue, resource
from cgroupd.nats.jetstream import JetStream

#: Subject a work-queue stream captures while its source is removed during a replay.
PLACEHOLDER = "_CGROUPD.replay.{stream}"
#: How long to wait for the re-sourced stream to show the replayed messages.
VERIFY_TIMEOUT = 10.0
#: The ``format`` of an exported plan (``--export`` / ``--from-file``).
EXPORT_FORMAT = "cgroupd-replay-plan/1"


@dataclass(frozen=True)
class Target:
    """Where processing resumes: exactly one of these.

    ``earliest``, ``sequence`` and ``time`` name one point for every partition (a replay:
    refused when it would skip messages still waiting); ``latest`` skips everything
    waiting; ``current`` changes nothing (shows the positions); ``shift`` moves each
    partition by that many of its own messages (negative: back), clamped at the stream's
    ends; ``positions`` gives each partition's position (an exported plan)."""

    earliest: bool = False
    sequence: int | None = None
    #: Unix seconds (``--to-time``, or now minus ``--by-duration``).
    time: float | None = None
    latest: bool = False
    current: bool = False
    shift: int | None = None
    #: ``(partition, sequence)`` pairs; partitions left out keep their position.
    positions: tuple[tuple[int, int], ...] | None = None
    #: Where ``positions`` came from, for the plan's description.
    source: str = ""

    def __post_init__(self) -> None:
        given = sum([self.earliest, self.sequence is not None, self.time is not None,
                     self.latest, self.current, self.shift is not None,
                     self.positions is not None])
        if given != 1:
            raise ValueError("give exactly one of earliest, a sequence, a time, latest, "
                             "current, a shift or positions")
        if self.sequence is not None and self.sequence < 1:
            raise ValueError(f"sequence {self.sequence} must be at least 1")
        if self.positions is not None and any(s < 1 for _, s in self.positions):
            raise ValueError("every position must be a sequence of at least 1")

    @property
    def uniform(self) -> bool:
        """One point for every partition (a replay in the strict sense)."""
        return self.earliest or self.sequence is not None or self.time is not None

    def describe(self) -> str:
        if self.earliest:
            return "the earliest message"
        if self.sequence is not None:
            return f"sequence {self.sequence}"
        if self.latest:
            return "the latest (skipping what waits)"
        if self.current:
            return "the current positions (no change)"
        if self.shift is not None:
            return f"a shift of {self.shift:+d} per partition"
        if self.positions is not None:
            return f"the positions in {self.source or 'a plan'}"
        assert self.time is not None
        stamp = datetime.fromtimestamp(self.time, UTC).isoformat(timespec="seconds")
        return f"{stamp.replace('+00:00', 'Z')}"


@dataclass(frozen=True)
class Expected:
    """What an exported plan was made against; applying it is refused when it changed."""

    type: str
    revision: int
    partitions: int
    origin_created: str | None


@dataclass(frozen=True)
class PartitionPlan:
    partition: int
    member: str | None
    #: Stream sequence processing resumes at (of the origin for elastic groups); None:
    #: unchanged (nothing at or after the target).
    from_sequence: int | None
    #: Messages processed already that will be processed again.
    reprocess: int
    #: Messages not processed yet that the move skips.
    skip: int = 0
    #: Messages still waiting in the work-queue stream, dropped and sourced again in order
    #: (elastic groups; they are processed once, not twice).
    dropped_pending: int = 0
    #: The position now (the next sequence it processes; past the last: at the end).
    current: int | None = None


@dataclass(frozen=True)
class _Work:
    """What executing a plan needs beyond what it shows."""

    #: Origin sequences of the group's messages from ``since``, all and per partition.
    since: int = 0
    seqs: tuple[int, ...] = ()
    per: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    #: Static groups: member -> (consumer exists, position now, target).
    moves: Mapping[str, tuple[bool, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    stream: str
    group: str
    static: bool
    target: Target
    #: The resolved start sequence (the earliest partition's when they differ; None:
    #: nothing moves).
    sequence: int | None
    members: tuple[str, ...]
    partitions: list[PartitionPlan]
    #: Why it cannot run now (empty: it can).
    blockers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    executed: bool = False
    #: The group record's KV revision, its partitions, the origin stream's creation time:
    #: what an exported plan is checked against before it is applied.
    revision: int = 0
    partition_count: int = 0
    origin_created: str | None = None
    work: _Work = field(default_factory=_Work, repr=False, compare=False)

    @property
    def changes(self) -> bool:
        return any(r.from_sequence is not None and r.from_sequence != r.current
                   for r in self.partitions)

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream, "group": self.group,
            "type": "static" if self.static else "elastic",
            "target": self.target.describe(), "sequence": self.sequence,
            "members": list(self.members), "executed": self.executed,
            "blockers": self.blockers, "notes": self.notes,
            "revision": self.revision, "partition_count": self.partition_count,
            "partitions": [{"partition": p.partition, "member": p.member,
                            "current": p.current,
                            "from_sequence": p.from_sequence, "reprocess": p.reprocess,
                            "skip": p.skip, "dropped_pending": p.dropped_pending}
                           for p in self.partitions],
        }

    def export(self) -> dict[str, Any]:
        """This group's entry in an exported plan: where each partition resumes."""
        return {
            "stream": self.stream, "group": self.group,
            "type": "static" if self.static else "elastic",
            "revision": self.revision, "partitions": self.partition_count,
            "origin_created": self.origin_created,
            "positions": [{"partition": r.partition, "member": r.member,
                           "sequence": r.from_sequence if r.from_sequence is not None
                           else r.current}
                          for r in self.partitions
                          if (r.from_sequence or r.current) is not None],
        }


def export_document(plans: Sequence[Plan]) -> str:
    """The ``--export`` file: JSON, one entry per group (see docs/replay.md)."""
    return json.dumps({"format": EXPORT_FORMAT,
                       "exported": datetime.now(UTC).isoformat(timespec="seconds"),
                       "groups": [p.export() for p in plans]}, indent=2) + "\n"


@dataclass(frozen=True)
class Imported:
    """One group's entry of an exported plan, as read back."""

    stream: str
    group: str
    target: Target
    expected: Expected


def read_document(text: str, source: str) -> list[Imported]:
    """Parse an exported plan; ValueError saying what is wrong with it."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{source} is not a cgroupd replay plan (format "
                         f"{EXPORT_FORMAT!r}; write one with --export)")
    out = []
    for i, g in enumerate(doc.get("groups") or []):
        try:
            positions = tuple((int(e["partition"]), int(e["sequence"]))
                              for e in g["positions"])
            expected = Expected(str(g["type"]), int(g["revision"]), int(g["partitions"]),
                                g.get("origin_created"))
            if expected.type not in ("elastic", "static"):
                raise ValueError(f"type {expected.type!r}")
            if len({p for p, _ in positions}) != len(positions):
                raise ValueError("a partition is listed twice")
            out.append(Imported(str(g["stream"]), str(g["group"]),
                                Target(positions=positions, source=source), expected))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: group entry {i} is not valid ({exc})") from exc
    if not out:
        raise ValueError(f"{source} lists no group")
    return out


def _stamp(info: StreamInfo) -> str | None:
    created = getattr(info, "created", None)
    if isinstance(created, datetime):
        return created.astimezone(UTC).isoformat()
    return str(created) if created else None


async def _start_sequence(js: JetStream, stream: str, target: Target,
                          notes: list[str]) -> tuple[int | None, StreamInfo]:
    info = await js.stream_info(stream)
    if info is None:
        raise ReplayRefused(f"stream {stream!r} does not exist")
    first, last = int(info.state.first_seq or 0), int(info.state.last_seq or 0)
    if not target.uniform:
        return None, info
    if target.earliest:
        return (first if info.state.messages else None), info
    if target.sequence is not None:
        if target.sequence > last:
            return None, info
        if target.sequence < first:
            notes.append(f"sequence {target.sequence} is no longer in {stream}; starting at "
                         f"its first message, {first}")
            return first, info
        return target.sequence, info
    assert target.time is not None
    found = await js.get_message(stream, start_time=target.time)
    return (found.seq if found is not None else None), info


async def _running(js: JetStream, stream: str, group: str,
                   members: Sequence[str] | None) -> list[str]:
    """Blockers: ``cgroupd join`` instances of the group (of ``members``) that answer."""
    found = await discover(js.nc, stream, group)
    if members is not None:
        found = [i for i in found if i.get("member") in members]
    if not found:
        return []
    per = Counter(str(i.get("member")) for i in found)
    listed = ", ".join(f"{m}: {n}" for m, n in sorted(per.items()))
    return [f"{len(found)} cgroupd instances of {stream}/{group} are running ({listed}); "
            "stop them first (a standby would take over at once)"]


def _consumer_blockers(views: list[ConsumerView]) -> list[str]:
    out = []
    for v in views:
        if v.role in ("sync", "data"):
            out.append(f"member {v.member or '?'} has an active or starting instance "
                       f"({v.instance or '?'}: consumer {v.name})")
        elif v.pinned_id or v.num_waiting:
            out.append(f"member {v.member or '?'} has a running instance (consumer {v.name}: "
                       f"{'pinned' if v.pinned_id else f'{v.num_waiting} pull requests waiting'}"
                       "); stop it, and retry once its pull requests expired")
    return out


def _expected_blockers(stored: StoredGroup, info: StreamInfo,
                       expected: Expected | None) -> list[str]:
    """Why an exported plan no longer fits the group (what ``--from-file`` checks)."""
    if expected is None:
        return []
    out = []
    kind = "static" if stored.static else "elastic"
    if expected.type != kind:
        out.append(f"the plan is for a {expected.type} group; {stored.group} is {kind}")
    n = stored.config.max_members
    if expected.partitions != n:
        out.append(f"the plan is for {expected.partitions} partitions; the group has {n} now")
    if expected.revision != stored.revision:
        out.append(f"the group's record changed since the plan was made (revision "
                   f"{expected.revision}, now {stored.revision}: members, mappings or "
                   "partitions may differ); make and export the plan again")
    now = _stamp(info)
    if expected.origin_created and now and expected.origin_created != now:
        out.append(f"stream {stored.stream} was created again since the plan was made "
                   f"({expected.origin_created}, now {now}): its sequences name other "
                   "messages")
    return out


async def plan(js: JetStream, stream: str, group: str, target: Target,
               members: Sequence[str] | None = None,
               expected: Expected | None = None) -> Plan:
    """What moving the group (or some of its members) to ``target`` would do;
    ``expected``: what an exported plan was made against (a mismatch blocks it)."""
    stored = await admin.get_group(js, stream, group)
    if stored.static:
        return await _plan_static(js, stored, target, members, expected)
    if members:
        raise ReplayRefused("an elastic group is replayed as a whole: its members share one "
                            "work-queue stream (leave out --member)")
    return await _plan_elastic(js, stored, target, expected)


# -- shared: where each partition's messages are ---------------------------------------
def _count(seqs: Sequence[int], lo: int, hi: int) -> int:
    """How many of the sorted ``seqs`` lie in ``[lo, hi)``."""
    return max(0, bisect_left(seqs, hi) - bisect_left(seqs, lo))


async def _index(js: JetStream, stored: StoredGroup, since: int
                 ) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """Origin sequences of the group's messages from ``since``, all and per partition."""
    config = stored.config
    n = config.max_members
    every: list[int] = []
    per: dict[int, list[int]] = {p: [] for p in range(n)}
    if isinstance(config, ElasticGroupConfig):
        filters = [pf.filter for pf in config.effective_filters]
        async for seq, subject in js.scan_subjects(stored.stream, filters, since):
            part = partition_of(subject, config.effective_filters, n)
            if part is not None:
                every.append(seq)
                per[part].append(seq)
    else:
        filters = [s for p in range(n) for s in partition_subjects(config, p)]
        async for seq, subject in js.scan_subjects(stored.stream, filters, since):
            head = subject.split(".", 1)[0]
            if head.isdigit() and int(head) < n:
                every.append(seq)
                per[int(head)].append(seq)
    return tuple(every), {p: tuple(s) for p, s in per.items()}


async def _shift_index(js: JetStream, stored: StoredGroup, positions: Mapping[int, int],
                       shift: int, first: int
                       ) -> tuple[int, tuple[int, ...], dict[int, tuple[int, ...]]]:
    """:func:`_index` from far enough back for ``shift``: forward, from the earliest
    position; back, from a window before it that grows (x4) until every partition has
    ``-shift`` of its messages before its position, or the window reaches the stream's
    first message (so a large stream is not read whole for a small shift)."""
    lo = max(first, min(positions.values(), default=first))
    if shift >= 0:
        return (lo, *await _index(js, stored, lo))
    window = max(1024, -4 * shift * max(1, len(positions)))
    while True:
        since = max(first, lo - window)
        every, per = await _index(js, stored, since)
        if since == first or all(bisect_left(per[p], at) >= -shift
                                 for p, at in positions.items()):
            return since, every, per
        window *= 4


def _shifted(seqs: Sequence[int], position: int, shift: int, end: int, p: int,
             notes: list[str]) -> int:
    """``position`` moved by ``shift`` of partition ``p``'s own messages ``seqs``,
    clamped as Kafka clamps to the log start and end offsets (saying so): before the first
    stored one is its first, past the last is the end."""
    if not seqs:
        return end
    i = bisect_left(seqs, position) + shift
    if i < 0:
        notes.append(f"partition {p}: only {bisect_left(seqs, position)} of its messages "
                     f"are stored before it; from its first one, {seqs[0]}")
        return seqs[0]
    if i >= len(seqs):
        if i > len(seqs):
            notes.append(f"partition {p}: only {len(seqs) - bisect_left(seqs, position)} "
                         f"of its messages wait; at the end ({end})")
        return end
    return seqs[i]


def _clamped(target: Target, p: int, current: int, first: int, end: int,
             notes: list[str]) -> int:
    """Partition ``p``'s position from ``target.positions`` (absent: ``current``),
    within the stream (as Kafka clamps offsets out of range, saying so)."""
    given = dict(target.positions or ())
    if p not in given:
        return current
    seq = given[p]
    if seq < first:
        notes.append(f"partition {p}: sequence {seq} is no longer stored; from the first "
                     f"one, {first}")
        return first
    if seq > end:
        notes.append(f"partition {p}: sequence {seq} is past the end; at the end ({end})")
        return end
    return seq


# -- static groups ------------------------------------------------------------------------
async def _plan_static(js: JetStream, stored: StoredGroup, target: Target,
                       chosen: Sequence[str] | None, expected: Expected | None) -> Plan:
    config = stored.config
    owned = assignment(config)
    names = tuple(chosen) if chosen else tuple(owned)
    if target.positions is not None and not chosen:
        listed = {p for p, _ in target.positions}
        names = tuple(m for m in owned if listed & set(owned[m]))
    unknown = [m for m in names if m not in owned]
    if unknown:
        raise ReplayRefused(f"{', '.join(unknown)} own no partitions of "
                            f"{stored.stream}/{stored.group}")
    notes: list[str] = []
    seq, info = await _start_sequence(js, stored.stream, target, notes)
    if is_work_queue(info):
        raise ReplayRefused(f"stream {stored.stream} is a work queue: processed messages "
                            "are gone and cannot be replayed")
    first, end = int(info.state.first_seq or 1), int(info.state.last_seq or 0) + 1
    views = {v.name: v for v in await admin.group_consumers(js, stored.stream, stored.group)}
    blockers = await _running(js, stored.stream, stored.group, names)
    blockers += _expected_blockers(stored, info, expected)
    positions: dict[str, tuple[bool, int]] = {}
    for member in names:
        consumer = views.get(f"{stored.group}-{member}")
        if consumer is not None:
            blockers += _consumer_blockers([consumer])
            positions[member] = (True, max(first, consumer.ack_floor_seq + 1))
        else:
            notes.append(f"{member} has no consumer yet: it starts at the beginning of the "
                         "stream when it first joins (nothing to move)")
            positions[member] = (False, first)
    per: dict[int, tuple[int, ...]] = {}
    if target.shift is not None:
        at = {p: positions[m][1] for m in names for p in owned[m]}
        _, _, per = await _shift_index(js, stored, at, target.shift, first)
    moves: dict[str, tuple[bool, int, int]] = {}
    for member in names:
        exists, now = positions[member]
        parts = owned[member]
        if target.uniform:
            want = [seq if seq is not None else now for _ in parts]
        elif target.latest:
            want = [end for _ in parts]
        elif target.current:
            want = [now for _ in parts]
        elif target.shift is not None:
            want = [_shifted(per[p], now, target.shift, end, p, notes) for p in parts]
        else:
            want = [_clamped(target, p, now, first, end, notes) for p in parts]
        if len(set(want)) > 1:
            if target.positions is not None:
                blockers.append(f"member {member}'s partitions {list(parts)} share one "
                                "consumer, so one position: the plan gives them "
                                f"{sorted(set(want))}")
            else:
                notes.append(f"member {member}'s partitions share its consumer: it moves "
                             f"to the earliest of their targets, {min(want)} (counted "
                             "per partition below)")
        moves[member] = (exists, now, min(want))
    rows: list[PartitionPlan] = []
    for member in names:
        exists, now, to = moves[member]
        for p in owned[member]:
            row = await _static_row(js, stored, p, member, to if exists else None, now - 1)
            rows.append(replace(row, current=now, from_sequence=to if exists else None))
    if target.uniform and seq is None:
        notes.append(f"no message at or after {target.describe()}: nothing to replay")
    rows.sort(key=lambda r: r.partition)
    return Plan(stored.stream, stored.group, True, target,
                seq if target.uniform else min((r.from_sequence for r in rows
                                                if r.from_sequence is not None),
                                               default=None),
                names, rows, sorted(set(blockers)), notes,
                revision=stored.revision, partition_count=config.max_members,
                origin_created=_stamp(info), work=_Work(moves=moves))


async def _count_from(js: JetStream, stream: str, subjects: list[str], start: int) -> int:
    answers = await js.first_matches(stream, [(s, start) for s in subjects])
    return sum(a.count for a in answers)


async def _static_row(js: JetStream, stored: StoredGroup, p: int, member: str,
                      seq: int | None, floor: int) -> PartitionPlan:
    if seq is None:
        return PartitionPlan(p, member, None, 0)
    subjects = partition_subjects(stored.config, p)
    if seq <= floor:
        again = (await _count_from(js, stored.stream, subjects, seq)
                 - await _count_from(js, stored.stream, subjects, floor + 1))
        return PartitionPlan(p, member, seq, again)
    skipped = (await _count_from(js, stored.stream, subjects, floor + 1)
               - await _count_from(js, stored.stream, subjects, seq))
    return PartitionPlan(p, member, seq, 0, skip=skipped)


async def _execute_static(js: JetStream, p: Plan) -> None:
    views = {v.name for v in await admin.group_consumers(js, p.stream, p.group)}
    for member in p.members:
        exists, now, to = p.work.moves[member]
        name = f"{p.group}-{member}"
        if not exists or name not in views or (to == now and not p.target.uniform):
            continue
        try:
            await js.reset_consumer(p.stream, name, to)
        except (JetStreamNotEnabled, ServerUnreachable) as exc:
            raise ReplayRefused(f"resetting {name} failed ({exc}): the consumer reset API "
                                "needs nats-server 2.14 or later") from exc


# -- elastic groups -----------------------------------------------------------------------
def _placeholder(wq: str) -> str:
    return PLACEHOLDER.format(stream=wq)


async def _elastic_positions(js: JetStream, wq: str, config: GroupConfig, end: int
                             ) -> tuple[dict[int, int], dict[int, int], list[str]]:
    """Per partition: its position (origin sequence of its oldest waiting message, or
    ``end``) and how many of its messages wait; blockers when a waiting message's origin
    cannot be told."""
    lags = await read_lag(js, wq, config, range(config.max_members))
    waiting = {p: lag.messages for p, lag in lags.items()}
    current: dict[int, int] = {}
    blockers = []
    for p in range(config.max_members):
        current[p] = end
        lag = lags.get(p)
        if lag is None or not lag.messages:
            continue
        oldest = await js.get_message(wq, lag.oldest_seq or 0, f"{p}.>")
        origin = _origin_seq(oldest.headers) if oldest is not None else None
        if origin is None:
            blockers.append(f"partition {p}: the origin of its oldest waiting message in "
                            f"{wq} cannot be told (no Nats-Stream-Source header)")
        else:
            current[p] = origin
    return current, waiting, blockers


async def _plan_elastic(js: JetStream, stored: StoredGroup, target: Target,
                        expected: Expected | None) -> Plan:
    config = stored.config
    assert isinstance(config, ElasticGroupConfig)
    wq = stored.consume_stream
    notes: list[str] = []
    seq, info = await _start_sequence(js, stored.stream, target, notes)
    first, end = int(info.state.first_seq or 1), int(info.state.last_seq or 0) + 1
    wq_info = await js.stream_info(wq)
    if wq_info is None:
        raise ReplayRefused(f"the group's work-queue stream {wq} does not exist")
    if not (wq_info.config.sources or []):
        notes.append("a previous replay was interrupted after removing the source; this "
                     "one puts it back")
    consumers = await admin.group_consumers(js, stored.stream, stored.group)
    blockers = await _running(js, stored.stream, stored.group, None)
    blockers += _consumer_blockers(consumers)
    blockers += _expected_blockers(stored, info, expected)
    n = config.max_members
    by_partition = owners(config)
    current, waiting, unknown = await _elastic_positions(js, wq, config, end)
    blockers += unknown
    if target.uniform and seq is None:
        notes.append(f"no message of {stored.stream} at or after {target.describe()}: "
                     "nothing to replay")
    targets: dict[int, int] = {}
    since = min([end, *current.values()])
    every: tuple[int, ...] = ()
    per: dict[int, tuple[int, ...]] = {p: () for p in range(n)}
    for p in range(n):
        if target.uniform:
            targets[p] = seq if seq is not None else current[p]
        elif target.latest:
            targets[p] = end
        elif target.current:
            targets[p] = current[p]
        elif target.positions is not None:
            targets[p] = _clamped(target, p, current[p], first, end, notes)
    if target.shift is not None:
        since, every, per = await _shift_index(js, stored, current, target.shift, first)
    elif any(targets[p] != current[p] for p in targets):
        since = min([since, *targets.values()])
        every, per = await _index(js, stored, since)
    if target.shift is not None:
        targets = {p: _shifted(per[p], current[p], target.shift, end, p, notes)
                   for p in range(n)}
    if target.uniform and seq is not None:
        late = [p for p in range(n) if waiting.get(p, 0) and current[p] < seq]
        if late:
            oldest = min(current[p] for p in late)
            blockers.append(
                f"{sum(waiting.values())} messages still wait in {wq}, the oldest from "
                f"origin sequence {oldest}, before the replay point {seq}: start the group "
                f"to process them first, or replay from {oldest} to include them")
    rows = []
    moving = any(targets[p] != current[p] for p in range(n))
    for p in range(n):
        t, c = targets[p], current[p]
        again = _count(per[p], t, c) if t < c else 0
        skip = _count(per[p], c, t) if t > c else 0
        rows.append(PartitionPlan(
            p, by_partition.get(p), None if (target.uniform and seq is None) else t,
            again, skip, max(0, waiting.get(p, 0) - skip) if moving else 0, c))
    start = seq if target.uniform else (min(targets.values()) if moving else None)
    return Plan(stored.stream, stored.group, False, target, start,
                tuple(sorted(set(by_partition.values()))), rows, sorted(set(blockers)),
                notes, revision=stored.revision, partition_count=n,
                origin_created=_stamp(info),
                work=_Work(since=since, seqs=every, per=per))


def _origin_seq(headers: dict[str, str]) -> int | None:
    """The origin sequence in a sourced message's ``Nats-Stream-Source`` header
    (``<stream> <seq> <filter> <transform> <subject> <hash>``)."""
    parts = headers.get("Nats-Stream-Source", "").split()
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return None


async def _execute_elastic(js: JetStream, p: Plan) -> list[str]:
    """Remove the source, purge, put the source back from the earliest target; then
    purge, per partition with a later target, its re-sourced messages before it."""
    assert p.sequence is not None
    stored = await admin.get_group(js, p.stream, p.group)
    config = stored.config
    assert isinstance(config, ElasticGroupConfig)
    wq = stored.consume_stream
    info = await js.stream_info(wq)
    assert info is not None
    await resource(js, wq, info, p.stream, config, p.sequence, _placeholder(wq))
    notes = await _verify_resourced(js, wq, p)
    later = [r for r in p.partitions if r.from_sequence is not None
             and _count(p.work.per.get(r.partition, ()), p.sequence, r.from_sequence)]
    if later and not notes:
        await _skip_before(js, wq, p, later)
    return notes


async def _skip_before(js: JetStream, wq: str, p: Plan, rows: list[PartitionPlan]) -> None:
    """Purge each of ``rows``' partitions below its target. The work-queue stream holds
    the group's origin messages from ``p.sequence`` in order under consecutive sequences
    (only the source writes to it, nothing consumes while the group is stopped): the
    first kept message's sequence follows from its rank, checked by its header."""
    assert p.sequence is not None
    ranked = p.work.seqs[bisect_left(p.work.seqs, p.sequence):]
    first = await js.get_message(wq, 0, ">")
    if first is None or not ranked or _origin_seq(first.headers) != ranked[0]:
        raise CgroupdError(f"{wq} does not start with origin sequence "
                           f"{ranked[0] if ranked else '?'} after re-sourcing: the "
                           "per-partition targets were not applied (every partition "
                           f"resumes at {p.sequence}); run the same plan again")
    for row in rows:
        assert row.from_sequence is not None
        mine = p.work.per[row.partition]
        keep = mine[bisect_left(mine, row.from_sequence):]
        rank = bisect_left(ranked, keep[0]) if keep else len(ranked)
        bound = first.seq + rank
        await _wait_sourced(js, wq, bound - 1)
        if keep:
            found = await js.get_message(wq, bound)
            if found is None or _origin_seq(found.headers) != keep[0]:
                raise CgroupdError(f"{wq} sequence {bound} is not origin sequence "
                                   f"{keep[0]}: partition {row.partition} was not moved to "
                                   f"{row.from_sequence}; run the same plan again")
        await js.purge(wq, subject=f"{row.partition}.>", keep_from_seq=bound)


async def _wait_sourced(js: JetStream, wq: str, seq: int) -> None:
    deadline = time.monotonic() + VERIFY_TIMEOUT
    while True:
        info = await js.stream_info(wq)
        if info is not None and int(info.state.last_seq or 0) >= seq:
            return
        if time.monotonic() > deadline:
            raise CgroupdError(f"{wq} had not sourced up to its sequence {seq} after "
                               f"{VERIFY_TIMEOUT:g}s; run the same plan again")
        await asyncio.sleep(0.05)


async def _verify_resourced(js: JetStream, wq: str, p: Plan) -> list[str]:
    """The first message sourced again must come from the target: a server that resumed
    its source where it had stopped instead would silently replay nothing."""
    total = sum(r.reprocess + r.dropped_pending for r in p.partitions)
    if not total:
        return []
    deadline = time.monotonic() + VERIFY_TIMEOUT
    while True:
        first = await js.get_message(wq, 0, ">")
        if first is not None:
            origin = _origin_seq(first.headers)
            assert p.sequence is not None
            if origin is not None and origin < p.sequence:
                raise CgroupdError(f"{wq} was sourced again from origin sequence {origin}, "
                                   f"not {p.sequence}: this server does not restart a "
                                   "source where asked")
            return []
        if time.monotonic() > deadline:
            return [f"{wq} had not sourced a replayed message after {VERIFY_TIMEOUT:g}s; "
                    "check its source with `nats stream info`"]
        await asyncio.sleep(0.05)


# -- both -----------------------------------------------------------------------------------
async def _apply(js: JetStream, p: Plan) -> Plan:
    if p.sequence is None or (not p.changes and not p.target.uniform):
        return replace(p, executed=True,
                       notes=[*p.notes, "nothing to change"] if not p.target.uniform
                       else p.notes)
    try:
        if p.static:
            await _execute_static(js, p)
            notes: list[str] = []
        else:
            notes = await _execute_elastic(js, p)
    except ApiError as exc:
        raise CgroupdError(f"replay of {p.stream}/{p.group} failed: {exc}") from exc
    return replace(p, executed=True, notes=[*p.notes, *notes])


async def execute(js: JetStream, stream: str, group: str, target: Target,
                  members: Sequence[str] | None = None,
                  expected: Expected | None = None) -> Plan:
    """Plan, refuse if anything blocks it, then replay; the executed plan."""
    p = await plan(js, stream, group, target, members, expected)
    if p.blockers:
        raise ReplayRefused("not replaying: " + "; ".join(p.blockers))
    return await _apply(js, p)


async def plan_all(js: JetStream, stream: str, target: Target) -> list[Plan]:
    """The plan of every group of ``stream`` (``--all-groups``)."""
    found = await admin.list_groups(js, stream)
    if not found:
        raise ReplayRefused(f"stream {stream!r} has no consumer group")
    return [await plan(js, stream, name, target) for name, _ in found]


async def execute_all(js: JetStream, plans_: Sequence[Plan]) -> list[Plan]:
    """Apply every plan, or none: refused when any group's plan is blocked."""
    blocked = [f"{p.group}: {b}" for p in plans_ for b in p.blockers]
    if blocked:
        raise ReplayRefused("not replaying any group: " + "; ".join(blocked))
    return [await _apply(js, p) for p in plans_]
