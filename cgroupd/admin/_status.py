"""Group status: who owns what right now, what is waiting, and asking an active instance
to step down. Read from the consumers on the group's stream (their metadata names member
and instance) and the group's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cgroupd.admin._groups import StoredGroup, get_group, static_group_consumers
from cgroupd.admin.lag import read_lag
from cgroupd.core.config import group_key
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import StreamNotFound
from cgroupd.core.naming import HOLDER_KEY, HOST_KEY, INSTANCE_KEY, MEMBER_KEY, SINCE_KEY
from cgroupd.core.partitions import SYNC_PREFIX, owners
from cgroupd.core.pinning import step_down_subject
from cgroupd.core.settings import PRIORITY_GROUP
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.lease import Presence

#: Seconds a pinned member's holder has to answer a step-down request before the pin is
#: simply cleared (a live holder answers within milliseconds).
STEP_DOWN_ANSWER = 1.0


@dataclass(frozen=True)
class ConsumerView:
    """A consumer on the group's stream, read back as an instance of a member."""

    name: str
    member: str | None
    instance: str | None
    role: str  # "sync", "data", "pinned" or "other"
    partitions: tuple[int, ...]
    num_pending: int
    num_ack_pending: int
    num_waiting: int
    pinned_id: str | None = None
    #: Stream sequences of the last delivered message and of the ack floor.
    delivered_seq: int = 0
    ack_floor_seq: int = 0
    #: A synchronization consumer held by something other than a member instance
    #: ("spark": a query's lease, :mod:`cgroupd.spark.lease`), and the host and time
    #: (RFC 3339) it records: such a holder is the member's active instance.
    holder: str | None = None
    host: str | None = None
    since: str | None = None


@dataclass(frozen=True)
class PartitionStatus:
    partition: int
    member: str | None
    instance: str | None
    #: Unprocessed messages (the partition's lag in messages).
    pending: int
    #: Age in seconds of the oldest unprocessed message (0 when none waits).
    lag_seconds: float = 0.0
    #: Delivered to the active instance, not yet acknowledged (None: not read).
    in_flight: int | None = None


@dataclass(frozen=True)
class GroupStatus:
    """Who owns what right now, and what is waiting."""

    group: StoredGroup
    partitions: list[PartitionStatus]
    consumers: list[ConsumerView]
    members_without_instance: list[str] = field(default_factory=list)

    @property
    def unowned_partitions(self) -> list[int]:
        """Partitions no active instance consumes: the ADR's 'idle group' alert."""
        return [p.partition for p in self.partitions if p.instance is None]


def _view(info: dict[str, Any]) -> ConsumerView:
    config = info.get("config") or {}
    meta = config.get("metadata") or {}
    filters = config.get("filter_subjects") or (
        [config["filter_subject"]] if config.get("filter_subject") else [])
    role, parts = "other", []
    for f in filters:
        tokens = f.split(".")
        if tokens[0] == SYNC_PREFIX and len(tokens) > 1 and tokens[1].isdigit():
            role = "sync"
            parts.append(int(tokens[1]))
        elif tokens[0].isdigit():
            parts.append(int(tokens[0]))
    groups = info.get("priority_groups") or []
    pinned = next((g.get("pinned_client_id") for g in groups
                   if g.get("group") == PRIORITY_GROUP), None)
    if role != "sync" and parts:
        role = "pinned" if PRIORITY_GROUP in (config.get("priority_groups") or []) else "data"
    name = info.get("name", "")
    return ConsumerView(
        name=name, member=meta.get(MEMBER_KEY), instance=meta.get(INSTANCE_KEY) or pinned,
        role=role, partitions=tuple(sorted(parts)),
        num_pending=int(info.get("num_pending", 0)),
        num_ack_pending=int(info.get("num_ack_pending", 0)),
        num_waiting=int(info.get("num_waiting", 0)),
        pinned_id=pinned,
        delivered_seq=int((info.get("delivered") or {}).get("stream_seq", 0)),
        ack_floor_seq=int((info.get("ack_floor") or {}).get("stream_seq", 0)),
        holder=_text(meta.get(HOLDER_KEY)), host=_text(meta.get(HOST_KEY)),
        since=_text(meta.get(SINCE_KEY)),
    )


def _text(value: Any) -> str | None:
    """A metadata value anyone able to create consumers may have written: a short string."""
    return value[:200] if isinstance(value, str) and value else None


async def group_consumers(js: JetStream, stream: str, group: str) -> list[ConsumerView]:
    """Every consumer on the group's stream that belongs to it, read as member instances."""
    stored = await get_group(js, stream, group)
    try:
        infos = await js.list_consumers(stored.consume_stream)
    except StreamNotFound as exc:
        raise _missing_stream(stored) from exc
    if stored.static:
        infos = static_group_consumers(group, infos)
    return sorted((_view(i) for i in infos), key=lambda v: v.name)


