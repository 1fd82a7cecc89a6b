"""The admin API (cgroupd.admin) against real nats-server processes.

Every test talks to a fresh server (``nats_server``/``nc``/``jetstream`` fixtures, or a
server started here with a special config); nothing is mocked. Consumers that a member
would create are created by hand with the shapes cgroupd.member uses, so status and
step-down are checked against what the server really reports.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import api

from cgroupd import admin
from cgroupd.admin._status import STEP_DOWN_ANSWER
from cgroupd.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticGroupConfig,
    MemberMapping,
    PartitioningFilter,
    StaticGroupConfig,
    group_key,
)
from cgroupd.core.errors import (
    ConfigError,
    GroupExists,
    GroupNotFound,
    JetStreamNotEnabled,
    PermissionDenied,
    StreamNotFound,
)
from cgroupd.core.partitions import partition_of
from cgroupd.core.pinning import step_down_subject
from cgroupd.core.settings import PRIORITY_GROUP
from cgroupd.member import INSTANCE_KEY, MEMBER_KEY
from cgroupd.nats.jetstream import JetStream, Record
from tests.support.groups import make_group
from tests.support.natsserver import NatsCluster, NatsServer, client_options
from tests.support.polling import eventually

ORDERS = "ORDERS"
WQ = "ORDERS-g"
BY_KEY = PartitioningFilter("orders.*", (1,))
#: Verified facts (FNV-1a of the key token, 4 partitions): key -> partition.
KNOWN_4 = {"17": 1, "0": 3, "1": 0}


def elastic(n: int = 4, members: Iterable[str] = ("m1", "m2"),
            filters: Iterable[PartitioningFilter] = (BY_KEY,), **kw: Any) -> ElasticGroupConfig:
    return ElasticGroupConfig(max_members=n, partitioning_filters=tuple(filters),
                              members=tuple(members), **kw)


async def origin(js: JetStream, name: str = ORDERS, subjects: Iterable[str] = ("orders.>",),
                 **kw: Any) -> api.StreamInfo:
    return await js.add_stream(api.StreamConfig(name=name, subjects=list(subjects), **kw))


async def wq_subjects(js: JetStream, stream: str, count: int) -> list[str]:
    """Subjects of the ``count`` messages of ``stream``, once they have all arrived."""
    async def arrived() -> api.StreamInfo | None:
        info = await js.stream_info(stream)
        return info if info is not None and info.state.messages >= count else None

    info = await eventually(arrived, what=f"{count} messages in {stream}")
    assert info.state.messages == count
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        out.append((await js.jsm.get_msg(stream, seq)).subject or "")
    return out


async def publish(nc: Client, subjects: Iterable[str], retry_for: float = 15.0) -> None:
    """Publish each subject, retrying while no stream answers yet: a replicated stream
    just created may still be electing its leader (NoStreamResponseError)."""
    js = nc.jetstream()
    for subject in subjects:
        deadline = time.monotonic() + retry_for
        while True:
            try:
                await js.publish(subject, subject.encode())
                break
            except (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


def consumer_config(filters: list[str], metadata: dict[str, str], **extra: Any) -> dict[str, Any]:
    """A consumer shaped like the ones cgroupd.member creates (long inactive threshold)."""
    return {"ack_policy": "explicit", "deliver_policy": "all", "filter_subjects": filters,
            "inactive_threshold": int(300e9), "metadata": metadata, **extra}


async def sync_instance(js: JetStream, stream: str, sync_name: str, member: str,
                        instance: str, partitions: Iterable[int]) -> None:
    """By hand, what an active sync-mode instance holds: sync + data consumer."""
    parts = list(partitions)
    meta = {MEMBER_KEY: member, INSTANCE_KEY: instance}
    await js.create_consumer(stream, sync_name,
                             consumer_config([f"sync.{p}.>" for p in parts], meta,
                                             max_ack_pending=1))
    await js.create_consumer(stream, f"{member}-{instance}",
                             consumer_config([f"{p}.>" for p in parts], meta))


async def consumer_names(js: JetStream, stream: str) -> set[str]:
    return {c["name"] for c in await js.list_consumers(stream)}


@asynccontextmanager
async def server(tmp_path: Path, name: str, extra_config: str) -> AsyncIterator[NatsServer]:
    """A single node with extra config lines, always stopped afterwards."""
    srv = NatsServer(workdir=tmp_path / name, extra_config=extra_config)
    with srv:
        yield srv


# -- create ------------------------------------------------------------------------------


async def test_create_elastic_group_builds_work_queue_stream(jetstream: JetStream) -> None:
    """Creating an elastic group stores its record and a work-queue stream <stream>-<group>
    sourcing the origin with one partitioning transform, the origin's replicas and storage,
    discard new, the configured buffer limits, direct get and work-queue retention."""
    await origin(jetstream, storage=api.StorageType.MEMORY)
    config = elastic(max_buffered_msgs=1000, max_buffered_bytes=1 << 20)
    assert await admin.create_elastic_group(jetstream, ORDERS, "g", config) == config

    stored = await admin.get_group(jetstream, ORDERS, "g")
    assert stored.config == config and not stored.static and stored.consume_stream == WQ
    record = await jetstream.get_record(ELASTIC_BUCKET, "ORDERS.g")
    assert record is not None and record.value is not None
    assert json.loads(record.value)["max_buffered_msg"] == 1000  # the Go field name

    info = await jetstream.stream_info(WQ)
    assert info is not None
    c = info.config
    assert c.retention == api.RetentionPolicy.WORK_QUEUE
    assert c.discard == api.DiscardPolicy.NEW
    assert c.max_msgs == 1000 and c.max_bytes == 1 << 20
    assert c.num_replicas == 1
    assert c.storage == api.StorageType.MEMORY  # copied from the origin, not the default
    assert c.allow_direct is True
    assert not c.subjects
    assert c.sources is not None and len(c.sources) == 1
    source = c.sources[0]
    assert source.name == ORDERS
    assert [(t.src, t.dest) for t in source.subject_transforms or []] == [
        ("orders.*", "{{Partition(4,1)}}.orders.{{Wildcard(1)}}")]


async def test_unlimited_buffers_by_default(jetstream: JetStream) -> None:
    """Without max_buffered_* the work-queue stream is unlimited (-1), file storage like
    its origin."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    info = await jetstream.stream_info(WQ)
    assert info is not None
    assert info.config.max_msgs == -1 and info.config.max_bytes == -1
    assert info.config.storage == api.StorageType.FILE


