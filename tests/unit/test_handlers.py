"""Handlers, dead letters, metrics, logs and connection options: no NATS server needed.

Messages are real :class:`~cgroupd.nats.message.Message` objects over a fake client that
records what they publish to their reply subject (``+ACK``, ``-NAK``, ``+TERM``); the
webhook handler talks to a real local aiohttp server.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from structlog.testing import capture_logs

from cgroupd.core import logs
from cgroupd.core.errors import ConfigError
from cgroupd.join.handlers import (
    DeadLetterFailed,
    DeadLetterOptions,
    HandlerLoadError,
    HandlerOptions,
    HandlerWrapper,
    NonRetryable,
    WebhookFailed,
    WebhookHandler,
    WebhookOptions,
    call_handler,
    load_handler,
    parse_statuses,
    webhook_headers,
)
from cgroupd.join.metrics import Metrics
from cgroupd.nats.connect import DEFAULT_SERVER, ConnectionOptions, connect_kwargs
from cgroupd.nats.message import Message, Outcome
from tests.support.cli import (
    WebhookServer,
    parse_metrics,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.natsserver import find_free_port
from tests.support.polling import within


class FakeClient:
    """Stands in for the NATS client: records (subject, payload) of acks."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes = b"", **_: Any) -> None:
        self.sent.append((subject, payload))


def message(data: bytes = b'{"key": "k1"}', deliveries: int = 1,
            headers: dict[str, str] | None = None) -> Message:
    return Message(subject="orders.k1", partition=2, data=data,
                   headers=headers if headers is not None else {"X-Trace": "abc"},
                   stream_sequence=41, delivery_count=deliveries,
                   _nc=FakeClient(), _reply="$JS.ACK.reply")  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return parse_metrics(metrics.render().decode()).get((name, tuple(sorted(labels.items()))))


# -- loading ----------------------------------------------------------------------------
def test_load_handler_finds_sync_and_async_functions() -> None:
    """``pkg.module:function`` resolves to the function, sync or async."""
    from tests.support.handlers import record_handler

    assert load_handler("tests.support.handlers.record_handler:handle") is record_handler.handle
    assert (load_handler("tests.support.handlers.record_handler:handle_async")
            is record_handler.handle_async)


@pytest.mark.parametrize(("reference", "expected"), [
    ("no_such_module_xyz:handle", "not found"),
    ("tests.support.handlers.record_handler:nope", "has no attribute 'nope'"),
    ("tests.support.handlers.record_handler", "must look like package.module:function"),
    (":handle", "must look like"),
    ("os:sep", "is not callable"),
    ("tests.support.handlers.broken_handler:handle", "failed to import: RuntimeError"),
])
def test_load_handler_explains_every_failure(reference: str, expected: str) -> None:
    """Each way a reference can be wrong gives one clear sentence."""
    with pytest.raises(HandlerLoadError, match=expected):
        load_handler(reference)


async def test_sync_handlers_run_in_a_thread_and_async_ones_on_the_loop() -> None:
    """A blocking handler must not stall the pulls that keep consumers alive."""
    seen: list[str] = []

    def sync(msg: Message) -> None:
        seen.append(threading.current_thread().name)

    async def asynchronous(msg: Message) -> None:
        seen.append(threading.current_thread().name)

    await call_handler(sync, message())
    await call_handler(asynchronous, message())
    assert seen[0] != threading.main_thread().name
    assert seen[1] == threading.main_thread().name


def test_option_validation() -> None:
    """Bad webhook, dead-letter and status options are refused up front."""
    assert parse_statuses("400, 422,") == {400, 422}
    with pytest.raises(ConfigError, match="not a number"):
        parse_statuses("400,abc")
    with pytest.raises(ConfigError, match="http"):
        WebhookOptions("ftp://x")
    with pytest.raises(ConfigError, match=r"within 300\.\.599"):
        WebhookOptions("http://x", non_retryable=frozenset({200}))
    with pytest.raises(ConfigError, match="without wildcards"):
        DeadLetterOptions(3, "dlq.*")
    with pytest.raises(ConfigError, match="exactly one handler"):
        HandlerOptions()


