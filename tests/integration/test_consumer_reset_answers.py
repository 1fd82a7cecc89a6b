"""What a real nats-server answers to a consumer reset it cannot serve, and how the pinned
takeover reads it (:func:`cgroupd.member.pinned_reset.reset_unsupported`): a refusal
to give up on, or a passing failure to retry (tests/unit/test_election_pinned_reset_unit.py).

Checked against nats-server 2.15.1: a reset that no consumer leader serves (the consumer
missing, or electing its leader) gets no answer at all, and neither does an API verb the
server lacks, which is how a server without the reset API (< 2.14) treats a reset as far
as 2.15 shows. Its source (jetstream_api.go, apiDispatch) answers such a subject with 400
"bad request" where its short circuit applies. So: no answer (ServerUnreachable) is
passing and is retried; a 4xx answer is a refusal."""

from __future__ import annotations

import nats
import pytest
from nats.aio.client import Client

from cgroupd.core.errors import ApiError, ConsumerNotFound, JetStreamNotEnabled, ServerUnreachable
from cgroupd.member.pinned_reset import reset_unsupported
from cgroupd.nats.jetstream import JetStream


async def test_a_reset_served_by_the_consumer_answers_with_its_position(
        jetstream: JetStream, nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(name="R", subjects=["r.>"])
    await js.add_consumer("R", durable_name="C", ack_policy="explicit")
    await js.publish("r.1", b"x")
    info = await jetstream.reset_consumer("R", "C")
    assert info["reset_seq"] == 1 and info["name"] == "C"


async def test_a_reset_nobody_serves_gets_no_answer_and_is_retried(
        jetstream: JetStream, nc: Client) -> None:
    """A missing consumer (its leader not there): no answer within the API timeout, not
    "no responders" and not an error reply. The takeover retries it."""
    js = nc.jetstream()
    await js.add_stream(name="R", subjects=["r.>"])
    with pytest.raises(ServerUnreachable) as caught:
        await jetstream.reset_consumer("R", "MISSING")
    assert not reset_unsupported(caught.value)


async def test_an_api_verb_the_server_lacks_gets_no_answer(nc: Client) -> None:
    """What a server without the reset API does with one, as far as 2.15 shows: it stays
    silent (the caller times out), so an old server reads as a passing failure; the
    takeover's retries pull between tries, so the ack wait still brings a dead holder's
    messages back."""
    await nc.jetstream().add_stream(name="R", subjects=["r.>"])
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request("$JS.API.CONSUMER.FROBNICATE.R.C", b"{}", timeout=1.0)


def test_only_a_4xx_refusal_gives_up() -> None:
    assert reset_unsupported(ApiError(400, 10003, "bad request"))
    for passing in (ApiError(503, 10008, "JetStream system temporarily unavailable"),
                    ApiError(500, 0, "undecodable reply"),
                    ConsumerNotFound(404, 10014, "consumer not found"),
                    JetStreamNotEnabled("no JetStream answered"),
                    ServerUnreachable("no answer")):
        assert not reset_unsupported(passing), passing
