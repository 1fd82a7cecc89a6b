"""Lag per partition against a real nats-server: counts and ages from one direct get per
partition, robust to publishers' headers, after a static consumer's ack floor, in flight;
and the daemon's lag series (only the partitions it consumes, removed when they move),
and its elastic group stream's source (heard from every second, then silent once the
source dies)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js import api

from cgroupd import admin
from cgroupd.admin.lag import PartitionLag, _merge, max_lag, partition_subjects, read_lag
from cgroupd.core.config import StaticGroupConfig
from cgroupd.join.metrics import Metrics
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.streamread import FirstMatch
from tests.support.cli import JoinProcess, parse_metrics
from tests.support.groups import make_group
from tests.support.polling import eventually

WQ = "ORDERS-g"


async def sourced(js: JetStream, n: int) -> None:
    async def check() -> bool:
        info = await js.stream_info(WQ)
        return info is not None and info.state.messages >= n
    await eventually(check, 10, what=f"{n} messages in {WQ}")


async def test_counts_and_age_per_partition(jetstream: JetStream, nc: Client) -> None:
    """Per partition: the number of waiting messages and the store time of the oldest
    (within the last seconds), 0 and no age for an empty partition; acked messages leave
    the count."""
    config = await make_group(jetstream, partitions=4, members=("m1",))
    before = time.time()
    for key, n in (("k1", 3), ("k2", 1), ("k3", 2)):
        for _ in range(n):
            await jetstream.js.publish(f"orders.{key}", b"{}")
    await sourced(jetstream, 6)
    lags = await read_lag(jetstream, WQ, config, range(4))
    counts = await admin.partition_pending(jetstream, "ORDERS", "g")
    assert {p: x.messages for p, x in lags.items()} == counts
    assert sum(counts.values()) == 6
    for lag in lags.values():
        if lag.messages:
            assert lag.oldest_time is not None and before - 1 <= lag.oldest_time <= time.time()
            assert 0 <= lag.seconds() < 10
        else:
            assert lag.oldest_time is None and lag.seconds() == 0.0
    busiest = max(lags.values(), key=lambda x: x.messages)
    sub = await nc.jetstream().pull_subscribe(f"{busiest.partition}.>", durable="d",
                                              stream=WQ)
    for msg in await sub.fetch(busiest.messages, timeout=5):
        await msg.ack_sync()
    again = await read_lag(jetstream, WQ, config, [busiest.partition])
    assert again[busiest.partition] == PartitionLag(busiest.partition, 0)


async def test_publisher_headers_cannot_fake_the_lag(jetstream: JetStream) -> None:
    """A message whose publisher set Nats-Time-Stamp, Nats-Num-Pending, Nats-Sequence and
    a Status header (and has an empty body) is counted and dated by what the server says."""
    config = await make_group(jetstream, partitions=1, members=("m1",))
    hostile = {"Nats-Time-Stamp": "2000-01-01T00:00:00Z", "Nats-Num-Pending": "999999",
               "Nats-Sequence": "77", "Status": "404", "Description": "No Messages",
               "Nats-Stream": "X"}
    await jetstream.js.publish("orders.a", b"", headers=hostile)
    await jetstream.js.publish("orders.b", b"{}", headers={"Status": "204"})
    await sourced(jetstream, 2)
    lag = (await read_lag(jetstream, WQ, config, [0]))[0]
    assert lag.messages == 2 and lag.oldest_seq == 1
    assert lag.oldest_time is not None and abs(time.time() - lag.oldest_time) < 30


async def test_static_lag_after_the_ack_floor_and_in_flight(jetstream: JetStream,
                                                            nc: Client) -> None:
    """On a static stream processed messages stay: only those after the member consumer's
    ack floor count, and those delivered but not acknowledged are in flight."""
    await jetstream.add_stream(api.StreamConfig(
        name="S", subjects=["0.s.>", "1.s.>"], allow_direct=True))
    await admin.create_static_group(jetstream, "S", "g", StaticGroupConfig(
        max_members=2, members=("m1",)))
    for i in range(10):
        await jetstream.js.publish(f"{i % 2}.s.k", json.dumps({"n": i}).encode())
    await jetstream.create_consumer("S", "g-m1", {
        "durable_name": "g-m1", "ack_policy": "explicit", "deliver_policy": "all",
        "filter_subjects": ["0.>", "1.>"], "max_ack_pending": 100,
        "metadata": {"cgroupd_member": "m1", "cgroupd_instance": "abc"}})
    sub = await nc.jetstream().pull_subscribe_bind("g-m1", stream="S")
    msgs = await sub.fetch(6, timeout=5)
    for msg in msgs[:4]:
        await msg.ack_sync()  # sequences 1-4 done, 5-6 held
    status = await admin.group_status(jetstream, "S", "g", in_flight=True)
    by_p = {r.partition: r for r in status.partitions}
    # Partition 0 holds 1,3,5,7,9: 5 in flight, 7, 9 waiting. Partition 1: 6 in flight.
    assert (by_p[0].pending, by_p[1].pending) == (3, 3)
    assert (by_p[0].in_flight, by_p[1].in_flight) == (1, 1)
    assert by_p[0].instance == "abc" and by_p[0].lag_seconds >= 0


def test_metrics_report_only_current_partitions() -> None:
    """The lag series are exactly the partitions given last: a partition that moved away
    disappears (its new owner reports it), and a step-down clears them all."""
    m = Metrics("S", "G", "M")
    m.set_lag({0: (5, 1.5), 1: (0, 0.0)}, 0.01)
    m.set_lag({1: (2, 0.5), 2: (7, 9.0)}, 0.02)
    got = parse_metrics(m.render().decode())
    lag = {dict(k[1])["partition"]: v for k, v in got.items()
           if k[0] == "cgroupd_partition_lag_messages"}
    assert lag == {"1": 2, "2": 7}
    assert got[("cgroupd_partition_lag_seconds", (("partition", "2"),))] == 9.0
    assert got[("cgroupd_lag_read_duration_seconds", ())] == 0.02
    m.clear_lag()
    assert not [k for k in parse_metrics(m.render().decode())
                if k[0].startswith("cgroupd_partition_lag")]


def test_partition_lag_pure_parts() -> None:
    """Without a server: a partition's filters (a static group's per-filter subjects,
    deduplicated), merging per-filter reads (counts add up, the oldest is the lowest
    sequence among filters that have messages), the age clamped at 0 when the server's
    clock runs ahead and 0 when nothing waits, and the group maximum."""
    static = StaticGroupConfig(max_members=4, members=("m1",),
                               filters=("orders.a", "orders.b", "orders.a"))
    assert partition_subjects(static, 3) == ["3.orders.a", "3.orders.b"]
    assert partition_subjects(StaticGroupConfig(max_members=4, members=("m1",)), 2) == [
        "2.>"]
    merged = _merge(1, [FirstMatch(2, 9, 100.0), FirstMatch(0), FirstMatch(3, 4, 150.0)])
    assert (merged.messages, merged.oldest_seq, merged.oldest_time) == (5, 4, 150.0)
    assert _merge(0, [FirstMatch(0), FirstMatch(0)]) == PartitionLag(0, 0)
    assert merged.seconds(now=160.0) == 10.0
    assert merged.seconds(now=140.0) == 0.0  # a server clock ahead of ours
    assert PartitionLag(0, 0, 100.0, 1).seconds(now=500.0) == 0.0  # nothing waits
    lags = [merged, PartitionLag(2, 9, 155.0, 20), PartitionLag(3, 0)]
    assert max_lag(lags, now=160.0) == (9, 10.0)
    assert max_lag([], now=1.0) == (0, 0.0)


@pytest.mark.slow
async def test_daemon_exports_its_partitions_lag(nats_server: object, jetstream: JetStream,
                                                 tmp_path: Path) -> None:
    """A `cgroupd join` of m1 whose handler keeps failing: its partitions' lag series
    grow (messages and seconds) and m2's partitions, which it does not consume, are not
    among them."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    url = nats_server.url  # type: ignore[attr-defined]
    # No CGROUPD_TEST_RECORD: the recording handler raises, every message is retried.
    proc = JoinProcess(url, tmp_path, "m1", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--handler",
                       "tests.support.handlers.record_handler:handle", "--status-interval", "0.3")
    try:
        async with aiohttp.ClientSession() as http:
            await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20,
                             what="m1 active")
            for i in range(20):
                await jetstream.js.publish(f"orders.k{i}", b"{}")

            async def lagging() -> dict[str, float]:
                got = await proc.metrics(http)
                seconds = {dict(k[1])["partition"]: v for k, v in got.items()
                           if k[0] == "cgroupd_partition_lag_seconds"}
                msgs = {dict(k[1])["partition"]: v for k, v in got.items()
                        if k[0] == "cgroupd_partition_lag_messages"}
                ok = set(msgs) == {"0", "1"} and sum(msgs.values()) > 0 and \
                    max(seconds.values(), default=0) > 0.5
                return seconds if ok else {}

            seconds = await eventually(lagging, 20, what="m1's partitions to lag")
            assert set(seconds) == {"0", "1"}
    finally:
        proc.close()


