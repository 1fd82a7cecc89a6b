"""Interop with the reference implementation, natsio-pcgroups, run for real.

The peer runs in its own venv (Python >= 3.12, see :mod:`tests.support.peer`) as
:mod:`tests.support.peer_driver` processes next to cgroupd, on one real nats-server:

- groups created by either side are read, listed, changed (members, mappings) and deleted
  by the other, through cgroupd's admin API and CLI and through the peer's API; the
  reference's ``-1`` limits survive cgroupd's changes;
- a ``cgroupd join`` instance consumes a group the peer created;
- in pinned mode, a cgroupd instance and a peer instance of one member stand by for each
  other: kill -9 of the active one, the other takes over, nothing is lost, per-key order
  holds (at-least-once across the crash);
- the partition a message lands in is what :func:`cgroupd.core.partitions.partition_of`
  computes, for groups of either side.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import api
from typer.testing import CliRunner

from cgroupd import admin
from cgroupd.cli import app
from cgroupd.core.config import (
    ELASTIC_BUCKET,
    ElasticGroupConfig,
    MemberMapping,
    PartitioningFilter,
    StaticGroupConfig,
    group_key,
)
from cgroupd.core.errors import GroupNotFound
from cgroupd.core.partitions import member_filters, member_partitions, partition_of
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess
from tests.support.groups import Record, check
from tests.support.natsserver import NatsServer
from tests.support.peer import PeerError, PeerProcess
from tests.support.polling import eventually

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HANDLER = "tests.support.handlers.record_handler:handle_events"
runner = CliRunner()
ORDERS = PartitioningFilter("orders.*", (1,))


@pytest_asyncio.fixture
async def peer(peer_python: str, nats_server: NatsServer,
               tmp_path: Path) -> AsyncIterator[PeerProcess]:
    """An admin peer (no member running in it)."""
    async with PeerProcess(peer_python, nats_server.url, tmp_path / "peer-admin.log") as p:
        yield p


async def cli(url: str, *args: str) -> tuple[int, str]:
    clean = {k: None for k in os.environ if k.startswith("CGROUPD_") or k == "NATS_URL"}
    result = await asyncio.to_thread(runner.invoke, app, ["--server", url, *args], env=clean)
    return result.exit_code, result.output


async def orders_stream(js: JetStream, name: str = "ORDERS") -> None:
    await js.add_stream(api.StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))


async def raw_record(js: JetStream, group: str, stream: str = "ORDERS",
                     bucket: str = ELASTIC_BUCKET) -> dict[str, Any]:
    record = await js.get_record(bucket, group_key(stream, group))
    assert record is not None and record.value is not None
    return json.loads(record.value)  # type: ignore[no-any-return]


# -- administration, both directions ---------------------------------------------------
async def test_elastic_group_created_by_the_peer_is_administered_by_cgroupd(
        peer: PeerProcess, jetstream: JetStream, nats_server: NatsServer) -> None:
    """The peer creates an elastic group with its default limits (-1) and members;
    cgroupd's CLI shows and lists it (it used to exit 2 on the -1), changes members and
    mappings, and the peer reads every change, limits still -1; cgroupd deletes it and the
    peer no longer finds it."""
    await orders_stream(jetstream)
    created = await peer.call("create_elastic", stream="ORDERS", group="g", max_members=4,
                              filters=[["orders.*", [1]]])
    assert created["max_buffered_msg"] == -1 and created["max_buffered_bytes"] == -1
    await peer.call("add_members", stream="ORDERS", group="g", members=["a", "b"])

    code, out = await cli(nats_server.url, "--json", "group", "info", "ORDERS", "g")
    assert code == 0, out
    info = json.loads(out)
    assert info["partitions"] == 4 and info["members"] == ["a", "b"], info
    code, out = await cli(nats_server.url, "--json", "group", "ls", "ORDERS")
    assert code == 0 and "g" in out, out
    stored = await admin.get_group(jetstream, "ORDERS", "g")
    assert isinstance(stored.config, ElasticGroupConfig)
    assert stored.config.max_buffered_msgs == 0  # -1: no limit

    # Creating the same group again from cgroupd is a no-op (the peer spells the
    # transform {{Partition(4,1)}}.orders.{{Wildcard(1)}}).
    code, out = await cli(nats_server.url, "group", "create", "ORDERS", "g", "--partitions",
                          "4", "--filter", "orders.*", "--wildcards", "1", "--member", "a",
                          "--member", "b")
    assert code == 0, out
    code, out = await cli(nats_server.url, "member", "add", "ORDERS", "g", "c")
    assert code == 0, out
    seen = await peer.call("get", kind="elastic", stream="ORDERS", group="g")
    assert seen["members"] == ["a", "b", "c"]
    assert seen["max_buffered_msg"] == -1 and seen["max_buffered_bytes"] == -1
    await admin.drop_members(jetstream, "ORDERS", "g", ["a"])
    assert (await peer.call("get", kind="elastic", stream="ORDERS", group="g"))["members"] \
        == ["b", "c"]
    code, out = await cli(nats_server.url, "mapping", "set", "ORDERS", "g", "b=0,1", "c=2-3")
    assert code == 0, out
    seen = await peer.call("get", kind="elastic", stream="ORDERS", group="g")
    assert seen["member_mappings"] == [{"member": "b", "partitions": [0, 1]},
                                       {"member": "c", "partitions": [2, 3]}]
    assert "members" not in seen and seen["max_buffered_msg"] == -1
    await admin.clear_mappings(jetstream, "ORDERS", "g")
    assert (await peer.call("get", kind="elastic", stream="ORDERS", group="g"))["members"] \
        == ["b", "c"]

    code, out = await cli(nats_server.url, "group", "delete", "ORDERS", "g", "--yes")
    assert code == 0, out
    with pytest.raises(PeerError, match="ConsumerGroupNotFoundError"):
        await peer.call("get", kind="elastic", stream="ORDERS", group="g")
    assert await jetstream.stream_info("ORDERS-g") is None
    assert await peer.call("list", kind="elastic", stream="ORDERS") == []


async def test_elastic_group_created_by_cgroupd_is_administered_by_the_peer(
        peer: PeerProcess, jetstream: JetStream) -> None:
    """cgroupd creates an elastic group; the peer reads and lists it, adds and drops
    members, sets and deletes mappings, and cgroupd reads each change; the peer deletes
    it (record and work-queue stream) and cgroupd no longer finds it."""
    await orders_stream(jetstream)
    await admin.create_elastic_group(jetstream, "ORDERS", "g", ElasticGroupConfig(
        max_members=4, partitioning_filters=(ORDERS,), members=("a", "b"),
        max_buffered_msgs=1000))
    seen = await peer.call("get", kind="elastic", stream="ORDERS", group="g")
    assert seen["max_members"] == 4 and seen["members"] == ["a", "b"]
    assert seen["max_buffered_msg"] == 1000 and "max_buffered_bytes" not in seen
    assert seen["partitioning_filters"] == [{"filter": "orders.*",
                                             "partitioning_wildcards": [1]}]
    assert await peer.call("list", kind="elastic", stream="ORDERS") == ["g"]
    # The peer creating the same group is a no-op (its limits as cgroupd wrote them).
    await peer.call("create_elastic", stream="ORDERS", group="g", max_members=4,
                    filters=[["orders.*", [1]]], max_buffered_msgs=1000, max_buffered_bytes=0)

    async def ours() -> ElasticGroupConfig:
        config = (await admin.get_group(jetstream, "ORDERS", "g")).config
        assert isinstance(config, ElasticGroupConfig)
        return config

    await peer.call("add_members", stream="ORDERS", group="g", members=["c"])
    assert (await ours()).members == ("a", "b", "c")
    await peer.call("delete_members", stream="ORDERS", group="g", members=["a"])
    assert (await ours()).members == ("b", "c")
    await peer.call("set_mappings", stream="ORDERS", group="g",
                    mappings=[["b", [0, 3]], ["c", [1, 2]]])
    assert (await ours()).member_mappings == (MemberMapping("b", (0, 3)),
                                              MemberMapping("c", (1, 2)))
    await peer.call("delete_mappings", stream="ORDERS", group="g")
    config = await ours()
    assert config.members == () and config.member_mappings == ()
    assert config.max_buffered_msgs == 1000

    await peer.call("delete", kind="elastic", stream="ORDERS", group="g")
    with pytest.raises(GroupNotFound):
        await admin.get_group(jetstream, "ORDERS", "g")
    assert await jetstream.stream_info("ORDERS-g") is None


async def test_static_groups_are_shared_both_ways(peer: PeerProcess,
                                                  jetstream: JetStream,
                                                  nats_server: NatsServer) -> None:
    """Static groups: the peer's (members, mappings) are read, listed, changed and deleted
    by cgroupd; cgroupd's are read, listed and deleted by the peer (its static groups are
    immutable: it has no membership calls for them)."""
    await jetstream.add_stream(api.StreamConfig(name="P", subjects=["p.>"]))
    await peer.call("create_static", stream="P", group="s1", max_members=2,
                    filters=["p.*"], members=["a", "b"])
    await peer.call("create_static", stream="P", group="s2", max_members=2,
                    mappings=[["a", [1]], ["b", [0]]])
    assert await admin.list_groups(jetstream, "P") == [("s1", "static"), ("s2", "static")]
    s1 = (await admin.get_group(jetstream, "P", "s1")).config
    assert isinstance(s1, StaticGroupConfig)
    assert s1.filters == ("p.*",) and s1.members == ("a", "b")
    code, out = await cli(nats_server.url, "--json", "group", "info", "P", "s2")
    assert code == 0 and json.loads(out)["mappings"] == [
        {"member": "a", "partitions": [1]}, {"member": "b", "partitions": [0]}], out
    await admin.add_members(jetstream, "P", "s1", ["c"])
    assert (await peer.call("get", kind="static", stream="P", group="s1"))["members"] == [
        "a", "b", "c"]
    await admin.set_mappings(jetstream, "P", "s2", [MemberMapping("a", (0, 1))])
    assert (await peer.call("get", kind="static", stream="P", group="s2"))[
        "member_mappings"] == [{"member": "a", "partitions": [0, 1]}]
    await admin.delete_group(jetstream, "P", "s1")
    with pytest.raises(PeerError, match="ConsumerGroupNotFoundError"):
        await peer.call("get", kind="static", stream="P", group="s1")

    await admin.create_static_group(jetstream, "P", "s3", StaticGroupConfig(
        max_members=3, filters=("p.>",), member_mappings=(
            MemberMapping("x", (0, 2)), MemberMapping("y", (1,)))))
    seen = await peer.call("get", kind="static", stream="P", group="s3")
    assert seen == {"max_members": 3, "filters": ["p.>"], "member_mappings": [
        {"member": "x", "partitions": [0, 2]}, {"member": "y", "partitions": [1]}]}
    assert await peer.call("list", kind="static", stream="P") == ["s2", "s3"]
    await peer.call("delete", kind="static", stream="P", group="s3")
    assert await admin.list_groups(jetstream, "P") == [("s2", "static")]


# -- consuming ---------------------------------------------------------------------------
async def publish(nc: Client, start: int, count: int, keys: int = 8) -> list[tuple[str, int]]:
    js = nc.jetstream()
    sent = []
    for n in range(start, start + count):
        key = f"k{n % keys}"
        await js.publish(f"orders.{key}", json.dumps({"key": key, "n": n}).encode())
        sent.append((key, n))
    return sent


def done(record: Callable[[], Record], sent: list[tuple[str, int]]) -> Callable[[], bool]:
    want = {n for _, n in sent}
    return lambda: want <= {e["n"] for e in record().ends()}


async def test_cgroupd_joins_a_group_the_peer_created(
        peer: PeerProcess, peer_python: str, jetstream: JetStream, nc: Client,
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A peer-created elastic group (with the reference's -1 limits) whose member ``a``
    runs as ``cgroupd join`` (sync mode) and member ``b`` as a peer instance: each
    consumes its own partitions, everything is processed once, in order per key."""
    await orders_stream(jetstream)
    await peer.call("create_elastic", stream="ORDERS", group="g", max_members=4,
                    filters=[["orders.*", [1]]])
    await peer.call("add_members", stream="ORDERS", group="g", members=["a", "b"])
    records = {m: tmp_path / f"{m}.jsonl" for m in ("a", "b")}
    proc = JoinProcess(nats_server.url, tmp_path, "a", "--stream", "ORDERS", "--group", "g",
                       "--member", "a", "--handler", HANDLER, record=records["a"],
                       metrics=False)
    member_b = await PeerProcess(peer_python, nats_server.url, tmp_path / "b.log").start()
    try:
        await member_b.call("consume", kind="elastic", stream="ORDERS", group="g",
                            member="b", record=str(records["b"]), max_ack_pending=1)

        def record() -> Record:
            return Record.load(records.values())

        sent = await publish(nc, 0, 200)
        await eventually(done(record, sent), 30, what="200 messages processed")
        verdict = check(record(), sent)
        verdict.assert_ok()
        assert verdict.duplicates == 0
        config = (await admin.get_group(jetstream, "ORDERS", "g")).config
        by = {e["partition"]: e["instance"].split("-")[0] for e in record().ends()}
        assert by == {p: "cgroupd" if p in member_partitions(config, "a") else "peer"
                      for p in range(4)}
    finally:
        proc.close()
        await member_b.close()


