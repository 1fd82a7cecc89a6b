"""A cluster node cut off the network while the active member instance is connected to it.

A 3-node JetStream cluster where node ``n2`` runs inside a network namespace (see
:class:`tests.faults.injectors.VethNamespace`): ``n0`` and ``n1`` listen on the host end of
the veth pair, ``n2`` on the namespace end, so taking the link down cuts both ``n2``'s
client connections and its routes. The group is R3 (origin stream, work-queue stream and
therefore its consumers). m1's active instance runs inside the namespace too and knows
only ``n2``; its standby knows only ``n0``. Before the cut the leaders of m1's consumers
(the synchronization consumer and the active instance's data consumer) are moved to
``n2``, the meta leader away from it: the worst case for the cut-off owner, whose every
self-check is answered by a node that no longer hears the cluster, while the majority
side takes the member over as fast as it can.

What the isolated node answers is measured from inside the namespace during the cut
(consumer info of the synchronization consumer, every 0.25 s) and put in the notes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from cgroupd.naming import data_consumer, sync_consumer
from cgroupd.settings import MemberSettings
from tests.faults.injectors import VethNamespace, namespace_for_test
from tests.faults.scenario import Scenario
from tests.support.natsserver import NatsCluster, running_cluster
from tests.support.polling import eventually

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SETTINGS = MemberSettings()
WQ = "ORDERS-g"
ISOLATED = 2  # the node in the namespace


@contextmanager
def cluster_with_node_in_namespace(tmp_path: Path) -> Iterator[tuple[VethNamespace, NatsCluster]]:
    with namespace_for_test() as ns, running_cluster(
            host=ns.host_addr, hosts={ISOLATED: ns.ns_addr}, prefixes={ISOLATED: ns.prefix()},
            workdir=tmp_path / "nats-cluster") as cl:
        yield ns, cl


async def _api(nc: Client, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await nc.request(subject, json.dumps(body or {}).encode(), timeout=5)
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


async def _leader_to(nc: Client, consumer: str, node: str, sc: Scenario) -> None:
    """Move the leader of ``consumer`` (on the work-queue stream) to ``node``."""
    async def there() -> bool:
        info = await _api(nc, f"$JS.API.CONSUMER.INFO.{WQ}.{consumer}")
        if (info.get("cluster") or {}).get("leader") == node:
            return True
        await _api(nc, f"$JS.API.CONSUMER.LEADER.STEPDOWN.{WQ}.{consumer}",
                   {"placement": {"preferred": node}})
        return False
    await eventually(there, 30, 0.2, f"{consumer}'s leader on {node}", retry=(Exception,),
                     diagnostics=sc.diagnostics)


async def _meta_leader_off(cl: NatsCluster, node: int) -> bool:
    """Move the JetStream meta leader off ``node`` (the meta leader stepdown API is the
    system account's): restart the node if it leads. True if it had to."""
    if await asyncio.to_thread(cl.meta_leader, 30.0) != node:
        return False
    await asyncio.to_thread(cl.stop, node)
    await asyncio.to_thread(cl.meta_leader, 30.0)
    await asyncio.to_thread(cl.restart, node, 30.0)
    return True


#: Asks the isolated node for the synchronization consumer's info every 0.25 s from inside
#: the namespace, printing one JSON line per answer: who it says leads, and the
#: nanoseconds since it last heard each replica (``active``).
PROBE = """
import asyncio, json, sys, time
import nats
async def main(url, subject):
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=-1)
    while True:
        t = time.time()
        try:
            d = json.loads((await nc.request(subject, b"", timeout=0.5)).data)
            c = d.get("cluster") or {}
            print(json.dumps({"t": t, "leader": c.get("leader"), "active": [
                r.get("active") for r in c.get("replicas") or []]}), flush=True)
        except Exception:
            pass
        await asyncio.sleep(max(0.0, t + 0.25 - time.time()))
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_cluster_node_cut_with_the_active_instance_on_it(tmp_path: Path) -> None:
    """Cut n2 off while m1's active instance, connected only to n2, has four handlers
    busy (6-12 s) with later messages of their keys waiting behind them (key ordering, 64
    in flight, the exactly-once recorder). n2 keeps answering its self-checks as the
    consumers' leader, from before the cut; the standby, on the majority side, takes
    over. The cut-off owner must start nothing once its lease (from the last answer that
    proves a quorum stood behind it) has run out, and the standby only after that. After
    the heal the old instance steps down. Nothing lost, nothing committed twice, every
    completion in per-key order (rewinds allowed: the cut-off owner's acks were lost)."""
    args = ("--ordering", "key", "--max-in-flight", "64")
    env = {"FAULTS_DELAY": "0.01"}
    with cluster_with_node_in_namespace(tmp_path) as (ns, cl):
        n0, n1, n2 = cl.servers
        async with Scenario("cluster_node_cut_with_the_active_instance_on_it",
                            [n0.url, n1.url], tmp_path / "scenario") as sc:
            sc.lost_acks = True
            sc.note(f"namespace {ns.name}: n2 at {ns.ns_addr}, n0/n1 at {ns.host_addr}")
            if await _meta_leader_off(cl, ISOLATED):
                sc.note("n2 restarted to move the meta leader off it")
            await sc.make_group(partitions=4, members=("m1",), replicas=3)
            isolated = sc.start("m1", netns=ns.name, urls=[n2.url], args=args, env=env)
            assert await sc.wait_active("m1") is isolated
            standby = sc.start("m1", urls=[n0.url], args=args, env=env)
            await sc.wait_joined([standby])
            assert sc.nc is not None
            sync = sync_consumer("g", "m1", False)
            for name in (sync, data_consumer("m1", isolated.instance)):
                await _leader_to(sc.nc, name, n2.server_name, sc)
            sc.note("meta leader off n2; m1's consumer leaders on n2")
            pub = sc.traffic(1600, keys=16, rate=200)
            busy = zip(sc.keys_of(range(4), keys=16), (6.0, 8.0, 10.0, 12.0), strict=False)
            held = {pub.first_of_key(k, after=300): b for k, b in busy}
            pub.holds.update(held)
            pub.start()
            for n in held:
                assert (await sc.wait_started(n)).instance == isolated.instance
            probe = subprocess.Popen(
                [*ns.prefix(), sys.executable, "-c", PROBE, n2.url,
                 f"$JS.API.CONSUMER.INFO.{WQ}.{sync}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                ns.cut()
                cut_at = time.time()
                sc.note(f"link down; busy handlers {sorted(held.items())}")
                assert await sc.wait_active("m1", exclude=[isolated], timeout=40) is standby
                took_over = time.time() - cut_at
                await sc.wait_progress(100, by=standby, timeout=40)
            finally:
                probe.kill()
                out, _ = probe.communicate(timeout=10)
            ns.heal()
            healed_at = time.time()
            sc.note(f"link up {healed_at - cut_at:.2f}s after the cut; {standby.instance} "
                    f"became active {took_over:.2f}s after it")
            answers = [json.loads(line) for line in out.splitlines()]
            stale = [a for a in answers if a["t"] > cut_at and a["leader"] == n2.server_name]
            if stale:
                quorum = min(stale[-1]["active"]) / 1e9
                sc.note(f"n2 answered {len(stale)} consumer infos as the sync consumer's "
                        f"leader during the cut, the last {stale[-1]['t'] - cut_at:.2f}s "
                        f"after it, then last hearing a replica {quorum:.2f}s before")
            await sc.wait_for(lambda: isolated.count("stepped down") >= 1, 40,
                              "the reconnected instance to step down")
            sc.note(f"{isolated.instance} stepped down {time.time() - healed_at:.2f}s "
                    "after the heal")
            await sc.settle(timeout=60)
            rows = sc.rows()
            after_cut = [r for r in rows if r.instance == isolated.instance
                         and r.t_start > cut_at]
            last = max((r.t_start for r in after_cut), default=cut_at) - cut_at
            first_b = min(r.t_start for r in rows if r.instance == standby.instance) - cut_at
            sc.note(f"{isolated.instance} started {len(after_cut)} after the cut, the last "
                    f"{last:.2f}s after it; {standby.instance} started its first "
                    f"{first_b:.2f}s after it")
            verdict = sc.verdict()
            verdict.assert_ok()
            # The attack happened: n2 still answered as leader when the standby could
            # have taken over (its lease and margin after the cut).
            assert stale and stale[-1]["t"] - cut_at > SETTINGS.lease + SETTINGS.takeover_margin
            # The cut-off owner's lease ran from an answer before the cut at the latest.
            assert last <= SETTINGS.lease + 0.5, f"started {last:.2f}s after the cut"
            assert first_b > last
            assert verdict.handovers and verdict.handovers[0][2] == standby.instance
            assert isolated.count("self-check answered by a server out of touch with its "
                                  "cluster; starting nothing") >= 1
