"""Group administration: create, delete, list, membership, mappings.

Async functions over the :class:`~cgroupd.nats.jetstream.JetStream` adapter. Membership changes
are compare-and-set updates on the record's KV revision, retried when another writer got
there first, so two operators adding members at once both succeed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cgroupd.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticGroupConfig,
    GroupConfig,
    MemberMapping,
    StaticGroupConfig,
    group_key,
    validate_name,
    work_queue_stream,
)
from cgroupd.core.errors import (
    BadRecord,
    BucketNotFound,
    CgroupdError,
    ConfigError,
    ConflictError,
    GroupExists,
    GroupNotFound,
    StreamNotFound,
)
from cgroupd.core.naming import INSTANCE_KEY, MEMBER_KEY
from cgroupd.core.records import elastic_from_json, static_from_json
from cgroupd.core.retrying import retried
from cgroupd.nats.groupstreams import (
    StreamInfo,
    ensure_bucket,
    ensure_work_queue_stream,
    is_work_queue,
    whole_subject_problem,
)
from cgroupd.nats.jetstream import JetStream

#: How often a CAS update is retried before ConflictError is raised, and the longest
#: random pause between two attempts (seconds).
CAS_ATTEMPTS = 20
CAS_MAX_PAUSE = 0.1


@dataclass(frozen=True)
class StoredGroup:
    """A group's config as stored, with its KV revision."""

    stream: str
    group: str
    config: GroupConfig
    revision: int

    @property
    def static(self) -> bool:
        return isinstance(self.config, StaticGroupConfig)

    @property
    def consume_stream(self) -> str:
        """The stream members consume from."""
        return self.stream if self.static else work_queue_stream(self.stream, self.group)


async def _origin(js: JetStream, stream: str) -> StreamInfo:
    info = await js.stream_info(stream)
    if info is None:
        raise StreamNotFound(f"stream {stream!r} does not exist")
    return info


def _decode(bucket: str, value: bytes, stream: str = "", group: str = "") -> GroupConfig:
    try:
        return (static_from_json(value) if bucket == STATIC_BUCKET
                else elastic_from_json(value))
    except BadRecord:
        raise
    except ConfigError as exc:
        where = f"group {stream}/{group}" if stream else "group"
        raise BadRecord(f"{where}: its record in {bucket} cannot be read: {exc}") from exc


async def _create_record(js: JetStream, bucket: str, stream: str, group: str,
                         config: GroupConfig, origin: StreamInfo) -> int | None:
    """Store the record if absent: its revision when created, None when an identical
    one exists."""
    await ensure_bucket(js, bucket, origin)
    key = group_key(stream, group)
    existing = await js.get_record(bucket, key)
    if existing is None or existing.value is None:
        try:
            return await _stored_once_available(
                lambda: js.create_record(bucket, key, config.to_json()))
        except ConflictError:
            existing = await js.get_record(bucket, key)
            if existing is None or existing.value is None:
                raise
    try:
        stored = _decode(bucket, existing.value)
    except ConfigError as exc:
        raise GroupExists(f"group {stream}/{group} exists with an invalid record: {exc}") from exc
    if stored != config:
        raise GroupExists(
            f"group {stream}/{group} already exists with a different configuration; "
            "delete it first or change only its members")
    return None


#: How long a record write waits for the bucket's stream to answer (seconds): a bucket
#: just made on a cluster has no leader for a moment, and a write then gets "no
#: responders" (CI on 8b9f385: test_admin.py::test_r3_group_on_cluster).
BUCKET_READY_WAIT = 10.0


async def _stored_once_available(write: Callable[[], Awaitable[int]]) -> int:
    """``write`` retried, with jittered backoff, while it fails in passing (a stream
    electing its leader, a server busy), for up to :data:`BUCKET_READY_WAIT`."""
    loop = asyncio.get_running_loop()
    return await retried(
        write, within=BUCKET_READY_WAIT, base=0.1, cap=1.0,
        retry_if=lambda exc: exc.retriable and not isinstance(exc, ConflictError),
        clock=loop.time, sleep=asyncio.sleep)


async def _check_other_kind(js: JetStream, stream: str, group: str, creating: str) -> None:
    """GroupExists when the name is taken by a group of the other kind on this stream."""
    other, kind = ((STATIC_BUCKET, "static") if creating == ELASTIC_BUCKET
                   else (ELASTIC_BUCKET, "elastic"))
    try:
        record = await js.get_record(other, group_key(stream, group))
    except BucketNotFound:
        return
    if record is not None and record.value is not None:
        raise GroupExists(f"group {stream}/{group} already exists as a {kind} group")