async def test_cgroupd_joins_a_static_group_the_peer_created(
        peer: PeerProcess, jetstream: JetStream, nc: Client, nats_server: NatsServer,
        tmp_path: Path) -> None:
    """A peer-created static group with filters: a ``cgroupd join`` instance consumes its
    partitions' subjects under the group's filters, and, like the reference, not the
    other subjects of the stream."""
    await jetstream.add_stream(api.StreamConfig(name="P", subjects=["0.>", "1.>"]))
    await peer.call("create_static", stream="P", group="s", max_members=2,
                    filters=["p.*"], members=["a"])
    record = tmp_path / "a.jsonl"
    proc = JoinProcess(nats_server.url, tmp_path, "a", "--stream", "P", "--group", "s",
                       "--member", "a", "--handler", HANDLER, record=record, metrics=False)
    try:
        js = nc.jetstream()
        sent = []
        for n in range(40):
            key = f"k{n % 5}"
            # In a static group the publisher picks the partition: each key keeps to one
            # (order is kept per partition, and partitions run at once).
            await js.publish(f"{n % 5 % 2}.p.{key}", json.dumps({"key": key, "n": n}).encode())
            sent.append((key, n))
        for p in (0, 1):
            await js.publish(f"{p}.other", json.dumps({"key": "other", "n": -1}).encode())
        await eventually(done(lambda: Record.load([record]), sent), 30,
                         what="the static group's messages")
        check(Record.load([record]), sent).assert_ok()
        info = await jetstream.consumer_info("P", "s-a")
        assert info is not None
        assert info["config"]["filter_subjects"] == ["0.p.*", "1.p.*"]
        assert -1 not in {e["n"] for e in Record.load([record]).ends()}
    finally:
        proc.close()