# -- webhook ----------------------------------------------------------------------------
async def test_webhook_statuses_headers_and_connection_reuse() -> None:
    """2xx returns, listed statuses raise NonRetryable, others WebhookFailed; headers
    carry the origin and the NATS headers; one session reuses its connection."""
    server = await WebhookServer(script={"k500": [500], "k422": [422], "k400": [400]}).start()
    try:
        async with aiohttp.ClientSession() as session:
            hook = WebhookHandler(WebhookOptions(server.url), session)
            await hook(message(b'{"key": "ok"}'))
            await hook(message(b'{"key": "ok2"}'))
            with pytest.raises(WebhookFailed, match="answered 500"):
                await hook(message(b'{"key": "k500"}'))
            with pytest.raises(NonRetryable, match="answered 422"):
                await hook(message(b'{"key": "k422"}'))
            with pytest.raises(NonRetryable, match="answered 400"):
                await hook(message(b'{"key": "k400"}'))
        first = server.hits[0]
        assert first.body == b'{"key": "ok"}'
        assert first.headers["Cgroupd-Subject"] == "orders.k1"
        assert first.headers["Cgroupd-Partition"] == "2"
        assert first.headers["Cgroupd-Stream-Sequence"] == "41"
        assert first.headers["Cgroupd-Delivery-Count"] == "1"
        assert first.headers["Nats-Header-X-Trace"] == "abc"
        assert first.headers["Content-Type"] == "application/octet-stream"
        assert len({h.peer for h in server.hits}) == 1, "connection was not reused"
    finally:
        await server.stop()


async def test_webhook_timeouts_and_refused_connections_are_retryable() -> None:
    """Slow or absent webhooks raise WebhookFailed, so the message is redelivered."""
    server = await WebhookServer(delay=1.0).start()
    try:
        async with aiohttp.ClientSession() as session:
            slow = WebhookHandler(WebhookOptions(server.url, timeout=0.2), session)
            with pytest.raises(WebhookFailed, match=r"timed out after 0\.2s"):
                await slow(message())
            gone = WebhookHandler(
                WebhookOptions(f"http://127.0.0.1:{find_free_port()}/hook"), session)
            with pytest.raises(WebhookFailed, match="failed"):
                await gone(message())
    finally:
        await server.stop()


def test_webhook_headers_keep_content_type_and_flatten_newlines() -> None:
    """The original Content-Type wins; header values never break the HTTP framing."""
    headers = webhook_headers(message(headers={"Content-Type": "application/json",
                                               "Multi": "a\r\nb"}))
    assert headers["Content-Type"] == "application/json"
    assert headers["Nats-Header-Multi"] == "a b"