async def test_recreate_identical_is_noop_and_different_raises(jetstream: JetStream) -> None:
    """The record is created only if absent: an identical re-create changes nothing (same
    revision, same stream), a different config raises GroupExists with a clear message and
    leaves the stored record as it was."""
    await origin(jetstream)
    config = elastic()
    await admin.create_elastic_group(jetstream, ORDERS, "g", config)
    before = await admin.get_group(jetstream, ORDERS, "g")
    created = (await jetstream.stream_info(WQ)).created  # type: ignore[union-attr]

    assert await admin.create_elastic_group(jetstream, ORDERS, "g", elastic()) == config
    again = await admin.get_group(jetstream, ORDERS, "g")
    assert again.revision == before.revision
    assert (await jetstream.stream_info(WQ)).created == created  # type: ignore[union-attr]

    with pytest.raises(GroupExists, match=r"ORDERS/g already exists with a different config"):
        await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(n=8))
    after = await admin.get_group(jetstream, ORDERS, "g")
    assert after.revision == before.revision and after.config == config


async def test_existing_record_is_kept(jetstream: JetStream) -> None:
    """A record already in the bucket (here Go-reference shaped, with a field cgroupd does
    not know) is never overwritten: creating the same group again leaves its bytes as they
    were, and still builds the work-queue stream if that is missing."""
    await origin(jetstream)
    await jetstream.bucket(ELASTIC_BUCKET, create_with=api.KeyValueConfig(
        bucket=ELASTIC_BUCKET, history=1))
    raw = json.dumps({"max_members": 4, "partitioning_filters": [
        {"filter": "orders.*", "partitioning_wildcards": [1]}],
        "members": ["m1", "m2"], "future_field": {"x": 1}}).encode()
    revision = await jetstream.create_record(ELASTIC_BUCKET, "ORDERS.g", raw)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    assert await jetstream.get_record(ELASTIC_BUCKET, "ORDERS.g") == Record(raw, revision)
    assert await jetstream.stream_info(WQ) is not None