async def create_elastic_group(js: JetStream, stream: str, group: str,
                               config: ElasticGroupConfig) -> ElasticGroupConfig:
    """Create an elastic group and its work-queue stream; an identical re-create is a no-op.

    All or nothing: when the server refuses the work-queue stream (overlapping filters, a
    transform it does not know), the record this call wrote is removed again and the
    server's refusal raised, so no member ever joins a group that cannot have a stream.
    A group without partitioning filters (whole-subject) needs nats-server >= 2.12:
    refused up front, saying so, on an older one.
    """
    validate_name("stream", stream)
    validate_name("group", group)
    problem = whole_subject_problem(config, js.server_version())
    if problem:
        raise ConfigError(problem)
    origin = await _origin(js, stream)
    await _check_other_kind(js, stream, group, ELASTIC_BUCKET)
    created = await _create_record(js, ELASTIC_BUCKET, stream, group, config, origin)
    try:
        await ensure_work_queue_stream(js, work_queue_stream(stream, group), stream, origin,
                                       config)
    except BaseException:
        if created is not None:
            await _undo_record(js, ELASTIC_BUCKET, group_key(stream, group), created)
        raise
    return config


async def _undo_record(js: JetStream, bucket: str, key: str, revision: int) -> None:
    """Remove the record a failed create wrote, unless someone changed it meanwhile (then
    it is theirs). Best effort: the create's own error is what the caller sees."""
    try:
        await asyncio.shield(js.delete_record(bucket, key, last=revision))
    except CgroupdError:  # ConflictError: someone else's record now
        pass


async def create_static_group(js: JetStream, stream: str, group: str,
                              config: StaticGroupConfig) -> StaticGroupConfig:
    """Create a static group on a stream whose subjects already start with the partition."""
    validate_name("stream", stream)
    validate_name("group", group)
    origin = await _origin(js, stream)
    await _check_other_kind(js, stream, group, STATIC_BUCKET)
    await _create_record(js, STATIC_BUCKET, stream, group, config, origin)
    return config


async def get_group(js: JetStream, stream: str, group: str) -> StoredGroup:
    """The group's stored config, elastic or static; GroupNotFound when neither exists."""
    for bucket in (ELASTIC_BUCKET, STATIC_BUCKET):
        try:
            record = await js.get_record(bucket, group_key(stream, group))
        except BucketNotFound:
            continue
        if record is not None and record.value is not None:
            return StoredGroup(stream, group, _decode(bucket, record.value, stream, group),
                               record.revision)
    raise GroupNotFound(f"no consumer group {group!r} on stream {stream!r}")


@dataclass(frozen=True)
class ListedGroup:
    """One group of a stream as listed: its stored config, or why its record cannot be
    read (one unreadable record never hides the others)."""

    group: str
    kind: str  # "elastic" or "static": the bucket the record is in
    stored: StoredGroup | None
    error: str | None = None


async def list_group_records(js: JetStream, stream: str) -> list[ListedGroup]:
    """Every group of ``stream``, sorted, each read on its own: an unreadable record is
    listed with its error instead of failing the listing; a record deleted meanwhile is
    left out."""
    out: list[ListedGroup] = []
    for name, kind in await list_groups(js, stream):
        bucket = ELASTIC_BUCKET if kind == "elastic" else STATIC_BUCKET
        record = await js.get_record(bucket, group_key(stream, name))
        if record is None or record.value is None:
            continue
        try:
            config = _decode(bucket, record.value, stream, name)
        except BadRecord as exc:
            out.append(ListedGroup(name, kind, None, str(exc)))
            continue
        out.append(ListedGroup(name, kind, StoredGroup(stream, name, config,
                                                        record.revision)))
    return out


async def list_groups(js: JetStream, stream: str) -> list[tuple[str, str]]:
    """``(group, "elastic"|"static")`` for every group of ``stream``, sorted."""
    return [(group, kind) for head, group, kind in await list_every_group(js)
            if head == stream]


async def list_every_group(js: JetStream) -> list[tuple[str, str, str]]:
    """``(stream, group, "elastic"|"static")`` for every group of every stream whose
    record the credentials can read, sorted."""
    out: list[tuple[str, str, str]] = []
    for bucket, kind in ((ELASTIC_BUCKET, "elastic"), (STATIC_BUCKET, "static")):
        try:
            keys = await js.keys(bucket)
        except BucketNotFound:
            continue
        for key in keys:
            head, _, name = key.partition(".")
            if head and name:
                out.append((head, name, kind))
    return sorted(out)


async def delete_group(js: JetStream, stream: str, group: str, force: bool = False) -> None:
    """Delete the record (members stop), then the work-queue stream or member consumers.

    A record that cannot be read is deleted only with ``force`` (BadRecord otherwise),
    with what its bucket says the group has: the ``<stream>-<group>`` work queue sourcing
    ``stream`` (elastic), or the group's member consumers (static).
    """
    try:
        stored = await get_group(js, stream, group)
    except BadRecord as exc:
        if not force:
            raise BadRecord(f"{exc}; 'cgroupd group delete --force' removes it") from exc
        await _force_delete(js, stream, group)
        return
    bucket = STATIC_BUCKET if stored.static else ELASTIC_BUCKET
    await js.delete_record(bucket, group_key(stream, group))
    if stored.static:
        await _delete_static_consumers(js, stream, group)
    else:
        await js.delete_stream(work_queue_stream(stream, group))


async def _delete_static_consumers(js: JetStream, stream: str, group: str) -> None:
    for info in static_group_consumers(group, await js.list_consumers(stream)):
        await js.delete_consumer(stream, info["name"])


