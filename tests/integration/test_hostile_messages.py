"""Any message a publisher sends is processed: hostile headers, payloads and subjects.

A publisher's headers are its own business: ``Status``, ``Description``, ``Nats-Pin-Id``,
``Nats-Pending-Messages`` and the like are ordinary application headers, and nats-py
merges a server status line with a message's headers into one dict. These tests publish
such messages (and empty, 1-byte, maximum-size, binary and invalid-UTF-8 payloads; subjects
at the maximum length and token count, unicode and number-like tokens) into one
long-lived nats-server, consumed by real ``cgroupd join`` processes, one group per
``--ordering`` plus one in pinned mode. Every message must be processed exactly once per
group, in order per key (not for ``none``), arrive intact, and no instance may step down.

The classification rule itself (:func:`cgroupd.nats.jsapi.server_status`) is checked against
what the real server sends for every pull status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from cgroupd import admin
from cgroupd.core.answers import PullStatus, classify_pull_status
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats import jsapi
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess
from tests.support.groups import Record, check
from tests.support.handlers.hostile_handler import N_HEADER, digest, headers_digest
from tests.support.natsserver import NatsServer, client_options, find_free_port, running_server
from tests.support.polling import within

pytestmark = pytest.mark.slow

STREAM = "HOSTILE"
HANDLER = "tests.support.handlers.hostile_handler:handle"
#: group -> extra ``cgroupd join`` arguments. One member each, 4 partitions.
GROUPS = {
    "gpart": ("--ordering", "partition"),
    "gkey": ("--ordering", "key"),
    "gnone": ("--ordering", "none"),
    "gpin": ("--ordering", "key", "--exclusivity", "pinned"),
    "ghook": ("--ordering", "key"),  # a --webhook instead of a handler
}
WEBHOOK_GROUP = "ghook"
#: The server reads at most 4096 bytes of a publish's control line ``HPUB <subject>
#: <reply> <header bytes> <total bytes>``; a JetStream publish's reply inbox and sizes
#: take about 80, so this is the longest subject a publisher can send (4,010 passes,
#: 4,050 is refused with "maximum control line exceeded").
MAX_SUBJECT = 4000
RESERVED = ("Status", "Description", "Nats-Pin-Id", "Nats-Pending-Messages",
            "Nats-Sequence", "Nats-Pending-Bytes", "Nats-Subject", "Nats-Last-Stream",
            "Nats-Consumer-Stalled", "Nats-Time-Stamp")
STATUS_DESCRIPTIONS = {"100": "Idle Heartbeat", "404": "No Messages",
                       "408": "Request Timeout", "409": "Consumer Deleted",
                       "423": "Nats-Pin-Id mismatch", "503": "No Responders"}


@dataclass(frozen=True)
class Outgoing:
    """One message to publish: key (second subject token), the rest, payload, headers."""

    key: str
    rest: str
    data: bytes | None  # None: the payload is the index (a message without headers)
    headers: dict[str, str] | None
    #: Pad the payload so that headers and payload are exactly the server's max payload.
    fill: bool = False

    def subject(self) -> str:
        return f"h.{self.key}.{self.rest}"


@dataclass
class Sent:
    key: str
    n: int
    subject: str
    data: bytes
    headers: dict[str, str]


class ThreadedWebhook:
    """A webhook (aiohttp, in a thread of its own: the tests' event loops come and go)
    recording each request's message index, body digest and forwarded headers."""

    def __init__(self) -> None:
        self.hits: list[dict[str, Any]] = []
        self.port = find_free_port()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        n = request.headers.get(f"Nats-Header-{N_HEADER}")
        self.hits.append({
            "n": int(n) if n is not None else int(body.decode().removeprefix("n:")),
            "data": digest(body), "size": len(body),
            "subject": request.headers.get("Cgroupd-Subject", ""),
            "omitted": request.headers.get("Cgroupd-Headers-Omitted", ""),
            "forwarded": sum(k.startswith("Nats-Header-") for k in request.headers)})
        return web.Response(text="ok")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            app = web.Application(client_max_size=4 << 20)
            app.router.add_post("/hook", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._started.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        assert self._started.wait(10)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class HostileEnv:
    """The long-lived server, its groups and their ``cgroupd join`` processes."""

    def __init__(self, server: NatsServer, workdir: Path) -> None:
        self.server = server
        self.workdir = workdir
        self.procs: dict[str, JoinProcess] = {}
        self.sent: list[Sent] = []
        self.max_payload = 0
        self.webhook = ThreadedWebhook()

    def record(self, group: str) -> Path:
        return self.workdir / f"{group}.jsonl"

    def events(self, group: str) -> Record:
        return Record.load([self.record(group)])

    def start(self) -> None:
        asyncio.run(self._setup())
        self.webhook.start()
        for group, extra in GROUPS.items():
            how = (("--webhook", self.webhook.url) if group == WEBHOOK_GROUP
                   else ("--handler", HANDLER))
            self.procs[group] = JoinProcess(
                self.server.url, self.workdir, group, "--stream", STREAM, "--group", group,
                "--member", "m", *how, *extra, record=self.record(group), metrics=False)
        deadline = time.monotonic() + 30
        for group, proc in self.procs.items():
            # Pinned mode is active once the server pins it, at its first message.
            ready = "joined" if "pinned" in GROUPS[group] else "became active"
            while not any(e.get("event") == ready for e in proc.events()):
                assert proc.proc.poll() is None, proc.log_text()[-3000:]
                assert time.monotonic() < deadline, f"{group} not active:\n{proc.log_text()}"
                time.sleep(0.05)

    async def _setup(self) -> None:
        nc = await nats.connect(self.server.url, **client_options())
        try:
            js = JetStream(nc)
            self.max_payload = nc.max_payload
            await js.add_stream(api.StreamConfig(name=STREAM, subjects=["h.>"]))
            for group in GROUPS:
                await admin.create_elastic_group(js, STREAM, group, ElasticGroupConfig(
                    max_members=4, members=("m",),
                    partitioning_filters=(PartitioningFilter("h.*.>", (1,)),)))
        finally:
            await nc.close()

    def close(self) -> None:
        for proc in self.procs.values():
            proc.close()
        self.webhook.stop()

    def ends(self, group: str) -> list[dict[str, Any]]:
        """Completed messages of a group: its handler's records, or its webhook's hits."""
        if group == WEBHOOK_GROUP:
            return list(self.webhook.hits)
        return self.events(group).ends()

    async def publish(self, batch: list[Outgoing]) -> list[Sent]:
        """Publish in order; return what was sent, with each message's index."""
        nc = await nats.connect(self.server.url, **client_options())
        out = []
        try:
            js = nc.jetstream()
            for item in batch:
                n = len(self.sent)
                if item.headers is None:
                    data, headers = f"n:{n}".encode(), {}
                    await js.publish(item.subject(), data)
                else:
                    # The index first: a webhook gets the first 64 headers only.
                    headers = {N_HEADER: str(n), **item.headers}
                    data = item.data or b""
                    if item.fill:
                        data = b"\xab" * (self.max_payload - _header_block(headers))
                    await js.publish(item.subject(), data, headers=headers)
                sent = Sent(item.key, n, item.subject(), data, headers)
                self.sent.append(sent)
                out.append(sent)
        finally:
            await nc.close()
        return out

    def wait_processed(self, sent: list[Sent], timeout: float = 60.0) -> None:
        want = {s.n for s in sent}
        deadline = time.monotonic() + timeout
        for group, proc in self.procs.items():
            while True:
                done = {e["n"] for e in self.ends(group)}
                if want <= done:
                    break
                assert proc.proc.poll() is None, f"{group} exited:\n{proc.log_text()[-3000:]}"
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{group}: {len(want - done)} of {len(want)} not processed, e.g. "
                        f"{sorted(want - done)[:5]}\n{proc.log_text()[-3000:]}")
                time.sleep(0.02)

    def verify(self) -> None:
        """Everything sent so far: once per group, in order per key, intact, no step-down."""
        pairs = [(s.key, s.n) for s in self.sent]
        by_n = {s.n: s for s in self.sent}
        for group, proc in self.procs.items():
            if group == WEBHOOK_GROUP:
                self._verify_webhook(by_n)
                continue
            record = self.events(group)
            verdict = check(record, pairs)
            assert not verdict.lost, (group, verdict.lost[:5])
            assert verdict.duplicates == 0, f"{group}: {verdict.duplicates} ran twice"
            if group != "gnone":
                assert not verdict.order_violations, (group, verdict.order_violations[:5])
            for e in record.ends():
                s = by_n[e["n"]]
                assert e["size"] == len(s.data) and e["data"] == digest(s.data), (group, s.n)
                assert e["headers"] == headers_digest(s.headers), (group, s.n)
                assert e["full_subject"] == digest(s.subject.encode()), (group, s.n)
            events = proc.events()
            downs = [e for e in events if e.get("event") == "stepped down"
                     or e.get("new") == "stepping-down"]
            assert not downs, f"{group} stepped down: {downs[:3]}"
            assert proc.proc.poll() is None, proc.log_text()[-3000:]

    def _verify_webhook(self, by_n: dict[int, Sent]) -> None:
        """Each message reached the webhook once, payload intact, subject as sent; the
        headers HTTP cannot carry were named, never a reason to give up."""
        hits = self.webhook.hits
        assert sorted(h["n"] for h in hits) == sorted(by_n), "each message exactly once"
        for hit in hits:
            s = by_n[hit["n"]]
            assert hit["size"] == len(s.data) and hit["data"] == digest(s.data), s.n
            assert hit["forwarded"] <= 64 + 1  # + Nats-Stream-Source from sourcing
            if len(s.headers) > 64:
                assert hit["omitted"], s.n
        proc = self.procs[WEBHOOK_GROUP]
        events = proc.events()
        assert not [e for e in events if "giving up" in e.get("event", "")
                    or "dead-letter" in e.get("event", "")], events[-5:]
        assert not [e for e in events if e.get("event") == "stepped down"]
        assert proc.proc.poll() is None, proc.log_text()[-3000:]

    def run(self, batch: list[Outgoing]) -> None:
        sent = asyncio.run(self.publish(batch))
        self.wait_processed(sent)
        self.verify()


@contextlib.asynccontextmanager
async def await_connection(url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(url, **client_options())
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileEnv]:
    workdir = tmp_path_factory.mktemp("hostile")
    with running_server(workdir=workdir / "nats") as server:
        env = HostileEnv(server, workdir)
        try:
            env.start()
            yield env
        finally:
            env.close()


def _header_block(headers: dict[str, str]) -> int:
    """Bytes nats-py sends for these headers (they count against the max payload)."""
    return len(b"NATS/1.0\r\n\r\n") + sum(
        len(k.encode()) + 2 + len(v.encode()) + 2 for k, v in headers.items())


def corpus() -> list[Outgoing]:
    """One message of every hostile kind the issue lists, several per key."""
    out: list[Outgoing] = []
    for code, description in STATUS_DESCRIPTIONS.items():
        for data in (b"", b"x"):
            out.append(Outgoing("status", f"s{code}", data,
                                {"Status": code, "Description": description}))
        out.append(Outgoing("status", "bare", b"", {"Status": code}))
    out += [
        Outgoing("status", "400", b"", {"Status": "400", "Description": "Bad Request"}),
        Outgoing("status", "409x", b"", {"Status": "409", "Description":
                                         "Exceeded MaxRequestBatch of 1"}),
        Outgoing("reserved", "pin", b"p", {"Nats-Pin-Id": "bogus-pin"}),
        Outgoing("reserved", "pending", b"", {"Nats-Pending-Messages": "not-a-number",
                                              "Nats-Pending-Bytes": "-5"}),
        Outgoing("reserved", "seq", b"", {"Nats-Sequence": "1", "Nats-Subject": "x.y",
                                          "Nats-Last-Stream": "9",
                                          "Nats-Consumer-Stalled": "$JS.FC.nowhere"}),
        Outgoing("reserved", "all", b"", {name: "503" for name in RESERVED}),
        Outgoing("headers", "many", b"m", {f"H-{i}": f"v{i}" for i in range(1000)}),
        # JetStream refuses more than 64 KiB of headers (err_code 10097).
        Outgoing("headers", "huge", b"h", {"Huge": "x" * 65_000}),
        Outgoing("headers", "unicode", b"u", {"Unicode": "ключ ✓ 🙂 数据",
                                              "Status": "٤٠٤"}),
        Outgoing("headers", "controls", b"c", {"Ctl": "bell\x07 tab\t del\x7f nul\x00"}),
        Outgoing("payload", "none", None, None),
        Outgoing("payload", "empty", b"", {}),
        Outgoing("payload", "one", b"\x00", {}),
        Outgoing("payload", "binary", bytes(range(256)) * 4, {"Content-Type": "x"}),
        Outgoing("payload", "utf8", b"\xff\xfe\xc3\x28\xed\xa0\x80", {}),
    ]
    out.append(Outgoing("payload", "max", b"", {"Status": "404"}, fill=True))
    long_rest = "l" * (MAX_SUBJECT - len("h.subject."))
    tokens_rest = ".".join(["t"] * ((MAX_SUBJECT - len("h.subject.")) // 2))
    out += [
        Outgoing("subject", long_rest, b"", {}),
        Outgoing("subject", tokens_rest, b"", {"Status": "409", "Description": "Consumer Deleted"}),
        Outgoing("ключ", "数据.🙂.ä", b"", {}),
        Outgoing("007", "1e3.-1.0x1F.٣.²", b"", {}),
        Outgoing("3", "4.5.6", b"", {"Status": "423"}),
        Outgoing("٣", "3.٣", None, None),
    ]
    return out


def test_every_hostile_message_is_processed_once_in_order(hostile: HostileEnv) -> None:
    """The corpus (twice, so every key has several messages): each group processes every
    message exactly once, per-key order holds, payload, headers and subject arrive
    intact, and no instance steps down."""
    batch = corpus()
    hostile.run(batch + batch)


# -- property test -------------------------------------------------------------------------
_TOKEN = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp"),
                                        blacklist_characters=".*>"),
                 min_size=1, max_size=12)
_KEYS = st.sampled_from(["a", "b", "007", "٣", "ключ", "🙂", "3", "1e3"])
_VALUE = st.one_of(
    st.sampled_from([*STATUS_DESCRIPTIONS, *STATUS_DESCRIPTIONS.values(), "200", "", "bogus",
                     "-1", "18446744073709551616"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), max_size=40)
    .map(str.strip),
)
_NAME = st.one_of(st.sampled_from(RESERVED), st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,15}",
                                                            fullmatch=True))
