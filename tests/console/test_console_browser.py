"""The console in a real browser: headless Chromium drives the page of a ``cgroupd
console`` process against a real server and real ``cgroupd join`` instances. A SIGKILLed
active instance's takeover shows in the grid, the instance list and the timeline; a
member added from the page (confirmed in its dialog) makes partitions move, unowned until
its instance starts; the screenshot the docs show is taken on the way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from cgroupd import admin
from cgroupd.nats import events
from cgroupd.nats.jetstream import JetStream
from tests.console.conftest import ConsoleProcess
from tests.support.browser import Chromium, Tab
from tests.support.cli import (
    ROOT,
    JoinProcess,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer

HANDLER = "tests.support.handlers.record_handler:handle"
#: Set to write the screenshot the README and docs/console.md show.
UPDATE_ENV = "CGROUPD_UPDATE_SCREENSHOTS"
DOCS_SHOT = ROOT / "docs" / "images" / "console.png"

CELLS = ("[...document.querySelectorAll('#grid .cell')].map(c => ({p: +c.dataset.partition, "
         "member: c.dataset.member, instance: c.dataset.instance, "
         "unowned: c.classList.contains('unowned'), text: c.innerText}))")
TIMELINE = ("[...document.querySelectorAll('#timeline li')].map(li => ({kind: li.dataset.kind, "
            "instance: li.dataset.instance, text: li.innerText}))")
INSTANCES = ("[...document.querySelectorAll('#members tbody tr')].map(tr => "
             "[tr.dataset.member, tr.dataset.instance, tr.dataset.state])")


async def _cells(tab: Tab) -> list[dict[str, Any]]:
    return list(await tab.evaluate(CELLS))


async def test_takeover_and_a_new_member_appear_in_the_page(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path,
        chromium: Chromium, console_process: Callable[..., ConsoleProcess],
        http: aiohttp.ClientSession, closing: list[Any]) -> None:
    """m1 runs as a and b (one active, one standby), m2 as c. The page shows every
    partition owned, coloured by member; SIGKILL of m1's active instance: its partitions
    show the standby, the killed one leaves the instance list, the timeline shows the
    standby becoming active. m3 added from the page (confirmed in the dialog): two
    partitions move to m3 and show UNOWNED with their lag until m3's instance d starts,
    then d owns them and the timeline says so."""
    await make_group(jetstream, partitions=6, members=("m1", "m2"))

    procs: dict[str, JoinProcess] = {}

    def join(name: str, member: str) -> JoinProcess:
        proc = procs[name] = JoinProcess(
            nats_server.url, tmp_path, name, "--stream", "ORDERS", "--group", "g",
            "--member", member, "--handler", HANDLER, "--status-interval", "0.3",
            "--instance-id", name, record=tmp_path / "handled.jsonl", metrics=False)
        closing.append(proc)
        return proc

    join("a", "m1")
    join("c", "m2")
    console = console_process(nats_server.url, "--stream", "ORDERS", "--interval", "0.5",
                              "--allow-actions")
    await console.ready(http)
    tab = await chromium.new_tab(console.url)
    await tab.wait_for("document.querySelectorAll('#grid .cell').length === 6", 20,
                       "the grid of 6 partitions")

    async def owners() -> dict[str, set[str]]:
        by: dict[str, set[str]] = {}
        for c in await _cells(tab):
            by.setdefault(c["member"], set()).add(c["instance"])
        return by

    await tab.wait_for("[...document.querySelectorAll('#grid .cell')].every(c => "
                       "c.dataset.instance) && !document.querySelector('.cell.unowned')", 30,
                       "every partition owned in the page")
    assert await owners() == {"m1": {"a"}, "m2": {"c"}}
    b = join("b", "m1")
    await tab.wait_for(f"JSON.stringify({INSTANCES}).includes('[\"m1\",\"b\",\"standby\"]')",
                       30, "b standing by in the instance list")
    rows = await tab.evaluate(INSTANCES)
    assert ["m1", "a", "active"] in rows and ["m2", "c", "active"] in rows, rows
    colours = await tab.evaluate("[...document.querySelectorAll('#grid .cell')]"
                                 ".map(c => c.style.backgroundColor)")
    assert len(set(colours)) == 2, colours  # coloured by member: m1's and m2's

    procs["a"].proc.send_signal(signal.SIGKILL)
    await tab.wait_for("[...document.querySelectorAll('#grid .cell')].filter(c => "
                       "c.dataset.member === 'm1').every(c => c.dataset.instance === 'b')",
                       30, "m1's partitions owned by b in the grid")
    await tab.wait_for(f"{TIMELINE}.some(e => e.kind === 'active' && e.instance === 'b')",
                       10, "b becoming active in the timeline")
    await tab.wait_for(f"!{INSTANCES}.some(r => r[1] === 'a')", 10,
                       "the killed instance gone from the instance list")
    line = next(e for e in await tab.evaluate(TIMELINE)
                if e["kind"] == "active" and e["instance"] == "b")
    assert "m1 instance b" in line["text"] and "became active" in line["text"], line

    # Add m3 from the page: fill the form, submit, confirm in the dialog.
    await tab.evaluate("document.querySelector('#f-member-add input').value = 'm3';"
                       "document.querySelector('#f-member-add button').click()")
    question = await tab.wait_for(
        "!document.getElementById('confirm').classList.contains('hidden') && "
        "document.getElementById('confirm-text').textContent", 5, "the confirmation")
    assert "Add m3 to ORDERS/g" in question
    assert (await admin.get_group(jetstream, "ORDERS", "g")).config.members == ("m1", "m2")
    await tab.evaluate("document.getElementById('confirm-ok').click()")
    result = await tab.wait_for("document.querySelector('#result.ok') && "
                                "document.querySelector('#result').textContent", 10,
                                "the action's result")
    assert result.startswith("added m3; members of ORDERS/g: m1, m2, m3"), result
    assert (await admin.get_group(jetstream, "ORDERS", "g")).config.members == (
        "m1", "m2", "m3")
    for i in range(120):
        await jetstream.nc.publish(f"orders.k{i}", json.dumps({"n": i}).encode())
    await tab.wait_for("[...document.querySelectorAll('#grid .cell')].filter(c => "
                       "c.dataset.member === 'm3' && c.classList.contains('unowned') && "
                       "!c.innerText.includes('no lag')).length === 2", 20,
                       "m3's two partitions unowned, with lag")
    moved = await owners()
    assert set(moved) == {"m1", "m2", "m3"} and moved["m3"] == {""}, moved
    await tab.wait_for("document.getElementById('t-unowned').textContent === '2'", 5)
    await tab.wait_for(f"{INSTANCES}.some(r => r[0] === 'm3' && r[2] === 'none')", 5,
                       "m3 listed with no instance")

    shot = await tab.screenshot()
    (tmp_path / "console.png").write_bytes(shot)
    assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 20_000
    if os.environ.get(UPDATE_ENV):
        DOCS_SHOT.parent.mkdir(parents=True, exist_ok=True)
        DOCS_SHOT.write_bytes(shot)

    join("d", "m3")
    await tab.wait_for("[...document.querySelectorAll('#grid .cell')].filter(c => "
                       "c.dataset.member === 'm3').every(c => c.dataset.instance === 'd')",
                       30, "d owning m3's partitions")
    await tab.wait_for(f"{TIMELINE}.some(e => e.kind === 'active' && e.instance === 'd')",
                       10, "d becoming active in the timeline")
    assert [e for e in tab.console if e.startswith("exception")] == []
    assert b.proc.poll() is None


async def test_a_read_only_console_offers_no_action_and_shows_hostile_text_as_text(
        nats_server: NatsServer, jetstream: JetStream, chromium: Chromium,
        console_process: Callable[..., ConsoleProcess], http: aiohttp.ClientSession) -> None:
    """Without --allow-actions the page shows the group and its record but no action
    form, says read-only, and holds no token. An advisory anyone could publish, with
    markup in its names, shows as text: no element is made of it, no script runs."""
    await make_group(jetstream, partitions=3, members=("m1",))
    console = console_process(nats_server.url)
    await console.ready(http)
    tab = await chromium.new_tab(console.url)
    await tab.wait_for("document.querySelectorAll('#grid .cell.unowned').length === 3", 20,
                       "three unowned partitions")
    assert await tab.evaluate("document.getElementById('mode').textContent") == "read-only"
    assert await tab.evaluate(
        "document.getElementById('actions').classList.contains('hidden')") is True
    assert await tab.evaluate(
        "document.querySelector('meta[name=cgroupd-token]').content") == ""
    record = json.loads(await tab.evaluate("document.getElementById('record').textContent"))
    assert (record["stream"], record["group"], record["members"]) == ("ORDERS", "g", ["m1"])

    hostile = "<img src=x onerror=\"window.pwned=1\">"
    event = events.make_event("active", "ORDERS", "g", member=hostile, instance=hostile,
                              host="<b>h</b>", partitions=[0])
    await jetstream.nc.publish(events.event_subject("ORDERS", "g", "active"),
                               json.dumps(event).encode())
    text = await tab.wait_for("document.querySelector('#timeline li .what') && "
                              "document.querySelector('#timeline li .what').textContent", 10,
                              "the hostile advisory in the timeline")
    assert hostile in text and "<b>h</b>" in text, text
    assert await tab.evaluate("document.querySelectorAll('#timeline img, #timeline b')"
                              ".length") == 0
    assert await tab.evaluate("window.pwned === undefined") is True


async def test_a_replay_shows_its_plan_before_it_is_executed(
        nats_server: NatsServer, jetstream: JetStream, chromium: Chromium,
        console_process: Callable[..., ConsoleProcess], http: aiohttp.ClientSession) -> None:
    """Replay from the page: "Show the plan" shows the CLI's dry run and changes nothing;
    "Execute" asks for confirmation, then runs that plan and says what it did."""
    await make_group(jetstream, partitions=2, members=("m1",))
    for i in range(6):
        await jetstream.nc.publish(f"orders.k{i}", b"{}")
    console = console_process(nats_server.url, "--allow-actions")
    await console.ready(http)
    tab = await chromium.new_tab(console.url)
    await tab.wait_for("document.querySelectorAll('#grid .cell').length === 2", 20)
    await tab.evaluate("document.querySelector('#f-replay button').click()")
    plan = await tab.wait_for("!document.getElementById('plan').classList.contains('hidden')"
                              " && document.getElementById('plan-text').textContent", 10,
                              "the replay plan")
    assert "dry run" in plan.lower(), plan
    assert await tab.evaluate(
        "document.getElementById('confirm').classList.contains('hidden')") is True
    await tab.evaluate("document.getElementById('replay-execute').click()")
    question = await tab.wait_for(
        "!document.getElementById('confirm').classList.contains('hidden') && "
        "document.getElementById('confirm-text').textContent", 5, "the confirmation")
    assert "Execute the replay of ORDERS/g" in question
    await tab.evaluate("document.getElementById('confirm-ok').click()")
    done = await tab.wait_for("document.querySelector('#result.ok') && "
                              "document.querySelector('#result').textContent", 20,
                              "the replay's result")
    assert "dry run" not in done.lower(), done
    await tab.wait_for(f"{TIMELINE}.some(e => e.kind === 'console' && "
                       "e.text.includes('replay-execute done'))", 10)


async def test_five_tabs_cost_one_status_read_per_interval(
        nats_server: NatsServer, jetstream: JetStream, chromium: Chromium,
        console_process: Callable[..., ConsoleProcess], http: aiohttp.ClientSession) -> None:
    """Five browser tabs watch one group, each refreshing on its own timer: over eight
    intervals the console's $JS.API requests (seen by a monitoring subscription) stay
    within one status read's worth per interval, as one `cgroupd status` costs."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    interval = 0.5
    console = console_process(nats_server.url, "--interval", str(interval))
    await console.ready(http)
    tabs = [await chromium.new_tab(console.url) for _ in range(5)]
    for tab in tabs:
        await tab.wait_for("document.querySelectorAll('#grid .cell').length === 4", 20)
    seen: list[str] = []

    async def on_request(msg: Any) -> None:
        seen.append(msg.subject)

    nc = jetstream.nc
    sub = await nc.subscribe("$JS.API.>", cb=on_request)
    await nc.flush()
    await admin.group_status(jetstream, "ORDERS", "g", in_flight=True)
    await nc.flush()
    one_read = len(seen)
    seen.clear()
    stamps = "document.getElementById('refreshed').textContent"
    before = [await tab.evaluate(stamps) for tab in tabs]
    windows = 8
    await asyncio.sleep(windows * interval)  # measuring over a span of time, not waiting
    await nc.flush()
    await sub.unsubscribe()
    after = [await tab.evaluate(stamps) for tab in tabs]
    assert all(a != b for a, b in zip(after, before, strict=True)), (before, after)
    assert one_read >= 3
    assert 0 < len(seen) <= (windows + 1) * one_read, (len(seen), one_read)
    print(f"\n5 tabs, {windows} intervals of {interval}s: {len(seen)} $JS.API requests "
          f"(one status read = {one_read})")
