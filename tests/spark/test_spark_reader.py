"""The source's reader against a real nats-server, driven as Spark drives it but without
a JVM (:class:`tests.support.spark_support.ManualQuery`: the same ``initialOffset``,
``latestOffset``, ``partitions``, ``read`` and ``commit`` calls, in this process).

Fast enough to attack every offset rule and every input one by one; the Spark tests
(``test_spark_source``) check the whole chain end to end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
import pytest_asyncio

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from nats.aio.client import Client
from nats.js import api
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from cgroupd import admin
from cgroupd.core.config import MemberMapping, StaticGroupConfig
from cgroupd.core.errors import ConfigError, DataLoss
from cgroupd.nats.jetstream import JetStream
from cgroupd.spark.offsets import Offset
from cgroupd.spark.source import close_executor_connections
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsCluster, NatsServer, client_options
from tests.support.polling import eventually
from tests.support.spark_support import (
    ManualQuery,
    check_rows,
    make_group,
    publish_hostile,
    wait_sourced,
)

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


@pytest_asyncio.fixture
async def hostile_nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_server.url, **client_options())
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture(autouse=True)
def _executor_connections() -> Iterator[None]:
    """Tasks keep a connection per server set in this process (as Spark's Python workers
    do); each test's server goes away with it."""
    yield
    close_executor_connections()


def _query(server: NatsServer, **options: object) -> ManualQuery:
    return ManualQuery(servers=server.url, stream="ORDERS", group="g",
                       leaseInactiveThreshold="1", idleWait="0.05", **options)


async def _drain(query: ManualQuery, **kwargs: object) -> list[dict[str, object]]:
    try:
        return await asyncio.to_thread(query.drain, **kwargs)  # type: ignore[arg-type]
    finally:
        await asyncio.to_thread(query.close)


async def test_hostile_messages_are_read_exactly_once_in_both_modes(
        nats_server: NatsServer, jetstream: JetStream, hostile_nc: Client) -> None:
    """Headers that look like server statuses (Status 100/404/408/409/423/503 with a
    Description, a raw status line), reserved names (Nats-Pin-Id, Nats-Pending-Messages,
    Nats-Sequence and the rest of the direct-get trailer), empty, binary and 1 MB
    payloads, long and unicode subjects: every message comes back exactly once, intact,
    with its own headers only, from the origin (read mode) and from the work queue; and
    the work queue is empty only once everything was read."""
    await jetstream.add_stream(api.StreamConfig(name="H", subjects=["h.>"], allow_direct=True))
    from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter

    await admin.create_elastic_group(jetstream, "H", "g", ElasticGroupConfig(
        max_members=4, members=("m1",),
        partitioning_filters=(PartitioningFilter("h.*.>", (1,)),)))
    sent = await publish_hostile(hostile_nc, "h", 300)
    await wait_sourced(jetstream, "H-g", len(sent))

    read = ManualQuery(servers=nats_server.url, stream="H", group="g", includeHeaders="true",
                       idleWait="0.05", fetchBatch="64")
    rows = await _drain(read)
    check_rows(rows, sent)

    queue = ManualQuery(servers=nats_server.url, stream="H", group="g", mode="workqueue",
                        includeHeaders="true", leaseInactiveThreshold="1", idleWait="0.05",
                        fetchBatch="64")
    try:
        rows_wq = await asyncio.to_thread(queue.drain)
        check_rows(rows_wq, sent, sequence="origin_sequence")
        # Both modes put each message in the partition the server's transform chose.
        assert {r["stream_sequence"]: r["partition"] for r in rows} == {
            r["origin_sequence"]: r["partition"] for r in rows_wq}
        # Spark asks for the latest offset after committing the last batch: purged now.
        assert await asyncio.to_thread(queue.step) is None
        info = await jetstream.stream_info("H-g")
        assert info is not None and info.state.messages == 0
    finally:
        await asyncio.to_thread(queue.close)


