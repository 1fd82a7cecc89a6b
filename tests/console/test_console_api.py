"""The console's JSON API against a real server, without a browser: what it costs the
server (one status read per interval however many pages watch, measured on the server's
own API counters), its guards (read-only by default, token, Origin, Host, no CORS),
nothing secret in what it serves, and actions that answer as the CLI does."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd import admin
from cgroupd.console import TOKEN_HEADER
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import (
    JoinProcess,
    cli,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer, running_server
from tests.support.polling import eventually

INTERVAL = 0.5
HANDLER = "tests.support.handlers.record_handler:handle"


async def _count_api(nc: Client) -> tuple[Counter[str], Any]:
    """Every $JS.API request anyone sends from now on, by subject (a monitoring
    subscription: the server delivers each request to it as to JetStream)."""
    seen: Counter[str] = Counter()

    async def on_msg(msg: Msg) -> None:
        seen[msg.subject] += 1

    sub = await nc.subscribe("$JS.API.>", cb=on_msg)
    await nc.flush()
    return seen, sub


def _api_total(server: NatsServer) -> int:
    """JetStream API requests the server has answered (its /jsz counter)."""
    return int(server.monitor("/jsz")["api"]["total"])


async def _get(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.get(url, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_one_status_read_per_interval_however_many_pages_watch(
        nats_server: NatsServer, jetstream: JetStream, nc: Client,
        served_console: Any, http: aiohttp.ClientSession) -> None:
    """Five clients poll the group as fast as they can (ten times an interval) for six
    intervals: the console reads the group's status once per interval for all of them.
    Measured twice: the $JS.API requests a monitoring subscription sees, and the server's
    /jsz API counter, each against what one status read (``cgroupd status``) costs."""
    await make_group(jetstream, partitions=6, members=("m1", "m2"))
    for i in range(30):
        await nc.publish(f"orders.k{i}", b"{}")
    served = await served_console(jetstream, streams=("ORDERS",), interval=INTERVAL)
    group_url = served.url + "api/groups/ORDERS/g"
    assert (await _get(http, group_url))[0] == 200  # watch started, first read done

    # What one status read costs, made as `cgroupd status` makes it.
    seen, sub = await _count_api(nc)
    await admin.group_status(jetstream, "ORDERS", "g", in_flight=True)
    await nc.flush()
    one_read = sum(seen.values())
    assert one_read >= 3, seen  # record, consumer list, lag
    seen.clear()
    reads_before, api_before = served.console.reads, _api_total(nats_server)

    windows = 6
    answers: list[int] = []

    async def page() -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + windows * INTERVAL
        while loop.time() < end:
            status, body = await _get(http, group_url)
            answers.append(status)
            assert body["status"]["partitions"], body
            await asyncio.sleep(INTERVAL / 10)

    await asyncio.gather(*(page() for _ in range(5)))
    await nc.flush()
    await sub.unsubscribe()
    reads = served.console.reads - reads_before
    api_total = _api_total(nats_server) - api_before
    requests = sum(seen.values())
    # At least one poll per client per interval: five times the reads allowed below.
    assert all(s == 200 for s in answers) and len(answers) >= 5 * windows, len(answers)
    # One read per interval (plus one for a window boundary), never one per page poll.
    assert 1 <= reads <= windows + 1, reads
    assert requests <= (windows + 1) * one_read, (requests, one_read, seen)
    assert api_total <= (windows + 1) * one_read, (api_total, one_read)
    print(f"\n5 clients, {len(answers)} polls in {windows} intervals of {INTERVAL}s: "
          f"{reads} status reads, {requests} $JS.API requests seen, {api_total} by /jsz "
          f"(one read = {one_read})")


async def test_read_only_by_default_and_every_post_guard(
        jetstream: JetStream, served_console: Any, http: aiohttp.ClientSession) -> None:
    """Without --allow-actions a POST is refused whatever it carries; with it, only one
    carrying the page's token, an Origin equal to the console's own address, and JSON.
    A Host header naming another site is refused on every request (DNS rebinding); no
    response allows another origin (no CORS)."""
    await make_group(jetstream, partitions=2, members=("m1",))
    ro = await served_console(jetstream)
    page = await (await http.get(ro.url)).text()
    assert 'name="cgroupd-token" content=""' in page  # no token handed out read-only
    url = ro.url + "api/groups/ORDERS/g/actions/member-add"
    origin = ro.url.rstrip("/")
    async with http.post(url, json={"members": ["m9"]},
                         headers={"Origin": origin, TOKEN_HEADER: ro.console.token}) as r:
        assert r.status == 403
        assert (await r.json())["error"] == ("actions are disabled: start the console "
                                             "with --allow-actions")

    rw = await served_console(jetstream, allow_actions=True)
    token = rw.console.token
    assert f'name="cgroupd-token" content="{token}"' in await (await http.get(rw.url)).text()
    url = rw.url + "api/groups/ORDERS/g/actions/member-add"
    origin = rw.url.rstrip("/")
    cases = [
        ({"Origin": origin}, 403, "missing or wrong console token"),
        ({"Origin": origin, TOKEN_HEADER: "x" + token}, 403, "missing or wrong"),
        ({TOKEN_HEADER: token}, 403, "cross-origin request refused"),
        ({TOKEN_HEADER: token, "Origin": "http://evil.example"}, 403, "cross-origin"),
        ({TOKEN_HEADER: token, "Origin": origin, "Sec-Fetch-Site": "cross-site"}, 403,
         "cross-site"),
    ]
    for headers, status, fragment in cases:
        async with http.post(url, json={"members": ["m9"]}, headers=headers) as r:
            assert r.status == status, headers
            assert fragment in (await r.json())["error"], headers
            assert "Access-Control-Allow-Origin" not in r.headers
    async with http.post(url, data="members=m9", headers={
            TOKEN_HEADER: token, "Origin": origin,
            "Content-Type": "application/x-www-form-urlencoded"}) as r:
        assert r.status == 415
    assert (await admin.get_group(jetstream, "ORDERS", "g")).config.members == ("m1",)
    async with http.post(url, json={"members": ["m9"]},
                         headers={TOKEN_HEADER: token, "Origin": origin}) as r:
        assert r.status == 200, await r.text()
    assert (await admin.get_group(jetstream, "ORDERS", "g")).config.members == ("m1", "m9")

    port = rw.url.rstrip("/").rpartition(":")[2]
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"):
        async with http.get(rw.url + "api/groups", headers={"Host": host}) as r:
            assert r.status == 200, host
    for target in (rw.url, rw.url + "api/groups"):
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                     "[::2]:80", ""):
            async with http.get(target, headers={"Host": host}) as r:
                assert r.status == 421, host
        async with http.options(target, headers={
                "Origin": "http://evil.example",
                "Access-Control-Request-Method": "POST"}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers
    async with http.get(rw.url + "api/groups") as r:
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
        assert "Access-Control-Allow-Origin" not in r.headers


async def test_nothing_secret_in_the_page_or_the_api(tmp_path: Any, http: aiohttp.ClientSession,
                                                    served_console: Any) -> None:
    """A console connected with a user and password in the server URL: neither the
    password nor the user appears in anything it serves (page, script, groups, group);
    the server is shown as scheme://host:port."""
    auth = "authorization { users = [ {user: opsuser, password: s3cr3t-pass} ] }"
    with running_server(workdir=tmp_path, extra_config=auth) as srv:
        secret_url = srv.url.replace("nats://", "nats://opsuser:s3cr3t-pass@")
        nc = await connect(ConnectionOptions(servers=(secret_url,)))
        try:
            js = JetStream(nc)
            await make_group(js, partitions=2, members=("m1",))
            served = await served_console(js)
            bodies = []
            for path in ("", "static/console.js", "static/console.css", "api/groups",
                         "api/groups/ORDERS/g"):
                async with http.get(served.url + path) as r:
                    assert r.status == 200, path
                    bodies.append(await r.text())
            text = "\n".join(bodies)
            assert "s3cr3t-pass" not in text and "opsuser" not in text
            assert json.loads(bodies[3])["server"] == srv.url.rstrip("/")
        finally:
            await nc.close()