async def _pinned_takeover(peer_python: str, nats_server: NatsServer, jetstream: JetStream,
                           nc: Client, tmp_path: Path, created_by: str,
                           first: str) -> None:
    """One member ``m``, a cgroupd instance and a peer instance; ``first`` is started
    first (so it gets pinned), then the other; traffic flows, the active one is killed
    with SIGKILL mid-stream, the other takes over; then the killed kind is started again
    and the new active one is killed too, so each kind takes over once."""
    await orders_stream(jetstream)
    admin_peer = await PeerProcess(peer_python, nats_server.url).start()
    try:
        if created_by == "peer":
            await admin_peer.call("create_elastic", stream="ORDERS", group="g",
                                  max_members=4, filters=[["orders.*", [1]]])
            await admin_peer.call("add_members", stream="ORDERS", group="g", members=["m"])
        else:
            await admin.create_elastic_group(jetstream, "ORDERS", "g", ElasticGroupConfig(
                max_members=4, partitioning_filters=(ORDERS,), members=("m",)))
    finally:
        await admin_peer.close()

    records: list[Path] = []
    running: list[Any] = []

    async def start(kind: str) -> Any:
        path = tmp_path / f"{kind}-{len(records)}.jsonl"
        records.append(path)
        if kind == "cgroupd":
            proc = JoinProcess(nats_server.url, tmp_path, path.stem, "--stream", "ORDERS",
                               "--group", "g", "--member", "m", "--handler", HANDLER,
                               "--exclusivity", "pinned", "--ack-wait", "2",
                               "--max-in-flight", "1", record=path, metrics=False)
        else:
            proc = await PeerProcess(peer_python, nats_server.url,
                                     tmp_path / f"{path.stem}.log").start()
            # natsio's consumer create is create-or-update: a peer instance that joins
            # rewrites the shared consumer with its template. Give it cgroupd's
            # (--max-in-flight 1: one message in flight, so a crash never lets a
            # later message overtake one waiting for redelivery).
            await proc.call("consume", kind="elastic", stream="ORDERS", group="g",
                            member="m", record=str(path), ack_wait=2, max_ack_pending=1)
        running.append(proc)
        return proc

    def record() -> Record:
        return Record.load(records)

    def kill(proc: Any) -> None:
        if isinstance(proc, JoinProcess):
            proc.proc.kill()
        else:
            proc.kill()

    def pid(proc: Any) -> int:
        return proc.proc.pid if isinstance(proc, JoinProcess) else proc.pid  # type: ignore

    def instance(proc: Any) -> str:
        return f"{'cgroupd' if isinstance(proc, JoinProcess) else 'peer'}-{pid(proc)}"

    try:
        other = "peer" if first == "cgroupd" else "cgroupd"
        active = await start(first)
        sent = await publish(nc, 0, 40)
        await eventually(done(record, sent), 30, what=f"{first} to process the first 40")
        standby = await start(other)
        await asyncio.sleep(1.0)  # the standby joins (pulls, waits for the pin)
        for round_ in range(2):
            more = await publish(nc, len(sent), 40)
            sent += more
            await eventually(done(record, more), 30, what="the active one to go on")
            processed_by = {e["instance"] for e in record().ends() if e["n"] >= more[0][1]}
            assert processed_by == {instance(active)}, (processed_by, instance(active))
            kill(active)
            # Keep publishing while the standby takes over.
            tail = await publish(nc, len(sent), 60)
            sent += tail
            await eventually(done(record, tail), 60,
                             what=f"{instance(standby)} to take over from {instance(active)}")
            late = {e["instance"] for e in record().ends() if e["n"] >= tail[-1][1] - 5}
            assert late == {instance(standby)}, late
            if round_ == 0:
                killed_kind = "cgroupd" if isinstance(active, JoinProcess) else "peer"
                active, standby = standby, await start(killed_kind)
                await asyncio.sleep(1.0)
        verdict = check(record(), sent, rewinds=True)
        verdict.assert_ok()
    finally:
        for proc in running:
            if isinstance(proc, JoinProcess):
                proc.close()
            else:
                await proc.close()


