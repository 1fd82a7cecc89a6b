"""Replay ("reset offsets"): process a group's messages again from a sequence or a time.

Like Kafka's ``kafka-consumer-groups --reset-offsets``: a plan first (per partition, what
would be processed again), executed only when asked, and never while the group's
instances run (they would race the change; a running standby would take over at once).

Static groups (consumers on the origin stream): each selected member's consumer
``<group>-<member>`` is moved to the target stream sequence with the consumer-reset API
(``$JS.API.CONSUMER.RESET.<stream>.<consumer>``, nats-server >= 2.14; its pending
deliveries are forgotten, its ack floor becomes the target - 1). Moving forward skips
messages; the plan says how many.

Elastic groups (a work-queue stream sourcing the origin): the work-queue stream is
re-sourced from the target sequence of the origin. Its source is removed (a placeholder
subject keeps the stream valid meanwhile), the stream is purged, and the source is put
back with ``opt_start_seq``: on an empty stream the server starts a returning source
there. What was still waiting in the work-queue stream is dropped and sourced again in
origin order, so each message is processed once more, in order; this needs everything
still waiting to lie at or after the target (otherwise the older waiting messages would
be lost, or ones processed in between replayed: the plan refuses and says why). A replay
interrupted between those steps is finished by running it again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from cgroupd import admin
from cgroupd.admin import ConsumerView, StoredGroup
from cgroupd.config import ElasticGroupConfig
from cgroupd.errors import (
    ApiError,
    CgroupdError,
    JetStreamNotEnabled,
    ReplayRefused,
    ServerUnreachable,
)
from cgroupd.events import discover
from cgroupd.groupstreams import StreamInfo, is_work_queue, resource
from cgroupd.jetstream import JetStream
from cgroupd.lag import partition_subjects, read_lag
from cgroupd.partitions import assignment, owners, partition_of

#: Subject a work-queue stream captures while its source is removed during a replay.
PLACEHOLDER = "_CGROUPD.replay.{stream}"
#: How long to wait for the re-sourced stream to show the first replayed message.
VERIFY_TIMEOUT = 10.0


@dataclass(frozen=True)
class Target:
    """Where processing restarts: the first message kept, by one of these."""

    earliest: bool = False
    sequence: int | None = None
    #: Unix seconds (``--to-time``, or now minus ``--by-duration``).
    time: float | None = None

    def __post_init__(self) -> None:
        given = sum([self.earliest, self.sequence is not None, self.time is not None])
        if given != 1:
            raise ValueError("give exactly one of earliest, a sequence or a time")
        if self.sequence is not None and self.sequence < 1:
            raise ValueError(f"sequence {self.sequence} must be at least 1")

    def describe(self) -> str:
        if self.earliest:
            return "the earliest message"
        if self.sequence is not None:
            return f"sequence {self.sequence}"
        assert self.time is not None
        stamp = datetime.fromtimestamp(self.time, UTC).isoformat(timespec="seconds")
        return f"{stamp.replace('+00:00', 'Z')}"


@dataclass(frozen=True)
class PartitionPlan:
    partition: int
    member: str | None
    #: Stream sequence processing restarts at (of the origin for elastic groups).
    from_sequence: int | None
    #: Messages processed already that will be processed again.
    reprocess: int
    #: Messages not processed yet that a forward reset skips (static groups).
    skip: int = 0
    #: Messages still waiting in the work-queue stream, dropped and sourced again in order
    #: (elastic groups; they are processed once, not twice).
    dropped_pending: int = 0


@dataclass(frozen=True)
class Plan:
    stream: str
    group: str
    static: bool
    target: Target
    #: The resolved start sequence (None: nothing at or after the target).
    sequence: int | None
    members: tuple[str, ...]
    partitions: list[PartitionPlan]
    #: Why it cannot run now (empty: it can).
    blockers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    executed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream, "group": self.group,
            "type": "static" if self.static else "elastic",
            "target": self.target.describe(), "sequence": self.sequence,
            "members": list(self.members), "executed": self.executed,
            "blockers": self.blockers, "notes": self.notes,
            "partitions": [{"partition": p.partition, "member": p.member,
                            "from_sequence": p.from_sequence, "reprocess": p.reprocess,
                            "skip": p.skip, "dropped_pending": p.dropped_pending}
                           for p in self.partitions],
        }


async def _start_sequence(js: JetStream, stream: str, target: Target,
                          notes: list[str]) -> tuple[int | None, StreamInfo]:
    info = await js.stream_info(stream)
    if info is None:
        raise ReplayRefused(f"stream {stream!r} does not exist")
    first, last = int(info.state.first_seq or 0), int(info.state.last_seq or 0)
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


async def plan(js: JetStream, stream: str, group: str, target: Target,
               members: Sequence[str] | None = None) -> Plan:
    """What replaying the group (or some of its members) from ``target`` would do."""
    stored = await admin.get_group(js, stream, group)
    if stored.static:
        return await _plan_static(js, stored, target, members)
    if members:
        raise ReplayRefused("an elastic group is replayed as a whole: its members share one "
                            "work-queue stream (leave out --member)")
    return await _plan_elastic(js, stored, target)


# -- static groups ------------------------------------------------------------------------
async def _plan_static(js: JetStream, stored: StoredGroup, target: Target,
                       chosen: Sequence[str] | None) -> Plan:
    config = stored.config
    owned = assignment(config)
    names = tuple(chosen) if chosen else tuple(owned)
    unknown = [m for m in names if m not in owned]
    if unknown:
        raise ReplayRefused(f"{', '.join(unknown)} own no partitions of "
                            f"{stored.stream}/{stored.group}")
    notes: list[str] = []
    seq, info = await _start_sequence(js, stored.stream, target, notes)
    if is_work_queue(info):
        raise ReplayRefused(f"stream {stored.stream} is a work queue: processed messages "
                            "are gone and cannot be replayed")
    views = {v.name: v for v in await admin.group_consumers(js, stored.stream, stored.group)}
    blockers = await _running(js, stored.stream, stored.group, names)
    rows: list[PartitionPlan] = []
    for member in names:
        consumer = views.get(f"{stored.group}-{member}")
        if consumer is not None:
            blockers += _consumer_blockers([consumer])
        floor = consumer.ack_floor_seq if consumer is not None else 0
        if consumer is None:
            notes.append(f"{member} has no consumer yet: it starts at the beginning of the "
                         "stream when it first joins")
        for p in owned[member]:
            rows.append(await _static_row(js, stored, p, member, seq, floor))
    if seq is None:
        notes.append(f"no message at or after {target.describe()}: nothing to replay")
    rows.sort(key=lambda r: r.partition)
    return Plan(stored.stream, stored.group, True, target, seq, names, rows,
                sorted(set(blockers)), notes)


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
    assert p.sequence is not None
    views = {v.name for v in await admin.group_consumers(js, p.stream, p.group)}
    for member in p.members:
        name = f"{p.group}-{member}"
        if name not in views:
            continue
        try:
            await js.reset_consumer(p.stream, name, p.sequence)
        except (JetStreamNotEnabled, ServerUnreachable) as exc:
            raise ReplayRefused(f"resetting {name} failed ({exc}): the consumer reset API "
                                "needs nats-server 2.14 or later") from exc


# -- elastic groups -----------------------------------------------------------------------
def _placeholder(wq: str) -> str:
    return PLACEHOLDER.format(stream=wq)


async def _plan_elastic(js: JetStream, stored: StoredGroup, target: Target) -> Plan:
    config = stored.config
    assert isinstance(config, ElasticGroupConfig)
    wq = stored.consume_stream
    notes: list[str] = []
    seq, _ = await _start_sequence(js, stored.stream, target, notes)
    wq_info = await js.stream_info(wq)
    if wq_info is None:
        raise ReplayRefused(f"the group's work-queue stream {wq} does not exist")
    interrupted = not (wq_info.config.sources or [])
    if interrupted:
        notes.append("a previous replay was interrupted after removing the source; this "
                     "one puts it back")
    consumers = await admin.group_consumers(js, stored.stream, stored.group)
    blockers = await _running(js, stored.stream, stored.group, None)
    blockers += _consumer_blockers(consumers)
    n = config.max_members
    by_partition = owners(config)
    again: Counter[int] = Counter()
    if seq is not None:
        filters = [pf.filter for pf in config.effective_filters]
        async for _, subject in js.scan_subjects(stored.stream, filters, seq):
            part = partition_of(subject, config.effective_filters, n)
            if part is not None:
                again[part] += 1
    else:
        notes.append(f"no message of {stored.stream} at or after {target.describe()}: "
                     "nothing to replay")
    lags = await read_lag(js, wq, config, range(n))
    waiting = {p: lag.messages for p, lag in lags.items()}
    first = await js.get_message(wq, 0, ">") if sum(waiting.values()) else None
    origin_first = _origin_seq(first.headers if first else {})
    if first is not None and seq is not None and (origin_first is None or origin_first < seq):
        where = (f"origin sequence {origin_first}" if origin_first is not None
                 else "an unknown origin sequence")
        blockers.append(
            f"{sum(waiting.values())} messages still wait in {wq}, the oldest from {where}, "
            f"before the replay point {seq}: start the group to process them first, or "
            f"replay from {origin_first or 'an earlier point'} to include them")
    rows = []
    for p in range(n):
        pending = waiting.get(p, 0)
        rows.append(PartitionPlan(p, by_partition.get(p), seq,
                                  max(0, again[p] - pending), 0, pending))
    return Plan(stored.stream, stored.group, False, target, seq,
                tuple(sorted(set(by_partition.values()))), rows, sorted(set(blockers)), notes)


def _origin_seq(headers: dict[str, str]) -> int | None:
    """The origin sequence in a sourced message's ``Nats-Stream-Source`` header
    (``<stream> <seq> <filter> <transform> <subject> <hash>``)."""
    parts = headers.get("Nats-Stream-Source", "").split()
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return None


async def _execute_elastic(js: JetStream, p: Plan) -> list[str]:
    """Remove the source, purge, put the source back from the target sequence."""
    assert p.sequence is not None
    stored = await admin.get_group(js, p.stream, p.group)
    config = stored.config
    assert isinstance(config, ElasticGroupConfig)
    wq = stored.consume_stream
    info = await js.stream_info(wq)
    assert info is not None
    await resource(js, wq, info, p.stream, config, p.sequence, _placeholder(wq))
    return await _verify_resourced(js, wq, p)


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
async def execute(js: JetStream, stream: str, group: str, target: Target,
                  members: Sequence[str] | None = None) -> Plan:
    """Plan, refuse if anything blocks it, then replay; the executed plan."""
    p = await plan(js, stream, group, target, members)
    if p.blockers:
        raise ReplayRefused("not replaying: " + "; ".join(p.blockers))
    if p.sequence is None:
        return replace(p, executed=True)
    try:
        if p.static:
            await _execute_static(js, p)
            notes: list[str] = []
        else:
            notes = await _execute_elastic(js, p)
    except ApiError as exc:
        raise CgroupdError(f"replay of {stream}/{group} failed: {exc}") from exc
    return replace(p, executed=True, notes=[*p.notes, *notes])
