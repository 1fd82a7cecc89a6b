"""How an elastic group's work-queue stream hears from its origin (issue 29), without a
server: the origin's ``sources[]`` entry of a stream info as nats-server 2.15 answers it,
the silence counted across reads while the server says "never", the gauges, and which
instance reads it (the active one of partition 0, nobody else: no request at rest)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from nats.js import api

from cgroupd import admin
from cgroupd.admin.lag import SourceLag, SourceSilence, source_lag
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter, StaticGroupConfig
from cgroupd.join.metrics import Metrics
from cgroupd.join.operations import Operations
from cgroupd.join.options import JoinOptions
from tests.support.cli import parse_metrics

SILENT = "cgroupd_group_stream_source_silent_seconds"
LAG = "cgroupd_group_stream_source_lag_messages"


def info(*sources: dict[str, Any]) -> api.StreamInfo:
    """A group stream's info as the server answers it (the fields cgroupd reads)."""
    return api.StreamInfo.from_response({
        "config": {"name": "ORDERS-g", "retention": "workqueue"},
        "state": {"messages": 0, "bytes": 0, "first_seq": 0, "last_seq": 0,
                  "consumer_count": 1},
        "sources": list(sources)})


def entry(name: str = "ORDERS", lag: int = 0, active: int = 400_000_000,
          error: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name, "lag": lag, "active": active,
        "subject_transforms": [{"src": "orders.*",
                                "dest": "{{partition(4,1)}}.orders.{{wildcard(1)}}"}]}
    if error is not None:
        out["error"] = error
    return out


def test_the_origins_entry_is_read_in_seconds() -> None:
    """``active`` is nanoseconds since the source was last heard (-1: never), ``lag`` the
    origin's pending count; another stream's entry is not the origin's; a stream without
    the origin among its sources (a replay removed it) has no entry."""
    got = source_lag(info(entry("OTHER", 9, 1), entry(lag=12, active=2_500_000_000)), "ORDERS")
    assert got == SourceLag(2.5, 12, None)
    assert source_lag(info(entry(active=-1)), "ORDERS") == SourceLag(None, 0, None)
    assert source_lag(info(), "ORDERS") is None
    assert source_lag(info(entry("OTHER")), "ORDERS") is None
    failed = entry(active=12_000_000_000, error={"code": 404, "err_code": 10059,
                                                 "description": "stream not found"})
    assert source_lag(info(failed), "ORDERS") == SourceLag(12.0, 0, "stream not found")


def test_never_heard_counts_as_silence_from_the_first_read_that_said_so() -> None:
    """A source the server never heard from (a new stream leader whose source consumer
    cannot be created) is silent for as long as reads keep saying so; a heard source
    gives the server's own count and starts the next "never" afresh."""
    now = [100.0]
    silence = SourceSilence(clock=lambda: now[0])
    never = SourceLag(None, 0)
    assert silence.seconds(never) == 0.0
    now[0] = 107.5
    assert silence.seconds(never) == 7.5
    assert silence.seconds(SourceLag(0.3, 0)) == 0.3
    now[0] = 110.0
    assert silence.seconds(never) == 0.0
    now[0] = 111.0
    silence.reset()
    assert silence.seconds(never) == 0.0


def series(m: Metrics) -> dict[str, float]:
    return {name: v for (name, _), v in parse_metrics(m.render().decode()).items()
            if name in (SILENT, LAG)}


def test_gauges_exist_only_while_set() -> None:
    m = Metrics("ORDERS", "g", "m1")
    assert series(m) == {}
    m.set_source(1.25, 40)
    assert series(m) == {SILENT: 1.25, LAG: 40}
    m.clear_source()
    assert series(m) == {}
    m.clear_source()  # twice: nothing to remove, no error


class FakeJetStream:
    """Answers stream info with a given group stream info, or raises."""

    def __init__(self, answer: api.StreamInfo | Exception | None) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def stream_info(self, name: str) -> api.StreamInfo | None:
        self.asked.append(name)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


