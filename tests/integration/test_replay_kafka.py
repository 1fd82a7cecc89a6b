"""Kafka's reset tool, the rest of it, against a real nats-server 2.15: ``--to-latest``,
``--shift-by N``, ``--to-current``, ``--all-groups``, ``--export`` / ``--from-file``. Each
test checks the plan per partition, then what members deliver after ``--execute``: exactly
the messages the plan says, once each, in per-key order, and nothing else."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from nats.js import api

from cgroupd import admin
from cgroupd.admin import replay
from cgroupd.admin.replay import Target
from cgroupd.core.config import StaticGroupConfig
from cgroupd.core.partitions import partition_of
from cgroupd.nats.jetstream import JetStream
from tests.integration.test_daemon import cli
from tests.support.cli import restore_logging  # noqa: F401 - autouse fixture
from tests.support.groups import Fleet, Record, check, make_group, publish_keyed
from tests.support.polling import eventually

pytestmark = pytest.mark.slow


def after(record: Record, since: float) -> Record:
    return Record([e for e in record.events if e["t"] >= since])


def completions(record: Record) -> Counter[int]:
    return Counter(e["n"] for e in record.ends())


async def stop_all(fleet: Fleet) -> None:
    for m in fleet.members:
        await m.stop()
    fleet.members.clear()


async def settled_plan(js: JetStream, target: Target, group: str = "g",
                       **kw: Any) -> replay.Plan:
    """The plan once stopped instances' consumers and pull requests are gone."""
    async def clear() -> replay.Plan | None:
        p = await replay.plan(js, "ORDERS", group, target, **kw)
        return None if p.blockers else p

    found: replay.Plan = await eventually(clear, 20, 0.1, "the stopped instances to let go")
    return found


async def waiting(js: JetStream, n: int, stream: str = "ORDERS-g") -> None:
    async def go() -> bool:
        info = await js.stream_info(stream)
        return info is not None and info.state.messages == n
    await eventually(go, 10, what=f"{n} messages waiting in {stream}")


def by_partition(sent: list[tuple[str, int]], config: Any) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for subject, n in sent:
        p = partition_of(subject, config.partitioning_filters, config.max_members)
        assert p is not None
        out.setdefault(p, []).append(n)
    return out


async def test_elastic_shift_by_back_clamped_and_forward(
        fleet: Fleet, jetstream: JetStream) -> None:
    """4 partitions processed 40 messages; 8 more wait. ``--shift-by -2`` moves each
    partition to its second-last processed message (origin sequence = n + 1): the plan
    counts 2 again and keeps the waiting ones; ``-1000`` clamps at each partition's first
    message and says so. Executed, the members then complete exactly each partition's last
    two processed messages and the waiting ones, once each, in order. Then 8 more wait
    and ``--shift-by 1`` skips the first waiting message of each partition: exactly the
    others run."""
    config = await make_group(jetstream, partitions=4, members=("m1", "m2"))
    for name in ("m1", "m2"):
        await fleet.add(name)
    first = await publish_keyed(jetstream, 40, keys=8)
    await eventually(lambda: set(range(40)) <= set(completions(fleet.record)), 30,
                     what="40 messages processed")
    await stop_all(fleet)
    later = await publish_keyed(jetstream, 8, keys=8, start=40)
    await waiting(jetstream, 8)
    done_by = by_partition(first, config)
    wait_by = by_partition(later, config)

    p = await settled_plan(jetstream, Target(shift=-2))
    assert p.sequence == min(done_by[q][-2] + 1 for q in range(4))
    assert {r.partition: (r.current, r.from_sequence, r.reprocess, r.skip, r.dropped_pending)
            for r in p.partitions} == {
        q: (wait_by[q][0] + 1 if q in wait_by else 49, done_by[q][-2] + 1, 2, 0,
            len(wait_by.get(q, []))) for q in range(4)}

    far = await replay.plan(jetstream, "ORDERS", "g", Target(shift=-1000))
    assert {r.partition: (r.from_sequence, r.reprocess) for r in far.partitions} == {
        q: (done_by[q][0] + 1, len(done_by[q])) for q in range(4)}
    assert sum("from its first one" in note for note in far.notes) == 4

    done = await replay.execute(jetstream, "ORDERS", "g", Target(shift=-2))
    assert done.executed
    want = {n for q in range(4) for n in done_by[q][-2:]} | {n for _, n in later}
    second = await _restart(fleet, want, first + later)
    assert set(completions(second)) == want

    await stop_all(fleet)
    more = await publish_keyed(jetstream, 8, keys=8, start=48)
    await waiting(jetstream, 8)
    more_by = by_partition(more, config)
    fwd = await settled_plan(jetstream, Target(shift=1))
    assert {r.partition: (r.skip, r.reprocess) for r in fwd.partitions} == {
        q: (1 if q in more_by else 0, 0) for q in range(4)}
    await replay.execute(jetstream, "ORDERS", "g", Target(shift=1))
    want = {n for q in more_by for n in more_by[q][1:]}
    await waiting(jetstream, len(want))
    second = await _restart(fleet, want, more)
    assert set(completions(second)) == want, "the first waiting message of each partition " \
                                             "was skipped, the others ran once"


