"""Group records as the reference writes them, on a real nats-server: whole-subject groups
(created by cgroupd or written as orbit.go writes them), partitions computed as the server
computes them, one bad record never hiding the others, and ``group create`` all or nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import string
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js import api
from typer.testing import CliRunner, Result

from cgroupd import admin
from cgroupd.cli import app
from cgroupd.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticGroupConfig,
    PartitioningFilter,
    group_key,
)
from cgroupd.core.errors import BucketNotFound, ConfigError
from cgroupd.core.partitions import partition_of, strip_partition
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess, restore_logging  # noqa: F401 - autouse fixture
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

FIXTURES = Path(__file__).parent.parent / "fixtures" / "reference-records"
runner = CliRunner()


async def cli(url: str, *args: str) -> Result:
    """``cgroupd --server url args...`` in-process, in a thread (it runs its own loop)."""
    clean = {k: None for k in os.environ if k.startswith("CGROUPD_") or k == "NATS_URL"}
    return await asyncio.to_thread(runner.invoke, app, ["--server", url, *args], env=clean)


def one_line_error(result: Result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    err = result.stderr.strip()
    assert err.startswith("cgroupd: error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


async def put_record(js: JetStream, bucket: str, stream: str, group: str,
                     value: bytes) -> None:
    """A record written by someone else (the reference, or garbage), byte for byte."""
    origin = await js.stream_info(stream)
    assert origin is not None
    await js.bucket(bucket, create_with=api.KeyValueConfig(bucket=bucket, history=1))
    await js.create_record(bucket, group_key(stream, group), value)


async def record_bytes(js: JetStream, bucket: str, stream: str, group: str) -> bytes | None:
    record = await js.get_record(bucket, group_key(stream, group))
    return None if record is None else record.value


async def go_create_work_queue(nc: Client, stream: str, group: str, partitions: int) -> None:
    """The work-queue stream orbit.go's CreateElastic makes for a group with no filter:
    one source of ``stream`` with the transform ``>`` -> ``{{Partition(N)}}.>``."""
    await nc.jetstream().add_stream(api.StreamConfig(
        name=f"{stream}-{group}", retention=api.RetentionPolicy.WORK_QUEUE,
        discard=api.DiscardPolicy.NEW, allow_direct=True,
        sources=[api.StreamSource(name=stream, subject_transforms=[api.SubjectTransform(
            src=">", dest=f"{{{{Partition({partitions})}}}}.>")])]))


async def test_ls_lists_every_readable_group_and_marks_unreadable_ones(
        nats_server: NatsServer, jetstream: JetStream, nc: Client) -> None:
    """Garbage and wrong-shape records among good ones: ``group ls`` lists every group
    (text and --json), marking the unreadable ones, exit 0; ``group info`` of a bad one
    exits 1 naming the problem; ``group delete`` of it exits 1 pointing to --force, and
    ``--force`` removes it. (Main failed the whole listing with exit 2.)"""
    url = nats_server.url
    await nc.jetstream().add_stream(api.StreamConfig(name="LS", subjects=["ls.>"]))
    assert (await cli(url, "group", "create", "LS", "good", "--partitions", "2",
                      "--filter", "ls.*", "--wildcards", "1", "--member", "m1")).exit_code == 0
    await put_record(jetstream, ELASTIC_BUCKET, "LS", "go",
                     (FIXTURES / "go-cli-whole-subject.record").read_bytes())
    await put_record(jetstream, ELASTIC_BUCKET, "LS", "garbage", b"\x00not json")
    await put_record(jetstream, ELASTIC_BUCKET, "LS", "shape", b'{"max_members":"four"}')
    await put_record(jetstream, STATIC_BUCKET, "LS", "sgarbage", b"[1,2]")

    listed = await cli(url, "--json", "group", "ls", "LS")
    assert listed.exit_code == 0, listed.output
    rows = {g["group"]: g for g in json.loads(listed.stdout)}
    assert set(rows) == {"good", "go", "garbage", "shape", "sgarbage"}
    assert rows["good"]["assignment"] == {"m1": [0, 1]} and "error" not in rows["good"]
    assert rows["go"]["partitions"] == 10 and rows["go"]["whole_subject"] is True
    assert "not valid JSON" in rows["garbage"]["error"]
    assert "max_members must be an integer" in rows["shape"]["error"]
    assert rows["sgarbage"]["type"] == "static" and "JSON object" in rows["sgarbage"]["error"]
    text = await cli(url, "group", "ls", "LS")
    assert text.exit_code == 0
    lines = {line.split()[0]: line for line in text.stdout.splitlines()[1:]}
    assert "UNREADABLE" in lines["garbage"] and "UNREADABLE" not in lines["good"]
    assert "m1" in lines["good"] and "10" in lines["go"]
    assert "3 group record(s) of LS cannot be read" in text.stderr

    one_line_error(await cli(url, "group", "info", "LS", "garbage"), 1,
                   "group LS/garbage", "cannot be read", "not valid JSON")
    one_line_error(await cli(url, "group", "delete", "LS", "shape", "--yes"), 1,
                   "--force")
    assert await record_bytes(jetstream, ELASTIC_BUCKET, "LS", "shape") is not None
    for name in ("shape", "garbage", "sgarbage"):
        forced = await cli(url, "group", "delete", "LS", name, "--yes", "--force")
        assert forced.exit_code == 0, forced.output
    after = json.loads((await cli(url, "--json", "group", "ls", "LS")).stdout)
    assert [g["group"] for g in after] == ["go", "good"]
    # --force on a readable group is an ordinary delete.
    assert (await cli(url, "group", "delete", "LS", "good", "--yes", "--force")).exit_code == 0
    assert await jetstream.stream_info("LS-good") is None


async def test_a_group_written_as_go_writes_it_is_changed_byte_for_byte(
        nats_server: NatsServer, jetstream: JetStream, nc: Client) -> None:
    """orbit.go's whole-subject record (``partitioning_filters: null``) with its stream:
    ``member add`` writes back ``null`` (not ``[]``) and nothing else but the members;
    ``group create`` of the same group by cgroupd is a no-op on both."""
    url = nats_server.url
    await nc.jetstream().add_stream(api.StreamConfig(name="GO", subjects=["go.>"]))
    await put_record(jetstream, ELASTIC_BUCKET, "GO", "cg",
                     b'{"max_members":4,"partitioning_filters":null}')
    await go_create_work_queue(nc, "GO", "cg", 4)
    added = await cli(url, "member", "add", "GO", "cg", "a", "b")
    assert added.exit_code == 0, added.output
    assert await record_bytes(jetstream, ELASTIC_BUCKET, "GO", "cg") == (
        b'{"max_members":4,"partitioning_filters":null,"members":["a","b"]}')
    again = await cli(url, "--json", "group", "create", "GO", "cg", "--partitions", "4",
                      "--member", "a", "--member", "b")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["whole_subject"] is True
    assert await record_bytes(jetstream, ELASTIC_BUCKET, "GO", "cg") == (
        b'{"max_members":4,"partitioning_filters":null,"members":["a","b"]}')


def _random_subject(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + "-_é€"
    tokens = ["ws"] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
                       for _ in range(rng.randint(1, 4))]
    return ".".join(tokens)


async def test_whole_subject_group_partitions_as_the_server_does(
        nats_server: NatsServer, jetstream: JetStream, nc: Client) -> None:
    """``group create`` without --filter: the Go CLI's record, a stream sourcing ``>``
    into ``{{Partition(7)}}.>``; for 500 random subjects (1-4 random tokens, non-ASCII
    among them) the partition the server put each in is the one cgroupd computes
    client side (Spark mode=read, lag, replay), and a replay plan counts them there."""
    url = nats_server.url
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="WS", subjects=["ws.>"]))
    created = await cli(url, "--json", "group", "create", "WS", "all", "--partitions", "7")
    assert created.exit_code == 0, created.output
    assert json.loads(created.stdout)["filters"] == []
    assert await record_bytes(jetstream, ELASTIC_BUCKET, "WS", "all") == (
        b'{"max_members":7,"partitioning_filters":null}')
    info = await jetstream.stream_info("WS-all")
    assert info is not None and info.config.sources
    transforms = info.config.sources[0].subject_transforms or []
    assert [(t.src, t.dest) for t in transforms] == [(">", "{{Partition(7)}}.>")]

    rng = random.Random(31)
    subjects = list(dict.fromkeys(_random_subject(rng) for _ in range(500)))
    assert len(subjects) == 500
    for subject in subjects:
        await js.publish(subject, b"x")
    config = (await admin.get_group(jetstream, "WS", "all")).config
    assert isinstance(config, ElasticGroupConfig)

    async def all_sourced() -> dict[str, int] | None:
        state = (await js.stream_info("WS-all", subjects_filter=">")).state
        return dict(state.subjects or {}) if state.messages == 500 else None

    sourced = await eventually(all_sourced, 15, what="500 messages in WS-all")
    seen = {}
    for wq_subject in sourced:
        partition, subject = strip_partition(wq_subject)
        seen[subject] = partition
    assert set(seen) == set(subjects)
    wrong = {s: (p, partition_of(s, config.effective_filters, 7)) for s, p in seen.items()
             if partition_of(s, config.effective_filters, 7) != p}
    assert not wrong, list(wrong.items())[:5]
    assert len(set(seen.values())) == 7  # every partition used: the hash is not constant
    # Once processed (here: purged from the work queue), a replay plan counts what it
    # would process again, computed client side, in the same partitions.
    await js.purge_stream("WS-all")
    plan = await cli(url, "--json", "replay", "WS", "all", "--to-earliest")
    assert plan.exit_code == 0, plan.output
    again = {p["partition"]: p["reprocess"] for p in json.loads(plan.stdout)["partitions"]}
    per_partition = {p: list(seen.values()).count(p) for p in range(7)}
    assert again == per_partition


async def test_whole_subject_group_on_an_older_server_is_refused_clearly(
        nats_server: NatsServer, jetstream: JetStream, nc: Client,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose INFO says 2.11: creating a whole-subject group is refused before
    anything is written, naming the version needed; with a filter it goes ahead."""
    await nc.jetstream().add_stream(api.StreamConfig(name="OLD", subjects=["old.>"]))
    real_version = jetstream.server_version()  # from the server's INFO
    assert real_version is not None and real_version[:2] >= (2, 12), real_version
    monkeypatch.setattr(JetStream, "server_version", lambda self: (2, 11, 4))
    with pytest.raises(ConfigError, match=r"nats-server >= 2.12.*this server is 2.11.4"):
        await admin.create_elastic_group(jetstream, "OLD", "g", ElasticGroupConfig(2))
    with pytest.raises(BucketNotFound):  # nothing was written, not even the bucket
        await record_bytes(jetstream, ELASTIC_BUCKET, "OLD", "g")
    assert await jetstream.stream_info("OLD-g") is None
    real = await nc.jetstream().stream_info("OLD")
    assert real.config.name == "OLD"


