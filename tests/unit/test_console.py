"""The console's pure parts: the shared read (one read per interval however many
callers), the Host names it serves, the timeline, pin advisories as shown, --listen."""

from __future__ import annotations

import asyncio
import json

import pytest

from cgroupd import views
from cgroupd.cli.parsers import parse_listen
from cgroupd.console import ConsoleOptions, Shared, Timeline, allowed_host_names
from cgroupd.nats import events


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_shared_read_serves_every_caller_from_one_read_per_ttl() -> None:
    """Callers arriving while a read runs wait for it; within the ttl after it began they
    get its result; after the ttl one more read is made; a failure goes to that read's
    callers only, and a cancelled caller does not cancel the read the others wait on."""
    clock = Clock()
    gate = asyncio.Event()
    calls = 0

    async def read() -> int:
        nonlocal calls
        calls += 1
        await gate.wait()
        if calls == 3:
            raise RuntimeError("server gone")
        return calls

    shared: Shared[int] = Shared(read, ttl=2.0, clock=clock)
    waiters = [asyncio.ensure_future(shared.get()) for _ in range(5)]
    await asyncio.sleep(0)
    waiters[0].cancel()  # a tab closed mid-read
    gate.set()
    results = await asyncio.gather(*waiters[1:])
    assert results == [1, 1, 1, 1] and calls == 1
    clock.now += 1.9
    assert await shared.get() == 1 and calls == 1
    clock.now += 0.2
    assert await shared.get() == 2 and calls == 2
    clock.now += 2.0
    with pytest.raises(RuntimeError, match="server gone"):
        await shared.get()
    clock.now += 2.0
    assert await shared.get() == 4 and shared.reads == 4
    shared.expire()
    assert await shared.get() == 5


def test_host_names_served() -> None:
    """Loopback names and the listen address; a wildcard address serves any Host unless
    --allow-host names them."""
    assert allowed_host_names(ConsoleOptions()) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_host_names(ConsoleOptions(host="10.0.0.5", allowed_hosts=("Ops.Example",))
                              ) == {"localhost", "127.0.0.1", "::1", "10.0.0.5", "ops.example"}
    assert allowed_host_names(ConsoleOptions(host="0.0.0.0")) is None
    assert "ops" in (allowed_host_names(ConsoleOptions(host="", allowed_hosts=("ops",)))
                     or ())


def test_timeline_numbers_entries_and_keeps_the_newest() -> None:
    timeline = Timeline(size=3)
    for i in range(5):
        timeline.add("console", f"t{i}", "2026-01-01T00:00:00.000Z")
    assert [e["text"] for e in timeline.after(0)] == ["t2", "t3", "t4"]
    assert [e["seq"] for e in timeline.after(4)] == [5]


def test_pin_advisories_as_shown() -> None:
    """The server's pin advisories: kind from the subject, the pin id left out, anything
    else (not JSON, another subject, no consumer) ignored."""
    pinned = {"type": "io.nats.jetstream.advisory.v1.consumer_group_pinned",
              "id": "x", "timestamp": "2026-05-01T10:00:01.123456Z", "stream": "ORDERS-g",
              "consumer": "m1", "group": "PCG", "pinned_id": "SECRETPIN"}
    clean = events.clean_pin_advisory("$JS.EVENT.ADVISORY.CONSUMER.PINNED.ORDERS-g.m1",
                                      json.dumps(pinned).encode())
    assert clean == {"type": "pinned", "timestamp": "2026-05-01T10:00:01.123456Z",
                     "stream": "ORDERS-g", "consumer": "m1", "group": "PCG", "reason": None}
    assert views.pin_line(clean, "ORDERS", "g", "m1") == (
        "[10:00:01.123] ORDERS/g PINNED member m1: the server pinned a new instance "
        "(a takeover)")
    unpinned = events.clean_pin_advisory(
        "$JS.EVENT.ADVISORY.CONSUMER.UNPINNED.ORDERS-g.m1",
        json.dumps({"consumer": "m1", "reason": "admin"}).encode())
    assert unpinned is not None
    assert views.pin_line(unpinned, "ORDERS", "g", "m1").endswith(
        "UNPINNED member m1: the server removed the pin (admin)")
    for subject, data in [("$JS.EVENT.ADVISORY.CONSUMER.PINNED.S.c", b"not json"),
                          ("$JS.EVENT.ADVISORY.CONSUMER.CREATED.S.c", b'{"consumer": "c"}'),
                          ("$JS.EVENT.ADVISORY.CONSUMER.PINNED.S.c", b'{"stream": "S"}'),
                          ("$JS.EVENT.ADVISORY.CONSUMER.PINNED.S.c", b"[1]")]:
        assert events.clean_pin_advisory(subject, data) is None


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:8480", ("127.0.0.1", 8480)),
    (":9000", ("", 9000)),
    ("[::1]:8480", ("::1", 8480)),
    ("console.local:0", ("console.local", 0)),
])
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["8480", "host:", "host:x", "h:65536", "::1:80", "[x]:80"])
def test_parse_listen_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--listen"):
        parse_listen(text)


def test_without_chromium_ci_fails_and_elsewhere_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """The browser tests never pass silently in CI: no Chromium fails there, and skips
    elsewhere saying how to install it."""
    from tests.support import browser

    monkeypatch.delenv("CGROUPD_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and no Chromium"):
        browser.require_chromium()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        browser.require_chromium()
