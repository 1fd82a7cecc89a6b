"""Issue 25 row 10, the bookkeeping alone (no server): which denials make /healthz fail,
how they are named, and for how long."""

from __future__ import annotations

from cgroupd.join.healthwatch import Denials, kind_of, shown_subject


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_denials_are_classified_grouped_and_expire() -> None:
    """Each ack of one consumer is one problem line (not one per sequence), counted;
    the line names the subject and the missing permission and goes 60 s after the last
    denial; errors that are no permission violation are ignored."""
    clock = Clock()
    denials = Denials(dead_letter_subject="DLQ.Orders", clock=clock)
    for seq in range(3):
        assert denials.record(
            f"nats: permissions violation for publish to "
            f"\"$js.ack.orders-g.m1-abc.1.{seq}.{seq}.1700000000000000000.0\"") == (
                "publish", "ack")
    assert denials.record("nats: permissions violation for subscription to "
                          "\"_cgroupd.presence.orders.g.m1.abc\"") == ("subscribe", "control")
    assert denials.record("nats: permissions violation for publish to \"dlq.orders\"") == (
        "publish", "dead_letter")
    assert denials.record("nats: stale connection") is None
    problems = denials.problems()
    assert len(problems) == 3
    ack = next(p for p in problems if "$JS.ACK." in p)
    assert ack.startswith("NATS permission denied: publish to $JS.ACK.orders-g.m1-abc.> "
                          "(3 times, last 0s ago): acks are not applied")
    assert ack.endswith("grant this user publish permission on it")
    assert any("subscribe to _CGROUPD.presence.orders.>" in p and "flaps" in p for p in problems)
    clock.now += 59
    assert len(denials.problems()) == 3
    clock.now += 2
    # A denied publish is refused again when it is tried again: gone after the window.
    # A denied subscription stays missing: it stays until the client subscribes again.
    [problem] = denials.problems()
    assert "subscribe to _CGROUPD.presence" in problem
    denials.reconnected()
    assert denials.problems() == []


def test_kinds_and_shown_subjects() -> None:
    assert kind_of("$JS.API.CONSUMER.CREATE.S") == "api"
    assert kind_of("$kv.bucket.key") == "api"
    assert kind_of("_INBOX.abc.def") == "inbox"
    # With --inbox-prefix, the connection's own reply subjects are inboxes too, and every
    # inbox denial is one problem line (each prober has an inbox of its own).
    assert kind_of("_inbox_m1.abc.def", inbox_prefix="_INBOX_m1") == "inbox"
    assert kind_of("_inbox_m1.abc.def") == "other"
    assert shown_subject("_inbox_m1.abc.def", "inbox", "_INBOX_m1") == "_INBOX_m1.>"
    assert kind_of("orders.k1") == "other"
    assert shown_subject("$js.api.consumer.create.s", "api") == "$JS.API.consumer.>"
    assert shown_subject("orders.k1", "other") == "orders.k1"


def test_the_number_of_remembered_subjects_is_bounded() -> None:
    """A flood of distinct denied subjects keeps at most 32 lines."""
    denials = Denials()
    for i in range(1000):
        denials.record(f"nats: permissions violation for publish to \"x.{i}\"")
    assert len(denials.problems()) == 32


def test_acks_that_do_not_take_effect_are_a_problem_once_most_come_back() -> None:
    """Messages delivered again after they were acked: a few among many acks (a
    reconnect) are no problem; three that are at least half of the window's acks are,
    and the problem goes once the window has passed without more."""
    from cgroupd.join.healthwatch import AckWatch

    clock = Clock()
    watch = AckWatch(clock)
    clock.now += 10
    assert watch.problem(acked=100, resettled=2) is None, "2 lost: a reconnect"
    clock.now += 10
    assert watch.problem(acked=100, resettled=40) is None, "40 of 100: not most"
    clock.now += 10
    problem = watch.problem(acked=100, resettled=60)
    assert problem is not None and problem.startswith(
        "acks are not taking effect: 60 messages were delivered again after this instance "
        "acked them in the last 30s (for 100 handled)")
    clock.now += 290
    assert watch.problem(acked=100, resettled=60) is not None, "still within the window"
    clock.now += 300
    assert watch.problem(acked=100, resettled=60) is None, "none more in the window"
    clock.now += 400
    problem = watch.problem(acked=100, resettled=90)
    assert problem is not None and "30 messages" in problem and "for 0 handled" in problem


def test_a_denial_is_logged_once_a_minute_with_a_count() -> None:
    """Not one log line per denied ack: the first, then one a minute saying how many."""
    clock = Clock()
    denials = Denials(clock=clock)
    ack = "nats: permissions violation for publish to \"$js.ack.s.c.1.{}.1.1.0\""
    logged = []
    for i in range(100):
        clock.now += 1
        denials.record(ack.format(i))
        if (fields := denials.to_log()) is not None:
            logged.append(fields)
    assert [f["times"] for f in logged] == [1, 60]
    assert logged[0] == {"operation": "publish", "subject": "$JS.ACK.s.c.>", "kind": "ack",
                         "times": 1}