async def test_create_is_all_or_nothing(nats_server: NatsServer, jetstream: JetStream,
                                        nc: Client) -> None:
    """Overlapping filters (``ov.*.*`` and ``ov.>``): the server refuses the work-queue
    stream; the command exits 1 with the server's reason and leaves no record (main left
    one, and a join stood by on it forever); a correct create afterwards works."""
    url = nats_server.url
    await nc.jetstream().add_stream(api.StreamConfig(name="OV", subjects=["ov.>"]))
    refused = await cli(url, "group", "create", "OV", "g", "--partitions", "2",
                        "--filter", "ov.*.*", "--wildcards", "1", "--filter", "ov.>")
    one_line_error(refused, 1, "creating stream OV-g", "source filters can not overlap")
    assert await record_bytes(jetstream, ELASTIC_BUCKET, "OV", "g") is None
    assert await jetstream.stream_info("OV-g") is None
    assert json.loads((await cli(url, "--json", "group", "ls", "OV")).stdout) == []
    fixed = await cli(url, "group", "create", "OV", "g", "--partitions", "2",
                      "--filter", "ov.*.*", "--wildcards", "1")
    assert fixed.exit_code == 0, fixed.output
    assert await jetstream.stream_info("OV-g") is not None


@pytest.mark.slow
async def test_a_member_of_a_group_without_its_stream_is_not_ready(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path) -> None:
    """A record whose work-queue stream does not exist (left by a failed create): the
    joined instance answers /readyz 503 saying so (main: 200, standing by forever), and
    ``cgroupd status`` names the missing stream (main: "stream not found"); once the
    stream exists, /readyz turns 200 by itself."""
    await nc.jetstream().add_stream(api.StreamConfig(name="NS", subjects=["ns.>"]))
    config = ElasticGroupConfig(max_members=2, members=("m1",), partitioning_filters=(
        PartitioningFilter("ns.*", (1,)),))
    await put_record(jetstream, ELASTIC_BUCKET, "NS", "g", config.to_json())
    proc = JoinProcess(nats_server.url, tmp_path, "m1", "--stream", "NS", "--group", "g",
                       "--member", "m1", "--handler",
                       "tests.support.handlers.record_handler:handle")
    try:
        async with aiohttp.ClientSession() as http:
            async def not_ready() -> dict[str, Any] | None:
                status, body = await proc.get(http, "/readyz")
                return json.loads(body) if status == 503 and "problem" in body else None

            body = await eventually(not_ready, 30, what="/readyz 503 with the problem",
                                    diagnostics=proc.log_tail)
            assert "work-queue stream NS-g does not exist" in body["problem"]
            assert any(e.get("event") == "group cannot be consumed" for e in proc.events())
            one_line_error(await cli(nats_server.url, "status", "NS", "g"), 1,
                           "the work-queue stream NS-g of group NS/g does not exist")
            await admin.create_elastic_group(jetstream, "NS", "g", config)

            async def ready() -> bool:
                return (await proc.get(http, "/readyz"))[0] == 200

            await eventually(ready, 30, what="/readyz 200 once the stream exists",
                             diagnostics=proc.log_tail)
    finally:
        proc.close()


async def test_join_refuses_more_partitions_than_a_consumer_can_filter(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path) -> None:
    """The largest group the reference can have (2**31-1 partitions, 3 members) is read
    and listed at once, but ``cgroupd join`` of one of its members exits 1 at once,
    saying how many partitions it would own and the bound, instead of building a list of
    715 million consumer filters."""
    url = nats_server.url
    await nc.jetstream().add_stream(api.StreamConfig(name="BIG", subjects=["big.>"]))
    await put_record(jetstream, ELASTIC_BUCKET, "BIG", "g",
                     (FIXTURES / "go-large-max-members.record").read_bytes())
    listed = await cli(url, "--json", "group", "ls", "BIG")
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)[0]["partitions"] == 2**31 - 1
    proc = JoinProcess(url, tmp_path, "b", "--stream", "BIG", "--group", "g", "--member",
                       "b", "--handler", "tests.support.handlers.record_handler:handle",
                       metrics=False)
    try:
        assert await proc.wait_exit(30) == 1
        assert "member b would own 715827882 partitions of BIG/g" in proc.log_text()
        assert "at most 1024 per member" in proc.log_text()
    finally:
        proc.close()
