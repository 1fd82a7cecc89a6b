"""Replay ("reset offsets") against a real nats-server 2.15: the plan per partition, the
refusal while instances run, and that replayed messages are processed again, in order,
exactly once (and nothing else is), for elastic and static groups."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest
from nats.js import api

from cgroupd import admin
from cgroupd.admin import replay
from cgroupd.admin.replay import ReplayRefused, Target
from cgroupd.core.config import StaticGroupConfig
from cgroupd.core.partitions import partition_of
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import restore_logging  # noqa: F401 - autouse fixture
from tests.support.groups import Fleet, Record, check, make_group, publish_keyed
from tests.support.polling import eventually

pytestmark = pytest.mark.slow


def after(record: Record, since: float) -> Record:
    """The events recorded from ``since`` on (the replay's second round)."""
    return Record([e for e in record.events if e["t"] >= since])


def completions(record: Record) -> Counter[int]:
    return Counter(e["n"] for e in record.ends())


async def stop_all(fleet: Fleet) -> None:
    for m in fleet.members:
        await m.stop()


async def plan_when_stopped(js: JetStream, target: Target, **kw: Any) -> replay.Plan:
    """The plan once the stopped instances' consumers and pull requests are gone."""
    async def clear() -> replay.Plan | None:
        p = await replay.plan(js, "ORDERS", "g", target, **kw)
        return None if p.blockers else p

    found: replay.Plan = await eventually(clear, 20, 0.1, "the stopped instances to let go")
    return found


async def test_elastic_replay_from_a_sequence(fleet: Fleet, jetstream: JetStream) -> None:
    """An elastic group processed 60 messages. While its members run, a replay is refused
    and changes nothing. Stopped, with 10 more messages waiting: the plan from origin
    sequence 31 says, per partition, which of 31..60 are processed again and which waiting
    ones are kept; executed and restarted, 31..70 are each completed exactly once more, in
    per-key order, and 1..30 not again."""
    config = await make_group(jetstream, partitions=4, members=("m1", "m2"))
    for name in ("m1", "m2"):
        await fleet.add(name)
    first = await publish_keyed(jetstream, 60, keys=16)
    await eventually(lambda: set(range(60)) <= set(completions(fleet.record)), 30,
                     what="60 messages processed")

    running = await replay.plan(jetstream, "ORDERS", "g", Target(sequence=31))
    assert running.blockers and any("active" in b for b in running.blockers)
    with pytest.raises(ReplayRefused, match="not replaying"):
        await replay.execute(jetstream, "ORDERS", "g", Target(sequence=31))
    wq = await jetstream.stream_info("ORDERS-g")
    assert wq is not None and wq.config.sources[0].opt_start_seq in (None, 0)

    await stop_all(fleet)
    later = await publish_keyed(jetstream, 10, keys=16, start=60)
    await eventually(lambda: _sourced(jetstream, 10), 10, what="10 messages waiting")
    p = await plan_when_stopped(jetstream, Target(sequence=31))
    assert p.sequence == 31 and not p.executed
    # Origin sequence k holds message k-1 (publish_keyed numbers from 0).
    want_again = Counter(partition_of(s, config.partitioning_filters, 4)
                         for s, n in first if n >= 30)
    want_waiting = Counter(partition_of(s, config.partitioning_filters, 4) for s, _ in later)
    assert {r.partition: r.reprocess for r in p.partitions} == {
        q: want_again[q] for q in range(4)}
    assert {r.partition: r.dropped_pending for r in p.partitions} == {
        q: want_waiting[q] for q in range(4)}

    done = await replay.execute(jetstream, "ORDERS", "g", Target(sequence=31))
    assert done.executed and done.notes == []
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name)
    await eventually(lambda: set(range(30, 70)) <= set(completions(after(fleet.record,
                                                                       started))),
                     30, what="the replayed and waiting messages processed")
    second = after(fleet.record, started)
    replayed = [(s, n) for s, n in first + later if n >= 30]
    verdict = check(second, replayed)
    verdict.assert_ok()
    assert verdict.duplicates == 0
    counts = completions(fleet.record)
    assert {n: counts[n] for n in range(70)} == {
        n: 1 if n < 30 or n >= 60 else 2 for n in range(70)}
    wq = await jetstream.stream_info("ORDERS-g")
    assert wq is not None and wq.config.subjects in (None, []) and len(wq.config.sources) == 1


def _sourced(js: JetStream, n: int) -> Any:
    async def go() -> bool:
        info = await js.stream_info("ORDERS-g")
        return info is not None and info.state.messages >= n
    return go()