async def _force_delete(js: JetStream, stream: str, group: str) -> None:
    """Delete unreadable records of ``stream``/``group`` and what they stand for."""
    for bucket in (ELASTIC_BUCKET, STATIC_BUCKET):
        try:
            record = await js.get_record(bucket, group_key(stream, group))
        except BucketNotFound:
            continue
        if record is None or record.value is None:
            continue
        await js.delete_record(bucket, group_key(stream, group))
        if bucket == STATIC_BUCKET:
            await _delete_static_consumers(js, stream, group)
            continue
        wq = work_queue_stream(stream, group)
        info = await js.stream_info(wq)
        sources = (info.config.sources or []) if info is not None else []
        # Only this group's stream: a work queue sourcing the origin (or, after an
        # interrupted replay, sourcing nothing).
        if info is not None and is_work_queue(info) and all(s.name == stream
                                                             for s in sources):
            await js.delete_stream(wq)


async def _update(js: JetStream, stream: str, group: str,
                  change: Callable[[GroupConfig], GroupConfig]) -> GroupConfig:
    """Apply ``change`` with compare-and-set on the record's revision, retrying races
    after a random pause that grows with each lost race (without it, six writers making
    changes in a loop starved one of them for 20 attempts in a row)."""
    for attempt in range(CAS_ATTEMPTS):
        if attempt:
            await asyncio.sleep(random.uniform(0, min(CAS_MAX_PAUSE, 0.002 * 2 ** attempt)))
        stored = await get_group(js, stream, group)
        new = change(stored.config)
        if new == stored.config:
            return new
        bucket = STATIC_BUCKET if stored.static else ELASTIC_BUCKET
        try:
            await js.update_record(bucket, group_key(stream, group), new.to_json(),
                                   last=stored.revision)
            return new
        except ConflictError:
            continue
    raise ConflictError(f"group {stream}/{group} kept changing; gave up after "
                        f"{CAS_ATTEMPTS} attempts")


def _check_members(members: Iterable[str]) -> list[str]:
    if isinstance(members, str):  # list("m1") would silently mean members "m" and "1"
        raise ConfigError(f"give member names as a list, not the string {members!r}")
    names = list(members)
    if not names:
        raise ConfigError("name at least one member")
    for m in names:
        validate_name("member", m)
    return names


async def add_members(js: JetStream, stream: str, group: str,
                      members: Iterable[str]) -> GroupConfig:
    """Add members (already present ones are kept once)."""
    names = _check_members(members)

    def change(config: GroupConfig) -> GroupConfig:
        if config.member_mappings:
            raise ConfigError("this group uses member mappings; clear them to list members")
        merged = list(config.members) + [m for m in dict.fromkeys(names)
                                         if m not in config.members]
        return config.with_members(merged)

    return await _update(js, stream, group, change)


async def drop_members(js: JetStream, stream: str, group: str,
                       members: Iterable[str]) -> GroupConfig:
    """Remove members (absent ones are ignored)."""
    names = set(_check_members(members))

    def change(config: GroupConfig) -> GroupConfig:
        if config.member_mappings:
            raise ConfigError("this group uses member mappings; change them with set_mappings")
        return config.with_members([m for m in config.members if m not in names])

    return await _update(js, stream, group, change)


async def set_mappings(js: JetStream, stream: str, group: str,
                       mappings: Iterable[MemberMapping]) -> GroupConfig:
    """Replace the membership with explicit member→partitions mappings."""
    chosen = tuple(mappings)
    return await _update(js, stream, group, lambda c: c.with_mappings(chosen))


async def clear_mappings(js: JetStream, stream: str, group: str) -> GroupConfig:
    """Drop the mappings; their members become the automatic member list."""
    def change(config: GroupConfig) -> GroupConfig:
        if not config.member_mappings:
            return config
        return config.with_members([m.member for m in config.member_mappings])

    return await _update(js, stream, group, change)


def static_group_consumers(group: str, infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The consumers of static group ``group`` among all the consumers of its stream.

    Its members' consumers are ``<group>-<member>`` (their metadata names the member, so
    group ``g`` does not claim ``g-x-m1`` of group ``g-x``; without cgroupd metadata the
    prefix decides), plus the data consumers (``<member>~<slot>``; earlier versions
    ``<member>-<instance>``) of the instances holding them.
    """
    def meta(info: dict[str, Any]) -> dict[str, Any]:
        return (info.get("config") or {}).get("metadata") or {}

    kept: list[dict[str, Any]] = []
    instances: set[tuple[str, str]] = set()
    for info in infos:
        name, member = info.get("name", ""), meta(info).get(MEMBER_KEY)
        if name == f"{group}-{member}" or (member is None and name.startswith(f"{group}-")):
            kept.append(info)
            if member is not None and meta(info).get(INSTANCE_KEY):
                instances.add((member, meta(info)[INSTANCE_KEY]))
    for info in infos:
        key = (meta(info).get(MEMBER_KEY), meta(info).get(INSTANCE_KEY))
        if key in instances and info.get("name") == f"{key[0]}-{key[1]}" and info not in kept:
            kept.append(info)
    return kept
