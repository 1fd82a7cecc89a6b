"""The adapter's consumer leader step-down and server name against a real 3-node cluster
(cgroupd/nats/jetstream.py): a standby whose own server leads a young claim that the
claim's holder cannot reach asks that leader to hand on its leadership (issue 29). The
leader answers the request and moves; ``server_name`` is how ``cluster.leader`` names
the server we are connected to."""

from __future__ import annotations

import nats
import pytest

from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.nats.jetstream import JetStream
from tests.support.natsserver import NatsCluster, client_options
from tests.support.polling import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


async def test_the_leader_steps_down_when_its_own_server_asks(
        nats_cluster: NatsCluster) -> None:
    """A client of the consumer leader's server asks it to step down: another peer leads
    after it, and the client's ``server_name`` was the old leader's name."""
    nc = await nats.connect(servers=nats_cluster.urls, **client_options())
    try:
        await nc.jetstream().add_stream(name="LEAD", subjects=["lead.>"], num_replicas=3)
        js = JetStream(nc)
        await js.create_consumer("LEAD", "c", {"durable_name": "c", "ack_policy": "explicit",
                                               "num_replicas": 3})

        async def leader() -> str:
            info = await js.consumer_info("LEAD", "c")
            name = ConsumerInfo(info).leader if info else ""
            assert name, "no leader yet"
            return name

        old = await eventually(leader, 30, 0.1, "the consumer's leader", retry=(Exception,))
        url = next(s.url for s in nats_cluster.servers if s.server_name == old)
        on_leader = await nats.connect(url, **client_options())
        try:
            there = JetStream(on_leader)
            assert there.server_name == old
            await there.step_down_consumer_leader("LEAD", "c")

            async def moved() -> bool:
                return await leader() != old
            await eventually(moved, 30, 0.1, "another leader", retry=(Exception,))
        finally:
            await on_leader.close()
    finally:
        await nc.close()