@pytest.mark.parametrize(("created_by", "first"), [("peer", "cgroupd"), ("cgroupd", "peer")])
async def test_pinned_cgroupd_and_peer_instances_stand_by_for_each_other(
        peer_python: str, nats_server: NatsServer, jetstream: JetStream, nc: Client,
        tmp_path: Path, created_by: str, first: str) -> None:
    """Pinned mode: a cgroupd instance and a peer instance of the same member share its
    consumer (same name, same filters); each one killed with SIGKILL while active is
    replaced by the other, nothing is lost and per-key order holds."""
    await _pinned_takeover(peer_python, nats_server, jetstream, nc, tmp_path, created_by,
                           first)


# -- partitioning ------------------------------------------------------------------------
SUBJECTS = ["orders.k0", "orders.17", "orders.0", "orders.ключ", "orders.🙂", "orders.a",
            *(f"orders.key-{i}" for i in range(60))]
MULTI = ["multi.ab.c", "multi.a.bc", "multi.x.y", *(f"multi.{i}.{i * 7}" for i in range(40))]
WHOLE = ["whole.a", "whole.a.b.c", "whole.ключ.1", *(f"whole.{i}.z" for i in range(40))]


async def _landed(js: JetStream, stream: str) -> dict[str, int]:
    counts = await js.subject_counts(stream)
    return {subject.split(".", 1)[1]: int(subject.split(".", 1)[0]) for subject in counts}