async def test_partitioned_subjects_land_in_the_expected_partition(
        nc: Client, jetstream: JetStream) -> None:
    """Messages published to the origin reach the work-queue stream prefixed with their
    partition: with 4 partitions on orders.* wildcard 1, orders.17 -> 1, orders.0 -> 3,
    orders.1 -> 0 (the hash the Go reference and the ADR use)."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    await publish(nc, [f"orders.{k}" for k in KNOWN_4])
    got = await wq_subjects(jetstream, WQ, len(KNOWN_4))
    assert got == [f"{p}.orders.{k}" for k, p in KNOWN_4.items()]


async def test_partition_of_predicts_where_the_server_puts_every_subject(
        nc: Client, jetstream: JetStream) -> None:
    """partition_of computes the partition nats-server's transform chooses, for keys of
    every shape (unicode, number-like, long, two wildcards in reverse order, the whole
    subject): 300 subjects over 13 partitions."""
    await origin(jetstream, subjects=["orders.>", "multi.>", "whole.>"])
    filters = (BY_KEY, PartitioningFilter("multi.*.*", (2, 1)), PartitioningFilter("whole.>"))
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(n=13, filters=filters))
    keys = ["", "0", "007", "٣", "ключ", "🙂", "a" * 200, "-1", "1e3", "x y"]
    subjects = [f"orders.{k or 'empty'}{i}" for i, k in enumerate(keys * 10)]
    subjects += [f"multi.{i}.{k or i}" for i, k in enumerate(keys * 10)]
    subjects += [f"whole.{k or 'z'}.{i}" for i, k in enumerate(keys * 10)]
    subjects = [s.replace(" ", "_") for s in subjects]
    await publish(nc, subjects)
    got = await wq_subjects(jetstream, WQ, len(subjects))
    assert sorted(got) == sorted(f"{partition_of(s, filters, 13)}.{s}" for s in subjects)


async def test_two_partitioning_filters(nc: Client, jetstream: JetStream) -> None:
    """Each partitioning filter becomes its own transform; a filter keyed on its second
    wildcard hashes only that token, so events.<x>.17 lands where orders.17 does."""
    await origin(jetstream, subjects=["orders.>", "events.>"])
    config = elastic(filters=[BY_KEY, PartitioningFilter("events.*.*", (2,))])
    await admin.create_elastic_group(jetstream, ORDERS, "g", config)
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.config.sources
    assert [(t.src, t.dest) for t in info.config.sources[0].subject_transforms or []] == [
        ("orders.*", "{{Partition(4,1)}}.orders.{{Wildcard(1)}}"),
        ("events.*.*", "{{Partition(4,2)}}.events.{{Wildcard(1)}}.{{Wildcard(2)}}"),
    ]
    await publish(nc, ["orders.17", "events.a.17", "events.b.0", "events.c.1", "orders.0"])
    got = await wq_subjects(jetstream, WQ, 5)
    assert got == ["1.orders.17", "1.events.a.17", "3.events.b.0", "0.events.c.1",
                   "3.orders.0"]


async def test_whole_subject_hashing(nc: Client, jetstream: JetStream) -> None:
    """With no wildcard indexes the whole subject is the key ({{Partition(N)}}): the server
    accepts the transform (also after a '>' filter), every message lands in some <p>.
    subject with p < N, one subject always in the same partition, and keys spread out."""
    await origin(jetstream, subjects=["orders.>", "events.>"])
    config = elastic(filters=[PartitioningFilter("orders.*"), PartitioningFilter("events.>")])
    await admin.create_elastic_group(jetstream, ORDERS, "g", config)
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.config.sources
    assert [t.dest for t in info.config.sources[0].subject_transforms or []] == [
        "{{Partition(4)}}.orders.{{Wildcard(1)}}", "{{Partition(4)}}.events.>"]
    sent = [f"orders.{i}" for i in range(30)] + [f"events.x.{i}.y" for i in range(10)]
    await publish(nc, sent + sent[:5])
    got = await wq_subjects(jetstream, WQ, len(sent) + 5)
    partition_of: dict[str, int] = {}
    for subject in got:
        head, _, rest = subject.partition(".")
        assert head.isdigit() and int(head) < 4, subject
        assert partition_of.setdefault(rest, int(head)) == int(head), f"{rest} moved"
    assert sorted(partition_of) == sorted(sent)
    assert len(set(partition_of.values())) > 1


async def test_create_static_group(jetstream: JetStream) -> None:
    """A static group is a record on an existing, already partitioned stream: no
    work-queue stream is created, and members consume the origin itself."""
    await origin(jetstream, "SENSORS", ["0.sensors.>", "1.sensors.>"])
    config = StaticGroupConfig(max_members=2, filters=("sensors.>",), members=("m1", "m2"))
    assert await admin.create_static_group(jetstream, "SENSORS", "g", config) == config
    stored = await admin.get_group(jetstream, "SENSORS", "g")
    assert stored.static and stored.config == config and stored.consume_stream == "SENSORS"
    assert await jetstream.stream_info("SENSORS-g") is None
    assert await admin.create_static_group(jetstream, "SENSORS", "g", config) == config
    with pytest.raises(GroupExists):
        await admin.create_static_group(jetstream, "SENSORS", "g",
                                        StaticGroupConfig(max_members=3, members=("m1",)))


async def test_missing_origin_stream(jetstream: JetStream) -> None:
    """Both kinds of group need their origin stream: StreamNotFound, and nothing is left
    behind (no record, no work-queue stream)."""
    with pytest.raises(StreamNotFound, match="NOPE"):
        await admin.create_elastic_group(jetstream, "NOPE", "g", elastic())
    with pytest.raises(StreamNotFound, match="NOPE"):
        await admin.create_static_group(jetstream, "NOPE", "s", StaticGroupConfig(max_members=2))
    assert await jetstream.stream_info("NOPE-g") is None
    with pytest.raises(GroupNotFound):
        await admin.get_group(jetstream, "NOPE", "g")
    assert await admin.list_groups(jetstream, "NOPE") == []


async def test_group_name_is_unique_across_kinds(jetstream: JetStream) -> None:
    """A stream cannot have an elastic and a static group of the same name: the second
    create raises GroupExists instead of writing a record get_group would never return."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    with pytest.raises(GroupExists, match="elastic"):
        await admin.create_static_group(jetstream, ORDERS, "g", StaticGroupConfig(max_members=4))
    await admin.create_static_group(jetstream, ORDERS, "s", StaticGroupConfig(max_members=4))
    with pytest.raises(GroupExists, match="static"):
        await admin.create_elastic_group(jetstream, ORDERS, "s", elastic())
    assert await jetstream.stream_info("ORDERS-s") is None
    assert await admin.list_groups(jetstream, ORDERS) == [("g", "elastic"), ("s", "static")]