_HEADERS = st.one_of(
    st.none(),
    st.dictionaries(_NAME.filter(lambda k: k.lower() != N_HEADER.lower()), _VALUE,
                    max_size=8),
)
_PAYLOAD = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00", b"\xff\xfe"]),
                     st.integers(1, 300_000).map(lambda n: b"\xfe" * n))


@st.composite
def _outgoing(draw: Any) -> Outgoing:
    headers = draw(_HEADERS)
    rest = ".".join(draw(st.lists(_TOKEN, min_size=1, max_size=6)))
    return Outgoing(draw(_KEYS), rest, None if headers is None else draw(_PAYLOAD), headers)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(_outgoing(), min_size=1, max_size=12))
def test_property_any_headers_payloads_and_subjects(hostile: HostileEnv,
                                                    batch: list[Outgoing]) -> None:
    """Generated batches of messages with reserved-looking headers (any value), any
    payload and unicode/number-like subject tokens: processed exactly once per group, in
    order per key, intact, with no step-down."""
    hostile.run(batch)


# -- the rule, against the real server -------------------------------------------------------
async def test_server_status_tells_server_statuses_from_messages(
        nats_server: NatsServer) -> None:
    """Every status a pull can get from nats-server (100 heartbeat, 404, 408, 409 deleted,
    409 exceeded max request batch, 409 exceeded max waiting, 423 pin mismatch, 503 no
    responders) is a status, and ``classify_pull_status`` reads each as the puller must;
    deliveries carrying the same headers, with and without a payload, are messages; the
    server's ack confirmation is neither a refusal nor a message."""
    nc = await nats.connect(nats_server.url, **client_options())
    got: asyncio.Queue[Msg] = asyncio.Queue()
    try:
        inbox = nc.new_inbox()

        async def receive(msg: Msg) -> None:
            await got.put(msg)

        await nc.subscribe(inbox, cb=receive)
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        for code, description in STATUS_DESCRIPTIONS.items():
            await js.publish("s.user", b"", headers={"Status": code, "Description": description})
        await js.publish("s.user", b"payload", headers={"Status": "409",
                                                        "Description": "Consumer Deleted"})

        async def create(name: str, **config: Any) -> None:
            await jsapi.create_consumer(nc, "S", name, {"ack_policy": "explicit", **config})

        async def pull(consumer: str, **body: Any) -> None:
            await nc.publish(jsapi.pull_subject("S", consumer), json.dumps(body).encode(),
                             reply=inbox)

        async def next_status(code: str) -> Msg:
            while True:
                msg = await within(got.get(), 5, f"a {code} status")
                status = jsapi.server_status(msg)
                if status is not None and status.code == code:
                    return msg
                assert status is None or status.code == "100", (msg.headers, msg.reply)

        async def next_kind(code: str) -> PullStatus:
            status = jsapi.server_status(await next_status(code))
            assert status is not None
            return classify_pull_status(status.code, status.description)

        await create("c", filter_subject="s.user")
        await pull("c", batch=8, expires=int(5e9), idle_heartbeat=int(0.1e9))
        deliveries = [await within(got.get(), 5, f"delivery {i + 1} of 7") for i in range(7)]
        assert all(jsapi.server_status(m) is None for m in deliveries)
        assert {m.headers["Status"] for m in deliveries if m.headers} >= set(STATUS_DESCRIPTIONS)
        for msg in deliveries:
            confirmation = await nc.request(msg.reply, b"+ACK", timeout=2)
            assert jsapi.server_status(confirmation) is None
        # idle heartbeat while the request waits
        assert await next_kind("100") is PullStatus.HEARTBEAT
        await jsapi.delete_consumer(nc, "S", "c")
        deleted = jsapi.server_status(await next_status("409"))
        assert deleted is not None and "deleted" in deleted.description.lower()
        assert classify_pull_status(deleted.code, deleted.description) \
            is PullStatus.CONSUMER_DELETED
        await pull("c", batch=1, expires=int(1e9))
        assert await next_kind("503") is PullStatus.NO_RESPONDERS  # no such consumer
        await create("d", filter_subject="s.none")
        await pull("d", batch=1, no_wait=True)
        assert await next_kind("404") is PullStatus.REQUEST_DONE
        await pull("d", batch=1, expires=int(0.2e9))
        timeout = jsapi.server_status(await next_status("408"))
        assert timeout is not None and timeout.headers.get("Nats-Pending-Messages") == "1"
        assert classify_pull_status(timeout.code, timeout.description) \
            is PullStatus.REQUEST_DONE
        # Two 409s told apart only by their description: a request that can never be
        # served ("Exceeded MaxRequestBatch of 1") and one that may wait next time
        # ("Exceeded MaxWaiting": another request holds the only waiting slot).
        await create("b", filter_subject="s.none", max_batch=1)
        await pull("b", batch=2, expires=int(1e9))
        assert await next_kind("409") is PullStatus.REJECTED
        await create("w", filter_subject="s.none", max_waiting=1)
        await pull("w", batch=1, expires=int(0.5e9))
        await pull("w", batch=1, expires=int(0.5e9))
        assert await next_kind("409") is PullStatus.ASK_AGAIN
        assert await next_kind("408") is PullStatus.REQUEST_DONE  # the waiting one ends
        await create("p", filter_subject="s.pin", priority_groups=["PCG"],
                     priority_policy="pinned_client", priority_timeout=int(5e9))
        await js.publish("s.pin", b"pin me", headers={"Nats-Pin-Id": "bogus"})
        await pull("p", batch=1, expires=int(1e9), group="PCG")
        pinned = await within(got.get(), 5, "the pinned message")
        assert jsapi.server_status(pinned) is None
        # The server appends its own Nats-Pin-Id after the publisher's: the last one wins.
        assert pinned.headers and pinned.headers["Nats-Pin-Id"] != "bogus"
        await pull("p", batch=1, expires=int(1e9), group="PCG", id="wrong")
        assert await next_kind("423") is PullStatus.PIN_LOST
    finally:
        await nc.close()