async def test_partition_of_agrees_with_groups_of_both_sides(
        peer: PeerProcess, jetstream: JetStream, nc: Client) -> None:
    """Messages land, in the work-queue streams of a peer-created and of a
    cgroupd-created group with the same filters, in the partition partition_of computes
    (one wildcard, two wildcards in reverse order, the whole subject)."""
    await jetstream.add_stream(api.StreamConfig(name="H", subjects=["orders.>", "multi.>",
                                                                     "whole.>"]))
    filters = [PartitioningFilter("orders.*", (1,)), PartitioningFilter("multi.*.*", (2, 1)),
               PartitioningFilter("whole.>")]
    await peer.call("create_elastic", stream="H", group="peer", max_members=7,
                    filters=[[f.filter, list(f.partitioning_wildcards)] for f in filters])
    await admin.create_elastic_group(jetstream, "H", "ours", ElasticGroupConfig(
        max_members=7, partitioning_filters=tuple(filters)))
    js = nc.jetstream()
    for subject in SUBJECTS + MULTI + WHOLE:
        await js.publish(subject, b"")
    for group in ("peer", "ours"):
        await eventually(lambda g=group: _count(jetstream, f"H-{g}", len(SUBJECTS + MULTI
                                                                          + WHOLE)), 10)
        landed = await _landed(jetstream, f"H-{group}")
        assert landed == {s: partition_of(s, filters, 7) for s in SUBJECTS + MULTI + WHOLE}


