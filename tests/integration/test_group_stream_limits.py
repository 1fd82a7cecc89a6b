"""A group's work-queue stream has room for every member's consumers (issue 27: nats-server
2.15 lets a stream without ``max_consumers`` have 1,000, and 500 members with two instances
each came to that and stalled), and a stream out of room says how to make more."""

from __future__ import annotations

import pytest
from nats.js import api

from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.errors import ApiError
from cgroupd.nats import jsapi
from cgroupd.nats.groupstreams import SERVER_DEFAULT_MAX_CONSUMERS, transforms
from cgroupd.nats.jetstream import JetStream

pytestmark = pytest.mark.slow


def _group(max_members: int) -> ElasticGroupConfig:
    return ElasticGroupConfig(max_members=max_members, members=("m1",),
                              partitioning_filters=(PartitioningFilter("orders.*", (1,)),))


async def _consumer(js: JetStream, stream: str, i: int) -> None:
    """A durable consumer: one with a name only is reaped after 5 s without interest, and
    under a CPU hog making 1,000 took longer, so the 1,001st found room (CI on ef1f3bd)."""
    await jsapi.create_consumer(js.nc, stream, f"c{i}",
                                {"durable_name": f"c{i}", "filter_subject": f"{i}.orders.x",
                                 "ack_policy": "explicit"})


async def test_a_group_stream_has_room_for_every_members_consumers(jetstream: JetStream) -> None:
    """A 300-member group's stream made as the reference makes it (no limit) takes 1,000
    consumers; the 1,001st is refused (10026) with the way out in the error. Creating the
    group again sizes the stream (300 x (sync + 4 data names) + 64) and the 1,001st is
    created. A new large group's stream is sized at once; a small group's keeps the
    server's default, as the reference makes it."""
    await jetstream.add_stream(api.StreamConfig(name="ORDERS", subjects=["orders.>"]))
    old = _group(300)
    await jetstream.add_stream(api.StreamConfig(
        name="ORDERS-old", retention=api.RetentionPolicy.WORK_QUEUE, allow_direct=True,
        sources=[api.StreamSource(name="ORDERS", subject_transforms=transforms(old))]))
    for i in range(SERVER_DEFAULT_MAX_CONSUMERS):
        await _consumer(jetstream, "ORDERS-old", i)
    with pytest.raises(ApiError, match="--max-consumers") as refused:
        await _consumer(jetstream, "ORDERS-old", SERVER_DEFAULT_MAX_CONSUMERS)
    assert refused.value.err_code == jsapi.ERR_MAX_CONSUMERS

    await admin.create_elastic_group(jetstream, "ORDERS", "old", old)
    adopted = await jetstream.stream_info("ORDERS-old")
    assert adopted is not None and adopted.config.max_consumers == 300 * 5 + 64
    await _consumer(jetstream, "ORDERS-old", SERVER_DEFAULT_MAX_CONSUMERS)

    await admin.create_elastic_group(jetstream, "ORDERS", "big", _group(300))
    big = await jetstream.stream_info("ORDERS-big")
    assert big is not None and big.config.max_consumers == 1564
    await admin.create_elastic_group(jetstream, "ORDERS", "small", _group(4))
    small = await jetstream.stream_info("ORDERS-small")
    assert small is not None and small.config.max_consumers == -1