async def test_hash_partitions_match_the_servers_transform(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Read mode computes each message's partition (FNV-1a of the key tokens, modulo
    the partition count); the work-queue stream holds the server's own answer in the
    subject: they agree for keys of every shape, over two partitioning wildcards."""
    from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter

    await jetstream.add_stream(api.StreamConfig(name="T", subjects=["t.>"], allow_direct=True))
    await admin.create_elastic_group(jetstream, "T", "g", ElasticGroupConfig(
        max_members=7, members=("m1",),
        partitioning_filters=(PartitioningFilter("t.*.*.x", (2, 1)),
                              PartitioningFilter("t.one.>", ()))))
    keys = ["a", "ab", "b.c", "ключ", "日本", "0", "-1", "x" * 200, "a b"[:1], "Z"]
    count = 0
    for i, k in enumerate(keys * 3):
        first = k.split(".")[0]
        await jetstream.publish(f"t.{first}.{i % 5}.x", b"")
        await jetstream.publish(f"t.one.{first}.{i}", b"")
        count += 2
    await jetstream.publish("t.nogroup", b"")  # matches no filter: in neither
    await wait_sourced(jetstream, "T-g", count)
    read = await _drain(ManualQuery(servers=nats_server.url, stream="T", group="g",
                                    idleWait="0.05"))
    queue = await _drain(ManualQuery(servers=nats_server.url, stream="T", group="g",
                                     mode="workqueue", leaseInactiveThreshold="1",
                                     idleWait="0.05"))
    assert len(read) == len(queue) == count
    assert {r["stream_sequence"]: r["partition"] for r in read} == {
        r["origin_sequence"]: r["partition"] for r in queue}
    assert len({r["partition"] for r in read}) > 3


async def test_static_group_and_plain_stream(nats_server: NatsServer,
                                             jetstream: JetStream) -> None:
    """A static group's stream (subjects already start with the partition) is read per
    partition, its filters applied; a stream without a group is one partition, with an
    optional subject filter; ``member`` keeps that member's partitions only."""
    await jetstream.add_stream(api.StreamConfig(name="ST", subjects=[
        "0.st.>", "1.st.>", "2.st.>"], allow_direct=True))
    await admin.create_static_group(jetstream, "ST", "s", StaticGroupConfig(
        max_members=3, member_mappings=(MemberMapping("a", (0,)), MemberMapping("b", (1, 2))),
        filters=("st.*.in",)))
    for i in range(30):
        await jetstream.publish(f"{i % 3}.st.k{i}.in", f"{i}".encode())
    await jetstream.publish("1.st.k.out", b"not the group's")
    rows = await _drain(ManualQuery(servers=nats_server.url, stream="ST", group="s",
                                    idleWait="0.05"))
    assert sorted(int(r["data"]) for r in rows) == list(range(30))
    assert all(r["partition"] == int(r["data"]) % 3 for r in rows)
    assert all(r["subject"] == f"st.k{int(r['data'])}.in" for r in rows)
    rows_b = await _drain(ManualQuery(servers=nats_server.url, stream="ST", group="s",
                                      member="b", idleWait="0.05"))
    assert sorted({r["partition"] for r in rows_b}) == [1, 2] and len(rows_b) == 20

    plain = await _drain(ManualQuery(servers=nats_server.url, stream="ST", idleWait="0.05"))
    assert len(plain) == 31 and {r["partition"] for r in plain} == {0}
    only = await _drain(ManualQuery(servers=nats_server.url, stream="ST",
                                    subject="*.st.*.out", idleWait="0.05"))
    assert [r["data"] for r in only] == [b"not the group's"]
    with ManualQuery(servers=nats_server.url, stream="ST", group="s",
                     mode="workqueue") as static, pytest.raises(ConfigError, match="static group"):
        static.reader.initialOffset()


