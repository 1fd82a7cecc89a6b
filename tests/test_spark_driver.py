"""The source's driver side against a real nats-server, without Spark: starting offsets,
latest offsets, rate caps, commits, and the groups it refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from nats.js import api

from cgroupd import admin
from cgroupd.config import StaticGroupConfig
from cgroupd.errors import ConfigError, GroupNotFound
from cgroupd.jetstream import JetStream
from cgroupd.spark.driver import DriverSession
from cgroupd.spark.offsets import Range
from cgroupd.spark.options import SourceOptions
from cgroupd.spark.source import GroupPartitions, read_partitions
from tests.groups import make_group, publish_keyed
from tests.natsserver import NatsServer
from tests.spark_support import wait_sourced

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


def _options(server: NatsServer, **extra: str) -> SourceOptions:
    return SourceOptions.parse({"servers": server.url, "stream": "ORDERS", "group": "g",
                                "leaseInactiveThreshold": "0.5", "leaseWaitTimeout": "1",
                                **extra})


@pytest.fixture
async def session(nats_server: NatsServer, jetstream: JetStream) -> AsyncIterator[DriverSession]:
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    await publish_keyed(jetstream, 400, keys=32)
    await wait_sourced(jetstream, WQ, 400)
    s = DriverSession(_options(nats_server))
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def _sequences(server: NatsServer, p: int, start: int, end: int) -> list[int]:
    """What an executor reads for partition p in (start, end] (it runs its own loop, so
    in a thread here)."""
    task = GroupPartitions(WQ, (Range(p, start, end),), ())

    def read() -> list[int]:
        return [seq for batch in read_partitions(_options(server, fetchBatch="7"), task)
                for seq in batch.column("stream_sequence").to_pylist()]

    return await asyncio.to_thread(read)


async def test_starting_offsets_and_latest(session: DriverSession, nats_server: NatsServer,
                                           jetstream: JetStream) -> None:
    """earliest is 0 everywhere; latest is each partition's last sequence, and the
    executor's read of (0, latest] is every message of the partition."""
    assert await session.initial() == {0: 0, 1: 0, 2: 0, 3: 0}
    latest = await session.latest()
    pending = await admin.partition_pending(jetstream, "ORDERS", "g")
    for p in range(4):
        seqs = await _sequences(nats_server, p, 0, latest[p])
        assert len(seqs) == pending[p] and seqs[-1] == latest[p]
    assert await session.latest({0: 10_000}) == {**latest, 0: 10_000}  # never backwards


async def test_cap_splits_the_limit_and_cuts_exactly(session: DriverSession,
                                                     nats_server: NatsServer) -> None:
    """The capped end holds exactly the limit, shared by backlog, cut at messages."""
    start = {0: 0, 1: 0, 2: 0, 3: 0}
    latest = await session.latest()
    end = await session.cap(start, latest, 101)
    counts = {p: await session.count(p, start[p], end[p]) for p in range(4)}
    assert sum(counts.values()) == 101
    for p in range(4):
        seqs = await _sequences(nats_server, p, 0, latest[p])
        assert end[p] in seqs
        assert counts[p] == seqs.index(end[p]) + 1
    assert await session.cap(start, latest, 10_000) == latest


async def test_commit_purges_below_end_only_and_is_idempotent(
        session: DriverSession, jetstream: JetStream, nats_server: NatsServer) -> None:
    """commit(end) leaves exactly the messages after end; repeating it changes nothing."""
    latest = await session.latest()
    end = await session.cap({p: 0 for p in range(4)}, latest, 200)
    await session.commit(end)
    await session.commit(end)
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.state.messages == 200
    for p in range(4):
        assert (await _sequences(nats_server, p, 0, latest[p]))[0] > end[p]


async def test_latest_starting_offsets_and_member_partitions(
        session: DriverSession, nats_server: NatsServer) -> None:
    """startingOffsets=latest starts after what is queued; member=m2 reads m2's half
    (and takes m2's lease while m1's stays free)."""
    await session.close()
    late = DriverSession(_options(nats_server, startingOffsets="latest", member="m2"))
    await late.open()
    try:
        assert late.partitions == (2, 3)
        assert await late.initial() == await late.latest()
        assert [c.consumer for c in late.lease.claims] == ["m2"]  # type: ignore[union-attr]
    finally:
        await late.close()


async def test_refusals(nats_server: NatsServer, jetstream: JetStream) -> None:
    """A missing group, a member without partitions and a static group are refused
    before anything is held."""
    with pytest.raises(GroupNotFound):
        await DriverSession(_options(nats_server)).open()
    await make_group(jetstream, partitions=2, members=("m1",))
    with pytest.raises(ConfigError, match="member 'zz' owns no partitions"):
        await DriverSession(_options(nats_server, member="zz")).open()
    await jetstream.add_stream(api.StreamConfig(name="ST", subjects=["st.>"]))
    await admin.create_static_group(jetstream, "ST", "s", StaticGroupConfig(max_members=2))
    with pytest.raises(ConfigError, match="static group"):
        await DriverSession(SourceOptions.parse(
            {"servers": nats_server.url, "stream": "ST", "group": "s"})).open()
    assert await jetstream.consumer_info(WQ, "m1") is None
