"""The partition listener with real ``cgroupd join`` processes and a real nats-server:
the handler module's ``on_partitions_assigned`` / ``_revoked`` / ``_lost`` and every
handler start and end go to one file, in the order they happened, across an incremental
move (a member added) and a step-down (SIGTERM of the active instance, a standby takes
over), in both exclusivity modes; and the webhook's events (``--webhook-events``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from cgroupd import admin
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess
from tests.support.groups import make_group, publish_keyed
from tests.support.polling import eventually

pytestmark = pytest.mark.slow
HANDLER = "tests.support.handlers.listener_handler:handle"


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_timeline(events: list[dict[str, Any]]) -> list[str]:
    """What breaks the listener's promises, event by event: a partition is assigned to
    one instance only once its previous owner revoked (or lost) it; a handler starts
    only on an instance the partition is assigned to; revoked comes after the end of
    every message of the partition that instance started."""
    owner: dict[int, int] = {}
    running: dict[tuple[int, int], int] = {}  # (pid, partition) -> handlers running
    problems = []
    for i, e in enumerate(events):
        pid = e["pid"]
        if e["event"] == "assigned":
            for p in e["partitions"]:
                if p in owner:
                    problems.append(f"#{i}: {pid} assigned {p} still owned by {owner[p]}")
                owner[p] = pid
        elif e["event"] in ("revoked", "lost"):
            for p in e["partitions"]:
                if owner.get(p) != pid:
                    problems.append(f"#{i}: {pid} {e['event']} {p} owned by {owner.get(p)}")
                if e["event"] == "revoked" and running.get((pid, p)):
                    problems.append(f"#{i}: {pid} revoked {p} while its message runs")
                owner.pop(p, None)
        elif e["event"] == "start":
            p = e["partition"]
            if owner.get(p) != pid:
                problems.append(f"#{i}: {pid} started #{e['n']} of {p} owned by "
                                f"{owner.get(p)}")
            running[(pid, p)] = running.get((pid, p), 0) + 1
        elif e["event"] == "end":
            running[(pid, e["partition"])] -= 1
    return problems


@pytest.mark.parametrize("exclusivity", ["sync", "pinned"])
async def test_listener_order_across_a_move_and_a_step_down(
        nats_server: Any, jetstream: JetStream, tmp_path: Path, exclusivity: str) -> None:
    """m1 runs as a (active) and b (standby); c is m2, not in the group yet. Under
    traffic: m2 is added (m1's active instance revokes the partitions that move after
    their last message ended; c is assigned them after that, before their first
    message), then the active m1 instance gets SIGTERM (it revokes the rest; the standby
    is assigned them, before its first message). Every message is processed; no lost."""
    await make_group(jetstream, partitions=4, members=("m1",))
    record = tmp_path / "timeline.jsonl"
    procs: list[JoinProcess] = []

    def join(name: str, member: str) -> JoinProcess:
        p = JoinProcess(nats_server.url, tmp_path, name, "--stream", "ORDERS", "--group",
                        "g", "--member", member, "--handler", HANDLER, "--exclusivity",
                        exclusivity, record=record, metrics=False)
        procs.append(p)
        return p

    try:
        a = join("a", "m1")
        b = join("b", "m1")
        c = join("c", "m2")
        # Pinned mode: an instance is active once a message pins it; traffic first.
        traffic = asyncio.create_task(publish_keyed(jetstream, 600, keys=16, rate=100))
        await eventually(lambda: any(e["event"] == "assigned" for e in lines(record)), 30,
                         what="m1 active")
        await asyncio.sleep(0.5)
        await admin.add_members(jetstream, "ORDERS", "g", ["m2"])
        await eventually(lambda: any(e["event"] == "assigned" and e["pid"] == c.proc.pid
                                     for e in lines(record)), 30, what="m2 assigned")
        await asyncio.sleep(0.5)
        active = a if any(e["event"] == "assigned" and e["pid"] == a.proc.pid
                          for e in lines(record)) else b
        standby = b if active is a else a
        active.terminate()
        assert await active.wait_exit() == 0
        await eventually(lambda: any(e["event"] == "assigned" and e["pid"] == standby.proc.pid
                                     for e in lines(record)), 30, what="the standby assigned")
        assert not traffic.done(), "traffic ran out before the step-down: no ordering seen"
        sent = await traffic
        await eventually(lambda: {e["n"] for e in lines(record) if e["event"] == "end"}
                         >= {n for _, n in sent}, 30, what="every message processed")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            await p.wait_exit()
            p.close()
    events = lines(record)
    assert check_timeline(events) == []
    kinds = [(e["event"], e["pid"]) for e in events if e["event"] not in ("start", "end")]
    pids = {p.proc.pid for p in procs}
    assert {pid for k, pid in kinds if k == "assigned"} == pids, kinds
    revokes = [e for e in events if e["event"] == "revoked"]
    # The move (m1 keeps some) and the SIGTERM step-down (all of m1's), then the stops.
    assert any(0 < len(e["partitions"]) < 4 and e["pid"] == active.proc.pid
               for e in revokes), kinds
    assert not [e for e in events if e["event"] == "lost"], kinds
    took = next(i for i, e in enumerate(events)
                if e["event"] == "assigned" and e["pid"] == standby.proc.pid)
    gave = max(i for i, e in enumerate(events)
               if e["event"] == "revoked" and e["pid"] == active.proc.pid)
    assert gave < took


async def test_webhook_events(nats_server: Any, jetstream: JetStream, tmp_path: Path) -> None:
    """``--webhook --webhook-events``: the webhook gets ``Cgroupd-Event:
    partitions-assigned`` (JSON body with the partitions) before the first message, and
    on SIGTERM ``partitions-revoked`` after the last one."""
    seen: list[tuple[str, Any]] = []

    async def receive(request: web.Request) -> web.Response:
        event = request.headers.get("Cgroupd-Event")
        if event is not None:
            seen.append((event, await request.json()))
        else:
            seen.append(("message", request.headers["Cgroupd-Stream-Sequence"]))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await make_group(jetstream, partitions=2, members=("m1",))
    await publish_keyed(jetstream, 6, keys=4)
    proc = JoinProcess(nats_server.url, tmp_path, "w", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--webhook", f"http://127.0.0.1:{port}/hook",
                       "--webhook-events", metrics=False)
    try:
        await eventually(lambda: sum(k == "message" for k, _ in seen) >= 6, 30,
                         what="6 messages posted")
        proc.terminate()
        assert await proc.wait_exit() == 0
    finally:
        proc.close()
        await runner.cleanup()
    kinds = [k for k, _ in seen]
    assert kinds[0] == "partitions-assigned" and kinds[-1] == "partitions-revoked", kinds
    assert kinds.count("message") == 6 and len(kinds) == 8
    body = seen[0][1]
    assert body == {"event": "partitions-assigned", "stream": "ORDERS", "group": "g",
                    "member": "m1", "instance": body["instance"], "partitions": [0, 1]}
    assert seen[-1][1]["partitions"] == [0, 1] and body["instance"]
