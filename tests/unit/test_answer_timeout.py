"""The wait for an API answer grows while the server does not answer and comes back as it
does (issue 27's congestion collapse: a fixed 2 s wait under a 2-3 s server queue)."""

from __future__ import annotations

import pytest

from cgroupd.core.answer_timeout import AnswerTimeout


def test_a_prompt_server_keeps_the_base_wait() -> None:
    t = AnswerTimeout(2.0)
    for _ in range(100):
        t.answered(0.003)
    assert t.seconds == 2.0 and not t.raised


def test_each_timeout_at_the_current_wait_doubles_it_up_to_the_cap() -> None:
    """By default not at all (see ANSWER_TIMEOUT_CAP_FACTOR); up to a cap given above the
    base."""
    t = AnswerTimeout(2.0)
    waits = []
    for _ in range(4):
        waits.append(t.seconds)
        t.unanswered(t.seconds)
    assert waits == [2.0, 2.0, 2.0, 2.0] and t.cap == 2.0 and not t.raised
    wide = AnswerTimeout(2.0, cap=16.0)
    waits = []
    for _ in range(6):
        waits.append(wide.seconds)
        wide.unanswered(wide.seconds)
    assert waits == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]


def test_a_burst_of_timeouts_sent_at_one_wait_doubles_it_once() -> None:
    """Requests that were all sent with the 2 s wait and all time out together are one
    sign of congestion: the wait doubles once, not once per request."""
    t = AnswerTimeout(2.0, cap=16.0)
    for _ in range(50):
        t.unanswered(2.0)
    assert t.seconds == 4.0


def test_answers_bring_the_wait_back_one_doubling_at_a_time() -> None:
    t = AnswerTimeout(2.0, cap=16.0)
    for _ in range(3):
        t.unanswered(t.seconds)
    assert t.seconds == 16.0
    seen = []
    for _ in range(3):
        t.answered(0.01)
        seen.append(t.seconds)
    assert seen == [8.0, 4.0, 2.0]


def test_slow_answers_keep_the_wait_above_four_times_their_smoothed_time() -> None:
    """A server answering in 1.5 s must not be asked with a 2 s wait: the next answer that
    takes a little longer would be thrown away and its request run for nothing."""
    t = AnswerTimeout(2.0, cap=16.0)
    for _ in range(40):
        t.answered(1.5)
    assert t.seconds == pytest.approx(6.0, rel=0.01)
    for _ in range(60):
        t.answered(0.002)
    assert t.seconds == 2.0


def test_a_wait_below_the_base_or_a_cap_below_it_is_refused_or_lifted() -> None:
    with pytest.raises(ValueError):
        AnswerTimeout(0)
    assert AnswerTimeout(20.0, cap=10.0).cap == 20.0 and AnswerTimeout(1.0).cap == 1.0