# -- delete, list, get -------------------------------------------------------------------


async def test_delete_elastic_group(jetstream: JetStream) -> None:
    """Deleting an elastic group removes its record and its work-queue stream (the origin
    stays); a second delete raises GroupNotFound; the name can be created again."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    await admin.delete_group(jetstream, ORDERS, "g")
    with pytest.raises(GroupNotFound, match="'g'"):
        await admin.get_group(jetstream, ORDERS, "g")
    assert await jetstream.get_record(ELASTIC_BUCKET, "ORDERS.g") is None
    assert await jetstream.stream_info(WQ) is None
    assert await jetstream.stream_info(ORDERS) is not None
    assert await admin.list_groups(jetstream, ORDERS) == []
    with pytest.raises(GroupNotFound):
        await admin.delete_group(jetstream, ORDERS, "g")

    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(n=2))
    assert (await admin.get_group(jetstream, ORDERS, "g")).config.max_members == 2
    assert await jetstream.stream_info(WQ) is not None


async def test_delete_static_group_removes_its_consumers(jetstream: JetStream) -> None:
    """Deleting a static group removes its record and its members' consumers (<group>-*
    and their instances' data consumers) but no other consumer, not even those of a
    group whose name starts with the same prefix."""
    await origin(jetstream, "SENSORS", ["0.sensors.>", "1.sensors.>", "2.sensors.>"])
    for group in ("g", "g-x"):
        await admin.create_static_group(jetstream, "SENSORS", group,
                                        StaticGroupConfig(max_members=3, members=("m1",)))
    await sync_instance(jetstream, "SENSORS", "g-m1", "m1", "abc", [0])
    await jetstream.create_consumer("SENSORS", "g-m2", consumer_config(
        ["1.>"], {MEMBER_KEY: "m2"}))
    await sync_instance(jetstream, "SENSORS", "g-x-m1", "m1", "def", [2])
    await jetstream.create_consumer("SENSORS", "other", consumer_config(["2.>"], {}))
    assert await consumer_names(jetstream, "SENSORS") == {
        "g-m1", "m1-abc", "g-m2", "g-x-m1", "m1-def", "other"}

    await admin.delete_group(jetstream, "SENSORS", "g")
    with pytest.raises(GroupNotFound):
        await admin.get_group(jetstream, "SENSORS", "g")
    assert await jetstream.get_record(STATIC_BUCKET, "SENSORS.g") is None
    assert await consumer_names(jetstream, "SENSORS") == {"g-x-m1", "m1-def", "other"}
    assert (await admin.get_group(jetstream, "SENSORS", "g-x")).static


async def test_list_groups_of_one_stream(jetstream: JetStream) -> None:
    """list_groups returns the groups of that stream only, both kinds, sorted by name,
    and not those of a stream whose name merely starts the same."""
    await origin(jetstream)
    await origin(jetstream, "ORDERS2", ["orders2.>"])
    await admin.create_elastic_group(jetstream, ORDERS, "b", elastic())
    await admin.create_elastic_group(jetstream, ORDERS, "a", elastic())
    await admin.create_static_group(jetstream, ORDERS, "s", StaticGroupConfig(max_members=2))
    await admin.create_elastic_group(
        jetstream, "ORDERS2", "x", elastic(filters=[PartitioningFilter("orders2.*", (1,))]))
    await admin.create_static_group(jetstream, "ORDERS2", "y", StaticGroupConfig(max_members=2))
    assert await admin.list_groups(jetstream, ORDERS) == [
        ("a", "elastic"), ("b", "elastic"), ("s", "static")]
    assert await admin.list_groups(jetstream, "ORDERS2") == [("x", "elastic"), ("y", "static")]
    assert await admin.list_groups(jetstream, "OTHER") == []
    # A deleted group's key keeps its delete marker in the bucket: not a group.
    await admin.delete_group(jetstream, ORDERS, "b")
    assert await admin.list_groups(jetstream, ORDERS) == [("a", "elastic"), ("s", "static")]


async def test_get_group_on_fresh_server(jetstream: JetStream) -> None:
    """On a server where no group was ever created (no KV buckets), reads answer
    GroupNotFound / nothing rather than a bucket error."""
    for call in (admin.get_group, admin.delete_group, admin.group_status,
                 admin.group_consumers, admin.partition_pending):
        with pytest.raises(GroupNotFound):
            await call(jetstream, ORDERS, "g")
    with pytest.raises(GroupNotFound):
        await admin.add_members(jetstream, ORDERS, "g", ["m1"])
    assert await admin.list_groups(jetstream, ORDERS) == []


# -- membership ---------------------------------------------------------------------------


async def test_add_and_drop_members(jetstream: JetStream) -> None:
    """add_members appends new names in the given order and keeps existing ones once;
    drop_members removes names and ignores absent ones; repeating either is a no-op
    that writes nothing."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m1"]))
    config = await admin.add_members(jetstream, ORDERS, "g", ["m3", "m1", "m2", "m3"])
    assert config.members == ("m1", "m3", "m2")
    stored = await admin.get_group(jetstream, ORDERS, "g")
    assert stored.config.members == ("m1", "m3", "m2")
    await admin.add_members(jetstream, ORDERS, "g", ["m2", "m1"])
    assert (await admin.get_group(jetstream, ORDERS, "g")).revision == stored.revision

    config = await admin.drop_members(jetstream, ORDERS, "g", ["m3", "nobody"])
    assert config.members == ("m1", "m2")
    stored = await admin.get_group(jetstream, ORDERS, "g")
    assert stored.config.members == ("m1", "m2")
    await admin.drop_members(jetstream, ORDERS, "g", ["m3"])
    assert (await admin.get_group(jetstream, ORDERS, "g")).revision == stored.revision

    # Static groups take the same membership changes.
    await admin.create_static_group(jetstream, ORDERS, "s", StaticGroupConfig(max_members=2))
    await admin.add_members(jetstream, ORDERS, "s", ["b", "a"])
    assert (await admin.get_group(jetstream, ORDERS, "s")).config.members == ("b", "a")


