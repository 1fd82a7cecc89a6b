"""Regression tests for library bugs the fault suite ran into (all fixed):

- a JetStream publish no stream stored leaked a nats-py exception;
- a 503 on pulls while an R3 consumer elected a new leader was taken for "consumer gone",
  so the active instance stepped down and flapped;
- a delivery lost in transit left the member stalled for the whole ack wait.
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import pytest

from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import CgroupdError
from cgroupd.core.naming import INSTANCE_KEY, PRESENCE_KEY
from cgroupd.nats import jsapi
from cgroupd.nats.jetstream import JetStream
from tests.faults import injectors
from tests.faults.scenario import Scenario
from tests.support.natsserver import NatsCluster

pytestmark = [pytest.mark.faults, pytest.mark.slow]


async def _data_consumer_of(js: JetStream, instance: str) -> str:
    """The name of ``instance``'s data consumer (named from its member's slots)."""
    names = [info["name"] for info in await js.list_consumers("ORDERS-g")
             if ConsumerInfo(info).meta(INSTANCE_KEY) == instance
             and ConsumerInfo(info).meta(PRESENCE_KEY) and info["name"] != "m1"]
    assert len(names) == 1, names
    return names[0]


async def test_publish_without_a_stream_raises_a_cgroupd_error(single: Scenario) -> None:
    """A JetStream publish nobody stores raises a CgroupdError, like every adapter call
    (errors.py: nothing above the adapter sees a nats-py exception)."""
    assert single.js is not None
    with pytest.raises(CgroupdError):
        await single.js.publish("nobody.stores.this", b"x", timeout=1.0)


async def test_losing_a_consumer_leader_is_not_a_step_down(cluster: NatsCluster,
                                                           tmp_path: Path) -> None:
    """Kill the node leading the active instance's data consumer (an R3 consumer, which
    survives with a new leader): the instance keeps its consumers and carries on after the
    election without stepping down."""
    async with Scenario("consumer_leader_loss", cluster.urls, tmp_path / "scenario") as sc:
        await sc.make_group(partitions=2, members=("m1",), replicas=3)
        member = sc.start("m1")
        await sc.wait_active("m1")
        assert sc.js is not None
        js = sc.js
        data = await _data_consumer_of(js, member.instance)
        info = await js.consumer_info("ORDERS-g", data)
        assert info is not None and info["cluster"]["replicas"], "an R3 consumer"
        leader = next(i for i, s in enumerate(cluster.servers)
                      if s.server_name == info["cluster"]["leader"])
        pub = sc.traffic(600, rate=50)
        pub.start()
        await sc.wait_progress(20)
        await injectors.kill_node(cluster, leader)

        async def new_leader() -> bool:
            try:
                now = await js.consumer_info("ORDERS-g", data)
            except CgroupdError:
                return False
            got = ((now or {}).get("cluster") or {}).get("leader")
            return got not in (None, cluster.servers[leader].server_name)

        await sc.wait_for(new_leader, 60, "the data consumer to elect a new leader")
        done = len(sc.finished())
        await sc.wait_progress(done + 20, timeout=60)
        stepped = [e for e in member.events() if e.get("event") == "stepped down"]
        assert not stepped, json.dumps(stepped)[:500]
        await pub.stop()
        await asyncio.to_thread(cluster.restart, leader, 60.0)


async def test_a_lost_delivery_does_not_stall_the_member_for_the_ack_wait(
        single: Scenario) -> None:
    """A message the server delivered but the active instance never received (a pull
    answered through a connection that then went away) must not stop the member for the
    full ack wait: the instance sees the server count a message as unacknowledged that it
    does not hold, and recovers within seconds.

    The lost delivery is made deterministic by pulling one message from the member's data
    consumer with a request of the test's own that nobody acknowledges; the server serves
    waiting pulls first come first served, so once the member's earlier requests have
    expired, the next message published goes to the test's request.
    """
    sc = single
    await sc.make_group(partitions=2, members=("m1",))
    member = sc.start("m1")
    await sc.wait_active("m1")
    assert sc.nc is not None and sc.js is not None
    nc, js = sc.nc, sc.js
    lost = await nc.subscribe(nc.new_inbox())
    await nc.publish(jsapi.pull_subject("ORDERS-g", await _data_consumer_of(js, member.instance)),
                     json.dumps({"batch": 1, "expires": int(60e9)}).encode(),
                     reply=lost.subject)

    async def publish(n: int) -> None:
        body = {"key": "orders.k1", "i": n, "n": n}
        await js.publish("orders.k1", json.dumps(body).encode())

    n = 0
    while True:  # each round waits for where message n went: the member or the test
        await publish(n)
        try:
            taken = await lost.next_msg(timeout=0.5)
            break
        except TimeoutError:
            await sc.wait_for(functools.partial(_finished, sc, n), 10, f"#{n} handled")
        n += 1
        assert n < 40, "the test's pull request never got a message"
    sc.note(f"message #{json.loads(taken.data)['n']} delivered to a request nobody acks")
    later = list(range(n + 1, n + 6))
    for m in later:
        await publish(m)
    await sc.wait_for(lambda: set(later) <= sc.finished(), 10,
                      "the member to carry on well before the 30 s ack wait")
    await lost.unsubscribe()


def _finished(sc: Scenario, n: int) -> bool:
    return n in sc.finished()
