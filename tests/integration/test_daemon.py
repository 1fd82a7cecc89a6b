"""``cgroupd join`` as real processes against a real nats-server.

Each test starts ``python -m cgroupd --server URL join ...`` children with a metrics port,
watches them through /metrics, /healthz and /readyz (polling with deadlines, never
sleeping), signals them, and always kills them in ``finally``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import api
from typer.testing import CliRunner, Result

from cgroupd import admin
from cgroupd.cli import app
from cgroupd.core.config import ELASTIC_BUCKET, group_key
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import (
    JoinProcess,
    WebhookServer,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer, find_free_port
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

HANDLER = "tests.support.handlers.record_handler:handle"
runner = CliRunner()


async def cli(url: str, *args: str) -> Result:
    """``cgroupd --server url args...`` in-process, in a thread (it runs its own loop)."""
    clean = {k: None for k in os.environ if k.startswith("CGROUPD_") or k == "NATS_URL"}
    return await asyncio.to_thread(runner.invoke, app, ["--server", url, *args], env=clean)


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def publish(nc: Client, subject: str, payload: dict[str, Any],
                  headers: dict[str, str] | None = None) -> None:
    await nc.jetstream().publish(subject, json.dumps(payload).encode(), headers=headers)


async def test_python_handler_metrics_probes_and_sigterm_handover(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    """Two instances of m1: the first is active and handles everything, /metrics and the
    probes say so; SIGTERM on it hands over to the standby well within 2 s (measured) and
    exits 0; the new active one carries on."""
    await make_group(jetstream, partitions=4, members=("m1",))
    record = tmp_path / "handled.jsonl"
    args = ("--stream", "ORDERS", "--group", "g", "--member", "m1", "--handler", HANDLER)
    a = JoinProcess(nats_server.url, tmp_path, "a", *args, record=record)
    b: JoinProcess | None = None
    try:
        await eventually(lambda: a.metric(http, "cgroupd_member_active"), 20, what="a to be active")
        b = JoinProcess(nats_server.url, tmp_path, "b", *args, record=record)
        await eventually(lambda: _status(b, http, "/readyz", 200), 20, what="b to be ready")
        assert await b.metric(http, "cgroupd_member_active") == 0

        for i in range(20):
            await publish(nc, f"orders.k{i % 7}", {"key": f"k{i % 7}", "n": i})
        await eventually(_async(lambda: len(records(record)) == 20), 15, what="20 messages handled")
        assert {r["pid"] for r in records(record)} == {a.proc.pid}
        assert {r["how"] for r in records(record)} == {"sync"}

        metrics = await eventually(lambda: _acked(a, http, 20), 5, what="ack counter at 20")
        assert metrics[("cgroupd_member_active", ())] == 1
        assert metrics[("cgroupd_partitions_owned", ())] == 4
        assert metrics[("cgroupd_messages_processed_total", (("outcome", "nak"),))] == 0
        assert metrics[("cgroupd_handler_duration_seconds_count", ())] == 20
        assert metrics[("cgroupd_messages_in_flight", ())] == 0
        assert metrics[("cgroupd_nats_connected", ())] == 1
        assert metrics[("cgroupd_api_answer_timeout_seconds", ())] >= 2.0  # the base at least
        assert metrics[("cgroupd_seconds_since_last_message", ())] >= 0
        status, body = await a.get(http, "/healthz")
        assert status == 200 and json.loads(body)["nats"] == "connected"
        status, body = await a.get(http, "/readyz")
        assert status == 200 and json.loads(body)["state"] == "active"
        assert [e["event"] for e in a.events()].count("joined") == 1

        # The admin view of the same moment: every partition held by a's instance.
        instance = json.loads(body)["instance"]
        url = nats_server.url
        group = json.loads((await cli(url, "--json", "status", "ORDERS", "g")).stdout)
        assert {p["instance"] for p in group["partitions"]} == {instance}
        assert group["unowned_partitions"] == [] and group["members_without_instance"] == []
        human = (await cli(url, "status", "ORDERS", "g")).stdout
        assert instance in human and "every partition has an active instance" in human
        members = json.loads((await cli(url, "--json", "member", "ls", "ORDERS", "g")).stdout)
        assert [(m["member"], m["active_instance"]) for m in members] == [("m1", instance)]

        started = time.monotonic()
        a.terminate()
        await eventually(lambda: b.metric(http, "cgroupd_member_active"), 5, what="b to take over",
                   interval=0.005)
        handover = time.monotonic() - started
        print(f"\nSIGTERM handover to the standby took {handover * 1000:.0f} ms")
        assert handover < 2.0
        assert await a.wait_exit() == 0
        events = [e["event"] for e in a.events()]
        assert events[-1] == "stopped" and "stopping" in events
        assert not any(e.get("level") == "error" for e in a.events()), a.log_text()

        for i in range(20, 25):
            await publish(nc, f"orders.k{i}", {"key": f"k{i}", "n": i})
        await eventually(_async(lambda: len(records(record)) == 25), 15, what="5 more handled by b")
        assert {r["pid"] for r in records(record)[20:]} == {b.proc.pid}

        # An administrative step-down: b steps down, and (alone) takes over again.
        stepped = await cli(url, "--json", "step-down", "ORDERS", "g", "m1")
        assert stepped.exit_code == 0 and json.loads(stepped.stdout)["stepped_down"]
        await eventually(lambda: _step_downs(b, http), 5, what="b to step down")
        await eventually(lambda: b.metric(http, "cgroupd_member_active"), 10, what="b active again")
        b.terminate()
        assert await b.wait_exit() == 0
    finally:
        a.close()
        if b is not None:
            b.close()


async def test_webhook_ack_retry_non_retryable_and_dead_letter(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    """Through a real local webhook: 200 acks, a 500 then 200 is retried and acked, a 422
    is given up at once, a message failing 3 deliveries is dead-lettered with its
    headers, and the metrics count each outcome."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await jetstream.add_stream(api.StreamConfig(name="DLQ", subjects=["dlq.>"]))
    letters = await nc.subscribe("dlq.orders")
    hook = await WebhookServer(script={"retry": [500], "bad": [422],
                                       "poison": [500, 503, 500, 500]}).start()
    proc = JoinProcess(nats_server.url, tmp_path, "w", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--webhook", hook.url, "--max-deliver", "3",
                       "--dead-letter-subject", "dlq.orders", "--non-retryable", "422,410")
    try:
        await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20, what="active")
        for key in ("ok", "retry", "bad", "poison"):
            await publish(nc, f"orders.{key}", {"key": key}, headers={"X-Trace": key})
        # Two dead letters (bad at once, poison after its third delivery).
        got = [await letters.next_msg(timeout=15), await letters.next_msg(timeout=15)]
        by_key = {json.loads(m.data)["key"]: m for m in got}
        assert set(by_key) == {"bad", "poison"}
        poison = by_key["poison"].headers or {}
        assert poison["X-Trace"] == "poison"
        assert poison["Cgroupd-Original-Subject"] == "orders.poison"
        assert poison["Cgroupd-Deliveries"] == "3"
        assert poison["Cgroupd-Error"].startswith("WebhookFailed: webhook ")
        assert "answered 500" in poison["Cgroupd-Error"]
        assert int(poison["Cgroupd-Partition"]) in (0, 1)
        assert int(poison["Cgroupd-Stream-Sequence"]) > 0
        bad = by_key["bad"].headers or {}
        assert bad["Cgroupd-Deliveries"] == "1" and "answered 422" in bad["Cgroupd-Error"]
        # A core subscriber can see a letter before the stream has stored it (the server
        # hands the stream its copy through an ingest queue), so the store is awaited.

        async def stored() -> bool:
            dlq = await jetstream.stream_info("DLQ")
            return dlq is not None and dlq.state.messages == 2
        await eventually(stored, 10, what="both dead letters stored in DLQ")

        # A message's outcome is counted once its handling is over: after its dead letter
        # was published (and seen above) and it was termed. Wait for every count.
        want = {"ack": 2, "dead_letter": 2, "nak": 3}
        await eventually(lambda: _counts(proc, http, want), 10, what=f"outcomes {want}")
        assert [h.headers["Cgroupd-Delivery-Count"] for h in hook.for_key("retry")] == [
            "1", "2"]
        assert len(hook.for_key("ok")) == 1 and len(hook.for_key("bad")) == 1
        assert len(hook.for_key("poison")) == 3
        ok = hook.for_key("ok")[0].headers
        assert ok["Cgroupd-Subject"] == "orders.ok" and ok["Nats-Header-X-Trace"] == "ok"
        assert ok["Cgroupd-Stream-Sequence"].isdigit()
        await eventually(_async_pending(jetstream, 0), 10, what="the group's stream to be empty")
    finally:
        proc.close()
        await hook.stop()
        await letters.unsubscribe()