def _count(js: JetStream, stream: str, n: int) -> Coroutine[Any, Any, bool]:
    async def go() -> bool:
        info = await js.stream_info(stream)
        return info is not None and info.state.messages == n
    return go()


async def test_pinned_member_filters_are_the_references(peer: PeerProcess,
                                                        jetstream: JetStream) -> None:
    """The consumer a peer member creates has exactly the filters member_filters gives,
    for a member list and for mappings (so a cgroupd instance shares it as it is)."""
    await orders_stream(jetstream)
    await peer.call("create_elastic", stream="ORDERS", group="g", max_members=4,
                    filters=[["orders.*", [1]]])
    await peer.call("add_members", stream="ORDERS", group="g", members=["a", "b", "c"])
    member = await PeerProcess(peer.python, peer.url).start()
    try:
        await member.call("consume", kind="elastic", stream="ORDERS", group="g",
                          member="b", record="/dev/null")
        config = (await admin.get_group(jetstream, "ORDERS", "g")).config

        async def filters() -> list[str] | None:
            info = await jetstream.consumer_info("ORDERS-g", "b")
            return None if info is None else info["config"]["filter_subjects"]

        await eventually(filters, 10, what="the peer's consumer")
        assert await filters() == member_filters(config, "b") == ["1.orders.*"]
        await peer.call("set_mappings", stream="ORDERS", group="g",
                        mappings=[["a", [0]], ["b", [3, 1]], ["c", [2]]])
        config = (await admin.get_group(jetstream, "ORDERS", "g")).config
        want = member_filters(config, "b")
        assert want == ["3.>", "1.>"]
        await eventually(lambda: _equal(filters, want), 15, what="the peer's new filters")
    finally:
        await member.close()


async def _equal(get: Callable[[], Coroutine[Any, Any, Any]], want: Any) -> bool:
    return bool(await get() == want)


