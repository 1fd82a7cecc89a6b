"""Issue 25 row 4: webhook credentials never leave the process.

A real ``cgroupd join`` process POSTs to a real local aiohttp webhook that answers 400 or
500 and echoes back the credentials it was sent (as careless error pages do). The
credentials come from the URL (``user:password@`` and a ``?sig=`` query), from
``--webhook-token-file`` or from ``--webhook-header-file``. Then every log line and
every dead letter (read back from the dead-letter stream) is searched for them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from nats.aio.client import Client
from nats.js import api

from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess, restore_logging  # noqa: F401 - autouse fixture
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer, find_free_port
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

PASSWORD = "pw-Zq81-userinfo-secret"
QUERY_SECRET = "sig-Qk77-query-secret"
TOKEN = "tok-Vb42-bearer-secret"
API_KEY = "key-Hh19-header-secret"


@dataclass
class EchoingWebhook:
    """Answers 400 to key ``bad`` and 500 to everything else, echoing the request's
    Authorization and X-Api-Key headers and its query string in the body."""

    seen: list[dict[str, str]] = field(default_factory=list)
    port: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append({**dict(request.headers), "query": request.query_string})
        key = json.loads(await request.read())["key"]
        echo = (f"denied: Authorization={request.headers.get('Authorization')} "
                f"X-Api-Key={request.headers.get('X-Api-Key')} query={request.query_string}")
        return web.Response(status=400 if key == "bad" else 500, text=echo)


@pytest_asyncio.fixture
async def webhook() -> AsyncIterator[EchoingWebhook]:
    hook = EchoingWebhook()
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    hook.port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", hook.port).start()
    try:
        yield hook
    finally:
        await runner.cleanup()


def _secrets_of(kind: str) -> list[str]:
    basic = base64.b64encode(f"svc:{PASSWORD}".encode()).decode()
    return {"userinfo": [PASSWORD, QUERY_SECRET, basic],
            "token_file": [TOKEN, QUERY_SECRET], "header_file": [TOKEN, API_KEY]}[kind]


@pytest.mark.parametrize("kind", ["userinfo", "token_file", "header_file"])
async def test_webhook_credentials_reach_the_webhook_and_nothing_else(
        kind: str, nats_server: NatsServer, jetstream: JetStream, nc: Client,
        tmp_path: Path, webhook: EchoingWebhook) -> None:
    """The webhook gets the credentials (Basic from userinfo, Bearer from a token file,
    any header from a header file); the join log (every retry line included) and the
    dead letters carry none of them, nor the webhook's answer, and the URL in
    ``Cgroupd-Error`` has neither userinfo nor query."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await jetstream.add_stream(api.StreamConfig(name="DLQ", subjects=["dlq.orders"]))
    base = f"127.0.0.1:{webhook.port}/hook"
    args = ["--stream", "ORDERS", "--group", "g", "--member", "m1", "--max-deliver", "2",
            "--dead-letter-subject", "dlq.orders"]
    if kind == "userinfo":
        args += ["--webhook", f"http://svc:{PASSWORD}@{base}?sig={QUERY_SECRET}"]
        want_auth = "Basic " + base64.b64encode(f"svc:{PASSWORD}".encode()).decode()
    elif kind == "token_file":
        (tmp_path / "token").write_text(TOKEN + "\n")
        args += ["--webhook", f"http://{base}?sig={QUERY_SECRET}",
                 "--webhook-token-file", str(tmp_path / "token")]
        want_auth = f"Bearer {TOKEN}"
    else:
        (tmp_path / "headers").write_text(f"# mounted Secret\nAuthorization: Bearer {TOKEN}\n"
                                          f"X-Api-Key: {API_KEY}\n")
        args += ["--webhook", f"http://{base}",
                 "--webhook-header-file", str(tmp_path / "headers")]
        want_auth = f"Bearer {TOKEN}"
    proc = JoinProcess(nats_server.url, tmp_path, "join", *args)
    try:
        js = nc.jetstream()
        await js.publish("orders.bad", json.dumps({"key": "bad"}).encode())
        await js.publish("orders.down", json.dumps({"key": "down"}).encode())

        async def two_dead_letters() -> bool:
            info = await js.stream_info("DLQ")
            return info.state.messages == 2

        await eventually(two_dead_letters, 30, what="2 dead letters", interval=0.1)
        letters = [await js.get_msg("DLQ", seq) for seq in (1, 2)]
        proc.terminate()
        assert await proc.wait_exit() == 0
        log, events = proc.log_text(), proc.events()
    finally:
        proc.close()

    assert webhook.seen, "the webhook was called"
    assert {h.get("Authorization") for h in webhook.seen} == {want_auth}
    if kind == "header_file":
        assert {h.get("X-Api-Key") for h in webhook.seen} == {API_KEY}
    else:
        assert {h["query"] for h in webhook.seen} == {f"sig={QUERY_SECRET}"}

    retries = [e for e in events if e.get("event") == "handler failed; retrying"]
    assert retries, "the 500 was retried, and logged"
    assert "answered 500" in log and "***" in log, "the answer is logged, scrubbed"
    errors = {}
    for letter in letters:
        headers = {k: str(v) for k, v in (letter.headers or {}).items()}
        errors[headers["Cgroupd-Original-Subject"]] = headers["Cgroupd-Error"]
        stored = json.dumps(headers) + letter.data.decode()
        for secret in _secrets_of(kind):
            assert secret not in stored, f"{secret!r} in a dead letter: {headers}"
        assert "denied" not in stored, "the webhook's answer is kept out of the dead letter"
    for secret in _secrets_of(kind):
        assert secret not in log, f"{secret!r} in the log:\n{log}"
    shown = f"http://{base}" + ("?..." if kind != "header_file" else "")
    assert errors == {"orders.bad": f"NonRetryable: webhook {shown} answered 400",
                      "orders.down": f"WebhookFailed: webhook {shown} answered 500"}


async def test_error_body_in_the_dead_letter_only_when_asked_and_scrubbed(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        webhook: EchoingWebhook) -> None:
    """``--dead-letter-error-body`` keeps the webhook's answer, with the credentials it
    echoed replaced by ``***``."""
    await make_group(jetstream, partitions=1, members=("m1",))
    await jetstream.add_stream(api.StreamConfig(name="DLQ", subjects=["dlq.orders"]))
    (tmp_path / "token").write_text(TOKEN)
    proc = JoinProcess(nats_server.url, tmp_path, "join", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--dead-letter-subject", "dlq.orders",
                       "--webhook", f"http://127.0.0.1:{webhook.port}/hook",
                       "--webhook-token-file", str(tmp_path / "token"),
                       "--dead-letter-error-body")
    try:
        js = nc.jetstream()
        await js.publish("orders.bad", json.dumps({"key": "bad"}).encode())

        async def stored() -> bool:
            return (await js.stream_info("DLQ")).state.messages == 1

        await eventually(stored, 30, what="the dead letter", interval=0.1)
        letter = await js.get_msg("DLQ", 1)
        proc.terminate()
        assert await proc.wait_exit() == 0
        log = proc.log_text()
    finally:
        proc.close()
    error = (letter.headers or {})["Cgroupd-Error"]
    assert error.startswith("NonRetryable: webhook http://127.0.0.1:")
    assert "denied: Authorization=*** X-Api-Key=None" in error
    assert TOKEN not in error and TOKEN not in log
