"""Against a real server stalled with SIGSTOP: a request that went unanswered is still
carried out once the server runs again (why a fixed short wait wastes an overloaded
server's work, issue 27), and the adapter waits longer after it and as before once answers
come back."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.js import api

from cgroupd.core.errors import NoAnswer
from cgroupd.nats.jetstream import JetStream
from tests.support.natsserver import NatsServer


async def test_an_unanswered_create_is_carried_out_and_the_wait_grows_then_comes_back(
        nc: Client, nats_server: NatsServer) -> None:
    js = JetStream(nc, timeout=1.0)
    await js.add_stream(api.StreamConfig(name="T", subjects=["t.>"]))
    assert await js.consumer_info("T", "late") is None  # answered: the wait stays
    assert js.answers.seconds == 1.0
    config = {"durable_name": "late", "ack_policy": "explicit", "filter_subject": "t.a"}
    nats_server.pause()
    try:
        with pytest.raises(NoAnswer, match="no answer"):
            await js.create_consumer("T", "late", config)
    finally:
        nats_server.resume()
    # The next wait is doubled, for nats-py's own requests too.
    assert js.answers.seconds == 2.0
    assert js.js._timeout == 2.0 and js.jsm._timeout == 2.0
    info = await js.consumer_info("T", "late")
    assert info is not None, "the server created the consumer it never answered for"
    # Answers bring the wait back (a few, when the first after the stall was slow).
    for _ in range(20):
        if js.answers.seconds == 1.0:
            break
        await js.consumer_info("T", "late")
    assert js.answers.seconds == 1.0 and js.jsm._timeout == 1.0