async def test_elastic_replay_refuses_to_lose_older_waiting_messages(
        fleet: Fleet, jetstream: JetStream) -> None:
    """Messages waiting from before the replay point would be lost (or ones processed in
    between replayed): the plan says so, and replaying from their start is allowed."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 6, keys=3)
    await eventually(lambda: _sourced(jetstream, 6), 10, what="6 messages sourced")
    p = await replay.plan(jetstream, "ORDERS", "g", Target(sequence=4))
    assert any("before the replay point 4" in b and "replay from 1" in b for b in p.blockers)
    with pytest.raises(ReplayRefused):
        await replay.execute(jetstream, "ORDERS", "g", Target(sequence=4))
    ok = await replay.plan(jetstream, "ORDERS", "g", Target(earliest=True))
    assert ok.blockers == [] and sum(r.dropped_pending for r in ok.partitions) == 6
    assert sum(r.reprocess for r in ok.partitions) == 0


async def test_static_replay_one_member_by_time(fleet: Fleet, jetstream: JetStream) -> None:
    """A static group (m1: partitions 0-1, m2: 2-3) processed 40 messages, then 40 more
    were published after time T. Resetting m1 to T (the consumer-reset API) while it runs
    is refused; stopped, the plan counts m1's partitions' messages after T; executed,
    exactly those are processed again, once each, in order, and m2 replays nothing."""
    await jetstream.add_stream(api.StreamConfig(
        name="ORDERS", subjects=[f"{p}.orders.>" for p in range(4)], allow_direct=True))
    await admin.create_static_group(jetstream, "ORDERS", "g", StaticGroupConfig(
        max_members=4, members=("m1", "m2")))
    for name in ("m1", "m2"):
        await fleet.add(name, static=True)
    sent: list[tuple[str, int]] = []

    async def publish(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            subject = f"{i % 4}.orders.k{i % 8}"
            await jetstream.js.publish(subject, json.dumps({"n": i}).encode())
            sent.append((subject.split(".", 1)[1], i))

    await publish(0, 40)
    await eventually(lambda: set(range(40)) <= set(completions(fleet.record)), 30,
                     what="the first 40 processed")
    mark = time.time()
    await publish(40, 80)
    await eventually(lambda: set(range(80)) <= set(completions(fleet.record)), 30,
                     what="all 80 processed")
    target = Target(time=mark)
    running = await replay.plan(jetstream, "ORDERS", "g", target, members=["m1"])
    assert running.blockers
    with pytest.raises(ReplayRefused):
        await replay.execute(jetstream, "ORDERS", "g", target, members=["m1"])

    await stop_all(fleet)
    p = await plan_when_stopped(jetstream, target, members=["m1"])
    assert p.sequence == 41 and p.members == ("m1",)
    assert [(r.partition, r.member, r.reprocess, r.skip) for r in p.partitions] == [
        (0, "m1", 10, 0), (1, "m1", 10, 0)]
    done = await replay.execute(jetstream, "ORDERS", "g", target, members=["m1"])
    assert done.executed
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name, static=True)
    again = {n for _, n in sent if n >= 40 and n % 4 < 2}  # partitions 0 and 1
    await eventually(lambda: again <= set(completions(after(fleet.record, started))), 30,
                     what="m1's messages after T processed again")
    second = after(fleet.record, started)
    verdict = check(second, [(s, n) for s, n in sent if n in again])
    verdict.assert_ok()
    assert verdict.duplicates == 0
    assert set(completions(second)) == again, "only m1's messages after T ran again"


async def test_replay_command_refuses_while_join_instances_run(
        nats_server: Any, jetstream: JetStream, tmp_path: Any) -> None:
    """`cgroupd replay` with a `cgroupd join` instance running (found by asking the
    instances, not only by the consumers): the dry run shows the plan and why it is
    refused now, --execute exits 1 changing nothing; with the instance stopped, --execute
    replays and says so."""
    from tests.integration.test_daemon import cli
    from tests.support.cli import JoinProcess

    await make_group(jetstream, partitions=2, members=("m1", "m2"))  # m2 never runs
    await publish_keyed(jetstream, 10, keys=4)
    url = nats_server.url
    proc = JoinProcess(url, tmp_path, "m1", "--stream", "ORDERS", "--group", "g", "--member",
                       "m1", "--handler", "tests.support.handlers.record_handler:handle",
                       record=tmp_path / "handled.jsonl")
    try:
        await eventually(lambda: _lines(tmp_path / "handled.jsonl") > 0, 20,
                         what="m1 to process")
        dry = await cli(url, "replay", "ORDERS", "g", "--to-sequence", "3")
        assert dry.exit_code == 0, dry.output
        assert dry.stdout.startswith("DRY RUN: would replay ORDERS/g (elastic) from "
                                     "sequence 3")
        assert "REFUSED now:" in dry.stdout and "cgroupd instances of ORDERS/g are " \
               "running (m1: 1)" in dry.stdout
        refused = await cli(url, "replay", "ORDERS", "g", "--to-sequence", "3", "--execute")
        assert refused.exit_code == 1 and "not replaying" in refused.stderr
        proc.terminate()
        assert await proc.wait_exit() == 0
    finally:
        proc.close()

    # m2's partition was never consumed: its messages wait from origin sequence 1 or 2,
    # so replaying from 3 is refused for them; from the start it is not.
    refused = await cli(url, "--json", "replay", "ORDERS", "g", "--to-sequence", "3")
    assert any("before the replay point 3" in b for b in json.loads(refused.stdout)[
        "blockers"])
    done = await cli(url, "--json", "replay", "ORDERS", "g", "--to-earliest", "--execute")
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert result["executed"] and result["blockers"] == [] and result["sequence"] == 1


def _lines(path: Any) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0