async def test_starting_offsets_follow_kafkas_meaning(nats_server: NatsServer,
                                                      jetstream: JetStream) -> None:
    """JSON gives the first sequence to read (Kafka's meaning), -2 earliest, -1 latest,
    also in Kafka's nested form; ``latest`` skips what is there; ``startingTimestamp``
    starts at the first message stored at or after it."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 40, keys=4)
    await asyncio.sleep(0.05)
    middle = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    await publish_keyed(jetstream, 20, keys=4, start=40)

    def numbers(rows: list[dict[str, object]]) -> list[int]:
        return sorted(json.loads(r["data"])["n"] for r in rows)  # type: ignore[arg-type]

    everything = await _drain(_query(nats_server))
    rows = await _drain(_query(nats_server, startingOffsets='{"0": 11, "1": -2}'))
    want = sorted(r["stream_sequence"] for r in everything  # type: ignore[type-var]
                  if r["partition"] == 1 or r["stream_sequence"] >= 11)  # type: ignore[operator]
    assert sorted(r["stream_sequence"] for r in rows) == want  # type: ignore[type-var]
    assert any(r["stream_sequence"] == 11 and r["partition"] == 0 for r in everything), \
        "sequence 11 is in partition 0, so the test checks the first one read"
    nested = await _drain(_query(nats_server, startingOffsets='{"ORDERS": {"0": -1, "1": -1}}'))
    assert nested == []
    assert await _drain(_query(nats_server, startingOffsets="latest")) == []
    late = await _drain(_query(nats_server, startingTimestamp=str(middle)))
    assert numbers(late) == list(range(40, 60))
    with _query(nats_server, startingOffsets='{"0": 3}') as partial, \
            pytest.raises(ConfigError, match="every partition"):
        partial.reader.initialOffset()


async def test_batch_zero_replayed_reads_the_range_it_was_planned_with(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Spark asks initialOffset again when batch 0 is replayed after a failure; with
    ``latest`` that is a later position, which used to skip batch 0's messages. The
    replay reads exactly what batch 0 held."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 30, keys=4)  # skipped: the query starts at latest
    query = _query(nats_server, startingOffsets="latest")
    try:
        start = await asyncio.to_thread(query.reader.initialOffset)
        await publish_keyed(jetstream, 20, keys=4, start=30)  # batch 0
        end = await asyncio.to_thread(query.reader.latestOffset, start, ReadAllAvailable())
        await publish_keyed(jetstream, 25, keys=4, start=50)  # after batch 0
        # The batch fails; on restart Spark calls initialOffset() again, then partitions.
        again = await asyncio.to_thread(query.reader.initialOffset)
        assert again != start
        rows = await asyncio.to_thread(query.read, again, end)
        assert sorted(json.loads(r["data"])["n"] for r in rows) == list(range(30, 50))
    finally:
        await asyncio.to_thread(query.close)


async def test_max_offsets_per_trigger_caps_batches(nats_server: NatsServer,
                                                    jetstream: JetStream) -> None:
    """``maxOffsetsPerTrigger`` (and its old name) bounds every batch; together they
    read everything once."""
    await make_group(jetstream, partitions=4, members=("m1",))
    await publish_keyed(jetstream, 230, keys=16)
    query = _query(nats_server, maxOffsetsPerTrigger=60)
    sizes = []
    rows: list[dict[str, object]] = []
    try:
        while (batch := await asyncio.to_thread(query.step, ReadMaxRows(60))) is not None:
            sizes.append(len(batch))
            rows.extend(batch)
    finally:
        await asyncio.to_thread(query.close)
    assert sizes[0] == 0 or sizes[0] <= 60  # batch 0 may be empty (Spark runs it anyway)
    assert [s for s in sizes if s] == [60, 60, 60, 50]
    assert sorted(json.loads(r["data"])["n"] for r in rows) == list(range(230))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not both"):
        _query(nats_server, maxOffsetsPerTrigger=5, maxMessagesPerTrigger=6)


async def test_min_offsets_per_trigger_waits_for_enough_or_the_delay(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Fewer than ``minOffsetsPerTrigger`` messages make no batch until
    ``maxTriggerDelay`` has passed since the last one; enough make one at once."""
    await make_group(jetstream, partitions=2, members=("m1",))
    query = _query(nats_server, minOffsetsPerTrigger=50, maxTriggerDelay="1500ms")
    try:
        assert await asyncio.to_thread(query.step) == []  # batch 0 always runs
        await publish_keyed(jetstream, 10, keys=4)
        began = time.monotonic()
        assert await asyncio.to_thread(query.step) is None
        rows = None
        while rows is None:
            rows = await asyncio.to_thread(query.step)
            assert time.monotonic() - began < 10
        assert len(rows) == 10 and time.monotonic() - began >= 1.2
        await publish_keyed(jetstream, 60, keys=4, start=10)
        rows = await asyncio.to_thread(query.step)
        assert rows is not None and len(rows) == 60
    finally:
        await asyncio.to_thread(query.close)