@asynccontextmanager
async def raw_webhook(answer: Callable[[asyncio.StreamWriter], Awaitable[None]]
                      ) -> AsyncIterator[str]:
    """A TCP server that reads a request's head and answers whatever ``answer`` writes:
    what a broken or hostile webhook sends. Yields its URL."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await answer(writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/hook"
    finally:
        server.close()


def _status(line: bytes) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(line)
    return write


@pytest.mark.parametrize(("answer", "raises", "match"), [
    (b"garbage\r\n\r\n", WebhookFailed, "failed"),
    (b"", WebhookFailed, "failed"),  # closes without a word
    # The status is the webhook's answer; a body cut short after it changes nothing.
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", None, ""),
    (b"HTTP/1.1 299 Odd\r\nContent-Length: 0\r\n\r\n", None, ""),
    (b"HTTP/1.1 600 Weird\r\nContent-Length: 2\r\n\r\nno", WebhookFailed, "answered 600"),
    (b"HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n", WebhookFailed, "answered 999"),
    (b"HTTP/1.1 303 See Other\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n",
     WebhookFailed, "redirects are not followed"),
    (b"HTTP/1.1 301 Moved\r\nLocation: http://127.0.0.1:1/x\r\nContent-Length: 0\r\n\r\n",
     WebhookFailed, "answered 301"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"x" * 100_000 + b"\r\n\r\n",
     WebhookFailed, "failed"),
], ids=["garbage", "silence", "short-body", "299", "600", "999", "303", "301", "huge-head"])
async def test_webhook_answers_of_any_shape(answer: bytes, raises: type[Exception] | None,
                                            match: str) -> None:
    """Garbage, silence, a truncated body, odd statuses, redirects and a huge answer
    head: only a 2xx acks; redirects are never followed (aiohttp would re-send a 301 or
    303 as a GET without the payload, and a 2xx there would ack an undelivered message);
    everything else is a retryable failure with a clear reason."""
    async with raw_webhook(_status(answer)) as url, aiohttp.ClientSession() as session:
        hook = WebhookHandler(WebhookOptions(url, timeout=5.0), session)
        if raises is None:
            await hook(message())
        else:
            with pytest.raises(raises, match=match):
                await hook(message())


async def test_webhook_endless_answer_is_read_only_so_far() -> None:
    """A 200 whose body never ends (or is gigabytes long) acks at once: the handler reads
    at most MAX_WEBHOOK_ANSWER bytes and drops the connection, instead of filling memory
    until the timeout."""
    sent = {"bytes": 0}

    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        while sent["bytes"] < 1 << 30:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent["bytes"] += len(chunk)
            await writer.drain()

    async with raw_webhook(endless) as url, aiohttp.ClientSession() as session:
        hook = WebhookHandler(WebhookOptions(url, timeout=30.0), session)
        await within(hook(message()), 10, "the webhook to give up on the endless answer")
    assert sent["bytes"] < 64 << 20, sent


async def test_webhook_forwards_what_http_can_carry_and_names_the_rest() -> None:
    """NATS headers HTTP cannot carry (control characters, names that are not HTTP
    tokens, a 60 KB value, a thousand headers) no longer make the request fail or the
    webhook answer 400 (which gave up on the message): control characters become spaces,
    unicode passes, and what is left out is named in Cgroupd-Headers-Omitted."""
    headers = {"Ctl": "a\x00b\x07c\x7fd\te", "U": "ключ ✓ 🙂", "a(b)": "v",
               "Huge": "x" * 60_000, **{f"H{i:04}": str(i) for i in range(1000)}}
    server = await WebhookServer().start()
    try:
        async with aiohttp.ClientSession() as session:
            await WebhookHandler(WebhookOptions(server.url), session)(message(headers=headers))
        [hit] = server.hits
        assert hit.headers["Nats-Header-Ctl"] == "a b c d\te"
        assert hit.headers["Nats-Header-U"] == "ключ ✓ 🙂"  # sent as UTF-8
        *omitted, more = hit.headers["Cgroupd-Headers-Omitted"].split(",")
        assert "'a(b)'" in omitted and "Huge" in omitted
        assert more.startswith("+") and more.endswith(" more")
        forwarded = [k for k in hit.headers if k.startswith("Nats-Header-")]
        assert len(forwarded) == 64
        assert len(forwarded) + len(omitted) + int(more[1:-5]) == len(headers)
    finally:
        await server.stop()


# -- dead letters -----------------------------------------------------------------------
class Publisher:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.published: list[tuple[str, bytes, dict[str, str]]] = []

    async def __call__(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        if self.fail:
            raise RuntimeError("no stream captures subject 'dlq.x'")
        self.published.append((subject, data, headers))


def wrapper(handler: Any, max_deliver: int = 3, subject: str | None = "dlq.orders",
            publish: Publisher | None = None,
            metrics: Metrics | None = None) -> HandlerWrapper:
    return HandlerWrapper(handler, DeadLetterOptions(max_deliver, subject),
                          publish if publish is not None else Publisher(), metrics,
                          context={"stream": "ORDERS", "group": "g", "member": "m1"})


async def failing(msg: Message) -> None:
    raise RuntimeError("database down")


async def test_success_is_left_for_the_runtime_to_ack_and_counted() -> None:
    """Returning normally: no ack sent by the wrapper (the runtime acks), outcome ack."""
    metrics = Metrics("ORDERS", "g", "m1")
    msg = message()
    await wrapper(lambda m: None, metrics=metrics)(msg)
    assert msg.outcome is None and msg._nc.sent == []  # type: ignore[attr-defined]
    assert sample(metrics, "cgroupd_messages_processed_total", outcome="ack") == 1
    assert sample(metrics, "cgroupd_handler_duration_seconds_count") == 1
    assert sample(metrics, "cgroupd_messages_in_flight") == 0


async def test_failures_before_max_deliver_are_raised_for_redelivery() -> None:
    """Below max_deliver the error propagates (the runtime naks with backoff)."""
    metrics = Metrics("ORDERS", "g", "m1")
    publish = Publisher()
    msg = message(deliveries=2)
    with pytest.raises(RuntimeError, match="database down"):
        await wrapper(failing, publish=publish, metrics=metrics)(msg)
    assert publish.published == [] and msg.outcome is None
    assert sample(metrics, "cgroupd_messages_processed_total", outcome="nak") == 1


async def test_last_delivery_failure_is_dead_lettered_then_termed() -> None:
    """At max_deliver: published with the original payload and headers plus why, then
    termed; a Nats-Msg-Id makes a retried publish a duplicate, not a second letter."""
    metrics = Metrics("ORDERS", "g", "m1")
    publish = Publisher()
    msg = message(deliveries=3, headers={"X-Trace": "abc", "Nats-Msg-Id": "orig-1"})
    await wrapper(failing, publish=publish, metrics=metrics)(msg)
    [(subject, data, headers)] = publish.published
    assert subject == "dlq.orders" and data == msg.data
    assert headers["X-Trace"] == "abc"
    assert headers["Cgroupd-Error"] == "RuntimeError: database down"
    assert headers["Cgroupd-Original-Subject"] == "orders.k1"
    assert headers["Cgroupd-Partition"] == "2"
    assert headers["Cgroupd-Stream-Sequence"] == "41"
    assert headers["Cgroupd-Deliveries"] == "3"
    # Issue 25 row 5: the id is not cgroupd-dl-<stream>-<group>-<seq> (a decoy could take
    # it first), but the same for a retry by this wrapper (dedup of a lost PubAck).
    msg_id = headers["Nats-Msg-Id"]
    assert msg_id.startswith("cgroupd-dl-41-") and len(msg_id) == len("cgroupd-dl-41-") + 32
    assert msg_id != "cgroupd-dl-ORDERS-g-41"
    assert msg.outcome is Outcome.TERM
    assert msg._nc.sent[-1][1].startswith(b"+TERM")  # type: ignore[attr-defined]
    assert sample(metrics, "cgroupd_messages_processed_total", outcome="dead_letter") == 1


async def test_dead_letter_is_counted_after_its_publish_once_handling_is_over() -> None:
    """The cause of a flaky daemon test: a dead letter is counted when the message's
    handling is over (published, then termed), so a reader that saw the dead letter
    arrive may still read the old count. Counted exactly once, right after."""
    metrics = Metrics("ORDERS", "g", "m1")
    seen_at_publish: list[float | None] = []

    class Watching(Publisher):
        async def __call__(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
            seen_at_publish.append(sample(metrics, "cgroupd_messages_processed_total",
                                          outcome="dead_letter"))
            await super().__call__(subject, data, headers)

    await wrapper(failing, publish=Watching(), metrics=metrics)(message(deliveries=3))
    assert seen_at_publish == [0.0]
    assert sample(metrics, "cgroupd_messages_processed_total", outcome="dead_letter") == 1


async def test_dead_letter_publish_failure_never_terms() -> None:
    """If the dead letter is not stored, the message must come back: raise, no term."""
    metrics = Metrics("ORDERS", "g", "m1")
    msg = message(deliveries=5)
    with capture_logs() as logged, pytest.raises(DeadLetterFailed, match="no stream"):
        await wrapper(failing, publish=Publisher(fail=True), metrics=metrics)(msg)
    assert msg.outcome is None
    assert any(e["event"].startswith("dead-letter publish failed") for e in logged)
    assert sample(metrics, "cgroupd_messages_processed_total", outcome="nak") == 1


async def test_without_dead_letter_subject_give_up_terms_and_logs_an_error() -> None:
    """No DLQ subject: term at max_deliver, with an error log line naming the message."""
    msg = message(deliveries=3)
    with capture_logs() as logged:
        await wrapper(failing, subject=None)(msg)
    assert msg.outcome is Outcome.TERM
    [err] = [e for e in logged if e["log_level"] == "error"]
    assert "giving up" in err["event"] and err["seq"] == 41


async def test_non_retryable_gives_up_on_first_delivery() -> None:
    """NonRetryable skips the retries: dead-lettered at once (or termed without DLQ)."""
    async def reject(msg: Message) -> None:
        raise NonRetryable("webhook answered 422")

    publish = Publisher()
    msg = message(deliveries=1)
    await wrapper(reject, max_deliver=0, publish=publish)(msg)
    assert publish.published[0][2]["Cgroupd-Deliveries"] == "1"
    assert msg.outcome is Outcome.TERM
    plain = message(deliveries=1)
    await wrapper(reject, subject=None)(plain)
    assert plain.outcome is Outcome.TERM


async def test_handler_that_acks_or_naks_itself_keeps_its_choice() -> None:
    """The handler's own ack/nak/term is the outcome recorded."""
    metrics = Metrics("ORDERS", "g", "m1")

    async def nak(msg: Message) -> None:
        await msg.nak(1.0)

    msg = message()
    await wrapper(nak, metrics=metrics)(msg)
    assert msg.outcome is Outcome.NAK
    assert sample(metrics, "cgroupd_messages_processed_total", outcome="nak") == 1


