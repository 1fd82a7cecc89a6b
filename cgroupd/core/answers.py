"""How the runtime reads what a server answers: two named policies, pure (no I/O), each
tested once in ``tests/unit/test_answers.py``.

- :func:`judge_answer`, the **stale-answer policy**: what a consumer info proves when the
  server that answered may be cut off from the consumer's other replicas.
- :func:`classify_pull_status`, the **server-status policy**: what a status message a
  pull request gets back (``100``, ``404``, ``409 …``) means for the puller.

Each caller keeps its own reaction (ignore the answer, "not proven", no answer, renew a
lease from ``as_of``); only the judgement lives here, so it is made one way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from cgroupd.core.consumerinfo import ConsumerInfo


@dataclass(frozen=True)
class Judged:
    """What one round of consumer infos proves (see :func:`judge_answer`)."""

    #: Seconds the answering server(s) had not heard from a quorum of the replicas.
    age: float
    #: On the caller's clock: the moment the state shown is proven at (``sent - age``); a
    #: lease confirmed by the answer is renewed from here, never from when it arrived.
    as_of: float
    #: The answer proves nothing: it neither confirms nor ends anything (no owner deleted,
    #: no generation ended on its word); ask again later.
    stale: bool


def judge_answer(infos: Iterable[Mapping[str, Any] | None], *, sent: float,
                 lease: float) -> Judged:
    """The stale-answer policy, the one place the runtime decides it.

    A clustered consumer's leader answers consumer info even when cut off from its
    replicas, from its old state, while the majority elects another leader (nats-server
    2.15.1, measured: an isolated leader still named itself leader 15 s into a cut;
    ``tests/faults/test_cluster_node_cut.py``). Right after a heal the node that was cut
    off answers for a moment with the consumers it led before the cut, the previous
    owner's claim among them (``tests/integration/test_rebalance_sync_claim_race.py``).
    So an answer proves the state it shows only as of when its server last heard a quorum
    (``as_of``), and one whose server had not heard a quorum for a whole ``lease`` or more
    is stale. ``sent`` is when the request went out, on the caller's clock; several infos
    (one self-check's) are as old as the oldest of them. A missing consumer (``None``) was
    answered by a server in touch (the answer is the absence)."""
    age = max((ConsumerInfo.of(info).quorum_age for info in infos), default=0.0)
    return Judged(age=age, as_of=sent - age, stale=age >= lease)


class PullStatus(Enum):
    """What a status message answering a pull request means for the puller."""

    HEARTBEAT = "heartbeat"  # 100: idle heartbeat; the connection is alive
    REQUEST_DONE = "request-done"  # 404 No Messages / 408 Request Timeout: it asks no more
    ASK_AGAIN = "ask-again"  # 409, passing (leadership change, max waiting, batch done)
    CONSUMER_DELETED = "consumer-deleted"  # 409 Consumer Deleted
    REJECTED = "rejected"  # 409 Exceeded MaxRequest…: the request can never succeed
    PIN_LOST = "pin-lost"  # 423: the request's pin id is not the pinned one
    #: 423 Nats-Wrong-Pin-Id: the pin moved to another client, or went with a consumer
    #: leader change (nats-server 2.15.1 keeps it in the leader's memory only); the
    #: member's next renewal tells which (tests/faults/test_pinned_rolling_restart.py).
    WRONG_PIN_ID = "wrong-pin-id"
    NO_RESPONDERS = "no-responders"  # 503: consumer gone or electing a leader
    FAILED = "failed"  # anything else: not a status a pull can expect


def classify_pull_status(code: str, description: str) -> PullStatus:
    """The server-status policy, the one place a pull status is read.

    The codes alone decide, but for 409: nats-server (2.15.1) sends it for several
    conditions told apart only by the description; the comparisons ignore case (and
    "max waiting" is found with or without its space). Each rule, with the test that proves it:

    - ``409 Consumer Deleted`` (contains "deleted"): the consumer is gone; seen from the
      real server in ``tests/integration/test_hostile_messages.py::
      test_server_status_tells_server_statuses_from_messages``.
    - ``409 Exceeded MaxRequestBatch of N`` / ``MaxRequestMaxBytes`` / ``MaxRequestExpires``
      (contains "exceeded", not "maxwaiting"): the request can never be served; ``409
      Exceeded MaxWaiting`` only means too many requests wait now (ask again). Both
      seen from the real server in the same test.
    - any other 409 (``Leadership Change``, ``Batch Completed``, ``Message Size Exceeds
      MaxBytes``: a pin renewal's one-byte request, ...): the request ended
      passing; ask again (``tests/unit/test_pull_unit.py::test_passing_409s_ask_again``).

    And for 423: ``Nats-Wrong-Pin-Id`` (contains "wrong"), the pin moved or went with
    a consumer leader change (the member's renewal tells which), apart from any other
    423 (``tests/faults/test_pinned_rolling_restart.py``).

    The table: ``tests/unit/test_answers.py``; the puller's reaction to each:
    ``tests/unit/test_pull_unit.py``."""
    if code == "100":
        return PullStatus.HEARTBEAT
    if code in ("404", "408"):
        return PullStatus.REQUEST_DONE
    if code == "409":
        lowered = description.lower()
        if "deleted" in lowered:
            return PullStatus.CONSUMER_DELETED
        if "exceeded" in lowered and "maxwaiting" not in lowered.replace(" ", ""):
            return PullStatus.REJECTED
        return PullStatus.ASK_AGAIN
    if code == "423":
        return (PullStatus.WRONG_PIN_ID if "wrong" in description.lower()
                else PullStatus.PIN_LOST)
    if code == "503":
        return PullStatus.NO_RESPONDERS
    return PullStatus.FAILED