ELASTIC = admin.StoredGroup("ORDERS", "g", ElasticGroupConfig(
    max_members=4, members=("m1", "m2"),
    partitioning_filters=(PartitioningFilter("orders.*", (1,)),)), 1)


def ops_of(member: str, active: bool, partitions: tuple[int, ...]) -> tuple[Operations, Log]:
    log = Log()
    ops = Operations(JoinOptions("ORDERS", "g", member), Metrics("ORDERS", "g", member),
                     log=log, publisher=None)
    ops.member = SimpleNamespace(active=active, partitions=partitions)  # type: ignore[assignment]
    return ops, log


async def test_only_the_active_instance_of_partition_0_reads_the_source() -> None:
    """One stream info of the group stream per interval, by one instance per group; an
    instance without partition 0 (or a static group, which has no source) asks nothing
    and exports nothing."""
    js = FakeJetStream(info(entry(lag=3, active=700_000_000)))
    reporter, _ = ops_of("m1", True, (0, 1))
    await reporter.report_source(js, ELASTIC, (0, 1))  # type: ignore[arg-type]
    assert js.asked == ["ORDERS-g"]
    assert series(reporter.metrics) == {SILENT: 0.7, LAG: 3}

    other, _ = ops_of("m2", True, (2, 3))
    await other.report_source(js, ELASTIC, (2, 3))  # type: ignore[arg-type]
    static = admin.StoredGroup("ORDERS", "g", StaticGroupConfig(max_members=4,
                                                                 members=("m1",)), 1)
    await reporter.report_source(js, static, (0, 1))  # type: ignore[arg-type]
    assert js.asked == ["ORDERS-g"]
    assert series(other.metrics) == {}
    assert series(reporter.metrics) == {}  # a static group: nothing to report


async def test_the_reporter_that_loses_partition_0_removes_its_series() -> None:
    """Partition 0 moved away (a rebalance) or the instance stepped down: its series go,
    so the new reporter's are the only ones."""
    js = FakeJetStream(info(entry(active=100_000_000)))
    ops, _ = ops_of("m1", True, (0, 1))
    await ops.report_source(js, ELASTIC, (0, 1))  # type: ignore[arg-type]
    assert SILENT in series(ops.metrics)
    ops.member = SimpleNamespace(active=True, partitions=(1,))  # type: ignore[assignment]
    await ops.report_source(js, ELASTIC, (1,))  # type: ignore[arg-type]
    assert series(ops.metrics) == {}

    ops.member = SimpleNamespace(active=True, partitions=(0,))  # type: ignore[assignment]
    await ops.report_source(js, ELASTIC, (0,))  # type: ignore[arg-type]
    assert SILENT in series(ops.metrics)
    ops.on_standby("stopping")
    assert series(ops.metrics) == {}


async def test_a_failed_read_is_counted_and_keeps_the_last_values() -> None:
    js = FakeJetStream(info(entry(lag=5, active=1_000_000_000)))
    ops, log = ops_of("m1", True, (0,))
    await ops.report_source(js, ELASTIC, (0,))  # type: ignore[arg-type]
    js.answer = TimeoutError("stream info timed out")
    await ops.report_source(js, ELASTIC, (0,))  # type: ignore[arg-type]
    got = parse_metrics(ops.metrics.render().decode())
    assert got[("cgroupd_lag_read_errors_total", ())] == 1
    assert series(ops.metrics) == {SILENT: 1.0, LAG: 5}
    assert [w[0] for w in log.warnings] == ["group stream source read failed"]


async def test_a_source_error_is_logged_once_and_the_silence_grows() -> None:
    """The server's error for the source (the origin is gone) is logged when it appears,
    not at every read; the gauge shows the silence."""
    error = {"code": 404, "err_code": 10059, "description": "stream not found"}
    js = FakeJetStream(info(entry(active=11_000_000_000, error=error)))
    ops, log = ops_of("m1", True, (0,))
    for _ in range(3):
        await ops.report_source(js, ELASTIC, (0,))  # type: ignore[arg-type]
    assert [(w[0], w[1]["error"]) for w in log.warnings] == [
        ("group stream source error", "stream not found")]
    assert series(ops.metrics)[SILENT] == 11.0