# -- metrics ----------------------------------------------------------------------------
def test_metrics_track_activity_step_downs_and_rebalance_time() -> None:
    """on_active/on_standby move the gauges; a config-changed step-down starts a
    rebalance that the next activation ends and measures."""
    clock = Clock()
    m = Metrics("ORDERS", "g", "m1", clock=clock)
    assert m.became_active((0, 1, 2)) is None
    assert sample(m, "cgroupd_member_active") == 1
    assert sample(m, "cgroupd_partitions_owned") == 3
    assert m.stepped_down("config-changed") is True
    assert sample(m, "cgroupd_member_active") == 0
    clock.now += 0.75
    assert m.became_active((0, 1)) == pytest.approx(0.75)
    assert sample(m, "cgroupd_rebalances_total") == 1
    assert sample(m, "cgroupd_rebalance_duration_seconds_count") == 1
    assert sample(m, "cgroupd_rebalance_duration_seconds_sum") == pytest.approx(0.75)
    assert m.stepped_down("sync-consumer-lost") is False
    assert sample(m, "cgroupd_step_downs_total", reason="config-changed") == 1
    assert sample(m, "cgroupd_step_downs_total", reason="sync-consumer-lost") == 1
    m.became_active((0, 1))
    m.rebalanced((0, 1, 2, 3), 0.2)  # an in-place move: no step-down
    assert sample(m, "cgroupd_rebalances_total") == 2
    assert sample(m, "cgroupd_rebalance_duration_seconds_count") == 2
    assert sample(m, "cgroupd_partitions_owned") == 4