SOURCE_SILENT = "cgroupd_group_stream_source_silent_seconds"


@pytest.mark.slow
async def test_daemon_exports_its_group_streams_source(nats_server: object,
                                                       jetstream: JetStream, tmp_path: Path,
                                                       closing: list[Any]) -> None:
    """Issue 29: `cgroupd join` of m1 (partitions 0-1) and m2 (2-3) of an elastic group:
    m1, the active instance of partition 0, exports how ORDERS-g hears from ORDERS,
    under 3 s while the source is healthy (it heartbeats every second), and m2 does not.
    Once the source dies (the origin deleted: its internal source consumer, which the
    consumer API does not reach, goes with it) the silence grows past 3 s while the
    partitions' lag reads 0."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    url = nats_server.url  # type: ignore[attr-defined]

    def join(member: str) -> JoinProcess:
        proc = JoinProcess(url, tmp_path, member, "--stream", "ORDERS", "--group", "g",
                           "--member", member, "--handler",
                           "tests.support.handlers.record_handler:handle",
                           "--status-interval", "0.3")
        closing.append(proc)
        return proc

    m1, m2 = join("m1"), join("m2")
    async with aiohttp.ClientSession() as http:
        def logs() -> str:
            return m1.log_tail() + "\n" + m2.log_tail()

        async def silent(proc: JoinProcess) -> list[float]:
            value = (await proc.metrics(http)).get((SOURCE_SILENT, ()))
            return [] if value is None else [value]

        healthy = await eventually(lambda: silent(m1), 30, 0.2, what="m1's source gauge",
                                   diagnostics=logs)
        assert 0 <= healthy[0] < 3.0
        assert (await m1.metrics(http))[
            ("cgroupd_group_stream_source_lag_messages", ())] == 0
        # m2 is active with its own partitions' lag, and no source series.
        async def m2_lag() -> dict[Any, float]:
            got = await m2.metrics(http)
            return got if ("cgroupd_partition_lag_seconds", (("partition", "2"),)) in got \
                else {}

        got = await eventually(m2_lag, 30, 0.2, what="m2's lag series", diagnostics=logs)
        assert not [k for k in got if k[0].startswith("cgroupd_group_stream_source")]

        assert await jetstream.delete_stream("ORDERS")

        async def dead() -> bool:
            return any(s > 3.0 for s in await silent(m1))

        await eventually(dead, 10, 0.2, what="m1's source to be silent > 3 s",
                         diagnostics=logs)
        got = await m1.metrics(http)
        assert {v for k, v in got.items() if k[0] == "cgroupd_partition_lag_messages"} == {0}