@pytest.mark.parametrize("names", [[], [""], ["a.b"], ["a b"], ["ok", "a*"], ["x>"],
                                   ["slash/"], ["m" * 101], "m1"])
async def test_bad_member_names(jetstream: JetStream, names: Any) -> None:
    """Invalid member lists (empty, bad characters, too long, a bare string instead of a
    list) raise ConfigError naming the problem and leave the record untouched."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m1"]))
    before = await admin.get_group(jetstream, ORDERS, "g")
    for change in (admin.add_members, admin.drop_members):
        with pytest.raises(ConfigError, match="member"):
            await change(jetstream, ORDERS, "g", names)
    assert await admin.get_group(jetstream, ORDERS, "g") == before


async def test_concurrent_add_members_are_all_kept(jetstream: JetStream,
                                                   nats_server: NatsServer) -> None:
    """Ten concurrent add_members of different names, over two connections, all land: the
    compare-and-set update retries lost races instead of overwriting them, and every
    member was written exactly once (one revision per add)."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m0"]))
    start = (await admin.get_group(jetstream, ORDERS, "g")).revision
    other_nc = await nats.connect(servers=[nats_server.url], **client_options())
    try:
        other = JetStream(other_nc)
        names = [f"w{i}" for i in range(10)]
        await asyncio.gather(*(admin.add_members(jetstream if i % 2 else other,
                                                 ORDERS, "g", [n])
                               for i, n in enumerate(names)))
    finally:
        await other_nc.close()
    stored = await admin.get_group(jetstream, ORDERS, "g")
    assert sorted(stored.config.members) == sorted(["m0", *names])
    assert stored.config.members[0] == "m0"
    assert stored.revision == start + len(names)


async def test_mappings(jetstream: JetStream) -> None:
    """set_mappings replaces the member list with explicit partitions; invalid mappings
    raise ConfigError; while mapped, add/drop_members refuse and say to clear them;
    clear_mappings turns the mapped members back into the member list."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m1", "m2"]))
    mapped = [MemberMapping("a", (0, 3)), MemberMapping("b", (1, 2))]
    config = await admin.set_mappings(jetstream, ORDERS, "g", mapped)
    assert config.member_mappings == tuple(mapped) and config.members == ()
    stored = await admin.get_group(jetstream, ORDERS, "g")
    assert stored.config == config

    for bad, why in (([MemberMapping("a", (0, 1, 2, 4))], "outside 0..3"),
                     ([MemberMapping("a", (0, 1))], "not mapped"),
                     ([MemberMapping("a", (0, 1)), MemberMapping("b", (1, 2, 3))],
                      "mapped more than once"),
                     ([MemberMapping("a.b", (0, 1, 2, 3))], "must not contain")):
        with pytest.raises(ConfigError, match=why):
            await admin.set_mappings(jetstream, ORDERS, "g", bad)
    with pytest.raises(ConfigError, match="clear them"):
        await admin.add_members(jetstream, ORDERS, "g", ["c"])
    with pytest.raises(ConfigError, match="set_mappings"):
        await admin.drop_members(jetstream, ORDERS, "g", ["a"])
    assert await admin.get_group(jetstream, ORDERS, "g") == stored

    config = await admin.clear_mappings(jetstream, ORDERS, "g")
    assert config.members == ("a", "b") and config.member_mappings == ()
    assert (await admin.get_group(jetstream, ORDERS, "g")).config == config
    cleared = await admin.get_group(jetstream, ORDERS, "g")
    await admin.clear_mappings(jetstream, ORDERS, "g")  # nothing to clear: no write
    assert (await admin.get_group(jetstream, ORDERS, "g")).revision == cleared.revision
    assert (await admin.add_members(jetstream, ORDERS, "g", ["c"])).members == ("a", "b", "c")


# -- status -------------------------------------------------------------------------------


async def test_group_consumers_and_status(nc: Client, jetstream: JetStream) -> None:
    """With m1 active by hand (sync consumer m1 on sync.<p>.> and data consumer m1-abc on
    <p>.>), consumers read back with their role, partitions and instance; m1's partitions
    are owned by instance abc, m2's have no data consumer so they are unowned and m2 is
    reported as the member without an instance; pending counts per partition."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m1", "m2"]))
    await sync_instance(jetstream, WQ, "m1", "m1", "abc", [0, 1])
    await publish(nc, ["orders.1", "orders.17", "orders.0", "orders.0"])
    await wq_subjects(jetstream, WQ, 4)

    views = await admin.group_consumers(jetstream, ORDERS, "g")
    assert [(v.name, v.role, v.member, v.instance, v.partitions) for v in views] == [
        ("m1", "sync", "m1", "abc", (0, 1)),
        ("m1-abc", "data", "m1", "abc", (0, 1)),
    ]
    data = views[1]
    assert data.num_pending == 2 and data.num_ack_pending == 0 and data.pinned_id is None

    status = await admin.group_status(jetstream, ORDERS, "g")
    assert [(p.partition, p.member, p.instance, p.pending) for p in status.partitions] == [
        (0, "m1", "abc", 1), (1, "m1", "abc", 1), (2, "m2", None, 0), (3, "m2", None, 2)]
    assert status.unowned_partitions == [2, 3]
    assert status.members_without_instance == ["m2"]
    assert status.consumers == views and status.group.config.members == ("m1", "m2")


