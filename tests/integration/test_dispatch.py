"""Ordering modes: per-key order under concurrency, retries in place, crash mid-flight."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from cgroupd.core.settings import MemberSettings
from cgroupd.member.dispatch import Ordering
from cgroupd.nats.jetstream import JetStream
from tests.support.groups import (
    Fleet,
    MemberProcess,
    Record,
    all_done,
    check,
    make_group,
    publish_keyed,
)
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually


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

