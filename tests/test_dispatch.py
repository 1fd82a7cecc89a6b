"""Ordering modes: per-key order under concurrency, retries in place, crash mid-flight."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from cgroupd.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.dispatch import Ordering
from cgroupd.jetstream import JetStream
from cgroupd.partitions import key_function
from cgroupd.settings import MemberSettings
from tests.groups import (
    Fleet,
    MemberProcess,
    Record,
    all_done,
    check,
    eventually,
    make_group,
    publish_keyed,
)
from tests.natsserver import NatsServer

CONFIG = ElasticGroupConfig(
    max_members=4,
    partitioning_filters=(PartitioningFilter("orders.*.*", (2,)), PartitioningFilter("x.>")))


@pytest.mark.parametrize(("spec", "subject", "headers", "key"), [
    ("auto", "orders.eu.17", {}, "17"),
    ("auto", "x.a.b", {}, "x.a.b"),
    ("auto", "unmatched", {}, "unmatched"),
    ("subject", "orders.eu.17", {}, "orders.eu.17"),
    ("partition", "orders.eu.17", {}, "3"),
    ("tokens:1,3", "orders.eu.17", {}, "orders.17"),
    ("header:Order-Id", "orders.eu.17", {"Order-Id": "A1"}, "A1"),
    ("header:Order-Id", "orders.eu.17", {}, "orders.eu.17"),
])
def test_key_functions(spec: str, subject: str, headers: dict[str, str], key: str) -> None:
    """Each key spec groups messages as documented (partition number here is 3)."""
    assert key_function(spec, CONFIG)(subject, headers, 3) == key


@pytest.mark.parametrize("spec", ["tokens:", "tokens:0", "tokens:a", "header:", "bogus"])
def test_bad_key_specs_are_refused_with_a_message(spec: str) -> None:
    """A key spec that cannot work is a clear ValueError, before any message flows."""
    with pytest.raises(ValueError, match="key"):
        key_function(spec, CONFIG)


def test_max_in_flight_defaults_follow_the_ordering() -> None:
    """Every ordering defaults to 256 in flight (the server sends ahead; the dispatcher
    keeps the order)."""
    assert MemberSettings().max_in_flight == 256
    assert MemberSettings(ordering=Ordering.KEY).max_in_flight == 256
    assert MemberSettings(ordering=Ordering.KEY, max_in_flight=8).max_in_flight == 8


@pytest.mark.slow
async def test_key_mode_keeps_per_key_order_under_concurrency_and_failures(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Key ordering with random handler latencies and injected failures: every message
    once, per-key order kept, failures retried in place, and keys really ran at once."""
    await make_group(jetstream, partitions=2, members=("m1",))
    rng = random.Random(7)
    fleet.fail_once = set(rng.sample(range(1500), 40))
    running = {"now": 0, "max": 0}
    original_add = fleet.record.add

    def add(event: str, instance: str, **fields: object) -> None:
        if event == "start":
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
        elif event in ("end", "fail"):
            running["now"] -= 1
        original_add(event, instance, **fields)

    fleet.record.add = add  # type: ignore[method-assign]
    fleet.handler_delay = 0.002
    await fleet.add("m1", MemberSettings(ordering=Ordering.KEY, max_in_flight=64,
                                         retry_backoff=0.01))
    sent = await publish_keyed(jetstream, 1500, keys=64)
    await all_done(fleet, sent, timeout=60)
    verdict = check(fleet.record, sent)
    verdict.assert_ok()
    assert verdict.duplicates == 0
    assert len([e for e in fleet.record.events if e["event"] == "fail"]) == 40
    assert running["max"] > 8, f"keys did not run concurrently (max {running['max']})"
    member = fleet.members[0]
    assert member.stats["retries"] == 40 and member.stats["naked"] == 0


@pytest.mark.slow
async def test_unordered_mode_processes_everything(fleet: Fleet, jetstream: JetStream) -> None:
    """``none`` ordering: failures are nak'ed and redelivered; nothing is lost."""
    await make_group(jetstream, partitions=2, members=("m1",))
    fleet.fail_once = {5, 50, 500}
    await fleet.add("m1", MemberSettings(ordering=Ordering.NONE, retry_backoff=0.01))
    sent = await publish_keyed(jetstream, 600, keys=16)
    await all_done(fleet, sent, timeout=60)
    assert not check(fleet.record, sent).lost
    assert fleet.members[0].stats["naked"] == 3


@pytest.mark.slow
async def test_key_mode_crash_mid_flight_keeps_per_key_order(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path) -> None:
    """SIGKILL a key-ordered instance with many messages in flight: the standby gets the
    unacknowledged ones in stream order and per-key order holds."""
    await make_group(jetstream, partitions=2, members=("m1",))
    procs = [MemberProcess(nats_server.url, tmp_path / f"p{i}.jsonl", "ORDERS", "g", "m1",
                           "--ordering", "key", "--max-in-flight", "32",
                           "--handler-delay", "0.01", "--jitter") for i in range(2)]
    try:
        active = await eventually(lambda: next((p for p in procs if p.active), None), 20)
        standby = next(p for p in procs if p is not active)
        sent = await publish_keyed(jetstream, 800, keys=32)
        await eventually(lambda: sum(e["event"] == "end" for e in active.events()) >= 200)
        t0 = time.monotonic()
        active.signal(signal.SIGKILL)
        await eventually(lambda: standby.active, 15, what="standby to take over")
        print(f"key-mode crash failover: {time.monotonic() - t0:.3f}s")
        await eventually(lambda: {n for _, n in sent} <= {
            e["n"] for e in Record.load(p.record for p in procs).ends()}, 30)
        # SIGKILL loses the killed instance's unflushed acks: its successor may redo them.
        verdict = check(Record.load(p.record for p in procs), sent, rewinds=True)
        verdict.assert_ok()
        print(f"redelivered after crash: {verdict.duplicates}")
    finally:
        for p in procs:
            p.close()