async def test_webhook_without_dead_letter_subject_terms(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    """No DLQ subject: a non-retryable status terms the message at once, and a message
    that fails --max-deliver times is termed with an error log line."""
    await make_group(jetstream, partitions=2, members=("m1",))
    hook = await WebhookServer(script={"bad": [400], "poison": [500, 500, 500]}).start()
    proc = JoinProcess(nats_server.url, tmp_path, "t", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--webhook", hook.url, "--max-deliver", "2")
    try:
        await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20, what="active")
        for key in ("bad", "poison", "fine"):
            await publish(nc, f"orders.{key}", {"key": key})
        # The three settle in any order (different keys): wait for all of them.
        await eventually(lambda: _counts(proc, http, {"term": 2, "ack": 1}), 15,
                   what="two terms and one ack")
        assert len(hook.for_key("bad")) == 1 and len(hook.for_key("poison")) == 2
        errors = [e for e in proc.events() if e.get("level") == "error"]
        assert any("giving up" in e["event"] and e["subject"] == "orders.poison"
                   for e in errors), proc.log_text()
        await eventually(_async_pending(jetstream, 0), 10, what="the group's stream to be empty")
    finally:
        proc.close()
        await hook.stop()


async def test_group_deletion_ends_the_process_with_0(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    """A membership change is a measured rebalance; a record that does not decode and
    one that changes the group's shape are each logged, counted in
    cgroupd_ignored_input_total and ignored (the member stays active on its partition);
    deleting the group then stops the member: the daemon logs it and exits 0."""
    await make_group(jetstream, partitions=2, members=("m1",))
    proc = JoinProcess(nats_server.url, tmp_path, "d", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--handler", HANDLER)
    try:
        await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20, what="active")
        assert await proc.metric(http, "cgroupd_partitions_owned") == 2
        await admin.add_members(jetstream, "ORDERS", "g", ["m2"])
        await eventually(lambda: proc.metric(http, "cgroupd_rebalance_duration_seconds_count"), 10,
                   what="the rebalance to complete")
        metrics = await proc.metrics(http)
        assert metrics[("cgroupd_rebalances_total", ())] == 1
        assert metrics[("cgroupd_member_active", ())] == 1
        assert metrics[("cgroupd_partitions_owned", ())] == 1
        assert 0 <= metrics[("cgroupd_rebalance_duration_seconds_sum", ())] < 5
        # In place (incremental) by default, or a full step-down and rejoin: either way
        # counted once and logged once.
        steps = [e for e in proc.events() if e["event"] in ("rebalanced", "rebalance")]
        assert [e.get("phase", "done") for e in steps][-1] == "done", proc.log_text()

        async def put(value: bytes) -> None:
            rec = await jetstream.get_record(ELASTIC_BUCKET, group_key("ORDERS", "g"))
            await jetstream.update_record(ELASTIC_BUCKET, group_key("ORDERS", "g"), value,
                                          last=rec.revision if rec else 0)

        def ignored(kind: str) -> Any:
            return proc.metric(http, "cgroupd_ignored_input_total", kind=kind)

        assert await ignored("invalid_group_record") == 0
        await put(b'{"max_members": "four", ')
        await eventually(lambda: ignored("invalid_group_record"), 10,
                         what="the invalid record counted")
        reshaped = json.dumps({"max_members": 5, "members": ["m1", "m2"],
                               "partitioning_filters": [
                                   {"filter": "orders.*", "partitioning_wildcards": [1]}]})
        await put(reshaped.encode())
        await eventually(lambda: ignored("replaced_group_record"), 10,
                         what="the reshaped record counted")
        metrics = await proc.metrics(http)
        assert metrics[("cgroupd_ignored_input_total", (("kind", "invalid_group_record"),))] == 1
        assert metrics[("cgroupd_ignored_input_total", (("kind", "not_jetstream_message"),))] == 0
        assert metrics[("cgroupd_member_active", ())] == 1
        assert metrics[("cgroupd_partitions_owned", ())] == 1
        logged = [e["event"] for e in proc.events()]
        assert "invalid group record ignored" in logged
        assert "group record changed more than membership; ignored" in logged
        await admin.delete_group(jetstream, "ORDERS", "g")
        assert await proc.wait_exit() == 0
        assert "group deleted; exiting" in [e["event"] for e in proc.events()]
    finally:
        proc.close()


async def test_startup_failures_exit_1_with_one_line(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path) -> None:
    """Unknown group, unreachable server, metrics port in use: one line, exit 1, fast."""
    await make_group(jetstream, partitions=2, members=("m1",))
    common = ("--member", "m1", "--handler", HANDLER)
    unknown = JoinProcess(nats_server.url, tmp_path, "u", "--stream", "ORDERS",
                          "--group", "nope", *common, metrics=False)
    unreachable = JoinProcess(f"nats://127.0.0.1:{find_free_port()}", tmp_path, "x",
                              "--stream", "ORDERS", "--group", "g", *common, metrics=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = JoinProcess(nats_server.url, tmp_path, "p", "--stream", "ORDERS", "--group",
                           "g", *common, "--metrics-port", str(port), "--metrics-host",
                           "127.0.0.1", metrics=False)
        try:
            started = time.monotonic()
            for proc, expected in ((unknown, "no consumer group 'nope' on stream 'ORDERS'"),
                                   (unreachable, "cannot connect to nats://127.0.0.1:"),
                                   (busy, f"cannot listen on 127.0.0.1:{port}")):
                assert await proc.wait_exit(timeout=10) == 1, proc.log_text()
                last = proc.log_text().strip().splitlines()[-1]
                assert last.startswith("cgroupd: error: ") and expected in last, last
                assert "Traceback" not in proc.log_text()
            assert time.monotonic() - started < 8
        finally:
            for proc in (unknown, unreachable, busy):
                proc.close()


async def test_second_signal_exits_without_waiting_for_the_drain(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    """A handler stuck in a slow webhook: the first SIGTERM starts draining, a second one
    exits at once with code 1 (the message stays unacked and is redelivered later)."""
    await make_group(jetstream, partitions=1, members=("m1",))
    hook = await WebhookServer(delay=20).start()
    proc = JoinProcess(nats_server.url, tmp_path, "s", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--webhook", hook.url, "--webhook-timeout", "60",
                       "--drain-timeout", "60")
    try:
        await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20, what="active")
        await publish(nc, "orders.k1", {"key": "slow"})
        await eventually(_async(lambda: hook.for_key("slow")), 10, what="the webhook call")
        proc.proc.send_signal(signal.SIGTERM)
        await eventually(_async(lambda: "stopping" in [e["event"] for e in proc.events()]), 5,
                   what="the first signal to be handled")
        proc.proc.send_signal(signal.SIGINT)
        assert await proc.wait_exit(timeout=5) == 1
    finally:
        proc.close()
        await hook.stop()


# -- helpers ----------------------------------------------------------------------------
def _async(check: Any) -> Any:
    async def run() -> Any:
        return check()
    return run


async def _status(proc: JoinProcess, http: aiohttp.ClientSession, path: str,
                  want: int) -> bool:
    return (await proc.get(http, path))[0] == want


async def _count(proc: JoinProcess, http: aiohttp.ClientSession, outcome: str,
                 n: int) -> dict[Any, float] | None:
    metrics = await proc.metrics(http)
    key = ("cgroupd_messages_processed_total", (("outcome", outcome),))
    return metrics if metrics.get(key) == n else None


async def _counts(proc: JoinProcess, http: aiohttp.ClientSession,
                  want: dict[str, int]) -> bool:
    metrics = await proc.metrics(http)
    return all(metrics.get(("cgroupd_messages_processed_total", (("outcome", outcome),)))
               == n for outcome, n in want.items())


async def _step_downs(proc: JoinProcess, http: aiohttp.ClientSession) -> float:
    metrics = await proc.metrics(http)
    return sum(v for (name, _), v in metrics.items() if name == "cgroupd_step_downs_total")


async def _acked(proc: JoinProcess, http: aiohttp.ClientSession,
                 n: int) -> dict[Any, float] | None:
    return await _count(proc, http, "ack", n)


def _async_pending(js: JetStream, n: int) -> Any:
    async def check() -> bool:
        counts = await admin.partition_pending(js, "ORDERS", "g")
        return sum(counts.values()) == n
    return check