async def test_actions_answer_as_the_cli_does(
        nats_server: NatsServer, jetstream: JetStream, served_console: Any,
        http: aiohttp.ClientSession) -> None:
    """The same refusals with the same messages as the CLI (a bad member name, a
    step-down with no active instance, a bad mapping, a replay with a bad duration),
    and the replay plan is the CLI's dry run."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    served = await served_console(jetstream, allow_actions=True)
    headers = {TOKEN_HEADER: served.console.token, "Origin": served.url.rstrip("/")}

    async def act(action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with http.post(f"{served.url}api/groups/ORDERS/g/actions/{action}",
                             json=body, headers=headers) as r:
            return r.status, await r.json()

    def cli_error(*args: str) -> str:
        result = cli(nats_server.url, *args)
        assert result.exit_code != 0, result.output
        return result.stderr.strip().removeprefix("cgroupd: error: ")

    checks = [
        ("member-add", {"members": ["bad name"]}, ("member", "add", "ORDERS", "g", "bad name")),
        ("step-down", {"member": "m1"}, ("step-down", "ORDERS", "g", "m1")),
        ("mapping-set", {"mappings": "m1=0,9"}, ("mapping", "set", "ORDERS", "g", "m1=0,9")),
        ("replay-plan", {"from": "duration", "value": "soon"},
         ("replay", "ORDERS", "g", "--by-duration", "soon")),
        ("replay-plan", {"from": "time", "value": "yesterday"},
         ("replay", "ORDERS", "g", "--to-time", "yesterday")),
    ]
    for action, body, args in checks:
        status, answer = await act(action, body)
        expected = await asyncio.to_thread(cli_error, *args)
        assert status in (400, 409), (action, answer)
        assert answer["error"] == expected, action

    status, answer = await act("replay-plan", {"from": "earliest"})
    assert status == 200, answer
    result = await asyncio.to_thread(cli, nats_server.url, "replay", "ORDERS", "g",
                                     "--to-earliest")
    assert answer["message"] == result.stdout.strip()
    status, answer = await act("nonsense", {})
    assert status == 404


@pytest.mark.parametrize("path", ["api/groups/ORDERS/nope", "api/groups/OTHER/g"])
async def test_a_group_not_shown_is_not_read(jetstream: JetStream, served_console: Any,
                                            http: aiohttp.ClientSession, path: str) -> None:
    """Only the groups listed (of --stream) can be watched: another name is a 404 and
    starts no watch."""
    await make_group(jetstream, partitions=2, members=("m1",))
    served = await served_console(jetstream, streams=("ORDERS",))
    status, body = await _get(http, served.url + path)
    assert status == 404 and "no consumer group" in body["error"]
    assert served.console.reads == 0


@pytest.mark.slow
async def test_pin_changes_and_a_step_down_from_the_console(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Any, served_console: Any,
        http: aiohttp.ClientSession, closing: list[Any]) -> None:
    """Pinned mode: the server's pin advisories show in the group's timeline as pin
    changes of the member; a step-down asked from the console (the CLI's admin call)
    moves the pin to the standby, and the timeline shows the unpin, the new pin and the
    standby becoming active."""
    await make_group(jetstream, partitions=2, members=("m1",))
    served = await served_console(jetstream, allow_actions=True, interval=0.3)
    url = served.url + "api/groups/ORDERS/g"
    assert (await _get(http, url))[0] == 200  # following from now on

    def join(name: str) -> JoinProcess:
        proc = JoinProcess(nats_server.url, tmp_path, name, "--stream", "ORDERS", "--group",
                           "g", "--member", "m1", "--handler", HANDLER, "--exclusivity",
                           "pinned", "--instance-id", name, "--status-interval", "0.3",
                           record=tmp_path / "handled.jsonl", metrics=False)
        closing.append(proc)
        return proc

    async def timeline() -> list[dict[str, Any]]:
        return list((await _get(http, url))[1]["events"])

    async def kinds() -> list[tuple[str, str | None, str | None]]:
        return [(e["kind"], e.get("member"), e.get("instance")) for e in await timeline()]

    a = join("a")
    for i in range(4):  # the server pins a puller when it has messages to deliver
        await jetstream.nc.publish(f"orders.k{i}", b"{}")
    await eventually(lambda: _has(kinds, ("active", "m1", "a")), 30, what="a active",
                     diagnostics=a.log_tail)
    await eventually(lambda: _has(kinds, ("pinned", "m1", None)), 10, what="a pin advisory")
    b = join("b")

    async def b_standing_by() -> bool:
        members = (await _get(http, url))[1]["members"]
        return any(i["instance"] == "b" and i["state"] == "standby"
                   for m in members for i in m["instances"])

    await eventually(b_standing_by, 30, what="b standing by", diagnostics=b.log_tail)
    async with http.post(url + "/actions/step-down", json={"member": "m1"}, headers={
            TOKEN_HEADER: served.console.token, "Origin": served.url.rstrip("/")}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["message"] == "asked the active instance of m1 to step down"
    for i in range(4):  # for the standby to be pinned
        await jetstream.nc.publish(f"orders.k{i}", b"{}")
    await eventually(lambda: _has(kinds, ("active", "m1", "b")), 30, what="b active",
                     diagnostics=lambda: f"{b.log_tail()}\n{a.log_tail()}")
    seen = await kinds()
    assert ("unpinned", "m1", None) in seen, seen
    assert len([k for k in seen if k[0] == "pinned"]) >= 2, seen
    pins = [e["text"] for e in await timeline() if e["kind"] in ("pinned", "unpinned")]
    assert all("ORDERS/g" in t and "member m1" in t for t in pins), pins
    assert any(e["kind"] == "console" and "step-down done" in e["text"]
               for e in await timeline())


async def _has(kinds: Any, wanted: tuple[str, str | None, str | None]) -> bool:
    return wanted in await kinds()


async def test_groups_of_every_stream_or_of_the_given_ones(
        jetstream: JetStream, served_console: Any, http: aiohttp.ClientSession) -> None:
    """Without --stream every group the credentials can read is listed; with it, only
    that stream's."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await make_group(jetstream, stream="PAYMENTS", group="p", partitions=2, members=("m1",))
    every = await served_console(jetstream)
    status, body = await _get(http, every.url + "api/groups")
    assert status == 200 and [(g["stream"], g["group"]) for g in body["groups"]] == [
        ("ORDERS", "g"), ("PAYMENTS", "p")]
    one = await served_console(jetstream, streams=("PAYMENTS",))
    status, body = await _get(http, one.url + "api/groups")
    assert [(g["stream"], g["group"], g["type"]) for g in body["groups"]] == [
        ("PAYMENTS", "p", "elastic")]
    assert (await _get(http, one.url + "api/groups/ORDERS/g"))[0] == 404


async def test_a_failed_read_keeps_the_last_good_one_and_says_why(
        jetstream: JetStream, served_console: Any, http: aiohttp.ClientSession) -> None:
    """The group deleted while a page watches it: the next refresh answers the last good
    read marked stale, with the CLI's message; re-created, the group reads fresh again."""
    await make_group(jetstream, partitions=2, members=("m1",))
    served = await served_console(jetstream, interval=0.2)
    url = served.url + "api/groups/ORDERS/g"
    status, body = await _get(http, url)
    assert status == 200 and body["error"] is None and not body["stale"]
    await admin.delete_group(jetstream, "ORDERS", "g")

    async def stale() -> dict[str, Any] | None:
        answer = (await _get(http, url))[1]
        return answer if answer.get("stale") else None

    body = await eventually(stale, 10, what="a stale answer")
    assert body["error"] == "no consumer group 'g' on stream 'ORDERS'"
    assert len(body["status"]["partitions"]) == 2  # the last good read
    await admin.create_elastic_group(jetstream, "ORDERS", "g", ElasticGroupConfig(
        max_members=3, members=("m1",),
        partitioning_filters=(PartitioningFilter("orders.*", (1,)),)))

    async def fresh() -> dict[str, Any] | None:
        answer = (await _get(http, url))[1]
        return answer if answer.get("error") is None else None

    body = await eventually(fresh, 10, what="a fresh read")
    assert len(body["status"]["partitions"]) == 3 and body["stale"] is False



async def test_membership_actions_change_the_record_as_the_cli_does(
        nats_server: NatsServer, jetstream: JetStream, served_console: Any,
        http: aiohttp.ClientSession) -> None:
    """mapping set and clear and member drop from the console: the record changes, the
    answer is the CLI's text, and the next refresh shows the change at once (the action
    expires the shared read)."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    served = await served_console(jetstream, allow_actions=True, interval=60)
    headers = {TOKEN_HEADER: served.console.token, "Origin": served.url.rstrip("/")}
    url = served.url + "api/groups/ORDERS/g"
    assert (await _get(http, url))[1]["record"]["mappings"] == []

    async def act(action: str, body: dict[str, Any]) -> dict[str, Any]:
        async with http.post(f"{url}/actions/{action}", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            return dict(await r.json())

    answer = await act("mapping-set", {"mappings": "m1=0,1 m2=2-3"})
    assert answer["message"].startswith("mappings set; members of ORDERS/g: m1, m2")
    record = (await _get(http, url))[1]["record"]  # read again despite the 60 s interval
    assert record["mappings"] == [{"member": "m1", "partitions": [0, 1]},
                                  {"member": "m2", "partitions": [2, 3]}]
    answer = await act("mapping-clear", {})
    assert answer["message"].startswith("mappings cleared")
    answer = await act("member-drop", {"members": ["m2"]})
    cli_text = (await asyncio.to_thread(cli, nats_server.url, "member", "drop", "ORDERS",
                                        "g", "m2")).stdout.strip()
    assert answer["message"] == cli_text
    status = (await _get(http, url))[1]["status"]
    assert {p["member"] for p in status["partitions"]} == {"m1"}
    assert (await admin.get_group(jetstream, "ORDERS", "g")).config.members == ("m1",)
