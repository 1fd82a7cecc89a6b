"""The metrics of bad input, without a server: the dispatcher counts a delivery that is
not a JetStream message (and keeps going), and ``cgroupd_ignored_input_total`` reports the
runtime's counts at scrape time, every kind from the first scrape."""

from __future__ import annotations

from nats.aio.msg import Msg

from cgroupd.join.metrics import IGNORED_INPUT, Metrics
from cgroupd.nats.message import Message
from tests.support.cli import parse_metrics
from tests.support.polling import eventually
from tests.unit.test_dispatch_unit import FakeConnection, delivery, dispatcher


def ignored(m: Metrics) -> dict[str, float]:
    return {dict(labels)["kind"]: value
            for (name, labels), value in parse_metrics(m.render().decode()).items()
            if name == "cgroupd_ignored_input_total"}


def test_every_kind_is_exported_at_zero_before_a_member_runs() -> None:
    m = Metrics("S", "G", "M")
    assert ignored(m) == {kind: 0 for kind in IGNORED_INPUT}


async def test_a_non_jetstream_delivery_is_counted_and_the_next_one_runs() -> None:
    """A message without a JetStream reply subject (a stray publish to the pull inbox) is
    neither handled nor answered; it is counted, the scrape shows it, and the real
    delivery after it is handled and acknowledged."""
    nc = FakeConnection()
    handled: list[int] = []

    async def handler(msg: Message) -> None:
        handled.append(msg.stream_sequence)

    d, stats = dispatcher(nc, handler)
    m = Metrics("S", "G", "M")
    m.count_ignored_input(lambda: stats)
    d.submit(Msg(nc, subject="0.orders.k", reply="", data=b"x"))  # type: ignore[arg-type]
    d.submit(Msg(nc, subject="0.orders.k", reply="_INBOX.x",  # type: ignore[arg-type]
                 data=b"y"))
    d.submit(delivery(nc, 1, "k"))
    await eventually(lambda: handled == [1] and nc.replies(b"+ACK"), 5, what="the ack")
    assert ignored(m)["not_jetstream_message"] == 2
    assert ignored(m)["invalid_group_record"] == 0
    assert stats["delivered"] == 1
    assert nc.replies(b"+ACK") == ["$JS.ACK.S.C.1.1.1.1700000000000000000.0"]
    await d.drain(1)


def test_takeovers_taken_and_declined_are_read_from_the_runtime_at_scrape_time() -> None:
    """Issue 29: a standby's declined takeovers (the consumer's leader still heard the
    owner) are visible beside the ones it made."""
    m = Metrics("S", "G", "M")
    counts = {"takeovers": 1, "takeovers_declined": 3}
    m.count_ignored_input(lambda: counts)
    got = {dict(labels)["outcome"]: value
           for (name, labels), value in parse_metrics(m.render().decode()).items()
           if name == "cgroupd_takeovers_total"}
    assert got == {"taken": 1, "declined": 3}


def test_pulls_restarted_is_read_from_the_runtime_at_scrape_time() -> None:
    """A pinned holder that restarted its pull loop (pinned, messages waiting, no request
    of its own at the leader) shows on a dashboard, not only in its log."""
    m = Metrics("S", "G", "M")
    counts = {"pulls_restarted": 0}
    m.count_ignored_input(lambda: counts)
    counts["pulls_restarted"] = 2
    got = {name: value for (name, _), value in parse_metrics(m.render().decode()).items()
           if name == "cgroupd_pulls_restarted_total"}
    assert got == {"cgroupd_pulls_restarted_total": 2}