# -- whole-subject groups (orbit.go >= 0.2.0: no partitioning filter) --------------------
async def test_whole_subject_group_written_as_go_writes_it_is_consumed_by_both(
        peer: PeerProcess, peer_python: str, jetstream: JetStream, nc: Client,
        nats_server: NatsServer, tmp_path: Path) -> None:
    """A whole-subject group exactly as orbit.go's ``cg elastic create ORDERS g 4``
    without a filter leaves it (record ``{"max_members":4,"partitioning_filters":null}``,
    a work queue sourcing ``>`` into ``{{Partition(4)}}.>``); cgroupd's CLI adds members
    ``a`` and ``b`` (the record stays Go's, ``null`` included); ``a`` runs as ``cgroupd
    join``, ``b`` as a natsio-pcgroups instance, side by side: every message processed
    exactly once, in order per key, each in the partition the server hashed the whole
    subject to and by its partition's owner."""
    await orders_stream(jetstream)
    await jetstream.bucket(ELASTIC_BUCKET, create_with=api.KeyValueConfig(
        bucket=ELASTIC_BUCKET, history=1))
    await jetstream.create_record(ELASTIC_BUCKET, group_key("ORDERS", "g"),
                                  b'{"max_members":4,"partitioning_filters":null}')
    await nc.jetstream().add_stream(api.StreamConfig(
        name="ORDERS-g", retention=api.RetentionPolicy.WORK_QUEUE,
        discard=api.DiscardPolicy.NEW, allow_direct=True,
        sources=[api.StreamSource(name="ORDERS", subject_transforms=[
            api.SubjectTransform(src=">", dest="{{Partition(4)}}.>")])]))
    code, out = await cli(nats_server.url, "member", "add", "ORDERS", "g", "a", "b")
    assert code == 0, out
    record = await jetstream.get_record(ELASTIC_BUCKET, group_key("ORDERS", "g"))
    assert record is not None and record.value == (
        b'{"max_members":4,"partitioning_filters":null,"members":["a","b"]}')
    seen = await peer.call("get", kind="elastic", stream="ORDERS", group="g")
    assert seen["members"] == ["a", "b"] and not seen.get("partitioning_filters")

    records = {m: tmp_path / f"{m}.jsonl" for m in ("a", "b")}
    proc = JoinProcess(nats_server.url, tmp_path, "a", "--stream", "ORDERS", "--group", "g",
                       "--member", "a", "--handler", HANDLER, record=records["a"],
                       metrics=False)
    member_b = await PeerProcess(peer_python, nats_server.url, tmp_path / "b.log").start()
    try:
        await member_b.call("consume", kind="elastic", stream="ORDERS", group="g",
                            member="b", record=str(records["b"]), max_ack_pending=1)

        def load() -> Record:
            return Record.load(records.values())

        sent = await publish(nc, 0, 400, keys=40)
        await eventually(done(load, sent), 60, what="400 messages processed",
                         diagnostics=proc.log_tail)
        verdict = check(load(), sent)
        verdict.assert_ok()
        assert verdict.duplicates == 0
        ends = load().ends()
        assert len(ends) == 400
        config = (await admin.get_group(jetstream, "ORDERS", "g")).config
        assert isinstance(config, ElasticGroupConfig) and config.whole_subject
        for e in ends:
            assert e["partition"] == partition_of(f"orders.{e['subject']}",
                                                  config.effective_filters, 4), e
        by = {e["partition"]: e["instance"].split("-")[0] for e in ends}
        assert by == {p: "cgroupd" if p in member_partitions(config, "a") else "peer"
                      for p in range(4)}
        counts = {who: sum(1 for e in ends if e["instance"].startswith(who))
                  for who in ("cgroupd", "peer")}
        assert counts["cgroupd"] > 0 and counts["peer"] > 0, counts
    finally:
        proc.close()
        await member_b.close()


async def test_whole_subject_group_created_by_the_peer_is_administered_by_cgroupd(
        peer: PeerProcess, jetstream: JetStream, nats_server: NatsServer) -> None:
    """natsio-pcgroups' create_elastic with no filter (its default -1 limits, written with
    Python's ``", "`` separators): cgroupd lists it as a whole-subject group, adds a
    member writing back every other byte as the peer wrote it, and the peer reads the
    change; a whole-subject group cgroupd creates is read by the peer."""
    await orders_stream(jetstream)
    await peer.call("create_elastic", stream="ORDERS", group="p", max_members=3, filters=[])
    before = await jetstream.get_record(ELASTIC_BUCKET, group_key("ORDERS", "p"))
    assert before is not None and before.value is not None
    code, out = await cli(nats_server.url, "--json", "group", "info", "ORDERS", "p")
    assert code == 0, out
    assert json.loads(out)["whole_subject"] is True
    code, out = await cli(nats_server.url, "member", "add", "ORDERS", "p", "x")
    assert code == 0, out
    after = await jetstream.get_record(ELASTIC_BUCKET, group_key("ORDERS", "p"))
    assert after is not None and after.value is not None
    assert after.value == before.value[:-1] + b', "members": ["x"]}', (before, after)
    seen = await peer.call("get", kind="elastic", stream="ORDERS", group="p")
    assert seen["members"] == ["x"] and seen["max_buffered_msg"] == -1

    code, out = await cli(nats_server.url, "group", "create", "ORDERS", "ours",
                          "--partitions", "5", "--member", "y")
    assert code == 0, out
    ours = await peer.call("get", kind="elastic", stream="ORDERS", group="ours")
    assert ours["max_members"] == 5 and ours["members"] == ["y"]
    assert not ours.get("partitioning_filters")
    info = await jetstream.stream_info("ORDERS-ours")
    assert info is not None and info.config.sources
    assert [(t.src, t.dest) for t in info.config.sources[0].subject_transforms or []] == [
        (">", "{{Partition(5)}}.>")]