async def test_sync_consumer_alone_does_not_own(jetstream: JetStream) -> None:
    """A sync consumer without its data consumer (an instance mid-election) owns nothing:
    its partitions are still reported unowned."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m1"]))
    await jetstream.create_consumer(WQ, "m1", consumer_config(
        ["sync.0.>", "sync.1.>", "sync.2.>", "sync.3.>"],
        {MEMBER_KEY: "m1", INSTANCE_KEY: "abc"}))
    status = await admin.group_status(jetstream, ORDERS, "g")
    assert status.unowned_partitions == [0, 1, 2, 3]
    assert status.members_without_instance == ["m1"]


async def test_static_group_status(nc: Client, jetstream: JetStream) -> None:
    """On a static group the consumers live on the origin stream: <group>-<member> sync
    consumers and their instances' data consumers count, other groups' consumers do not;
    pending counts the origin's messages per leading partition token."""
    await origin(jetstream, "SENSORS", ["0.sensors.>", "1.sensors.>"])
    await admin.create_static_group(jetstream, "SENSORS", "g",
                                    StaticGroupConfig(max_members=2, members=("m1", "m2")))
    await sync_instance(jetstream, "SENSORS", "g-m1", "m1", "abc", [0])
    await jetstream.create_consumer("SENSORS", "unrelated", consumer_config(["1.>"], {}))
    await publish(nc, ["0.sensors.a", "1.sensors.b", "1.sensors.c"])

    views = await admin.group_consumers(jetstream, "SENSORS", "g")
    assert [(v.name, v.role, v.instance, v.partitions) for v in views] == [
        ("g-m1", "sync", "abc", (0,)), ("m1-abc", "data", "abc", (0,))]
    status = await admin.group_status(jetstream, "SENSORS", "g")
    assert [(p.partition, p.member, p.instance, p.pending) for p in status.partitions] == [
        (0, "m1", "abc", 1), (1, "m2", None, 2)]
    assert status.unowned_partitions == [1]
    assert status.members_without_instance == ["m2"]
    assert await admin.partition_pending(jetstream, "SENSORS", "g") == {0: 1, 1: 2}


async def test_partition_pending(nc: Client, jetstream: JetStream) -> None:
    """partition_pending counts the messages waiting in each partition of the work-queue
    stream, zero for partitions with none, and drops as messages are acknowledged."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    assert await admin.partition_pending(jetstream, ORDERS, "g") == {0: 0, 1: 0, 2: 0, 3: 0}
    await publish(nc, ["orders.1", "orders.1", "orders.17", "orders.0", "orders.0", "orders.0"])
    await wq_subjects(jetstream, WQ, 6)
    assert await admin.partition_pending(jetstream, ORDERS, "g") == {0: 2, 1: 1, 2: 0, 3: 3}

    # Consume partition 3 (work queue: acked messages are removed).
    sub = await nc.jetstream().pull_subscribe("3.>", durable="p3", stream=WQ)
    for msg in await sub.fetch(3, timeout=5):
        await msg.ack_sync()
    assert await admin.partition_pending(jetstream, ORDERS, "g") == {0: 2, 1: 1, 2: 0, 3: 0}


async def test_partition_pending_without_work_queue_stream(jetstream: JetStream) -> None:
    """If an elastic group's work-queue stream was deleted behind its back, status calls
    raise cgroupd's StreamNotFound, never a nats-py exception."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    await jetstream.delete_stream(WQ)
    for call in (admin.partition_pending, admin.group_status):
        with pytest.raises(StreamNotFound):
            await call(jetstream, ORDERS, "g")


