"""The cgroupd Spark source end to end: local[2] Spark against a real nats-server.

One SparkSession for the module (starting one costs ~5 s); each test gets a fresh server
and its own checkpoint. Spark calls block, so the tests run them in a thread and keep
the event loop free for the NATS client (and, where used, an in-process member).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.errors import StreamingQueryException
from pyspark.sql import Row, SparkSession

from cgroupd import admin
from cgroupd.core.naming import HOLDER_KEY
from cgroupd.member import INSTANCE_KEY, Member, MemberState
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.message import Message
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually, eventually_blocking
from tests.support.spark_support import (
    finish,
    make_group,
    shared_spark,
    source,
    to_parquet,
    wait_sourced,
)

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return shared_spark()


async def _group(js: JetStream, count: int, partitions: int = 4,
                 members: tuple[str, ...] = ("m1", "m2"), start: int = 0) -> None:
    if start == 0:
        await make_group(js, partitions=partitions, members=members)
    await publish_keyed(js, count, keys=32, start=start)
    await wait_sourced(js, WQ, count)


def _rows(spark: SparkSession, out: Path) -> list[Row]:
    return spark.read.parquet(str(out / "data")).collect()


def _numbers(rows: list[Row]) -> list[int]:
    return sorted(json.loads(r.data)["n"] for r in rows)


async def _held_by_spark(js: JetStream, consumer: str) -> bool:
    info = await js.consumer_info(WQ, consumer)
    meta = ((info or {}).get("config") or {}).get("metadata") or {}
    return meta.get(HOLDER_KEY) == "spark"


async def test_stream_reads_every_message_once_with_subject_key_and_order(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """Read mode (the default) and workqueue mode each put every message in Parquet
    once, in the same partition; subject has no partition token; key is the
    partitioning token; one key lives in one partition, in publish order; read mode
    consumes nothing, workqueue mode consumes what it committed."""
    await _group(jetstream, 1000)
    query = to_parquet(source(spark, nats_server.url), tmp_path / "read")
    await asyncio.to_thread(finish, query)
    queue = to_parquet(source(spark, nats_server.url, mode="workqueue"), tmp_path / "wq")
    await asyncio.to_thread(finish, queue)

    rows = _rows(spark, tmp_path / "read")
    queued = _rows(spark, tmp_path / "wq")
    assert _numbers(rows) == _numbers(queued) == list(range(1000))
    assert {r.stream_sequence: r.partition for r in rows} == {
        r.origin_sequence: r.partition for r in queued}
    origin = await jetstream.stream_info("ORDERS")
    assert origin is not None and origin.state.messages == 1000
    by_key: dict[str, list[Row]] = {}
    for r in rows:
        payload = json.loads(r.data)
        assert r.subject == payload["key"]
        assert r.key == r.subject.split(".")[1]
        assert r.origin_sequence == r.stream_sequence
        assert r.timestamp is not None
        by_key.setdefault(r.key, []).append(r)
    for key, mine in by_key.items():
        assert len({r.partition for r in mine}) == 1, f"{key} spans partitions"
        mine.sort(key=lambda r: r.stream_sequence)
        ns = [json.loads(r.data)["n"] for r in mine]
        assert ns == sorted(ns), f"{key} out of publish order"


async def test_max_messages_per_trigger_bounds_batches_and_commits_purge(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """No batch exceeds maxMessagesPerTrigger; committed batches leave the stream."""
    await _group(jetstream, 700)
    query = to_parquet(source(spark, nats_server.url, mode="workqueue",
                              maxOffsetsPerTrigger=150), tmp_path)
    await asyncio.to_thread(finish, query)

    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [150, 150, 150, 150, 100]
    assert _numbers(_rows(spark, tmp_path)) == list(range(700))
    # A batch is purged once Spark has committed it and asks for the next one: after
    # the last batch Spark asks once more (to see that nothing is left), so all of them.
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.state.messages == 0


async def test_stop_and_restart_resumes_without_loss_or_duplicate(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """A query stopped mid-stream (its last commit never sent) restarts from its
    checkpoint; with more messages published meanwhile, each arrives exactly once."""
    await _group(jetstream, 800)
    df = source(spark, nats_server.url, maxMessagesPerTrigger=100)
    query = to_parquet(df, tmp_path, available_now=False)
    await asyncio.to_thread(
        eventually_blocking, lambda: (query.lastProgress or {}).get("batchId", -1) >= 2,
        timeout=60, what="three batches")
    await asyncio.to_thread(query.stop)
    await _group(jetstream, 400, start=800)

    query = to_parquet(source(spark, nats_server.url), tmp_path)
    await asyncio.to_thread(finish, query)
    rows = _rows(spark, tmp_path)
    assert len(rows) == 1200
    assert _numbers(rows) == list(range(1200))


async def test_failure_in_read_replays_the_same_range(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """Tasks that fail after emitting rows fail the query; the restarted query reads the
    very same ranges and the sink holds every message once."""
    await _group(jetstream, 600)
    markers = tmp_path / "markers"
    markers.mkdir()
    df = source(spark, nats_server.url, fmt="cgroupd_flaky", failOnceDir=markers,
                minPartitions=3, fetchBatch=50)
    query = to_parquet(df, tmp_path)
    with pytest.raises(StreamingQueryException, match="injected read failure"):
        await asyncio.to_thread(finish, query)
    failed = (markers / "failed").read_text()
    first_run = set((markers / "reads.log").read_text().splitlines())
    (markers / "reads.log").rename(markers / "first-run.log")

    query = to_parquet(df, tmp_path)
    await asyncio.to_thread(finish, query)
    replay = (markers / "reads.log").read_text().splitlines()
    assert failed in replay
    assert sorted(replay) == sorted(first_run), "the replay planned different ranges"
    assert _numbers(_rows(spark, tmp_path)) == list(range(600))


async def test_member_option_reads_only_that_members_partitions(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """member=m1 reads m1's partitions only; m2's messages stay queued, untouched."""
    await _group(jetstream, 600, partitions=6)
    before = await admin.partition_pending(jetstream, "ORDERS", "g")
    query = to_parquet(source(spark, nats_server.url, member="m1", mode="workqueue",
                              maxMessagesPerTrigger=200), tmp_path)
    await asyncio.to_thread(finish, query)

    rows = _rows(spark, tmp_path)
    assert {r.partition for r in rows} <= {0, 1, 2}
    assert len(rows) == sum(before[p] for p in (0, 1, 2))
    after = await admin.partition_pending(jetstream, "ORDERS", "g")
    assert [after[p] for p in (3, 4, 5)] == [before[p] for p in (3, 4, 5)]


async def test_second_query_on_the_same_member_is_refused(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """While one query reads m1, a second one fails, naming the member and the holder."""
    await _group(jetstream, 100)
    first = to_parquet(source(spark, nats_server.url, member="m1", mode="workqueue"),
                       tmp_path / "a",
                       available_now=False)
    try:
        await eventually(lambda: _held_by_spark(jetstream, "m1"), timeout=60,
                         what="the first query's lease")
        second = to_parquet(source(spark, nats_server.url, member="m1", mode="workqueue",
                                   leaseWaitTimeout="0.5"), tmp_path / "b")
        with pytest.raises(StreamingQueryException) as failure:
            await asyncio.to_thread(finish, second)
        text = str(failure.value)
        assert "member 'm1'" in text and "another Spark query" in text, text
        assert first.isActive
    finally:
        await asyncio.to_thread(first.stop)


async def test_daemon_instance_and_query_exclude_each_other(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """An active daemon instance makes the query fail with its instance id; while a query
    holds the member, a daemon instance stays standby and takes over once it stops,
    without running any message the query read (the query purges its last batch when
    Spark asks past it, not one batch late)."""
    await _group(jetstream, 50)
    handled: list[int] = []

    def handler(message: Message) -> None:
        handled.append(json.loads(message.data)["n"])

    daemon = Member(jetstream, "ORDERS", "g", "m1", handler, instance_id="daemon-1")
    await daemon.start()
    await eventually(lambda: daemon.active, what="the daemon instance to be active")
    refused = to_parquet(source(spark, nats_server.url, member="m1", mode="workqueue",
                                leaseWaitTimeout="0.5"), tmp_path / "a")
    with pytest.raises(StreamingQueryException) as failure:
        await asyncio.to_thread(finish, refused)
    assert "daemon instance daemon-1" in str(failure.value)
    await daemon.stop()

    query = to_parquet(source(spark, nats_server.url, member="m1", mode="workqueue"),
                       tmp_path / "b", available_now=False)
    standby = Member(jetstream, "ORDERS", "g", "m1", handler, instance_id="daemon-2")
    try:
        await eventually(lambda: _held_by_spark(jetstream, "m1"), timeout=60,
                         what="the query's lease")
        await standby.start()
        # It competes every retry_interval (1 s): give it three tries.
        loop = asyncio.get_running_loop()
        until = loop.time() + 3.0
        while loop.time() < until:
            assert standby.state is MemberState.STANDBY
            await asyncio.sleep(0.05)
        info = await jetstream.consumer_info(WQ, "m1")
        assert info is not None
        assert info["config"]["metadata"][INSTANCE_KEY].startswith("spark-")

        async def m1_read_and_purged() -> bool:
            pending = await admin.partition_pending(jetstream, "ORDERS", "g")
            return pending[0] == pending[1] == 0

        await eventually(m1_read_and_purged, timeout=60, what="m1's partitions read")
        await asyncio.to_thread(query.stop)
        handled.clear()
        await eventually(lambda: standby.active, timeout=15,
                         what="the daemon instance to take over")
        await _group(jetstream, 30, start=50)

        async def sourced() -> bool:
            wq = await jetstream.stream_info(WQ)
            return wq is not None and wq.state.last_seq >= 80

        await eventually(sourced, timeout=20, what="the new messages in the queue")
        await eventually(m1_read_and_purged, timeout=30, what="the daemon to consume")
        assert handled and all(n >= 50 for n in handled), sorted(handled)
        assert len(handled) == len(set(handled))
    finally:
        await asyncio.to_thread(query.stop)
        await standby.stop()


async def test_query_fails_when_its_lease_is_taken_away(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """An operator's step-down deletes the lease's consumer: the query stops with an
    error rather than read on next to whoever takes the partitions."""
    await _group(jetstream, 50)
    query = to_parquet(source(spark, nats_server.url, member="m1", mode="workqueue"),
                       tmp_path, available_now=False)
    await eventually(lambda: _held_by_spark(jetstream, "m1"), timeout=60,
                     what="the query's lease")
    assert await admin.step_down(jetstream, "ORDERS", "g", "m1")
    with pytest.raises(StreamingQueryException, match="lost its lease"):
        await asyncio.to_thread(finish, query, 30.0)


async def test_batch_read_between_starting_and_ending_offsets(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream) -> None:
    """spark.read reads earliest to latest (split by minPartitions), or from
    startingOffsets (the first sequence to read) to endingOffsets (the first not to
    read, -1 latest), per partition, as Spark's Kafka source; it cannot consume a work
    queue."""
    await _group(jetstream, 300)

    def read(**options: str) -> list[Row]:
        reader = (spark.read.format("cgroupd").option("servers", nats_server.url)
                  .option("stream", "ORDERS").option("group", "g"))
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load().collect()

    everything = await asyncio.to_thread(read, minPartitions="3")
    assert sorted(r.stream_sequence for r in everything) == list(range(1, 301))
    part = await asyncio.to_thread(
        read, startingOffsets=json.dumps({"0": 51, "1": 51, "2": 51, "3": -2}),
        endingOffsets=json.dumps({"0": 201, "1": 201, "2": 201, "3": -1}))
    want = sorted(r.stream_sequence for r in everything
                  if r.partition == 3 or 51 <= r.stream_sequence < 201)
    assert sorted(r.stream_sequence for r in part) == want
    with pytest.raises(Exception, match="cannot consume a work queue"):
        await asyncio.to_thread(read, mode="workqueue")