async def _restart(fleet: Fleet, want: set[int], sent: list[tuple[str, int]],
                   static: bool = False) -> Record:
    """Start m1 and m2 again and return what they completed once ``want`` is done and
    their work-queue stream / consumers show nothing left (so anything more would be
    in the record)."""
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name, static=static)
    await eventually(lambda: want <= set(completions(after(fleet.record, started))), 30,
                     what=f"{len(want)} messages processed")
    js = fleet.members[0].js
    assert isinstance(js, JetStream)
    if not static:
        await waiting(js, 0)
    second = after(fleet.record, started)
    verdict = check(second, [(s, n) for s, n in sent if n in want])
    assert verdict.duplicates == 0, verdict
    return second


async def test_elastic_to_current_then_to_latest(fleet: Fleet, jetstream: JetStream) -> None:
    """``--to-current`` shows where each partition is (its oldest waiting message's
    origin sequence, or the end) and changes nothing when executed: the waiting messages
    stay. ``--to-latest`` skips all of them: after it, members complete only what is
    published afterwards."""
    config = await make_group(jetstream, partitions=4, members=("m1", "m2"))
    for name in ("m1", "m2"):
        await fleet.add(name)
    first = await publish_keyed(jetstream, 12, keys=6)
    await eventually(lambda: set(range(12)) <= set(completions(fleet.record)), 30,
                     what="12 messages processed")
    await stop_all(fleet)
    later = await publish_keyed(jetstream, 6, keys=6, start=12)
    await waiting(jetstream, 6)
    wait_by = by_partition(later, config)

    now = await settled_plan(jetstream, Target(current=True))
    assert {r.partition: (r.current, r.from_sequence, r.reprocess, r.skip)
            for r in now.partitions} == {
        q: ((wait_by[q][0] + 1,) * 2 if q in wait_by else (19, 19)) + (0, 0)
        for q in range(4)}
    done = await replay.execute(jetstream, "ORDERS", "g", Target(current=True))
    assert done.executed and "nothing to change" in done.notes
    await waiting(jetstream, 6)

    latest = await settled_plan(jetstream, Target(latest=True))
    assert {r.partition: (r.from_sequence, r.skip) for r in latest.partitions} == {
        q: (19, len(wait_by.get(q, []))) for q in range(4)}
    await replay.execute(jetstream, "ORDERS", "g", Target(latest=True))
    await waiting(jetstream, 0)
    started = time.time()
    newer = await publish_keyed(jetstream, 4, keys=6, start=18)
    second = await _restart(fleet, {n for _, n in newer}, newer)
    assert set(completions(second)) == {18, 19, 20, 21}
    assert set(completions(after(fleet.record, started))) == {18, 19, 20, 21}
    assert first  # the first 12 were never run again either (checked by the set above)


