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
from tests.faults.injectors import NetnsUnavailable, VethNamespace
from tests.faults.scenario import Scenario
from tests.support.natsserver import NatsCluster, running_cluster
from tests.support.polling import eventually

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SETTINGS = MemberSettings()
WQ = "ORDERS-g"
ISOLATED = 2  # the node in the namespace


@contextmanager
def cluster_with_node_in_namespace(tmp_path: Path) -> Iterator[tuple[VethNamespace, NatsCluster]]:
    ns = VethNamespace()
    try:
        ns.create()
    except NetnsUnavailable as exc:
        ns.close()
        pytest.fail(f"this test needs network namespaces and veth pairs (root): {exc}")
    try:
        with running_cluster(host=ns.host_addr, hosts={ISOLATED: ns.ns_addr},
                             prefixes={ISOLATED: ns.prefix()},
                             workdir=tmp_path / "nats-cluster") as cl:
            yield ns, cl
    finally:
        ns.close()


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


async def _meta_leader_off(nc: Client, cl: NatsCluster, node: int) -> None:
    async def off() -> bool:
        if await asyncio.to_thread(cl.meta_leader, 30.0) != node:
            return True
        await _api(nc, "$JS.API.META.LEADER.STEPDOWN",
                   {"placement": {"preferred": cl.servers[(node + 1) % len(cl)].server_name}})
        return False
    await eventually(off, 30, 0.5, "the meta leader off the isolated node",
                     retry=(Exception,))


PROBE = """
import asyncio, json, sys, time
import nats
async def main(url, subject, seconds):
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=-1)
    end = time.time() + seconds
    while time.time() < end:
        t = time.time()
        try:
            r = await nc.request(subject, b"", timeout=0.5)
            d = json.loads(r.data)
            c = d.get("cluster") or {}
            print(json.dumps({"t": t, "leader": c.get("leader"),
                "replicas": [(p.get("name"), p.get("current"), p.get("active"))
                             for p in c.get("replicas") or []],
                "instance": (d.get("config") or {}).get("metadata", {}).get("cgroupd.instance"),
                "error": d.get("error")}), flush=True)
        except Exception as e:
            print(json.dumps({"t": t, "exc": type(e).__name__}), flush=True)
        await asyncio.sleep(max(0.0, t + 0.25 - time.time()))
    await nc.close()
asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


async def test_cluster_node_cut_with_the_active_instance_on_it(tmp_path: Path) -> None:
    args = ("--ordering", "key", "--max-in-flight", "64")
    env = {"FAULTS_DELAY": "0.01"}
    with cluster_with_node_in_namespace(tmp_path) as (ns, cl):
        n0, n1, n2 = cl.servers
        async with Scenario("cluster_node_cut_with_the_active_instance_on_it",
                            [n0.url, n1.url], tmp_path / "scenario") as sc:
            sc.lost_acks = True
            sc.note(f"namespace {ns.name}: n2 at {ns.ns_addr}, n0/n1 at {ns.host_addr}")
            await sc.make_group(partitions=4, members=("m1",), replicas=3)
            isolated = sc.start("m1", netns=ns.name, urls=[n2.url], args=args, env=env)
            assert await sc.wait_active("m1") is isolated
            standby = sc.start("m1", urls=[n0.url], args=args, env=env)
            await sc.wait_joined([standby])
            assert sc.nc is not None
            nc = sc.nc
            await _meta_leader_off(nc, cl, ISOLATED)
            for name in (sync_consumer("g", "m1", False),
                         data_consumer("m1", isolated.instance)):
                await _leader_to(nc, name, "n2", sc)
            sc.note("meta leader off n2; m1's consumer leaders on n2")
            pub = sc.traffic(1600, keys=16, rate=200)
            busy = {k: b for k, b in zip(sc.keys_of(range(4), keys=16)[:4],
                                         (6.0, 8.0, 10.0, 12.0), strict=False)}
            held = {pub.first_of_key(k, after=300): b for k, b in busy.items()}
            pub.holds.update(held)
            pub.start()
            for n in held:
                row = await sc.wait_started(n)
                assert row.instance == isolated.instance
            probe = subprocess.Popen(
                [*ns.prefix(), sys.executable, "-c", PROBE, n2.url,
                 f"$JS.API.CONSUMER.INFO.{WQ}.m1", "16"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                await asyncio.sleep(1.0)
                ns.cut()
                cut_at = time.time()
                sc.note(f"link down; holds {sorted(held.items())}")
                assert await sc.wait_active("m1", exclude=[isolated], timeout=40) is standby
                took_over = time.time() - cut_at
                await sc.wait_progress(100, by=standby, timeout=40)
                out, _ = await asyncio.to_thread(probe.communicate, timeout=30)
            finally:
                if probe.poll() is None:
                    probe.kill()
                    probe.wait()
            for line in out.splitlines():
                try:
                    d = json.loads(line)
                except ValueError:
                    sc.note(f"probe: {line}")
                    continue
                d["t"] = round(d["t"] - cut_at, 2)
                sc.note(f"probe: {d}")
            ns.heal()
            sc.note(f"link up; {standby.instance} active {took_over:.2f}s after the cut")
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
            assert first_b > last