def _missing_stream(stored: StoredGroup) -> StreamNotFound:
    """The group's stream is gone: say which, and what a missing work queue means."""
    if stored.static:
        return StreamNotFound(f"stream {stored.stream!r} of static group "
                              f"{stored.stream}/{stored.group} does not exist")
    return StreamNotFound(
        f"the work-queue stream {stored.consume_stream} of group {stored.stream}/"
        f"{stored.group} does not exist (the server refused it when the group was "
        "created, or it was deleted): its members have nothing to consume; delete the "
        "group and create it again")


async def partition_pending(js: JetStream, stream: str, group: str) -> dict[int, int]:
    """Messages waiting in each partition of the group's stream (its lag)."""
    stored = await get_group(js, stream, group)
    lags = await read_lag(js, stored.consume_stream, stored.config,
                          range(stored.config.max_members))
    return {p: lag.messages for p, lag in lags.items()}


def owned_partitions(consumers: list[ConsumerView]) -> set[int]:
    """Partitions an active instance consumes, from the consumers alone (no lag read)."""
    return set(_holders(consumers)[0])


def _holders(consumers: list[ConsumerView]
             ) -> tuple[dict[int, ConsumerView], dict[int, ConsumerView]]:
    """Per partition: the consumer of its active instance, and the consumer whose
    position counts for it (a static member's consumer, active or not). A Spark query
    holding a member consumes its partitions through its synchronization consumer (it
    reads the work queue directly): that consumer stands for its active instance."""
    active: dict[int, ConsumerView] = {}
    position: dict[int, ConsumerView] = {}
    for view in consumers:
        if view.role == "sync" and view.holder is not None:
            for p in view.partitions:
                active.setdefault(p, view)
        if view.role == "data" or (view.role == "pinned" and view.pinned_id):
            for p in view.partitions:
                active[p] = view
        if view.role in ("data", "pinned"):
            for p in view.partitions:
                position.setdefault(p, view)
    position.update(active)
    return active, position


async def group_status(js: JetStream, stream: str, group: str,
                       in_flight: bool = False) -> GroupStatus:
    """Per partition: its member, that member's active instance, and its lag (messages,
    and the age of the oldest; with ``in_flight``, one more request per busy partition
    tells how many of them its active instance is handling)."""
    stored = await get_group(js, stream, group)
    consumers = await group_consumers(js, stream, group)
    active, position = _holders(consumers)
    n = stored.config.max_members
    # A static stream keeps processed messages: only what follows the ack floor waits.
    floors = {p: v.ack_floor_seq for p, v in position.items()} if stored.static else {}
    delivered = ({p: v.delivered_seq for p, v in active.items() if v.num_ack_pending}
                 if in_flight else {})
    lags = await read_lag(js, stored.consume_stream, stored.config, range(n), floors,
                          delivered)
    by_partition = owners(stored.config)
    rows = []
    for p in range(n):
        holder, lag = active.get(p), lags[p]
        flight = (lag.in_flight or 0) if in_flight and holder else (0 if in_flight else None)
        rows.append(PartitionStatus(p, by_partition.get(p),
                                    holder.instance if holder else None, lag.messages,
                                    lag.seconds(), flight))
    missing = sorted({r.member for r in rows if r.member and r.instance is None})
    return GroupStatus(stored, rows, consumers, missing)


async def step_down(js: JetStream, stream: str, group: str, member: str) -> bool:
    """Ask the member's active instance to step down so a standby takes over.

    Sync mode deletes the member's synchronization consumer (the ADR's step-down); the
    active instance notices at once, finishes its running handlers and releases. Pinned
    mode asks the instance holding the pin, which does the same and then unpins (see
    :func:`cgroupd.core.pinning.step_down_subject`); when no holder answers within
    ``STEP_DOWN_ANSWER`` (the reference implementation's, or a frozen one) it unpins,
    as the reference does: the pin then moves at once, and what the old holder still
    runs is refused and run again by the new one. False when the member had no active
    instance.
    """
    stored = await get_group(js, stream, group)
    name = f"{group}-{member}" if stored.static else member
    info = await js.consumer_info(stored.consume_stream, name)
    if info is None:
        return False
    if PRIORITY_GROUP in ((info.get("config") or {}).get("priority_groups") or []):
        pin = ConsumerInfo.of(info).pinned_client(PRIORITY_GROUP)
        if pin:
            answer = await js.probe(step_down_subject(group_key(stream, group), member),
                                    STEP_DOWN_ANSWER, pin.encode())
            if answer.presence is Presence.ALIVE:
                return True
        await js.unpin(stored.consume_stream, name, PRIORITY_GROUP)
        return True
    return await js.delete_consumer(stored.consume_stream, name)