async def test_static_shift_by_and_to_latest(fleet: Fleet, jetstream: JetStream) -> None:
    """A static group (m1: partitions 0-1, m2: 2-3) processed 40 messages. m1's two
    partitions share its consumer: ``--shift-by -3 --member m1`` moves it to the earlier of
    its partitions' targets and says so; executed, exactly those messages run again and m2
    replays nothing. Then 8 more wait and ``--to-latest`` skips them: only messages
    published afterwards run."""
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
                     what="40 processed")
    await stop_all(fleet)
    # Sequence s holds message s - 1; m1's partitions 0 and 1 are i % 4 in (0, 1).
    p = await settled_plan(jetstream, Target(shift=-3), members=["m1"])
    assert [(r.partition, r.current, r.from_sequence, r.reprocess) for r in p.partitions] \
        == [(0, 39, 29, 3), (1, 39, 29, 3)]
    assert any("share its consumer" in note for note in p.notes)
    await replay.execute(jetstream, "ORDERS", "g", Target(shift=-3), members=["m1"])
    want = {28, 29, 32, 33, 36, 37}
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name, static=True)
    await eventually(lambda: want <= set(completions(after(fleet.record, started))), 30,
                     what="m1's last three per partition processed again")
    await _static_idle(jetstream)
    assert set(completions(after(fleet.record, started))) == want

    await stop_all(fleet)
    await publish(40, 48)
    latest = await settled_plan(jetstream, Target(latest=True))
    assert {r.partition: (r.from_sequence, r.skip) for r in latest.partitions} == {
        q: (49, 2) for q in range(4)}
    await replay.execute(jetstream, "ORDERS", "g", Target(latest=True))
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name, static=True)
    await publish(48, 52)
    await eventually(lambda: {48, 49, 50, 51} <= set(completions(after(fleet.record,
                                                                       started))),
                     30, what="the 4 new messages processed")
    await _static_idle(jetstream)
    assert set(completions(after(fleet.record, started))) == {48, 49, 50, 51}


async def _static_idle(js: JetStream) -> None:
    """Every member consumer has acked all it has (so a message more would be seen)."""
    async def go() -> bool:
        views = await admin.group_consumers(js, "ORDERS", "g")
        return len(views) == 2 and all(v.num_pending == 0 and v.num_ack_pending == 0
                                       for v in views)
    await eventually(go, 20, what="the member consumers idle")


async def test_all_groups_export_and_from_file(
        fleet: Fleet, nats_server: Any, jetstream: JetStream, tmp_path: Path) -> None:
    """Two elastic groups, g and h, on ORDERS with 10 messages waiting in each.
    ``--all-groups --to-latest --export`` writes both groups' positions; ``--from-file
    --all-groups --execute`` applies exactly them: both work-queue streams are emptied and
    a member of g then completes only a message published afterwards. A plan from before a
    membership change is refused (the record's revision) and changes nothing; with an
    instance of g running, ``--all-groups --execute`` refuses every group."""
    url = nats_server.url
    await make_group(jetstream, partitions=2, members=("m1", "m2"))
    await admin.create_elastic_group(jetstream, "ORDERS", "h", (
        await admin.get_group(jetstream, "ORDERS", "g")).config)
    await publish_keyed(jetstream, 10, keys=5)
    await waiting(jetstream, 10)
    await waiting(jetstream, 10, "ORDERS-h")
    path = tmp_path / "plan.json"

    dry = await cli(url, "--json", "replay", "ORDERS", "--all-groups", "--to-latest",
                    "--export", str(path))
    assert dry.exit_code == 0, dry.output
    plans = json.loads(dry.stdout)["plans"]
    assert [(p["group"], sum(r["skip"] for r in p["partitions"]), p["executed"])
            for p in plans] == [("g", 10, False), ("h", 10, False)]
    doc = json.loads(path.read_text())
    assert doc["format"] == replay.EXPORT_FORMAT
    assert [(g["group"], sorted(e["sequence"] for e in g["positions"]))
            for g in doc["groups"]] == [("g", [11, 11]), ("h", [11, 11])]
    await waiting(jetstream, 10)  # a dry run changed nothing

    stale = tmp_path / "stale.json"
    await cli(url, "replay", "ORDERS", "g", "--to-current", "--export", str(stale))
    await admin.add_members(jetstream, "ORDERS", "g", ["m3"])
    refused = await cli(url, "replay", "ORDERS", "g", "--from-file", str(stale),
                        "--execute")
    assert refused.exit_code == 1 and "record changed since the plan was made" \
        in refused.stderr, refused.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"groups": []}')
    usage = await cli(url, "replay", "ORDERS", "g", "--from-file", str(bad))
    assert usage.exit_code == 2 and "not a cgroupd replay plan" in usage.stderr

    member = await fleet.add("m1")
    blocked = await cli(url, "replay", "ORDERS", "--all-groups", "--from-file", str(path),
                        "--execute")
    assert blocked.exit_code == 1 and "not replaying any group" in blocked.stderr
    await waiting(jetstream, 10, "ORDERS-h")  # h untouched although only g runs
    await member.stop()
    fleet.members.clear()
    await stop_all(fleet)

    # The membership change made the export stale for g: h's entry alone still applies.
    await admin.drop_members(jetstream, "ORDERS", "g", ["m3"])
    fresh = tmp_path / "fresh.json"
    again = await cli(url, "replay", "ORDERS", "--all-groups", "--to-latest", "--export",
                      str(fresh))
    assert again.exit_code == 0, again.output
    ok = await _until_ok(url, "replay", "ORDERS", "--all-groups", "--from-file",
                         str(fresh), "--execute")
    assert [p["executed"] for p in json.loads(ok.stdout)["plans"]] == [True, True]
    await waiting(jetstream, 0)
    await waiting(jetstream, 0, "ORDERS-h")
    newer = await publish_keyed(jetstream, 2, keys=5, start=10)
    await waiting(jetstream, 2, "ORDERS-h")
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name)
    await eventually(lambda: {10, 11} <= set(completions(after(fleet.record, started))),
                     30, what="the 2 new messages processed")
    await waiting(jetstream, 0)
    assert set(completions(after(fleet.record, started))) == {n for _, n in newer}