async def test_min_partitions_cuts_the_run_into_that_many_tasks(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """``minPartitions`` splits a batch by sequence; the tasks together read each
    message once."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 9000, keys=16)
    query = _query(nats_server, minPartitions=4)
    try:
        start, end = await asyncio.to_thread(query.plan)  # type: ignore[misc]
        tasks = await asyncio.to_thread(query.reader.partitions, start, end)
        assert len(tasks) == 4
        rows = await asyncio.to_thread(query.read, start, end)
        assert len(rows) == 9000 == len({r["stream_sequence"] for r in rows})
    finally:
        await asyncio.to_thread(query.close)


# -- data loss ------------------------------------------------------------------------------
async def test_recreated_stream_is_data_loss(nats_server: NatsServer,
                                             jetstream: JetStream) -> None:
    """A checkpoint's stream deleted and created again (sequences start over) fails the
    query by default, naming what happened; with failOnDataLoss=false it warns and reads
    the new stream from its start."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 50, keys=4)
    query = _query(nats_server)
    rows = await asyncio.to_thread(query.drain)
    assert len(rows) == 50
    committed = query.committed
    await asyncio.to_thread(query.close)
    await jetstream.delete_stream("ORDERS")
    await jetstream.add_stream(api.StreamConfig(name="ORDERS", subjects=["orders.>"],
                                                allow_direct=True))
    await publish_keyed(jetstream, 10, keys=4, start=100)

    again = _query(nats_server)
    again.committed = committed
    with pytest.raises(DataLoss, match="deleted and created again"):
        await asyncio.to_thread(again.step)
    await asyncio.to_thread(again.close)
    lenient = _query(nats_server, failOnDataLoss="false")
    lenient.committed = committed
    rows = await _drain(lenient)
    assert sorted(json.loads(r["data"])["n"] for r in rows) == list(range(100, 110))


async def test_checkpoint_of_another_group_is_refused(nats_server: NatsServer,
                                                      jetstream: JetStream) -> None:
    """Offsets written for one group's work queue are not applied to another's."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await admin.create_elastic_group(jetstream, "ORDERS", "h", (await admin.get_group(
        jetstream, "ORDERS", "g")).config)
    await publish_keyed(jetstream, 20, keys=4)
    await wait_sourced(jetstream, "ORDERS-h", 20)
    first = _query(nats_server, mode="workqueue")
    await asyncio.to_thread(first.drain)
    await asyncio.to_thread(first.close)
    other = ManualQuery(servers=nats_server.url, stream="ORDERS", group="h", mode="workqueue",
                        leaseInactiveThreshold="1", idleWait="0.05")
    other.committed = first.committed
    try:
        with pytest.raises(DataLoss, match="belongs to another query"):
            await asyncio.to_thread(other.step)
    finally:
        await asyncio.to_thread(other.close)


async def test_messages_removed_before_they_were_read_are_data_loss(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Messages purged (or aged out) from the origin before the query read them fail the
    query, naming the sequences; failOnDataLoss=false reads on from what is there."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 20, keys=4)
    query = _query(nats_server)
    assert len(await asyncio.to_thread(query.drain)) == 20
    committed = query.committed
    await asyncio.to_thread(query.close)
    await publish_keyed(jetstream, 30, keys=4, start=20)
    await jetstream.purge("ORDERS", None, 31)  # sequences 21-30 go unread

    again = _query(nats_server)
    again.committed = committed
    with pytest.raises(DataLoss, match="from sequence 21 to 30 were removed"):
        await asyncio.to_thread(again.step)
    await asyncio.to_thread(again.close)
    lenient = _query(nats_server, failOnDataLoss="false")
    lenient.committed = committed
    rows = await _drain(lenient)
    assert sorted(json.loads(r["data"])["n"] for r in rows) == list(range(30, 50))


async def test_messages_removed_from_the_work_queue_by_someone_else_are_data_loss(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """In workqueue mode a purge by someone else (an operator, a script) of messages the
    query had not read fails the query instead of being skipped without a word."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 20, keys=4)
    await wait_sourced(jetstream, WQ, 20)
    query = _query(nats_server, mode="workqueue")
    try:
        assert len(await asyncio.to_thread(query.drain)) == 20
        await publish_keyed(jetstream, 30, keys=4, start=20)

        async def sourced() -> bool:
            info = await jetstream.stream_info(WQ)
            return info is not None and info.state.last_seq >= 50

        await eventually(sourced, timeout=20, what="the new messages in the queue")
        await jetstream.purge(WQ, None, 31)  # sequences 21-30 go unread
        with pytest.raises(DataLoss, match="from sequence 21 to 30 were removed"):
            await asyncio.to_thread(query.step)
    finally:
        await asyncio.to_thread(query.close)


async def test_offsets_carry_the_stream_identity(nats_server: NatsServer,
                                                 jetstream: JetStream) -> None:
    """Offsets name the stream and its creation time; Spark compares them as text, so
    equal offsets serialise identically."""
    await make_group(jetstream, partitions=3, members=("m1",))
    info = await jetstream.stream_info("ORDERS")
    assert info is not None
    query = _query(nats_server)
    try:
        initial = await asyncio.to_thread(query.reader.initialOffset)
    finally:
        await asyncio.to_thread(query.close)
    offset = Offset.from_json(initial)
    assert offset.stream == "ORDERS" and offset.created
    assert json.dumps(Offset.from_json(json.loads(json.dumps(initial))).to_json()) == \
        json.dumps(initial)


# -- replicas --------------------------------------------------------------------------------
async def test_reads_through_a_follower_under_publish_load_lose_nothing(
        nats_cluster: NatsCluster) -> None:
    """An R3 group on the 3-node cluster, read through a follower (whose direct gets
    that follower answers, lagging or not) while messages keep arriving: in read mode
    and in workqueue mode (which purges every committed batch) every message is read
    exactly once. A range is read to its end and checked against the leader, never
    taken as complete because a replica said so."""
    client = await nats.connect(servers=nats_cluster.urls, **client_options())
    try:
        js = JetStream(client, timeout=10)
        await make_group(js, partitions=4, members=("m1",), replicas=3)
        info = await js.stream_info(WQ)
        assert info is not None and info.cluster is not None
        leaders = {info.cluster.leader}
        origin = await js.stream_info("ORDERS")
        assert origin is not None and origin.cluster is not None
        leaders.add(origin.cluster.leader)
        # A node that leads neither stream: its replicas answer its clients' direct gets.
        follower = next(s for s in nats_cluster.servers if s.server_name not in leaders)
        total = 3000
        published = 0

        async def load() -> None:
            nonlocal published
            for start in range(0, total, 100):
                await publish_keyed(js, 100, keys=32, start=start)
                published = start + 100
                await asyncio.sleep(0.005)

        def run(query: ManualQuery) -> list[dict[str, object]]:
            rows: list[dict[str, object]] = []
            # Batches while the load runs, then until nothing is new once it ended. A
            # load that failed ends it too (its error is raised below): this looped for
            # ever once (CI on e723b75, a publish that failed left `published` short).
            while published < total and not loader.done():
                rows.extend(query.step() or [])
            return rows + query.drain()

        loader = asyncio.create_task(load())
        read = ManualQuery(servers=follower.url, stream="ORDERS", group="g",
                           idleWait="0.01", fetchBatch="50")
        queue = ManualQuery(servers=follower.url, stream="ORDERS", group="g",
                            mode="workqueue", idleWait="0.01", fetchBatch="50",
                            leaseInactiveThreshold="2")
        try:
            rows, queued = await asyncio.gather(asyncio.to_thread(run, read),
                                                asyncio.to_thread(run, queue))
            await loader
            # The work queue's last messages may be sourced after the query looked last.
            async def all_sourced() -> bool:
                wq = await js.stream_info(WQ)
                return wq is not None and wq.state.last_seq >= total

            await eventually(all_sourced, timeout=20, what="everything sourced")
            queued += await asyncio.to_thread(queue.drain)
        finally:
            loader.cancel()
            await asyncio.to_thread(read.close)
            await asyncio.to_thread(queue.close)
        for got, column in ((rows, "stream_sequence"), (queued, "origin_sequence")):
            numbers = sorted(json.loads(r["data"])["n"] for r in got)  # type: ignore[arg-type]
            assert numbers == list(range(total)), (column, len(numbers))
            assert len({r[column] for r in got}) == total
    finally:
        await client.close()