async def test_step_down_sync_mode(jetstream: JetStream) -> None:
    """step_down deletes the member's sync consumer (the ADR's step-down) and returns True;
    for a member with no active instance it returns False and deletes nothing."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
    await sync_instance(jetstream, WQ, "m1", "m1", "abc", [0, 1])
    assert await admin.step_down(jetstream, ORDERS, "g", "m1") is True
    assert await jetstream.consumer_info(WQ, "m1") is None
    assert await consumer_names(jetstream, WQ) == {"m1-abc"}  # the instance drains it
    assert await admin.step_down(jetstream, ORDERS, "g", "m1") is False
    assert await admin.step_down(jetstream, ORDERS, "g", "m2") is False
    assert await consumer_names(jetstream, WQ) == {"m1-abc"}


async def test_step_down_static_group(jetstream: JetStream) -> None:
    """On a static group the sync consumer step_down deletes is <group>-<member>."""
    await origin(jetstream, "SENSORS", ["0.sensors.>", "1.sensors.>"])
    await admin.create_static_group(jetstream, "SENSORS", "g",
                                    StaticGroupConfig(max_members=2, members=("m1", "m2")))
    await sync_instance(jetstream, "SENSORS", "g-m1", "m1", "abc", [0])
    assert await admin.step_down(jetstream, "SENSORS", "g", "m2") is False
    assert await admin.step_down(jetstream, "SENSORS", "g", "m1") is True
    assert await consumer_names(jetstream, "SENSORS") == {"m1-abc"}


async def test_pinned_mode_status_and_step_down(nc: Client, jetstream: JetStream) -> None:
    """A pinned-client consumer owns its partitions only while the server has pinned a
    client: status reports the pin id as the instance. step_down asks the holder (which
    then steps down itself) and unpins only when nobody answers: the partitions become
    unowned again."""
    await origin(jetstream)
    await admin.create_elastic_group(jetstream, ORDERS, "g", elastic(members=["m1", "m2"]))
    await jetstream.create_consumer(WQ, "m2", consumer_config(
        ["2.>", "3.>"], {MEMBER_KEY: "m2"}, priority_groups=[PRIORITY_GROUP],
        priority_policy="pinned_client", priority_timeout=int(60e9)))
    status = await admin.group_status(jetstream, ORDERS, "g")
    assert [v.role for v in status.consumers] == ["pinned"]
    assert status.unowned_partitions == [0, 1, 2, 3]

    await publish(nc, ["orders.0"])  # partition 3
    await wq_subjects(jetstream, WQ, 1)
    pull = {"batch": 1, "expires": int(5e9), "group": PRIORITY_GROUP}
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{WQ}.m2", json.dumps(pull).encode(),
                     reply=inbox)
    msg = await sub.next_msg(timeout=5)
    await sub.unsubscribe()
    pin = (msg.headers or {}).get("Nats-Pin-Id")
    assert pin and msg.subject == "3.orders.0"

    status = await admin.group_status(jetstream, ORDERS, "g")
    view = status.consumers[0]
    assert (view.role, view.member, view.instance, view.pinned_id, view.partitions) == (
        "pinned", "m2", pin, pin, (2, 3))
    assert status.unowned_partitions == [0, 1]
    assert status.members_without_instance == ["m1"]

    # The holder answers the request naming its pin: it steps down itself (after its
    # running handlers), so the pin is not cleared under it.
    subject = step_down_subject(group_key(ORDERS, "g"), "m2")
    asked: list[bytes] = []

    async def holder(request: Any) -> None:
        asked.append(request.data)
        await request.respond(b"abc stepping-down")

    answering = await nc.subscribe(subject, cb=holder)
    assert await admin.step_down(jetstream, ORDERS, "g", "m2") is True
    await answering.unsubscribe()
    assert asked == [pin.encode()]
    assert (await admin.group_status(jetstream, ORDERS, "g")).consumers[0].pinned_id == pin

    # A holder that hears but does not answer (frozen, or another implementation's): the
    # pin is cleared once the answer is overdue.
    frozen = await nc.subscribe(subject)
    began = time.monotonic()
    assert await admin.step_down(jetstream, ORDERS, "g", "m2") is True
    assert time.monotonic() - began >= STEP_DOWN_ANSWER * 0.9
    await frozen.unsubscribe()
    status = await admin.group_status(jetstream, ORDERS, "g")
    assert status.consumers[0].pinned_id is None
    assert status.unowned_partitions == [0, 1, 2, 3]
    assert await consumer_names(jetstream, WQ) == {"m2"}  # unpinned, not deleted
    # Nobody pinned (and nobody listening): nothing to ask, the unpin is a no-op.
    assert await admin.step_down(jetstream, ORDERS, "g", "m2") is True


# -- errors from the server ---------------------------------------------------------------


async def test_server_without_jetstream(tmp_path: Path) -> None:
    """Against a server with JetStream disabled (no responder on $JS.API.>) every admin
    call raises JetStreamNotEnabled, without waiting for a timeout."""
    async with server(tmp_path, "nojs", "jetstream: disabled") as srv:
        client = await nats.connect(servers=[srv.url], **client_options())
        try:
            js = JetStream(client)
            with pytest.raises(JetStreamNotEnabled):
                await admin.create_elastic_group(js, ORDERS, "g", elastic())
            with pytest.raises(JetStreamNotEnabled):
                await admin.get_group(js, ORDERS, "g")
        finally:
            await client.close()


async def test_account_without_jetstream(tmp_path: Path) -> None:
    """A user of an account without JetStream gets the server's 503/10039 answer as
    JetStreamNotEnabled."""
    accounts = ("accounts { JS: { jetstream: enabled, users: [{user: a, password: a}] }\n"
                "  PLAIN: { users: [{user: p, password: p}] } }")
    async with server(tmp_path, "acct", accounts) as srv:
        client = await nats.connect(servers=[srv.url], user="p", password="p",
                                    **client_options())
        try:
            js = JetStream(client)
            with pytest.raises(JetStreamNotEnabled, match="not enabled for account"):
                await admin.get_group(js, ORDERS, "g")
        finally:
            await client.close()


async def test_permission_denied_is_reported_as_such(tmp_path: Path) -> None:
    """A publish-permission violation on a $JS.API subject gets no API reply: the server
    sends an async -ERR 'Permissions Violation' (seen by the error callback) and the
    request times out; the adapter ties the two and raises PermissionDenied, while the
    application's own error callback still sees the violation. Checked for a user denied
    $JS.API.STREAM.CREATE.> (fails creating the KV bucket) and one allowed only _INBOX.>
    and $JS.API.INFO (fails at the first stream lookup)."""
    auth = """authorization { users = [
      {user: admin, password: a}
      {user: nocreate, password: n,
       permissions: {publish: {deny: ["$JS.API.STREAM.CREATE.>"]}}}
      {user: inbox, password: i, permissions: {publish: {allow: ["_INBOX.>", "$JS.API.INFO"]}}}
    ] }"""
    async with server(tmp_path, "perm", auth) as srv:
        admin_nc = await nats.connect(servers=[srv.url], user="admin", password="a",
                                      **client_options())
        try:
            await origin(JetStream(admin_nc))
        finally:
            await admin_nc.close()
        for user, password, denied in (("nocreate", "n", "$js.api.stream.create.kv_"),
                                       ("inbox", "i", "$js.api.stream.info.orders")):
            errors: list[Exception] = []

            async def on_error(exc: Exception, errors: list[Exception] = errors) -> None:
                errors.append(exc)

            client = await nats.connect(servers=[srv.url], user=user, password=password,
                                        error_cb=on_error, **client_options())
            try:
                js = JetStream(client, timeout=0.5)
                with pytest.raises(PermissionDenied, match="ermissions violation"):
                    await admin.create_elastic_group(js, ORDERS, "g", elastic())
                await eventually(errors.copy, what="a permissions violation error")
                assert "permissions violation" in str(errors[0]).lower()
                assert denied in str(errors[0]).lower()
            finally:
                await client.close()


# -- cluster ------------------------------------------------------------------------------


async def test_r3_group_on_cluster(nats_cluster: NatsCluster) -> None:
    """On a 3-node cluster an R3 origin gives an R3 work-queue stream (and an R3 record
    bucket), and messages published to the origin flow into it partitioned."""
    client = await nats.connect(servers=nats_cluster.urls, **client_options())
    try:
        js = JetStream(client, timeout=10)
        await make_group(js, partitions=4, members=("m1", "m2"), replicas=3)
        info = await js.stream_info(WQ)
        assert info is not None and info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        bucket = await js.stream_info(f"KV_{ELASTIC_BUCKET}")
        assert bucket is not None and bucket.config.num_replicas == 3
        await publish(client, [f"orders.{k}" for k in KNOWN_4])
        got = await wq_subjects(js, WQ, len(KNOWN_4))
        assert got == [f"{p}.orders.{k}" for k, p in KNOWN_4.items()]
        assert await admin.partition_pending(js, ORDERS, "g") == {0: 1, 1: 1, 2: 0, 3: 1}
    finally:
        await client.close()


async def test_a_foreign_stream_named_like_the_work_queue_is_refused(
        jetstream: JetStream) -> None:
    """create refuses to adopt an unrelated stream that happens to be called
    <stream>-<group> instead of silently consuming from it."""
    await origin(jetstream)
    await jetstream.add_stream(api.StreamConfig(name=f"{ORDERS}-g", subjects=["other.>"]))
    with pytest.raises(GroupExists, match="not this group's work-queue stream"):
        await admin.create_elastic_group(jetstream, ORDERS, "g", elastic())