def test_metrics_idle_time_unowned_partitions_and_labels() -> None:
    """Seconds since the last message is computed at scrape time; every series carries
    the stream, group and member labels."""
    clock = Clock()
    m = Metrics("ORDERS", "g", "m1", clock=clock)
    clock.now += 5
    assert sample(m, "cgroupd_seconds_since_last_message") == 5
    m.message_started()
    m.message_finished("ack", 0.01)
    clock.now += 2
    assert sample(m, "cgroupd_seconds_since_last_message") == 2
    m.set_unowned_partitions(3)
    m.status_failed()
    assert sample(m, "cgroupd_group_unowned_partitions") == 3  # last known value kept
    assert sample(m, "cgroupd_status_errors_total") == 1
    text = m.render().decode()
    assert 'cgroupd_member_active{group="g",member="m1",stream="ORDERS"} 0.0' in text
    with pytest.raises(ValueError):
        m.message_finished("lost", 0.1)


def test_two_instances_in_one_process_have_separate_registries() -> None:
    """A dedicated registry per instance: no duplicate-timeseries clash."""
    a, b = Metrics("S", "g", "m1"), Metrics("S", "g", "m2")
    a.became_active((0,))
    assert sample(a, "cgroupd_member_active") == 1
    assert sample(b, "cgroupd_member_active") == 0


