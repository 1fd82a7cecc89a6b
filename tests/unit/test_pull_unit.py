"""The Puller's handling of what the server sends on its inbox (statuses 100, 404, 408,
409, 423, 503; delivery gaps; pin ids), on a fake connection and a fake clock: no server,
milliseconds per test. The same paths against a real server:
tests/integration/test_sync_liveness.py, tests/unit/test_pinning.py and the fault suite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cgroupd.nats.pull import PENDING_MSGS, PIN_ID, PullEnd, Puller, PullOptions
from tests.support.fakes import FakeClock, FakeNats, delivery, status

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time


class Harness:
    def __init__(self, options: PullOptions) -> None:
        self.nc = FakeNats()
        self.clock = FakeClock()
        self.got: list[Any] = []
        self.puller = Puller(self.nc, "S", "c", options,  # type: ignore[arg-type]
                             self.got.append, clock=self.clock)

    @property
    def inbox(self) -> str:
        return next(iter(self.nc.subs))

    async def send(self, msg: Any) -> None:
        await self.nc.deliver(self.inbox, msg)


@pytest.fixture
async def pull() -> AsyncIterator[Harness]:
    h = Harness(PullOptions(batch=4, expires=2.0, heartbeat=0.5))
    await h.puller.start()
    await asyncio.sleep(0)  # the first pull request goes out
    yield h
    await h.puller.stop()


@pytest.fixture
async def checked() -> AsyncIterator[Harness]:
    h = Harness(PullOptions(batch=4, expires=2.0, heartbeat=0.5, check_gaps=True))
    await h.puller.start()
    await asyncio.sleep(0)
    yield h
    await h.puller.stop()


async def test_first_pull_asks_for_a_batch(pull: Harness) -> None:
    assert pull.nc.pulls()[0]["batch"] == 4 and pull.puller.outstanding == 4


async def test_heartbeat_is_liveness_only(pull: Harness) -> None:
    """100: the server is there; nothing delivered, nothing ends."""
    pull.clock.advance(5)
    await pull.send(status("100", "Idle Heartbeat"))
    assert pull.puller.last_seen == pull.clock.now()
    assert not pull.puller.ended.done() and pull.got == []


@pytest.mark.parametrize("code", ["404", "408"])
async def test_expired_request_gives_back_what_it_did_not_bring(pull: Harness,
                                                                code: str) -> None:
    """404/408 with Nats-Pending-Messages: that many will not come; ask again."""
    await pull.send(status(code, "Request Timeout", **{PENDING_MSGS: "3"}))
    assert pull.puller.outstanding == 1 and not pull.puller.ended.done()


async def test_409_consumer_deleted_ends_the_puller(pull: Harness) -> None:
    await pull.send(status("409", "Consumer Deleted"))
    assert pull.puller.ended.result()[0] is PullEnd.CONSUMER_GONE


async def test_409_exceeded_max_request_batch_is_a_failure(pull: Harness) -> None:
    """A request no re-pull can fix (the consumer's limits refuse it) ends the puller."""
    await pull.send(status("409", "Exceeded MaxRequestBatch of 1"))
    assert pull.puller.ended.result()[0] is PullEnd.FAILED


async def test_a_pin_renewal_asks_for_no_message(pull: Harness) -> None:
    """pull_one renews the pin (the server resets the pin's timer when it reads the
    request) and brings nothing: one byte at most, so the server ends it with a 409 before
    it would deliver. A renewal that brought a message took the member consumer's spare
    delivery (PIN_SPARE): stopped then, the holder left nobody pinnable for the ack wait."""
    first = pull.puller.outstanding
    await pull.puller.pull_one()
    renewal = pull.nc.pulls()[-1]
    assert renewal["batch"] == 1 and renewal["max_bytes"] == 1
    assert pull.nc.pulls()[0]["max_bytes"] > 1  # the pulls that bring messages
    await pull.send(status("409", "Message Size Exceeds MaxBytes", **{PENDING_MSGS: "1"}))
    assert not pull.puller.ended.done() and pull.puller.outstanding == first


@pytest.mark.parametrize("description", ["Exceeded MaxWaiting", "Leadership Change",
                                         "Batch Completed", "Message Size Exceeds MaxBytes"])
async def test_passing_409s_ask_again(pull: Harness, description: str) -> None:
    await pull.send(status("409", description, **{PENDING_MSGS: "4"}))
    assert not pull.puller.ended.done() and pull.puller.outstanding == 0


async def test_423_pin_lost(pull: Harness) -> None:
    """Another client is pinned: this puller ends and forgets its pin id."""
    pull.puller.pin_id = "old"
    await pull.send(status("423", "Nats-Pin-Id mismatch"))
    assert pull.puller.ended.result()[0] is PullEnd.PIN_LOST
    assert pull.puller.pin_id is None


async def test_503_asks_again_only_after_a_pause(pull: Harness) -> None:
    """No responders (a consumer electing a leader, or gone): not ours to decide; no new
    request for one heartbeat (the self-check asks whether the consumer exists)."""
    await pull.send(status("503"))
    assert not pull.puller.ended.done() and pull.puller.outstanding == 0
    sent = len(pull.nc.pulls())
    await pull.puller.pull_one()
    assert len(pull.nc.pulls()) == sent
    pull.clock.advance(0.5)
    await pull.puller.pull_one()
    assert len(pull.nc.pulls()) == sent + 1


async def test_unknown_status_fails(pull: Harness) -> None:
    await pull.send(status("400", "Bad Request"))
    assert pull.puller.ended.result()[0] is PullEnd.FAILED


async def test_a_publishers_status_header_is_a_message(pull: Harness) -> None:
    """Only the server's statuses count: a delivery (it has an ack subject) whose
    publisher set a Status header is handed on like any other."""
    msg = delivery(1, Status="409", Description="Consumer Deleted")
    await pull.send(msg)
    assert pull.got == [msg] and not pull.puller.ended.done()
    assert pull.puller.last_delivery == 1


async def test_deliveries_in_order_pass_the_gap_check(checked: Harness) -> None:
    for seq in (1, 2, 3):
        await checked.send(delivery(seq))
    assert [m.consumer_seq for m in checked.got] == [1, 2, 3]
    assert not checked.puller.ended.done()


async def test_a_missing_delivery_ends_the_puller_before_anything_later_runs(
        checked: Harness) -> None:
    """Delivery 3 never came: 4 is not handed on (it could overtake 3's key) and the
    consumer must be replaced."""
    for seq in (1, 2, 4):
        await checked.send(delivery(seq))
    assert [m.consumer_seq for m in checked.got] == [1, 2]
    why, detail = checked.puller.ended.result()
    assert why is PullEnd.DELIVERY_LOST and "delivery 3 never arrived" in detail


async def test_nothing_after_a_missing_delivery_is_handed_on(checked: Harness) -> None:
    """Issue 29 (cause 4 of the route cut's leaders-on-B reorders): delivery 3 never came,
    and 5, 6 follow 4 without a gap of their own. None of them is handed on and nothing more
    is asked for: they stay unacknowledged and go with the consumer that replaces this one,
    whose fresh numbering delivers 3 first. Handing on 5 and 6 let a later message of
    3's key run before it (its key's order broken, 2 completions in one run)."""
    for seq in (1, 2, 4):
        await checked.send(delivery(seq))
    requests = len(checked.nc.pulls())
    for seq in (5, 6):
        await checked.send(delivery(seq))
    await checked.puller.refill()
    assert [m.consumer_seq for m in checked.got] == [1, 2]
    assert len(checked.nc.pulls()) == requests and checked.puller.room == 0


async def test_no_gap_check_on_shared_consumers(pull: Harness) -> None:
    for seq in (1, 5):
        await pull.send(delivery(seq))
    assert len(pull.got) == 2 and not pull.puller.ended.done()


async def test_pin_id_is_learnt_and_sent_back() -> None:
    """Pinned mode: the pin id of a delivery goes into every later pull request."""
    h = Harness(PullOptions(batch=1, expires=2.0, heartbeat=0.5, group="PCG"))
    await h.puller.start()
    await asyncio.sleep(0)
    try:
        assert "id" not in h.nc.pulls()[0] and h.nc.pulls()[0]["group"] == "PCG"
        await h.send(delivery(1, **{PIN_ID: "pin-1"}))
        assert h.puller.pin_id == "pin-1"
        await h.puller.pull_one()
        assert h.nc.pulls()[-1]["id"] == "pin-1"
        assert h.puller.pin_pulled_at == h.clock.now()
    finally:
        await h.puller.stop()


async def test_a_newly_pinned_puller_asks_again_with_its_pin_id() -> None:
    """Requests sent before the pin carry no pin id, and the server serves only requests
    that carry it: once pinned, ask again at once, with it (a previous holder's
    handed-back messages waited a whole pinned TTL, until the consumer reset)."""
    options = PullOptions(batch=8, expires=2.0, heartbeat=0.5, group="PCG")
    h = Harness(options)
    h.puller = Puller(h.nc, "S", "c", options,  # type: ignore[arg-type]
                      h.got.append, clock=h.clock, capacity=lambda: 8)
    await h.puller.start()
    await asyncio.sleep(0)
    try:
        assert [(p["batch"], p.get("id")) for p in h.nc.pulls()] == [(8, None)]
        await h.send(delivery(1, **{PIN_ID: "pin-1"}))
        assert [(p["batch"], p.get("id")) for p in h.nc.pulls()] == [(8, None), (8, "pin-1")]
        await h.send(delivery(2, **{PIN_ID: "pin-1"}))
        assert len(h.nc.pulls()) == 2, "the pin is known: nothing more to ask"
    finally:
        await h.puller.stop()


async def test_retiring_naks_what_still_arrives() -> None:
    """After an unpin, a delivery to one of our waiting requests goes back at once."""
    h = Harness(PullOptions(batch=1, expires=2.0, heartbeat=0.5, group="PCG"))
    await h.puller.start()
    await asyncio.sleep(0)
    retiring = asyncio.ensure_future(h.puller.retire(5.0))
    await asyncio.sleep(0.02)
    inbox = h.inbox
    msg = delivery(1)
    await h.nc.deliver(inbox, msg)
    await retiring
    assert h.got == [] and (msg.reply, b"-NAK") in [(s, d) for s, d, _ in h.nc.published]


@pytest.mark.parametrize("overlap", [True, False])
async def test_idle_requests_overlap_only_when_asked(overlap: bool) -> None:
    """Overlapping (pinned mode): a second request half-way to the first one's expiry.
    Not overlapping (sync mode's idle cost): none until the request ends, then one at
    once, for the whole batch."""
    h = Harness(PullOptions(batch=4, expires=0.2, heartbeat=0.05, overlap=overlap))
    await h.puller.start()
    try:
        await asyncio.sleep(0)
        assert len(h.nc.pulls()) == 1
        h.clock.advance(0.15)  # past half the expiry
        await asyncio.sleep(0.12)  # the pull loop's timed wakeups (heartbeat 0.05)
        assert len(h.nc.pulls()) == (2 if overlap else 1)
        if not overlap:
            await h.send(status("408", "Request Timeout", **{PENDING_MSGS: "4"}))
            await asyncio.sleep(0.01)
            assert [p["batch"] for p in h.nc.pulls()] == [4, 4]
    finally:
        await h.puller.stop()


async def test_423_wrong_pin_id_waits_for_the_member() -> None:
    """423 "Nats-Wrong-Pin-Id" (the pin moved, or went with a consumer leader change: the
    member's renewal tells which) does not end the puller; it asks for nothing until
    :meth:`Puller.repin`, then asks without a pin id. An older request answered so while
    being pinned again changes nothing."""
    h = Harness(PullOptions(batch=4, expires=2.0, heartbeat=0.5, group="PCG"))
    await h.puller.start()
    await asyncio.sleep(0)
    try:
        h.puller.pin_id = "old"
        await h.send(status("423", "Nats-Wrong-Pin-Id", **{PENDING_MSGS: "4"}))
        assert not h.puller.ended.done() and h.puller.pin_refused
        sent = len(h.nc.pulls())
        await h.puller.pull_one()
        assert len(h.nc.pulls()) == sent, "no request while refused"
        h.puller.repin()
        await h.puller.pull_one()
        assert len(h.nc.pulls()) == sent + 1 and "id" not in h.nc.pulls()[-1]
        await h.send(status("423", "Nats-Wrong-Pin-Id", **{PENDING_MSGS: "1"}))
        assert not h.puller.ended.done() and not h.puller.pin_refused
    finally:
        await h.puller.stop()


async def test_pin_news_tells_the_member_at_once() -> None:
    """The member hears of a pin change as the puller sees it, not at its next renewal:
    a delivery bringing a pin id other than ours (after the message is handed over), and
    the first 423 "Nats-Wrong-Pin-Id" for ours; not the same pin again, nor a second
    refusal while the first is being checked."""
    h = Harness(PullOptions(batch=4, expires=2.0, heartbeat=0.5, group="PCG"))
    news: list[int] = []
    h.puller.on_pin_news = lambda: news.append(len(h.got))
    await h.puller.start()
    await asyncio.sleep(0)
    try:
        await h.send(delivery(1, **{PIN_ID: "pin-1"}))
        await h.send(delivery(2, **{PIN_ID: "pin-1"}))
        assert news == [1], "told once, after the delivery reached the callback"
        await h.send(status("423", "Nats-Wrong-Pin-Id", **{PENDING_MSGS: "4"}))
        await h.send(status("423", "Nats-Wrong-Pin-Id", **{PENDING_MSGS: "4"}))
        assert news == [1, 2]
        h.puller.repin()
        await h.send(delivery(3, **{PIN_ID: "pin-2"}))
        assert news == [1, 2, 3] and h.puller.pin_id == "pin-2"
    finally:
        await h.puller.stop()
