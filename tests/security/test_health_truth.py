"""Issue 25 row 10: /healthz tells the truth about what the NATS server refuses.

A real nats-server with users whose permissions are narrowed: ``noack`` may not publish
to ``$JS.ACK.>`` (so no ack is ever applied: the server answers a denied publish only
with an asynchronous -ERR), ``noprobe`` may not use the presence subjects. A real
``cgroupd join`` as each must report 503 on /healthz with a reason that names the
permission, and count the violations in ``cgroupd_permission_violations_total``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import pytest

from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess, restore_logging  # noqa: F401 - autouse fixture
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer, client_options, running_server
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

USERS = """
authorization {
  users = [
    {user: admin, password: adminpw}
    {user: noack, password: noackpw, permissions: {publish: {deny: ["$JS.ACK.>"]}}}
    {user: noprobe, password: noprobepw,
     permissions: {publish: {deny: ["_CGROUPD.presence.>"]},
                   subscribe: {deny: ["_CGROUPD.presence.>"]}}}
  ]
}
"""
HANDLER = "tests.support.handlers.record_handler:handle"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    with running_server(workdir=tmp_path / "nats", extra_config=USERS) as srv:
        assert isinstance(srv, NatsServer)
        yield srv


def _url(server: NatsServer, user: str) -> str:
    return server.url.replace("nats://", f"nats://{user}:{user}pw@")


async def _health(proc: JoinProcess, http: aiohttp.ClientSession) -> tuple[int, list[str]]:
    status, body = await proc.get(http, "/healthz")
    return status, (json.loads(body).get("problems", []) if status else [])


async def test_a_member_that_may_not_ack_is_unhealthy_and_counted(
        server: NatsServer, tmp_path: Path) -> None:
    """Every ack is denied: /healthz goes 503 naming ``publish to $JS.ACK.ORDERS...``
    and the missing permission, and the counter counts each denied ack (one per handled
    message at least); the redelivered messages are seen as acks not taking effect."""
    admin = await nats.connect(_url(server, "admin"), **client_options())
    try:
        await make_group(JetStream(admin), partitions=2, members=("m1",))
        record = tmp_path / "handled.jsonl"
        proc = JoinProcess(_url(server, "noack"), tmp_path, "noack", "--stream", "ORDERS",
                           "--group", "g", "--member", "m1", "--handler", HANDLER,
                           "--ack-wait", "1", record=record)
        try:
            async with aiohttp.ClientSession() as http:
                await eventually(lambda: proc.metric(http, "cgroupd_member_active"), 20,
                                 what="active", diagnostics=proc.log_tail)
                status, problems = await _health(proc, http)
                assert (status, problems) == (200, []), "healthy before any ack"
                for i in range(5):
                    await admin.jetstream().publish(f"orders.k{i}", b"{}")

                async def unhealthy() -> list[str]:
                    status, problems = await _health(proc, http)
                    return problems if status == 503 else []

                problems = await eventually(unhealthy, 15, what="/healthz 503",
                                            diagnostics=proc.log_tail)
                problem = problems[0]
                assert "NATS permission denied: publish to $JS.ACK.orders-g.m1~" in problem
                assert "acks are not applied" in problem and "grant" in problem

                # The messages come back (ack wait 1 s): seen as acks not taking effect,
                # whatever the cause, counted and named in /healthz as well.
                async def lost_acks() -> list[str]:
                    _, problems = await _health(proc, http)
                    return [p for p in problems if p.startswith("acks are not taking effect")]

                await eventually(lost_acks, 20, what="lost acks in /healthz",
                                 diagnostics=proc.log_tail)
                lost = await proc.metric(http, "cgroupd_acks_not_applied_total")
                assert lost is not None and lost >= 3
                # Each first ack and each ack sent again is denied, and counted.
                async def counted() -> bool:
                    denied = await proc.metric(http, "cgroupd_permission_violations_total",
                                               operation="publish", kind="ack")
                    return denied is not None and denied >= 5 + lost

                await eventually(counted, 10, what=f"{5 + lost:g} denied acks counted")
            # Logged once (then once a minute), not once per denied ack.
            events = [e.get("event") for e in proc.events()]
            assert events.count("NATS permission denied") == 1, proc.log_tail()
            assert "nats error" not in events
        finally:
            proc.close()
    finally:
        await admin.close()


async def test_a_member_without_presence_permission_says_why(
        server: NatsServer, tmp_path: Path) -> None:
    """Denied on its presence subject, an instance cannot prove it is alive: /healthz
    says so, naming the subject, and the counter counts it."""
    admin = await nats.connect(_url(server, "admin"), **client_options())
    try:
        await make_group(JetStream(admin), partitions=2, members=("m1",))
        proc = JoinProcess(_url(server, "noprobe"), tmp_path, "noprobe", "--stream",
                           "ORDERS", "--group", "g", "--member", "m1", "--handler", HANDLER,
                           record=tmp_path / "handled.jsonl")
        try:
            async with aiohttp.ClientSession() as http:
                async def unhealthy() -> list[str]:
                    # Until it has connected, /healthz says "not connected to NATS" (503
                    # too): wait for the 503 that names a permission.
                    status, problems = await _health(proc, http)
                    denied = status == 503 and any("permission" in p for p in problems)
                    return problems if denied else []

                problems = await eventually(unhealthy, 20, what="/healthz 503 (permission)",
                                            diagnostics=proc.log_tail)
                assert any("NATS permission denied" in p and "_CGROUPD.presence" in p
                           and "cgroupd control subjects" in p for p in problems), problems
                metrics = await proc.metrics(http)
                denied = sum(v for (name, labels), v in metrics.items()
                             if name == "cgroupd_permission_violations_total"
                             and ("kind", "control") in labels)
                assert denied >= 1
        finally:
            proc.close()
    finally:
        await admin.close()
