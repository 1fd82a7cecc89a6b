"""nats-server faults under traffic: a single node restarted, a 3-node cluster losing nodes.

Members m1 (active + standby) and m2 run as ``cgroupd join`` processes with the
exactly-once recording handler. Acks in flight when a server goes away cannot be
confirmed: the handler rolls back and the runtime retries the message, so what must hold
is the committed view: nothing lost, nothing committed twice, per-key order, and no two
instances of one member committing at the same time.

Cluster scenarios use R3 streams (origin, the group's work-queue stream) and an R3 KV
bucket (the group record); members and the test's publisher know all three URLs.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from cgroupd.core.config import ELASTIC_BUCKET
from tests.faults import injectors
from tests.faults.scenario import Scenario
from tests.support.natsserver import NatsCluster, NatsServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STREAMS = ("ORDERS", "ORDERS-g", f"KV_{ELASTIC_BUCKET}")


async def _start_members(sc: Scenario, replicas: int = 1) -> None:
    await sc.make_group(partitions=4, members=("m1", "m2"), replicas=replicas)
    first = sc.start("m1")
    sc.start("m2")
    await sc.wait_active("m1")
    standby = sc.start("m1")
    await sc.wait_active("m2")
    await sc.wait_joined([standby])
    assert first.active


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_server_restart_under_load(single: Scenario, server: NatsServer,
                                         how: str) -> None:
    """Stop the only nats-server (gracefully, or SIGKILL: a crash) while members consume,
    keep it down for a second, start it on the same store: members reconnect and resume,
    nothing lost or committed twice, order kept."""
    sc = single
    sc.name = f"server_restart_{how}"
    await _start_members(sc)
    pub = sc.traffic(1400, rate=200)
    pub.start()
    await sc.wait_progress(300)
    sc.crash = how == "sigkill"
    outage = await injectors.restart_server(server, graceful=how == "sigterm", down_for=1.0)
    sc.note(f"nats-server {how} + restart: {outage:.2f}s without a server")
    verdict = await sc.finish()
    verdict.assert_ok()


async def test_cluster_kill_stream_leader(cluster: NatsCluster, tmp_path: Path) -> None:
    """SIGKILL the node leading the group's work-queue stream under traffic; later bring
    it back. Members follow the new leader; the committed view is intact."""
    async with Scenario("cluster_kill_stream_leader", cluster.urls,
                        tmp_path / "scenario") as sc:
        await _start_members(sc, replicas=3)
        pub = sc.traffic(1600, rate=150)
        pub.start()
        await sc.wait_progress(250)
        leader = await injectors.stream_leader(cluster, "ORDERS-g")
        origin = await injectors.stream_leader(cluster, "ORDERS")
        sc.crash = True
        await injectors.kill_node(cluster, leader)
        sc.note(f"SIGKILL n{leader} (leader of ORDERS-g; ORDERS led by n{origin})")
        await sc.wait_progress(len(sc.finished()) + 250, timeout=60)
        sc.note("250 more finished")
        new = await injectors.stream_leader(cluster, "ORDERS-g")
        await injectors.restart_node(cluster, leader, STREAMS)
        sc.note(f"n{leader} back and in sync (ORDERS-g now led by n{new})")
        verdict = await sc.finish(timeout=120)
        verdict.assert_ok()


async def test_cluster_kill_random_node(cluster: NatsCluster, tmp_path: Path) -> None:
    """SIGKILL a random node under traffic (seed in the report; set FAULTS_SEED to
    replay), later bring it back: the committed view is intact."""
    seed = int(os.environ.get("FAULTS_SEED") or random.randrange(1 << 30))
    victim = random.Random(seed).randrange(len(cluster))
    async with Scenario("cluster_kill_random_node", cluster.urls,
                        tmp_path / "scenario") as sc:
        await _start_members(sc, replicas=3)
        pub = sc.traffic(1600, rate=150)
        pub.start()
        await sc.wait_progress(250)
        sc.crash = True
        await injectors.kill_node(cluster, victim)
        sc.note(f"SIGKILL n{victim} (seed {seed})")
        await sc.wait_progress(len(sc.finished()) + 250, timeout=60)
        sc.note("250 more finished")
        await injectors.restart_node(cluster, victim, STREAMS)
        sc.note(f"n{victim} back and in sync")
        verdict = await sc.finish(timeout=120)
        verdict.assert_ok()


async def test_cluster_rolling_restart(cluster: NatsCluster, tmp_path: Path) -> None:
    """Restart all three nodes one after another (SIGTERM, start, wait until every
    stream is in sync) under traffic: the committed view is intact."""
    async with Scenario("cluster_rolling_restart", cluster.urls,
                        tmp_path / "scenario") as sc:
        await _start_members(sc, replicas=3)
        pub = sc.traffic(3000, rate=150)
        pub.start()
        await sc.wait_progress(200)
        took = await injectors.rolling_restart(cluster, STREAMS)
        sc.note("rolling restart: " + ", ".join(f"n{i} {t:.1f}s" for i, t in enumerate(took)))
        assert pub.published < pub.count, "traffic must outlast the rolling restart"
        verdict = await sc.finish(timeout=120)
        verdict.assert_ok()
