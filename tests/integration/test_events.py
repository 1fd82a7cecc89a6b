"""Advisories and instance discovery with real `cgroupd join` processes, followed by a
real `cgroupd events` process (JSON and human), and `member ls` describing every
instance."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd import admin
from cgroupd.nats import events
from cgroupd.nats.jetstream import JetStream
from tests.integration.test_daemon import cli
from tests.support.cli import (
    ROOT,
    JoinProcess,
    child_env,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

pytestmark = pytest.mark.slow
HANDLER = "tests.support.handlers.record_handler:handle"


class Follower:
    """``cgroupd events STREAM GROUP`` in a child process, its output in a file."""

    def __init__(self, url: str, path: Path, *flags: str) -> None:
        self.path = path
        self._out = open(path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cgroupd", "--server", url, *flags, "events", "ORDERS",
             "g"], cwd=ROOT, env=child_env(), stdout=self._out, stderr=subprocess.STDOUT)

    def lines(self) -> list[str]:
        self._out.flush()
        return self.path.read_text().splitlines()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.lines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


async def test_advisories_follow_failover_rebalance_and_idle_partitions(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path,
        closing: list[Any]) -> None:
    """Instances a (active) and b (standby) of m1, followed by `cgroupd events --json` and
    by the human form: SIGTERM on a gives `stepped_down` (reason stopping, its partitions)
    then `active` from b; m2 joining moves partitions in place (`rebalanced` from b: lost
    2-3) and c becomes active; SIGKILL of c gives timed `unowned` advisories naming
    partitions 2-3 and m2, published by b alone. Every payload has type, id and
    timestamp; `member ls` lists each instance with its state, host and partitions, and
    `cgroupd events` exits 0 on Ctrl-C."""
    await make_group(jetstream, partitions=4, members=("m1",))
    url = nats_server.url
    as_json = Follower(url, tmp_path / "events.jsonl", "--json")
    human = Follower(url, tmp_path / "events.txt")
    closing += [as_json, human]
    for follower in (as_json, human):
        await eventually(lambda f=follower: any("following events of ORDERS/g" in line
                                                for line in f.lines()), 20,
                         what="the followers to subscribe")

    def join(name: str, member: str) -> JoinProcess:
        proc = JoinProcess(url, tmp_path, name, "--stream", "ORDERS", "--group", "g",
                           "--member", member, "--handler", HANDLER, "--status-interval",
                           "0.3", "--instance-id", name, record=tmp_path / "handled.jsonl")
        closing.append(proc)
        return proc

    def kinds() -> list[tuple[str, str | None]]:
        return [(events.kind_of(e), e.get("instance")) for e in as_json.events()]

    async with aiohttp.ClientSession() as http:
        a = join("a", "m1")
        await eventually(lambda: a.metric(http, "cgroupd_member_active"), 20, what="a active")
        b = join("b", "m1")
        await eventually(lambda: _ready(b, http), 20, what="b standing by")
        await eventually(lambda: ("active", "a") in kinds(), 10, what="a's advisory")

        described = json.loads((await cli(url, "--json", "member", "ls", "ORDERS",
                                          "g")).stdout)
        instances = {i["instance"]: i for i in described[0]["instances"]}
        assert instances["a"]["state"] == "active" and instances["a"]["partitions"] == [
            0, 1, 2, 3]
        assert instances["b"]["state"] == "standby" and instances["b"]["partitions"] == []
        assert instances["a"]["host"] == events.hostname()
        assert instances["a"]["pid"] == a.proc.pid and instances["a"]["since"]
        same = json.loads((await cli(url, "--json", "status", "ORDERS", "g",
                                     "--members")).stdout)
        assert [(m["member"], sorted(i["instance"] for i in m["instances"]))
                for m in same] == [("m1", ["a", "b"])]

        a.terminate()
        assert await a.wait_exit() == 0
        await eventually(lambda: ("active", "b") in kinds(), 20, what="b's advisory")
        seen = as_json.events()
        down = next(e for e in seen if events.kind_of(e) == "stepped_down")
        assert (down["instance"], down["member"], down["reason"], down["partitions"]) == (
            "a", "m1", "stopping", [0, 1, 2, 3])
        assert kinds().index(("stepped_down", "a")) < kinds().index(("active", "b"))
        for e in seen:
            assert e["type"].startswith(events.TYPE_PREFIX) and len(e["id"]) == 16
            assert e["timestamp"].endswith("Z") and (e["stream"], e["group"]) == (
                "ORDERS", "g")

        await admin.add_members(jetstream, "ORDERS", "g", ["m2"])
        c = join("c", "m2")

        def claim_files_lost() -> bool:
            # nats-server removes a deleted consumer's files after announcing the deletion:
            # b's claim, created on a's announcement, can lose its own (1 run in 25). Its
            # move in place then fails and b rejoins instead (see test_rebalance.py::
            # test_a_claim_whose_files_the_server_lost_is_created_again).
            return "meta.inf.tmp: no such file or directory" in b.log_text()

        def b_moved() -> bool:
            return ("rebalanced", "b") in kinds() or (
                claim_files_lost() and kinds().count(("active", "b")) >= 2)

        await eventually(lambda: b_moved() and ("active", "c") in kinds(), 20,
                         what="b to rebalance and c to become active",
                         diagnostics=lambda: f"advisories {kinds()}\n{b.log_tail()}\n"
                         f"{c.log_tail()}")
        if ("rebalanced", "b") in kinds():
            moved = next(e for e in as_json.events() if events.kind_of(e) == "rebalanced")
            assert (moved["partitions"], moved["gained"], moved["lost"]) == (
                [0, 1], [], [2, 3])
        else:
            again = [e for e in as_json.events()
                     if (events.kind_of(e), e.get("instance")) == ("active", "b")][-1]
            assert again["partitions"] == [0, 1]

        c.proc.send_signal(signal.SIGKILL)

        def unowned() -> list[dict[str, Any]]:
            return [e for e in as_json.events() if events.kind_of(e) == "unowned"
                    and e["unowned_partitions"] == [2, 3]]

        timed = await eventually(lambda: len(unowned()) >= 2 and unowned(), 20,
                                 what="two timed unowned advisories")
        assert {e["instance"] for e in timed} == {"b"}
        assert all(e["members_without_instance"] == ["m2"] and e["idle"] is False
                   for e in timed)

    text = "\n".join(human.lines())
    assert "following events of ORDERS/g" in text
    assert "STEPPED_DOWN m1 instance a on" in text and "(stopping)" in text
    assert "UNOWNED partitions 2-3 have no active instance (members without one: m2" in text
    human.close()
    assert human.proc.returncode == 0


async def _ready(proc: JoinProcess, http: aiohttp.ClientSession) -> bool:
    status, body = await proc.get(http, "/readyz")
    return status == 200 and json.loads(body)["state"] == "standby"


async def test_events_command_errors(nats_server: NatsServer, jetstream: JetStream) -> None:
    """A group that does not exist is one clear error (exit 1), not a silent wait; --count
    with --timeout ends with exit 1 when too few events came."""
    result = await cli(nats_server.url, "events", "NOPE", "g")
    assert result.exit_code == 1 and "no consumer group" in result.stderr
    await make_group(jetstream, partitions=2)
    quiet = await cli(nats_server.url, "events", "ORDERS", "g", "--count", "1",
                      "--timeout", "0.3")
    assert quiet.exit_code == 1 and "0 of 1 events within 0.3s" in quiet.stderr


async def test_hostile_advisories_and_discovery_answers(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        closing: list[Any]) -> None:
    """Anyone allowed to publish can write on the advisory subjects and answer discovery.
    `cgroupd events` shows junk advisories (not JSON, unknown type, wrong field types) as
    such, keeps following and prints the real one after them, and exits 0 on Ctrl-C
    without a stray error; `member ls` and `status` drop malformed discovery answers, keep
    the well-formed one, and exit 0."""
    await make_group(jetstream, partitions=2, members=("m1",))
    human = Follower(nats_server.url, tmp_path / "events.txt")
    closing.append(human)
    await eventually(lambda: any("following events of" in line for line in human.lines()),
                     20, what="the follower to subscribe")
    subject = events.event_subject("ORDERS", "g", "active")
    good = events.make_event("active", "ORDERS", "g", member="m1", instance="real",
                             host="h", partitions=[0, 1])
    for junk in (b"\xff not json", b"[1, 2]", json.dumps({"type": "x.y"}).encode(),
                 json.dumps({**good, "partitions": "abc"}).encode(),
                 json.dumps({**good, "partitions": [1, "a"]}).encode(),
                 json.dumps(events.make_event("rebalanced", "ORDERS", "g",
                                              seconds="soon")).encode(),
                 json.dumps(events.make_event("unowned", "ORDERS", "g",
                                              members_without_instance=[1])).encode(),
                 json.dumps(good).encode()):
        await nc.publish(subject, junk)
    await eventually(lambda: any("ACTIVE m1 instance real" in line for line in human.lines()),
                     20, what="the real advisory after the junk")
    lines = human.lines()
    assert sum("INVALID advisory" in line for line in lines) == 2
    assert sum("UNKNOWN advisory" in line for line in lines) == 1
    assert sum("MALFORMED" in line for line in lines) == 4
    assert human.proc.poll() is None
    human.close()
    assert human.proc.returncode == 0
    after = human.path.read_text().splitlines()
    assert not [line for line in after if "exception" in line.lower()
                or "error" in line.lower()], after

    well_formed = events.instance_info(member="m1", instance="i1", state="standby",
                                       since="2026-01-01T00:00:00.000Z", partitions=[],
                                       in_flight=0, version="x")

    async def answer(msg: Msg) -> None:
        for reply in (b"junk", b"{}", json.dumps({**well_formed, "partitions": "abc"}),
                      json.dumps({**well_formed, "instance": 7}),
                      json.dumps({**well_formed, "partitions": [0, -1]}),
                      json.dumps({**well_formed, "pid": "many", "host": ["x"],
                                  "instance": "i2"}),
                      json.dumps(well_formed)):
            await nc.publish(msg.reply, reply if isinstance(reply, bytes) else reply.encode())

    sub = await nc.subscribe(events.info_subject("ORDERS", "g"), cb=answer)
    try:
        described = await cli(nats_server.url, "--json", "member", "ls", "ORDERS", "g")
        assert described.exit_code == 0, described.output
        instances = json.loads(described.stdout)[0]["instances"]
        assert sorted(i["instance"] for i in instances) == ["i1", "i2"]
        i2 = next(i for i in instances if i["instance"] == "i2")
        assert (i2["pid"], i2["host"]) == (None, None)
        text = await cli(nats_server.url, "member", "ls", "ORDERS", "g")
        assert text.exit_code == 0 and "i1" in text.stdout and "i2" in text.stdout, text.output
        status = await cli(nats_server.url, "--json", "status", "ORDERS", "g")
        assert status.exit_code == 0, status.output
        assert len(json.loads(status.stdout)["instances"]) == 2
    finally:
        await sub.unsubscribe()


async def test_unowned_advisory_publisher_is_chosen_by_member_not_pin() -> None:
    """The timed `unowned` advisory comes from the active instance of the member owning
    the lowest consumed partition, matched by member (pinned consumers name a pin id, not
    the instance id), from nobody else, and from everyone while the group is idle."""
    from types import SimpleNamespace

    from cgroupd.admin import GroupStatus, PartitionStatus
    from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
    from cgroupd.join.metrics import Metrics
    from cgroupd.join.operations import Operations
    from cgroupd.join.options import JoinOptions

    config = ElasticGroupConfig(max_members=4, members=("m1", "m2"), partitioning_filters=(
        PartitioningFilter("orders.*", (1,)),))
    stored = admin.StoredGroup("ORDERS", "g", config, 1)

    def status(*instances: str | None) -> GroupStatus:
        rows = [PartitionStatus(p, "m1" if p < 2 else "m2", inst, 1)
                for p, inst in enumerate(instances)]
        return GroupStatus(stored, rows, [], sorted({r.member for r in rows
                                                     if r.instance is None and r.member}))

    def published(member: str, active: bool, st: GroupStatus) -> list[str]:
        ops = Operations(JoinOptions("ORDERS", "g", member), Metrics("ORDERS", "g", member),
                         log=None, publisher=None)
        ops.member = SimpleNamespace(active=active, instance_id="own-id")  # type: ignore
        kinds: list[str] = []
        ops.event = lambda kind, **_: kinds.append(kind)  # type: ignore[method-assign]
        ops.unowned_advisory(st)
        return kinds

    half = status("pin-1", "pin-1", None, None)  # m1 pinned (pin id), m2 gone
    assert published("m1", True, half) == ["unowned"]
    assert published("m1", False, half) == []  # a standby of m1
    assert published("m2", False, half) == []
    idle = status(None, None, None, None)
    assert published("m1", False, idle) == published("m2", False, idle) == ["unowned"]
    assert published("m1", True, status("a", "a", "b", "b")) == []  # nothing unowned