async def _until_ok(url: str, *args: str) -> Any:
    """The command's result once stopped instances' pull requests have expired."""
    async def go() -> Any:
        result = await cli(url, "--json", *args)
        return result if result.exit_code == 0 else None
    return await eventually(go, 20, 0.2, f"{' '.join(args)} to succeed")


async def test_static_export_edit_and_from_file(fleet: Fleet, jetstream: JetStream) -> None:
    """A static group's positions exported (``--to-current``), edited by hand and applied:
    m1's partitions resume at sequence 9, m2's stay; exactly m1's messages from 9 on run
    again. A file giving one member's partitions different sequences is refused (one
    consumer, one position), and so is one whose group record changed since."""
    await jetstream.add_stream(api.StreamConfig(
        name="ORDERS", subjects=[f"{p}.orders.>" for p in range(4)], allow_direct=True))
    await admin.create_static_group(jetstream, "ORDERS", "g", StaticGroupConfig(
        max_members=4, members=("m1", "m2")))
    for name in ("m1", "m2"):
        await fleet.add(name, static=True)
    for i in range(20):
        await jetstream.js.publish(f"{i % 4}.orders.k{i % 8}", json.dumps({"n": i}).encode())
    await eventually(lambda: set(range(20)) <= set(completions(fleet.record)), 30,
                     what="20 processed")
    await stop_all(fleet)
    now = await settled_plan(jetstream, Target(current=True))
    doc = json.loads(replay.export_document([now]))
    assert [(e["partition"], e["member"]) for e in doc["groups"][0]["positions"]] == [
        (0, "m1"), (1, "m1"), (2, "m2"), (3, "m2")]
    for entry in doc["groups"][0]["positions"]:
        if entry["member"] == "m1":
            entry["sequence"] = 9
    [edited] = replay.read_document(json.dumps(doc), "edited.json")
    p = await replay.plan(jetstream, "ORDERS", "g", edited.target, expected=edited.expected)
    assert p.blockers == [] and p.members == ("m1", "m2")
    assert [(r.partition, r.from_sequence, r.reprocess) for r in p.partitions] == [
        (0, 9, 3), (1, 9, 3), (2, r2 := p.partitions[2].current, 0), (3, r2, 0)]

    split = json.loads(json.dumps(doc))
    split["groups"][0]["positions"][0]["sequence"] = 5
    [bad] = replay.read_document(json.dumps(split), "split.json")
    refused = await replay.plan(jetstream, "ORDERS", "g", bad.target, expected=bad.expected)
    assert any("share one consumer" in b for b in refused.blockers)

    await replay.execute(jetstream, "ORDERS", "g", edited.target, expected=edited.expected)
    started = time.time()
    for name in ("m1", "m2"):
        await fleet.add(name, static=True)
    want = {8, 9, 12, 13, 16, 17}
    await eventually(lambda: want <= set(completions(after(fleet.record, started))), 30,
                     what="m1's messages from sequence 9 again")
    await _static_idle(jetstream)
    assert set(completions(after(fleet.record, started))) == want
    await stop_all(fleet)
    await admin.add_members(jetstream, "ORDERS", "g", ["m3"])
    stale = await replay.plan(jetstream, "ORDERS", "g", edited.target,
                              expected=edited.expected)
    assert any("record changed since the plan was made" in b for b in stale.blockers)
