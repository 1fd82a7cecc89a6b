"""The source's driver side against a real nats-server, without Spark: latest offsets,
rate caps, work-queue purges, member partitions, and the groups it refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from nats.js import api

from cgroupd import admin
from cgroupd.core.config import StaticGroupConfig
from cgroupd.core.errors import ConfigError, GroupNotFound
from cgroupd.nats.jetstream import JetStream
from cgroupd.spark.driver import DriverSession
from cgroupd.spark.offsets import READ_SUBJECT, Offset, ReadRange
from cgroupd.spark.options import SourceOptions
from cgroupd.spark.source import ReadTask, close_executor_connections, read_task
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.spark_support import make_group, wait_sourced

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


def _options(server: NatsServer, **extra: str) -> SourceOptions:
    return SourceOptions.parse({"servers": server.url, "stream": "ORDERS", "group": "g",
                                "leaseInactiveThreshold": "0.5", "leaseWaitTimeout": "1",
                                **extra})


@pytest.fixture(autouse=True)
def _executor_connections() -> Iterator[None]:
    yield
    close_executor_connections()


@pytest.fixture
async def session(nats_server: NatsServer, jetstream: JetStream) -> AsyncIterator[DriverSession]:
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    await publish_keyed(jetstream, 400, keys=32)
    await wait_sourced(jetstream, WQ, 400)
    s = DriverSession(_options(nats_server, mode="workqueue"))
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def _rows(server: NatsServer, session: DriverSession, start: Offset,
                end: Offset) -> list[dict[str, object]]:
    """What the executors read for the batch (start, end] (they run their own loop, so
    in a thread here)."""
    layout = session.plan_layout
    bounds = tuple((p, start.partitions[p], end.partitions[p]) for p in layout.partitions)
    task = ReadTask(layout, ReadRange(READ_SUBJECT, min(start.partitions.values()),
                                      end.position), bounds)
    options = _options(server, mode="workqueue", fetchBatch="7")

    def read() -> list[dict[str, object]]:
        return [row for batch in read_task(options, task) for row in batch.to_pylist()]

    return await asyncio.to_thread(read)


async def test_latest_is_the_queue_and_never_goes_backwards(
        session: DriverSession, nats_server: NatsServer, jetstream: JetStream) -> None:
    """From earliest, the latest offset covers every queued message of every partition;
    a start beyond the stream's end is never moved back; nothing new is the very same
    offset (Spark compares offsets as text)."""
    start = await session.initial()
    latest = await session.latest(start)
    rows = await _rows(nats_server, session, start.plain(), latest)
    pending = await admin.partition_pending(jetstream, "ORDERS", "g")
    for p in range(4):
        assert sum(r["partition"] == p for r in rows) == pending[p]
    assert sorted(r["stream_sequence"] for r in rows) == list(range(1, 401))  # type: ignore[type-var]
    ahead = Offset(latest.stream, latest.created, 10_000, {p: 10_000 for p in range(4)})
    assert await session.latest(ahead) is ahead


async def test_cap_cuts_exactly_at_the_limit(session: DriverSession,
                                             nats_server: NatsServer) -> None:
    """A capped batch holds exactly the limit, the oldest messages first, and the rest
    follows in the next batch without a gap."""
    start = (await session.initial()).plain()
    latest = await session.latest(start)
    end = await session.cap(start, latest, 101)
    first = await _rows(nats_server, session, start, end)
    assert sorted(r["stream_sequence"] for r in first) == list(range(1, 102))  # type: ignore[type-var]
    rest = await _rows(nats_server, session, end, latest)
    assert sorted(r["stream_sequence"] for r in rest) == list(range(102, 401))  # type: ignore[type-var]
    assert await session.cap(start, latest, 10_000) == latest


async def test_purge_removes_below_the_committed_end_only_and_is_idempotent(
        session: DriverSession, jetstream: JetStream, nats_server: NatsServer) -> None:
    """Work-queue mode purges what Spark committed, exactly: what lies after the end
    stays, and repeating the purge changes nothing."""
    start = (await session.initial()).plain()
    end = await session.cap(start, await session.latest(start), 200)
    await session.purge_below(end)
    await session.purge_below(end)
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.state.messages == 200 and info.state.first_seq == 201


async def test_member_partitions_and_lease(nats_server: NatsServer,
                                           jetstream: JetStream) -> None:
    """member=m2 reads m2's half and holds m2's lease alone; startingOffsets=latest in
    workqueue mode is refused (it would leave queued messages for a purge)."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    late = DriverSession(_options(nats_server, mode="workqueue", member="m2"))
    await late.open()
    try:
        assert late.plan_layout.partitions == (2, 3)
        assert late.lease is not None
        assert [c.consumer for c in late.lease.claims] == ["m2"]
        assert await jetstream.consumer_info(WQ, "m1") is None
    finally:
        await late.close()
    with pytest.raises(ConfigError, match="startingOffsets other than 'earliest'"):
        _options(nats_server, mode="workqueue", startingOffsets="latest")


async def test_refusals(nats_server: NatsServer, jetstream: JetStream) -> None:
    """A missing group, a member without partitions, a static group in workqueue mode
    and a stream without direct get are refused before anything is held."""
    await jetstream.add_stream(api.StreamConfig(name="ORDERS", subjects=["orders.>"],
                                                allow_direct=True))
    with pytest.raises(GroupNotFound):
        await DriverSession(_options(nats_server)).open()
    await jetstream.delete_stream("ORDERS")
    await make_group(jetstream, partitions=2, members=("m1",))
    with pytest.raises(ConfigError, match="member 'zz' owns no partitions"):
        await DriverSession(_options(nats_server, member="zz")).open()
    await jetstream.add_stream(api.StreamConfig(name="ST", subjects=["st.>"]))
    await admin.create_static_group(jetstream, "ST", "s", StaticGroupConfig(max_members=2))
    with pytest.raises(ConfigError, match="static group"):
        await DriverSession(SourceOptions.parse(
            {"servers": nats_server.url, "stream": "ST", "group": "s",
             "mode": "workqueue"})).open()
    with pytest.raises(ConfigError, match="does not allow direct get"):
        await DriverSession(SourceOptions.parse(
            {"servers": nats_server.url, "stream": "ST", "group": "s"})).open()
    assert await jetstream.consumer_info(WQ, "m1") is None
