"""The two named answer policies of :mod:`cgroupd.core.answers` (no server): the
stale-answer policy and the pull-status classifier. Each caller's reaction is tested where
it lives (self-check, pin renewal, election, puller)."""

from __future__ import annotations

import math

import pytest

from cgroupd.core.answers import PullStatus, classify_pull_status, judge_answer


def _info(active_ns: int) -> dict[str, object]:
    """A consumer info from an R3 leader whose freshest follower was heard ``active_ns``
    ago (the shape nats-server 2.15.1 answers with)."""
    return {"name": "m1", "cluster": {"leader": "n2", "replicas": [
        {"name": "n0", "current": True, "active": active_ns},
        {"name": "n1", "current": True, "active": 60_000_000_000}]}}


def test_an_answer_in_touch_with_a_quorum_proves_its_state_as_of_its_quorum() -> None:
    """A lease is renewed from when the quorum was last heard, not from when the request
    went out."""
    judged = judge_answer([_info(500_000_000)], sent=100.0, lease=2.0)
    assert not judged.stale
    assert math.isclose(judged.age, 0.5)
    assert math.isclose(judged.as_of, 99.5)


def test_an_answer_a_whole_lease_out_of_touch_is_stale() -> None:
    """The bound is inclusive: a quorum heard exactly a lease ago proves nothing."""
    assert judge_answer([_info(2_000_000_000)], sent=100.0, lease=2.0).stale
    assert not judge_answer([_info(1_999_000_000)], sent=100.0, lease=2.0).stale


def test_several_answers_are_as_old_as_the_oldest_and_absence_is_fresh() -> None:
    """A self-check's answers together; a consumer reported missing (None) or an
    unclustered one is answered in touch; one whose replicas are all offline is not."""
    judged = judge_answer([None, {"name": "d"}, _info(3_000_000_000)], sent=10.0, lease=5.0)
    assert math.isclose(judged.age, 3.0) and not judged.stale
    assert judge_answer([None], sent=10.0, lease=5.0) == judge_answer([], sent=10.0, lease=5.0)
    assert judge_answer([None], sent=10.0, lease=5.0).as_of == 10.0
    lonely = {"cluster": {"leader": "n2", "replicas": [
        {"name": "n0", "offline": True}, {"name": "n1", "offline": True}]}}
    assert judge_answer([lonely], sent=10.0, lease=5.0).stale


@pytest.mark.parametrize(("code", "description", "kind"), [
    ("100", "Idle Heartbeat", PullStatus.HEARTBEAT),
    ("404", "No Messages", PullStatus.REQUEST_DONE),
    ("408", "Request Timeout", PullStatus.REQUEST_DONE),
    ("409", "Consumer Deleted", PullStatus.CONSUMER_DELETED),
    ("409", "Exceeded MaxRequestBatch of 1", PullStatus.REJECTED),
    ("409", "Exceeded MaxRequestMaxBytes of 10", PullStatus.REJECTED),
    ("409", "Exceeded MaxWaiting", PullStatus.ASK_AGAIN),
    ("409", "Exceeded Max Waiting", PullStatus.ASK_AGAIN),
    ("409", "exceeded maxwaiting", PullStatus.ASK_AGAIN),
    ("409", "Leadership Change", PullStatus.ASK_AGAIN),
    ("409", "Batch Completed", PullStatus.ASK_AGAIN),
    # A pin renewal's one-byte request, ended before it would deliver (Puller.pull_one).
    ("409", "Message Size Exceeds MaxBytes", PullStatus.ASK_AGAIN),
    ("409", "", PullStatus.ASK_AGAIN),
    ("423", "Nats-Pin-Id mismatch", PullStatus.PIN_LOST),
    ("423", "Nats-Wrong-Pin-Id", PullStatus.WRONG_PIN_ID),
    ("503", "No Responders", PullStatus.NO_RESPONDERS),
    ("400", "Bad Request", PullStatus.FAILED),
    ("", "", PullStatus.FAILED),
])
def test_pull_statuses(code: str, description: str, kind: PullStatus) -> None:
    """What each status nats-server 2.15.1 answers a pull with means for the puller."""
    assert classify_pull_status(code, description) is kind