async def test_a_burst_of_maximum_size_messages_is_taken_without_a_stall(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """150 messages of the server's maximum size to a key-ordered member (256 in
    flight): all processed once, with no step-down. nats-py drops what exceeds 128 MiB
    in a subscription's queue as a slow consumer, which the member took for a lost
    delivery and stepped down, again and again; its pull inbox now has room for all it
    asks for."""
    async with await_connection(nats_server.url) as nc:
        js = JetStream(nc)
        await js.add_stream(api.StreamConfig(name="BIG", subjects=["big.>"]))
        await admin.create_elastic_group(js, "BIG", "g", ElasticGroupConfig(
            max_members=2, members=("m",),
            partitioning_filters=(PartitioningFilter("big.*", (1,)),)))
        record = tmp_path / "big.jsonl"
        proc = JoinProcess(nats_server.url, tmp_path, "big", "--stream", "BIG", "--group", "g",
                           "--member", "m", "--ordering", "key", "--handler",
                           "tests.support.handlers.record_handler:handle_events", record=record,
                           metrics=False)
        try:
            sent = []
            for n in range(150):
                body = json.dumps({"key": f"k{n % 8}", "n": n}).encode()
                pad = b" " * (nc.max_payload - len(body) - 64)
                await nc.jetstream().publish(f"big.k{n % 8}", body + pad)
                sent.append((f"k{n % 8}", n))
            deadline = time.monotonic() + 60
            while {e["n"] for e in Record.load([record]).ends()} != {n for _, n in sent}:
                assert time.monotonic() < deadline, proc.log_text()[-3000:]
                await asyncio.sleep(0.05)
            verdict = check(Record.load([record]), sent)
            verdict.assert_ok()
            assert verdict.duplicates == 0
            downs = [e for e in proc.events() if e.get("event") == "stepped down"]
            assert not downs, downs
        finally:
            proc.close()
