"""``cgroupd join`` processes whose health is not what it seems: a handler that blocks the
event loop, a release stuck on a sync handler that does not return (whose partitions stay
with it: no standby runs that message meanwhile), two processes given one instance id, and
a drain shorter than the webhook timeout (issue 13: /healthz, the instance id, item 7).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client
from typer.testing import CliRunner

from cgroupd.cli import app
from cgroupd.core.settings import MemberSettings
from cgroupd.join.daemon import drain_problems
from cgroupd.join.handlers import HandlerOptions, WebhookOptions
from cgroupd.nats.jetstream import JetStream
from tests.integration.test_daemon import _async, http, publish, records  # noqa: F401 - http fixture
from tests.support.cli import (
    JoinProcess,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

ARGS = ("--stream", "ORDERS", "--group", "g", "--member", "m1")


async def _health(proc: JoinProcess, session: aiohttp.ClientSession) -> tuple[int, dict]:
    status, body = await proc.get(session, "/healthz")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {}


def _scraped(proc: JoinProcess, session: aiohttp.ClientSession,
             name: str) -> Callable[[], Awaitable[tuple[float] | None]]:
    """A poll for one metric's value that tells a failed scrape (None) from a 0."""
    async def read() -> tuple[float] | None:
        value = await proc.metric(session, name)
        return None if value is None else (value,)
    return read


async def test_healthz_fails_while_a_handler_keeps_blocking_the_event_loop(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:  # noqa: F811
    """A handler that blocks the loop for 1.5 s per message: the process answers between
    the stalls, and /healthz says 503 with why (it said 200: NATS was connected)."""
    await make_group(jetstream, partitions=2, members=("m1",))
    proc = JoinProcess(nats_server.url, tmp_path, "b", *ARGS, "--handler",
                       "tests.support.handlers.record_handler:block_loop",
                       record=tmp_path / "r.jsonl")
    try:
        await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20, what="active")
        async def answered() -> tuple[int, dict] | None:  # a scrape may time out (status 0)
            status, body = await _health(proc, http)
            return (status, body) if status else None

        status, body = await eventually(answered, 10, what="/healthz to answer")
        assert status == 200 and body["problems"] == [], body
        for n in range(3):
            await publish(nc, f"orders.k{n}", {"n": n, "block": 1.5})

        async def unhealthy() -> dict | None:
            status, body = await _health(proc, http)
            return body if status == 503 else None

        body = await eventually(unhealthy, 20, what="/healthz to fail")
        assert any("event loop blocked" in p for p in body["problems"]), body
    finally:
        proc.close()


async def test_a_release_stuck_on_a_sync_handler_keeps_its_partitions_and_fails_healthz(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:  # noqa: F811
    """SIGTERM with a 0.5 s drain timeout while a sync handler hangs for a minute: the
    thread cannot be cancelled, so the instance keeps its consumers (the standby runs
    nothing of the member meanwhile) and /healthz says the release is stuck; once it is
    killed, the standby takes over at once and runs the message."""
    await make_group(jetstream, partitions=2, members=("m1",))
    record = tmp_path / "r.jsonl"
    args = (*ARGS, "--handler", "tests.support.handlers.record_handler:hang",
            "--drain-timeout", "0.5")
    a = JoinProcess(nats_server.url, tmp_path, "a", *args, record=record)
    b: JoinProcess | None = None
    try:
        await eventually(lambda: a.metric(http, "cgroupd_member_active"), 20, what="a active")
        b = JoinProcess(nats_server.url, tmp_path, "b", *args, record=record)
        await eventually(lambda: b.get(http, "/readyz"), 20, what="b ready")
        await publish(nc, "orders.k1", {"n": 1, "hang": 60})
        await eventually(_async(lambda: records(record)), 10, what="the handler to start")
        a.terminate()

        async def stuck() -> dict | None:
            status, body = await _health(a, http)
            return body if status == 503 else None

        body = await eventually(stuck, 15, what="a's /healthz to report the stuck release")
        assert any("release stuck" in p for p in body["problems"]), body
        # A scrape can time out on a loaded machine (metric() is then None): read until
        # one answers, then the value must be 0.
        (b_active,) = await eventually(_scraped(b, http, "cgroupd_member_active"), 10,
                                       what="b's /metrics")
        assert b_active == 0
        assert [r["pid"] for r in records(record)] == [a.proc.pid]
        a.proc.send_signal(signal.SIGKILL)
        await eventually(lambda: b.metric(http, "cgroupd_member_active"), 5, what="b to take over")
        await eventually(_async(lambda: len(records(record)) == 2), 10, what="b to run the message")
        assert records(record)[1]["pid"] == b.proc.pid
    finally:
        a.close()
        if b is not None:
            b.close()


async def test_a_second_process_with_the_same_instance_id_exits_1(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:  # noqa: F811
    """Two processes given one --instance-id would both pass for the active instance: the
    second one exits 1 and says why."""
    await make_group(jetstream, partitions=2, members=("m1",))
    args = (*ARGS, "--handler", "tests.support.handlers.record_handler:handle",
            "--instance-id", "twin")
    a = JoinProcess(nats_server.url, tmp_path, "a", *args, record=tmp_path / "r.jsonl")
    b: JoinProcess | None = None
    try:
        await eventually(lambda: a.metric(http, "cgroupd_member_active"), 20, what="a active")
        b = JoinProcess(nats_server.url, tmp_path, "b", *args, metrics=False)
        assert await b.wait_exit() == 1
        last = b.log_text().strip().splitlines()[-1]
        assert last.startswith("cgroupd: error: ") and "'twin' is already used" in last, last
        assert await a.metric(http, "cgroupd_member_active") == 1
    finally:
        a.close()
        if b is not None:
            b.close()


def test_a_drain_shorter_than_the_webhook_timeout_is_refused() -> None:
    """A webhook cut off at the drain timeout may go on at the far side while the next
    owner runs the same key: join refuses the combination (exit 2, one line); the
    defaults are consistent."""
    env = {k: None for k in os.environ if k.startswith("CGROUPD_") or k == "NATS_URL"}
    result = CliRunner().invoke(app, [
        "--server", "nats://127.0.0.1:1", "join", *ARGS, "--webhook", "http://h/x",
        "--webhook-timeout", "10", "--drain-timeout", "5"], env=env)
    assert result.exit_code == 2, result.output
    assert "--drain-timeout (5s) must be at least --webhook-timeout (10s)" in result.output
    defaults = HandlerOptions(webhook=WebhookOptions("http://h/x"))
    assert drain_problems(MemberSettings(), defaults) == []
