"""Issue 16's remaining gaps, each pinned by a test: data loss is reported for the
partitions it reached, and what a work-queue query stopped between two triggers leaves
behind (and that a restart from its checkpoint repeats nothing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from cgroupd.core.errors import DataLoss
from cgroupd.nats.jetstream import JetStream
from cgroupd.spark.source import close_executor_connections
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually_blocking
from tests.support.spark_support import (
    ManualQuery,
    finish,
    make_group,
    shared_spark,
    source,
    wait_sourced,
)

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


@pytest.fixture(autouse=True)
def _executor_connections() -> Iterator[None]:
    yield
    close_executor_connections()


def _query(server: NatsServer, **options: object) -> ManualQuery:
    return ManualQuery(servers=server.url, stream="ORDERS", group="g",
                       leaseInactiveThreshold="1", idleWait="0.05", **options)


async def test_data_loss_names_only_the_partitions_whose_unread_messages_went(
        nats_server: NatsServer, jetstream: JetStream) -> None:
    """Read mode: partition 0 starts at sequence 16, partition 1 at 1; sequences 1-10
    are purged before the query reads. Only partition 1 had them unread: the error names
    it, not partition 0. Purged below a point every partition had passed: no error."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 20, keys=4)
    await jetstream.purge("ORDERS", None, 11)

    query = _query(nats_server, startingOffsets='{"0": 16, "1": 1}')
    try:
        with pytest.raises(DataLoss) as err:
            await asyncio.to_thread(query.step)
    finally:
        await asyncio.to_thread(query.close)
    text = str(err.value)
    assert "from sequence 1 to 10 were removed" in text
    assert "partition 1 had read to 0" in text and "partition 0" not in text

    with _query(nats_server) as whole:
        everything = {r["stream_sequence"]: r["partition"]
                      for r in await asyncio.to_thread(whole.drain)}
    untouched = _query(nats_server, startingOffsets='{"0": 16, "1": 11}')
    try:
        rows = await asyncio.to_thread(untouched.drain)
    finally:
        await asyncio.to_thread(untouched.close)
    assert sorted(r["stream_sequence"] for r in rows) == sorted(
        s for s, p in everything.items() if (p == 0 and s >= 16) or (p == 1 and s >= 11))


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return shared_spark()


async def test_workqueue_query_stopped_between_triggers_leaves_its_last_batch(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """Spark tells a source that a batch is committed only when it plans the next one, so
    a work-queue query stopped between two triggers cannot purge its last batch: it
    stays in the queue, and whoever consumes those partitions next (a daemon, another
    query) gets it again, as the README says. The same query restarted from its
    checkpoint repeats nothing: its first look purges the batch, and every message is in
    the output once."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 300, keys=8)
    await wait_sourced(jetstream, WQ, 300)
    out = tmp_path / "out"

    def start(**trigger: str | bool) -> StreamingQuery:
        return (source(spark, nats_server.url, mode="workqueue").writeStream
                .format("parquet").option("path", str(out / "data"))
                .option("checkpointLocation", str(out / "checkpoint"))
                .trigger(**trigger).start())  # type: ignore[call-overload]

    query = start(processingTime="1 hour")
    await asyncio.to_thread(
        eventually_blocking, lambda: any(p["numInputRows"] == 300 for p in query.recentProgress),
        60, what="the first batch")
    await asyncio.to_thread(query.stop)
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.state.messages == 300, "the last batch was purged"

    again = start(availableNow=True)
    await asyncio.to_thread(finish, again)
    assert sum(p["numInputRows"] for p in again.recentProgress) == 0
    info = await jetstream.stream_info(WQ)
    assert info is not None and info.state.messages == 0
    rows = spark.read.parquet(str(out / "data")).collect()
    assert sorted(json.loads(r.data)["n"] for r in rows) == list(range(300))
