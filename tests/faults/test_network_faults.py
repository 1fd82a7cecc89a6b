"""A member process cut off the network, then reconnected.

The active instance of m1 runs inside a network namespace created for this test, joined
to the host by a veth pair addressed from a private /30 that exists only for this test;
nats-server listens on the host end, and every other client (m1's standby, m2, the test's
publisher) connects to that address too. Taking the host end down cuts m1's active
instance off without it noticing (no RST: packets just go nowhere); bringing it up heals.

The cut-off instance is alive but silent: nobody can tell it from a stalled one. It keeps
starting the handlers it holds only while its lease runs (``MemberSettings.lease`` from its
last confirmed ownership check), then starts nothing; its standby takes over after hearing
nothing for the lease and the margin, and takes its data consumer a lease later (see
:mod:`cgroupd.nats.lease`). What it ran meanwhile is redone by its successor: its acks were
lost with the link, like a crashed process's.

If namespaces or veth pairs cannot be created, the test fails: it never skips.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cgroupd.core.settings import MemberSettings
from tests.faults.injectors import VethNamespace, namespace_for_test
from tests.faults.scenario import Scenario
from tests.support.natsserver import NatsServer, running_server

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SETTINGS = MemberSettings()


@contextmanager
def namespace_and_server(tmp_path: Path) -> Iterator[tuple[VethNamespace, NatsServer]]:
    with namespace_for_test() as ns, running_server(backend="process", host=ns.host_addr,
                                                    workdir=tmp_path / "nats") as srv:
        assert isinstance(srv, NatsServer)
        yield ns, srv


async def test_member_network_partition_then_heal(tmp_path: Path) -> None:
    """Cut m1's active instance off while it is inside a handler: the standby takes over,
    the isolated instance's acks are never confirmed so it commits nothing; after the link
    comes back it notices and steps down. Nothing lost, committed twice or out of order."""
    with namespace_and_server(tmp_path) as (ns, srv):
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
            # After the link is down: a message finished while `ip link set down` ran (a
            # subprocess, slow under a CPU hog) could still be committed (hog CI on ef1f3bd).
            cut_at = time.time()
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
            # Its double_ack cannot succeed: "not applied" (aborted) or, when no reply
            # came and the message has left the stream, "outcome unknown" (in doubt).
            assert verdict.aborted + verdict.in_doubt >= 1, \
                "the isolated instance's double_ack must fail"
            # Partitions run at once (the default ordering): its other partition may
            # commit what it finished before the cut, never anything after it, nor
            # anything of the held message's partition behind it.
            mine = [r for r in sc.rows() if r.instance == isolated.instance
                    and r.status == "committed"]
            assert not any(r.t_done is not None and r.t_done >= cut_at for r in mine)
            assert not any(r.partition == row.partition and r.t_start > row.t_start
                           for r in mine)


async def test_isolated_owner_with_64_in_flight_stops_starting_once_its_lease_ran_out(
        tmp_path: Path) -> None:
    """Key ordering, 64 messages in flight, the at-least-once recorder (every start is
    recorded): cut m1's active instance off while one of its handlers is busy for 5 s,
    longer than the lease, with later messages of that key waiting behind it. The
    isolated instance may start what it holds only while its lease runs: when the busy
    handler ends it starts nothing more, and the standby starts only after that. The
    standby takes over and redoes what the isolated instance's lost acks covered; after the
    heal the old instance steps down and starts nothing more."""
    args = ("--ordering", "key", "--max-in-flight", "64")
    env = {"FAULTS_DELAY": "0.02"}
    busy = 5.0
    assert busy > SETTINGS.lease + 1
    with namespace_and_server(tmp_path) as (ns, srv):
        async with Scenario("isolated_owner_key_mode_64_in_flight", [srv.url],
                            tmp_path / "scenario", variant="at_least_once") as sc:
            sc.lost_acks = True
            await sc.make_group(partitions=4, members=("m1",))
            isolated = sc.start("m1", netns=ns.name, args=args, env=env)
            assert await sc.wait_active("m1") is isolated
            standby = sc.start("m1", args=args, env=env)
            await sc.wait_joined([standby])
            pub = sc.traffic(1200, keys=16, rate=200)
            held = pub.first_of_key("k3", after=300)
            pub.holds[held] = busy
            pub.start()
            row = await sc.wait_started(held)
            assert row.instance == isolated.instance
            ns.cut()
            cut_at = time.time()
            sc.note(f"link down: {isolated.instance} cut off while #{held} is busy for "
                    f"{busy:g}s")
            assert await sc.wait_active("m1", exclude=[isolated], timeout=40) is standby
            took_over = time.time() - cut_at
            await sc.wait_progress(100, by=standby)
            ns.heal()
            sc.note(f"link up; {standby.instance} took over {took_over:.2f}s after the cut")
            await sc.wait_for(lambda: isolated.count("stepped down") >= 1, 40,
                              "the reconnected instance to step down")
            await sc.settle()
            rows = sc.rows()
            after_cut = [r for r in rows if r.instance == isolated.instance
                         and r.t_start > cut_at]
            last = max((r.t_start for r in after_cut), default=cut_at) - cut_at
            first_b = min(r.t_start for r in rows if r.instance == standby.instance) - cut_at
            busy_end = next(r.t_end for r in rows if r.n == held
                            and r.instance == isolated.instance)
            sc.note(f"{isolated.instance} started {len(after_cut)} after the cut, the last "
                    f"{last:.2f}s after it; its busy handler ended "
                    f"{(busy_end or 0) - cut_at:.2f}s after it; {standby.instance} started "
                    f"its first {first_b:.2f}s after the cut")
            verdict = sc.verdict()
            verdict.assert_ok()
            # Its lease ran from its last confirmed check, sent before the cut: nothing
            # of its key started when the busy handler ended, nor anything else.
            assert last <= SETTINGS.lease + 0.5, f"started {last:.2f}s after the cut"
            assert busy_end is not None and busy_end - cut_at > SETTINGS.lease + 0.5
            assert first_b > last
            assert verdict.handovers and verdict.handovers[0][2] == standby.instance
