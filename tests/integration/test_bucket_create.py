"""Creating the record bucket rides out a server that answers late (a replicated bucket
is answered only once its replicas elected a leader, which a busy cluster can take longer
than one request's timeout for)."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from cgroupd.core.errors import ServerUnreachable
from cgroupd.nats import jetstream as jetstream_module
from cgroupd.nats.jetstream import JetStream
from tests.support.natsserver import NatsServer


async def _create_while_stalled(nc: Client, server: NatsServer, bucket: str) -> None:
    """Create ``bucket`` with a 0.5 s request timeout while the server stalls for 0.8 s."""
    js = JetStream(nc, timeout=0.5)
    await js.stream_info("warm-up")  # the client and its response inbox are set up
    server.pause()
    asyncio.get_running_loop().call_later(0.8, server.resume)
    try:
        await js.bucket(bucket, create_with=KeyValueConfig(bucket=bucket, history=1))
    finally:
        if server.is_paused:
            await asyncio.sleep(1.0)


async def test_a_bucket_creation_answered_late_is_asked_again(
        nc: Client, nats_server: NatsServer) -> None:
    """The first request times out while the server is stalled; asking again with the same
    config gets the bucket (the one the first request made, or a new one)."""
    await _create_while_stalled(nc, nats_server, "late")
    info = await JetStream(nc).stream_info("KV_late")
    assert info is not None and info.config.max_msgs_per_subject == 1


async def test_without_asking_again_the_same_stall_is_an_error(
        nc: Client, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall above is long enough to fail a single request (the test above can fail)."""
    monkeypatch.setattr(jetstream_module, "BUCKET_CREATE_ATTEMPTS", 1)
    with pytest.raises(ServerUnreachable):
        await _create_while_stalled(nc, nats_server, "once")