# -- logs -------------------------------------------------------------------------------
def test_logs_are_json_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a TTY: one JSON object per event, filtered by level, stdlib logs included."""
    import logging

    logs.configure("info", json=None)  # capsys' stderr is not a TTY
    structlog.get_logger("t").info("joined", member="m1")
    structlog.get_logger("t").debug("hidden")
    logging.getLogger("nats").warning("from the stdlib")
    lines = capsys.readouterr().err.strip().splitlines()
    events = [json.loads(line) for line in lines]
    assert events[0]["event"] == "joined" and events[0]["member"] == "m1"
    assert events[0]["level"] == "info" and "timestamp" in events[0]
    assert events[1]["event"] == "from the stdlib" and events[1]["level"] == "warning"
    assert len(events) == 2


def test_console_format_and_level_names(capsys: pytest.CaptureFixture[str]) -> None:
    """json=False renders for humans; unknown level names are refused."""
    logs.configure("warning", json=False)
    structlog.get_logger("t").warning("stepped down", reason="config-changed")
    err = capsys.readouterr().err
    assert "stepped down" in err and "reason" in err and not err.startswith("{")
    with pytest.raises(ValueError, match="unknown log level"):
        logs.configure("loud")


# -- connection options -----------------------------------------------------------------
def test_connect_kwargs_defaults_and_auth(tmp_path: Path) -> None:
    """Default server, comma lists, reconnect forever, each auth method."""
    kw = connect_kwargs(ConnectionOptions())
    assert kw["servers"] == [DEFAULT_SERVER]
    assert kw["max_reconnect_attempts"] == -1 and kw["allow_reconnect"]
    assert "tls" not in kw
    kw = connect_kwargs(ConnectionOptions(servers=("nats://a:4222,nats://b:4222",),
                                          token="s3cret"))
    assert kw["servers"] == ["nats://a:4222", "nats://b:4222"] and kw["token"] == "s3cret"
    assert connect_kwargs(ConnectionOptions(user="u", password="p"))["password"] == "p"
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert connect_kwargs(ConnectionOptions(creds=creds))["user_credentials"] == str(creds)
    with pytest.raises(ConfigError, match="not a readable file"):
        connect_kwargs(ConnectionOptions(nkey_seed=tmp_path / "missing.nk"))
    with pytest.raises(ConfigError, match="choose one"):
        ConnectionOptions(token="t", user="u")
    with pytest.raises(ConfigError, match="both a TLS certificate and its key"):
        ConnectionOptions(tls_cert=creds)


def test_inbox_prefix() -> None:
    """Issue 25 row 9: replies come under --inbox-prefix, so that a member's user may be
    given `sub _INBOX_<member>.>` instead of every client's `_INBOX.>`; a prefix with a
    wildcard or an empty token is refused, saying so."""
    assert "inbox_prefix" not in connect_kwargs(ConnectionOptions())
    kw = connect_kwargs(ConnectionOptions(inbox_prefix="_INBOX_m1"))
    assert kw["inbox_prefix"] == "_INBOX_m1"
    assert connect_kwargs(ConnectionOptions(inbox_prefix="a.b"))["inbox_prefix"] == "a.b"
    for bad in ("", "_INBOX.*", "a..b", "x.>", "a b"):
        with pytest.raises(ConfigError, match="inbox prefix"):
            ConnectionOptions(inbox_prefix=bad)


def test_tls_options_build_an_ssl_context(tmp_path: Path) -> None:
    """tls:// URLs or a CA give an SSLContext; unreadable TLS files are a ConfigError."""
    kw = connect_kwargs(ConnectionOptions(servers=("tls://nats.example:4222",)))
    assert isinstance(kw["tls"], ssl.SSLContext)
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load TLS files"):
        connect_kwargs(ConnectionOptions(tls_ca=bad))



