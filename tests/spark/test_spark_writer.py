"""The cgroupd Spark sink: rows published to JetStream, replays de-duplicated.

One SparkSession for the module; a fresh nats-server per test.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from nats.js import api
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from cgroupd.nats.jetstream import JetStream
from cgroupd.spark.writer import batch_prefix
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.spark_support import (
    finish,
    make_group,
    shared_spark,
    source,
    wait_sourced,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return shared_spark()


async def _out_stream(js: JetStream) -> None:
    await js.add_stream(api.StreamConfig(name="OUT", subjects=["out.>"],
                                         duplicate_window=120.0))


async def _messages(js: JetStream) -> list[tuple[str, dict[str, str], bytes]]:
    info = await js.stream_info("OUT")
    assert info is not None
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.js.get_msg("OUT", seq)
        out.append((msg.subject, dict(msg.headers or {}), msg.data))
    return out


async def test_stream_writer_replay_is_deduplicated(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """Every task publishes its rows and then fails; the restarted query replays the
    batch with the same message ids, and the server keeps one copy of each."""
    await make_group(jetstream, partitions=4, members=("m1",))
    await publish_keyed(jetstream, 400, keys=16)
    await wait_sourced(jetstream, "ORDERS-g", 400)
    await _out_stream(jetstream)
    markers = tmp_path / "markers"
    markers.mkdir()
    rows = source(spark, nats_server.url).select(
        F.concat(F.lit("out."), F.col("key")).alias("subject"), "data")

    def start() -> StreamingQuery:
        # Started on this thread: Spark looks Python data sources up in the session
        # that is active on the calling thread.
        return (rows.writeStream.format("cgroupd_flaky_sink")
                .option("servers", nats_server.url).option("stream", "OUT")
                .option("failOnceDir", str(markers))
                .option("checkpointLocation", str(tmp_path / "checkpoint"))
                .trigger(availableNow=True).start())

    with pytest.raises(StreamingQueryException, match="injected failure after publishing"):
        await asyncio.to_thread(finish, start())
    before = len(await _messages(jetstream))
    assert before > 0, "the failed attempt published something"
    (markers / "reports.log").rename(markers / "first-run.log")
    await asyncio.to_thread(finish, start())

    replay = [line.split() for line in (markers / "reports.log").read_text().splitlines()]
    assert sum(int(p) + int(d) for _, p, d in replay) == 400
    assert sum(int(d) for _, _, d in replay) == before, "replayed rows were dropped as dupes"
    published = await _messages(jetstream)
    assert len(published) == 400
    assert sorted(json.loads(data)["n"] for _, _, data in published) == list(range(400))
    assert all(subject == json.loads(data)["key"].replace("orders.", "out.")
               for subject, _, data in published)
    ids = {headers["Nats-Msg-Id"] for _, headers, _ in published}
    assert len(ids) == 400 and all(i.split(":")[1] == "0" for i in ids), "batch 0 ids"


async def test_batch_writer_publishes_rows_and_dedupes_a_rerun(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream) -> None:
    """df.write publishes subject, data and headers; re-running the write, with or
    without an idPrefix, adds nothing; a write under a new idPrefix publishes anew."""
    await _out_stream(jetstream)
    df = spark.createDataFrame(
        [(f"out.s{i % 3}", f"reading {i}", {"sensor": f"s{i % 3}"}) for i in range(30)],
        "subject string, data string, headers map<string,string>").repartition(3)

    def write(**options: str) -> None:
        writer = df.write.format("cgroupd").mode("append").option("servers", nats_server.url)
        for key, value in options.items():
            writer = writer.option(key, value)
        writer.save()

    # Spark calls block the event loop; nothing else needs it meanwhile.
    write(idPrefix="job-1")
    published = await _messages(jetstream)
    assert sorted(data.decode() for _, _, data in published) == sorted(
        f"reading {i}" for i in range(30))
    assert all(h["sensor"] == s.split(".")[1] for s, h, _ in published)

    write(idPrefix="job-1")
    assert len(await _messages(jetstream)) == 30
    write()
    assert len(await _messages(jetstream)) == 60
    write()
    assert len(await _messages(jetstream)) == 60, "a rerun without idPrefix published again"


async def test_a_rerun_batch_write_publishes_each_row_once(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream) -> None:
    """Issue 30 row 1: the same batch job run twice (no idPrefix, no msg_id) leaves each
    of its 20,000 rows once in the stream (was 40,000), and rows that are genuinely
    repeated within the job (1,000 values written twice, in the same task and in
    others) are all published, the second copy included."""
    await _out_stream(jetstream)
    rows = 20_000
    df = spark.range(0, rows, numPartitions=4).select(
        F.lit("out.r").alias("subject"),
        # Values 0-99 three times (twice in the first task, once in the last), 200-999
        # twice (first and last task), every other value once.
        F.concat(F.lit("reading "), F.when(F.col("id") < 200, F.col("id") % 100)
                 .otherwise(F.col("id") % (rows - 1_000)).cast("string")).alias("data"))

    def write() -> None:
        # On this thread: Spark looks the format up in the session active on it.
        df.write.format("cgroupd").mode("append").option("servers", nats_server.url) \
            .option("stream", "OUT").save()

    write()
    info = await jetstream.stream_info("OUT")
    assert info is not None and info.state.messages == rows
    write()
    info = await jetstream.stream_info("OUT")
    assert info is not None and info.state.messages == rows, "the rerun published again"
    first = await jetstream.js.get_msg("OUT", 1)
    assert first.headers is not None
    assert first.headers["Nats-Msg-Id"].startswith(
        f"{batch_prefix(spark.sparkContext.appName)}:"), "the application's name"


async def test_writer_rejects_a_dataframe_without_data(
        spark: SparkSession, nats_server: NatsServer) -> None:
    """A missing 'data' column is reported before anything is published."""
    df = spark.createDataFrame([("out.a", "x")], "subject string, payload string")
    with pytest.raises(Exception, match="needs a 'data' column"):
        df.write.format("cgroupd").mode("append").option("servers", nats_server.url).save()


async def test_sink_refuses_what_it_cannot_keep(spark: SparkSession, nats_server: NatsServer,
                                                jetstream: JetStream, tmp_path: Path) -> None:
    """overwrite and complete modes are refused (a stream is append-only) rather than
    silently appended; a reused idPrefix publishes new rows instead of dropping them as
    duplicates; a duplicate window shorter than the trigger interval is refused at start,
    and check_duplicate_window reports it before a query is started."""
    from cgroupd.spark.writer import check_duplicate_window

    await _out_stream(jetstream)
    df = spark.createDataFrame([("out.a", f"first {i}") for i in range(5)],
                               "subject string, data string")
    with pytest.raises(Exception, match="append-only"):
        df.write.format("cgroupd").mode("overwrite").option("servers", nats_server.url).save()
    info = await jetstream.stream_info("OUT")
    assert info is not None and info.state.messages == 0

    df.write.format("cgroupd").mode("append").option("servers", nats_server.url) \
        .option("idPrefix", "job").save()
    again = spark.createDataFrame([("out.a", f"second {i}") for i in range(5)],
                                  "subject string, data string")
    again.write.format("cgroupd").mode("append").option("servers", nats_server.url) \
        .option("idPrefix", "job").save()
    assert sorted(d.decode() for _, _, d in await _messages(jetstream)) == sorted(
        [f"first {i}" for i in range(5)] + [f"second {i}" for i in range(5)])

    counts = (spark.readStream.format("rate").option("rowsPerSecond", "5").load()
              .groupBy().count()
              .select(F.lit("out.count").alias("subject"),
                      F.col("count").cast("string").alias("data")))
    complete = (counts.writeStream.format("cgroupd").outputMode("complete")
                .option("servers", nats_server.url)
                .option("checkpointLocation", str(tmp_path / "complete")).start())
    with pytest.raises(StreamingQueryException, match="append-only"):
        await asyncio.to_thread(finish, complete, 60.0)

    await jetstream.add_stream(api.StreamConfig(name="SHORT", subjects=["short.>"],
                                                duplicate_window=1.0))
    short = (spark.readStream.format("rate").option("rowsPerSecond", "5").load()
             .select(F.lit("short.x").alias("subject"),
                     F.col("value").cast("string").alias("data")))
    query = (short.writeStream.format("cgroupd").option("servers", nats_server.url)
             .option("stream", "SHORT").option("triggerInterval", "30")
             .option("checkpointLocation", str(tmp_path / "short"))
             .trigger(processingTime="30 seconds").start())
    with pytest.raises(StreamingQueryException, match="drops duplicates for 1s"):
        await asyncio.to_thread(finish, query, 60.0)
    problems = await asyncio.to_thread(
        check_duplicate_window, {"servers": nats_server.url, "subject": "short.x"},
        "5 minutes")
    assert len(problems) == 1 and "'SHORT'" in problems[0]
    assert await asyncio.to_thread(
        check_duplicate_window, {"servers": nats_server.url, "stream": "OUT"}, "30s") == []
