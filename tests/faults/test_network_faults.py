"""A member process cut off the network, then reconnected.

The active instance of m1 runs inside a network namespace created for this test, joined
to the host by a veth pair addressed from a private /30 that exists only for this test;
nats-server listens on the host end, and every other client (m1's standby, m2, the test's
publisher) connects to that address too. Taking the host end down cuts m1's active
instance off without it noticing (no RST: packets just go nowhere); bringing it up heals.

Overlaps are judged on committed work (see :mod:`tests.faults.checks`): the cut-off
instance keeps running the handler it was in and retries it, concurrently with its
successor by definition, but its ``double_ack`` cannot be confirmed, so none of it
commits.

If namespaces or veth pairs cannot be created, the test fails: it never skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.injectors import NetnsUnavailable, VethNamespace
from tests.faults.scenario import Scenario
from tests.natsserver import running_server

pytestmark = [pytest.mark.faults, pytest.mark.slow]


async def test_member_network_partition_then_heal(tmp_path: Path) -> None:
    """Cut m1's active instance off while it is inside a handler: the standby takes over
    (the server drops the isolated instance's consumers), the isolated instance's acks
    are never confirmed so it commits nothing; after the link comes back it notices and
    steps down. Nothing lost, committed twice or out of order."""
    ns = VethNamespace()
    try:
        ns.create()
    except NetnsUnavailable as exc:
        ns.close()
        pytest.fail(f"this test needs network namespaces and veth pairs (root): {exc}")
    try:
        with running_server(backend="process", host=ns.host_addr,
                            workdir=tmp_path / "nats") as srv:
            async with Scenario("member_network_partition_then_heal", [srv.url],
                                tmp_path / "scenario") as sc:
                sc.note(f"namespace {ns.name}: {ns.ns_addr} <-> nats-server "
                        f"{ns.host_addr}:{srv.port} ({ns.subnet})")
                await sc.make_group(partitions=4, members=("m1", "m2"))
                isolated = sc.start("m1", netns=ns.name)
                sc.start("m2")
                assert await sc.wait_active("m1") is isolated
                standby = sc.start("m1")
                await sc.wait_joined([standby])
                await sc.wait_active("m2")
                pub = sc.traffic(1400, rate=200)
                held = pub.first_of_key(sc.keys_of([0, 1])[0], after=300)
                pub.holds[held] = 1.0
                pub.start()
                row = await sc.wait_started(held)
                assert row.instance == isolated.instance
                ns.cut()
                sc.note(f"link down: {isolated.instance} cut off while it held #{held}")
                assert not ns.reachable(srv.port)
                assert await sc.wait_active("m1", exclude=[isolated]) is standby
                await sc.wait_progress(50, by=standby)
                ns.heal()
                sc.note(f"link up after {standby.instance} committed 50")
                await sc.wait_for(lambda: isolated.count("stepped down") >= 1, 40,
                                  "the reconnected instance to step down")
                sc.note(f"{isolated.instance} stepped down")
                verdict = await sc.finish()
                verdict.assert_ok()
                assert verdict.aborted >= 1, "the isolated instance's double_ack must fail"
                assert not any(r.instance == isolated.instance and r.status == "committed"
                               and r.t_start > row.t_start for r in sc.rows())
    finally:
        ns.close()