def test_a_handler_modules_listener_hooks() -> None:
    """``cgroupd join --handler mod:fn`` uses the module's on_partitions_* functions: all
    three of listener_handler, none of record_handler; a hook name bound to something not
    callable is refused with its name."""
    import sys
    import types

    from cgroupd.join.handlers import LISTENER_HOOKS, listener_hooks, module_hooks

    found = module_hooks("tests.support.handlers.listener_handler:handle")
    assert sorted(found) == sorted(LISTENER_HOOKS)
    assert module_hooks("tests.support.handlers.record_handler:handle") == {}
    spec = HandlerOptions(function=lambda m: None,
                          reference="tests.support.handlers.listener_handler:handle")
    assert sorted(listener_hooks(spec, None, {})) == sorted(LISTENER_HOOKS)
    bad = types.ModuleType("cgroupd_test_bad_hooks")
    bad.on_partitions_lost = 3  # type: ignore[attr-defined]
    sys.modules[bad.__name__] = bad
    try:
        with pytest.raises(HandlerLoadError, match="on_partitions_lost is not callable"):
            module_hooks(f"{bad.__name__}:handle")
    finally:
        del sys.modules[bad.__name__]


async def test_webhook_listener_events() -> None:
    """With ``events``, each hook POSTs ``Cgroupd-Event`` and a JSON body naming the
    instance and the partitions; a non-2xx answer raises (the runtime logs and counts
    it); without ``events`` the webhook gets none."""
    from cgroupd.join.handlers import listener_hooks

    server = await WebhookServer(script={"None": [503]}).start()
    try:
        async with aiohttp.ClientSession() as session:
            context = {"stream": "S", "group": "g", "member": "m1"}
            quiet = HandlerOptions(webhook=WebhookOptions(server.url))
            assert listener_hooks(quiet, session, context) == {}
            hooks = listener_hooks(HandlerOptions(webhook=WebhookOptions(
                server.url, events=True)), session, context)
            context["instance"] = "i1"
            with pytest.raises(WebhookFailed, match="answered 503 to partitions-revoked"):
                await hooks["on_partitions_revoked"]((2, 3))
            await hooks["on_partitions_assigned"]((0, 1))
        assert [h.headers["Cgroupd-Event"] for h in server.hits] == [
            "partitions-revoked", "partitions-assigned"]
        assert json.loads(server.hits[1].body) == {
            "event": "partitions-assigned", "stream": "S", "group": "g", "member": "m1",
            "instance": "i1", "partitions": [0, 1]}
    finally:
        await server.stop()
