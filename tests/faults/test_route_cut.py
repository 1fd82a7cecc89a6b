"""A route cut between two servers makes a live owner look dead (issue 29, part 1).

A 3-node JetStream cluster, every node in its own network namespace on one host bridge
(:class:`tests.faults.injectors.BridgedNamespaces`): A (``n0``), B (``n1``), C (``n2``).
Only the A-B route is cut (blackhole routes inside A and B), A-C and B-C stay up, so
JetStream keeps a quorum everywhere and every stream and consumer keeps working. The
group is R3; m1's active instance runs inside A's namespace and knows only A, its standby
inside B's and knows only B (sync exclusivity, ``--ordering key --max-in-flight 64``,
the exactly-once recorder: a completion is a run whose double-ack the server confirmed).
Keyed traffic at 200 msg/s comes from the host through C; both streams lead on C (so
does the meta leader: the standby can create consumers through it).

During the cut B no longer hears A's subscriptions, so the standby's presence probe gets
"no responders" for an owner that is alive and renewing its lease through A. Variants:

- ``fast_pings_leaders_on_c``: servers with ``ping_interval: 1s``, ``ping_max: 2`` (the
  dead route is dropped within seconds), m1's consumer leaders on C: the owner keeps
  reaching them, so it must keep the member (0 owner changes).
- ``default_pings_leaders_on_c``: the same with server default pings (the route stays
  "up", silent): 0 owner changes.
- ``fast_pings_leaders_on_b``: m1's consumer leaders on B: the owner can no longer reach
  them and a takeover is unavoidable: at most one owner change, no return to A. What the
  cut does to the new owner's consumers must not cost it the member: a consumer it creates
  during the cut can get its first leader on A's side, out of B's reach (its create goes
  unanswered: the data consumer is made again under another name; the claim's leader is
  asked to step down by A's standby, a client of that server), and the node cut off forces
  leader elections that can lose a delivery (the data consumer is replaced in place, and
  nothing it delivers after the gap is handed on: the deliveries that followed the first
  one after it once ran before the lost message of their key, a per-key reorder of 2).
  The new owner's claim can also get its first leader on A's server while A's instance is
  still active: A notices its loss when the claim is older than a lease, and asks its
  server's leader to hand the claim on rather than take it back (it did take it back, in
  4 of 23 runs, before that). Not covered: the claim's leadership coming back to A's
  server by an election after that one nudge (seen only with the claim moved to A on
  purpose: docs/performance.md, issue 29, cause 5).

Every variant asserts: nothing lost, no completed message started again anywhere, every
completion in per-key order, the owner changes above, and notes the longest gap in
completions. The numbers go into the verdict's table (``-m faults`` prints them).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import CgroupdError
from cgroupd.core.naming import INSTANCE_KEY, sync_consumer
from cgroupd.core.settings import MemberSettings
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.nats import jsapi
from tests.faults.checks import FaultVerdict, Row, committed
from tests.faults.injectors import BridgedNamespaces, js_api, move_leader
from tests.faults.runner import JoinProc
from tests.faults.scenario import Scenario
from tests.support.natsserver import NatsCluster, client_options, running_cluster
from tests.support.polling import eventually

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SETTINGS = MemberSettings()
A, B, C = 0, 1, 2
STREAM, WQ = "ORDERS", "ORDERS-g"
RATE = 200.0
KEYS = 16
#: Seconds of traffic before the cut, of the cut, and after the heal.
BEFORE, CUT, AFTER = 7.0, 15.0, 4.0
FAST_PINGS = 'ping_interval: "1s"\nping_max: 2'
#: The system account needs a user to move the meta leader ($JS.API.META.LEADER.STEPDOWN);
#: with accounts defined, clients without credentials land in APP (JetStream enabled).
ACCOUNTS = """accounts {
  SYS { users: [{user: meta, password: meta}] }
  APP { jetstream: enabled, users: [{user: app, password: app}] }
}
system_account: SYS
no_auth_user: app"""
ARGS = ("--ordering", "key", "--max-in-flight", "64")
TAKEOVER = "taking over from the active instance"
DECLINED = "not taking over"


@dataclass(frozen=True)
class Variant:
    name: str
    #: Extra server configuration (the route pings).
    config: str
    #: The node m1's synchronization and data consumers lead on.
    leaders_on: int
    #: Whether the owner loses its consumer leaders in the cut (a takeover is unavoidable).
    takeover: bool


VARIANTS = [
    Variant("fast_pings_leaders_on_c", FAST_PINGS, C, False),
    Variant("default_pings_leaders_on_c", "", C, False),
    Variant("fast_pings_leaders_on_b", FAST_PINGS, B, True),
]


@contextmanager
def three_namespaced_nodes(tmp_path: Path, config: str
                           ) -> Iterator[tuple[BridgedNamespaces, NatsCluster]]:
    with BridgedNamespaces(3) as net, running_cluster(
            hosts=dict(enumerate(net.addrs)), prefixes={i: net.prefix(i) for i in range(3)},
            extra_config=f"{ACCOUNTS}\n{config}", workdir=tmp_path / "nats-cluster") as cl:
        yield net, cl


async def _meta_leader_to(cl: NatsCluster, node: int, sc: Scenario) -> None:
    """Move the JetStream meta leader to ``node`` (as the system account's user)."""
    name = cl.servers[node].server_name
    nc = await nats.connect(cl.servers[node].url, user="meta", password="meta",
                            **client_options(name="faults-meta"))
    try:
        async def there() -> bool:
            if await asyncio.to_thread(cl.meta_leader, 10.0) == node:
                return True
            await js_api(nc, "$JS.API.META.LEADER.STEPDOWN", {"placement": {"preferred": name}})
            return False
        await eventually(there, 30, 0.2, f"the meta leader on {name}", retry=(Exception,),
                         diagnostics=sc.diagnostics)
    finally:
        await nc.close()


def _routes_between(cl: NatsCluster, i: int, j: int) -> int:
    """How many route connections node ``i`` lists to node ``j``."""
    routes = cl.servers[i].monitor("/routez").get("routes") or []
    name = cl.servers[j].server_name
    return sum(r.get("remote_name") == name for r in routes)


async def _consumer_leaders(sc: Scenario) -> list[tuple[str, str, str]] | str:
    """(consumer, instance, leader) of every consumer on the work-queue stream: whether
    an owner's consumers lead where it can reach them. A note only: a list the meta leader
    could not complete in time (a consumer leader changing at that moment) says so rather
    than failing the scenario (seen once at the heal)."""
    assert sc.nc is not None
    out = []
    try:
        infos = await jsapi.list_consumers(sc.nc, WQ)
    except CgroupdError as exc:
        return f"unread ({exc})"
    for info in infos:
        view = ConsumerInfo(info)
        out.append((view.name, str(view.meta(INSTANCE_KEY)),
                    str((info.get("cluster") or {}).get("leader"))))
    return sorted(out)


def _stamp(text: str | None) -> float:
    """An RFC 3339 server time (nanoseconds allowed) as epoch seconds; nan if absent."""
    if not text:
        return float("nan")
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


async def _watch_owner(nc: Client, names: list[str], into: list[tuple[float, str, int, float]]
                       ) -> None:
    """Ask the leaders of the owner's consumers every 0.1 s (from the host, through C)
    what they see of it: (time, consumer, pull requests waiting, last ack applied)."""
    while True:
        t = time.time()
        for name in names:
            try:
                info = await js_api(nc, f"$JS.API.CONSUMER.INFO.{WQ}.{name}")
            except Exception:  # noqa: BLE001 - unanswered: recorded as such
                info = {}
            into.append((t, name, int(info.get("num_waiting", -1)),
                         _stamp((info.get("ack_floor") or {}).get("last_active"))))
        await asyncio.sleep(max(0.0, t + 0.1 - time.time()))  # the poll's pace


def _owner_seen(seen: list[tuple[float, str, int, float]], cut_at: float) -> str:
    """What the leaders showed of the owner during the cut."""
    during = [s for s in seen if s[0] > cut_at]
    out = []
    for name in sorted({s[1] for s in during}):
        mine = [s for s in during if s[1] == name]
        waiting = [s for s in mine if s[2] > 0]
        acks = [s[3] - cut_at for s in mine if s[3] == s[3]]
        none = [round(s[0] - cut_at, 2) for s in mine if s[2] == 0]
        out.append(f"{name}: {len(waiting)}/{len(mine)} answers with its pull waiting "
                   f"(last {max((s[0] - cut_at for s in waiting), default=math.nan):.2f}s "
                   f"after the cut, none at {none[:8]}), "
                   f"{sum(s[2] < 0 for s in mine)} unanswered or missing, "
                   f"last ack applied {max(acks, default=math.nan):.2f}s after the cut")
    return "; ".join(out)


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


@dataclass
class RouteCut:
    """What one cut showed; times in seconds after the cut."""

    verdict: FaultVerdict
    #: Messages started again after a run of theirs had completed (committed).
    reruns: dict[int, list[str]]
    #: Per key, completions out of publish order.
    reorders: list[str]
    #: (seconds after the cut, new owner) per owner change after the first activation.
    changes: list[tuple[float, str]]
    #: Every takeover decision (the owner's claim deleted): (seconds after the cut,
    #: instance deciding, why, silent for).
    takeovers: list[tuple[float, str, str, float]]
    #: Whether the owner came back to the cut-off instance after losing it.
    returned: bool


def _reruns(rows: list[Row]) -> dict[int, list[str]]:
    """Per message, the runs that started after a run of it had committed (its ack
    confirmed by the server): work that was done and is done again."""
    done = {s.row.n: s.row for s in committed(rows)[0]}
    out: dict[int, list[str]] = defaultdict(list)
    for r in rows:
        first = done.get(r.n)
        if first is not None and r is not first and r.t_start > first.t_start:
            out[r.n].append(f"{r.instance} seq {r.seq} delivery {r.deliveries} {r.status} "
                            f"after {first.instance}'s commit")
    return dict(out)


def _reorders(rows: list[Row]) -> list[str]:
    """Every committed run per key in commit order: its index must grow each time."""
    by_key: dict[str, list[Row]] = defaultdict(list)
    for s in committed(rows)[0]:
        by_key[s.row.subject].append(s.row)
    out = []
    for key, runs in sorted(by_key.items()):
        runs.sort(key=lambda r: r.t_done or r.t_end or 0.0)
        last = -1
        for r in runs:
            if r.i <= last:
                out.append(f"{key}: #{r.n} (i {r.i}) committed by {r.instance} after i {last}")
            last = max(last, r.i)
    return out


def _judge(sc: Scenario, procs: list[JoinProc], owner: JoinProc, cut_at: float) -> RouteCut:
    rows = sc.rows()
    active = sorted((_at(e), p.instance) for p in procs for e in p.events()
                    if e.get("event") == "became active" and _at(e) < sc.settled_at)
    changes, holder = [], None
    for t, who in active:
        if holder is not None and who != holder:
            changes.append((round(t - cut_at, 2), who))
        holder = who
    takeovers = sorted((round(_at(e) - cut_at, 2), p.instance, str(e.get("why")),
                        float(e.get("silent_for") or 0.0))
                       for p in procs for e in p.events()
                       if e.get("event") == TAKEOVER and _at(e) < sc.settled_at)
    # The cut-off owner back: it took the member from its successor (a takeover decision
    # of its own: the claim is deleted even if it never became active again), or became
    # active again after a first takeover from it.
    first = min((cut_at + t for t, who, *_ in takeovers if who != owner.instance),
                default=None)
    returned = any(who == owner.instance for _, who, *_ in takeovers) or (
        first is not None and any(who == owner.instance and t > first
                                  for t, who in active))
    reruns, reorders = _reruns(rows), _reorders(rows)
    for p in procs:
        events = [e for e in p.events() if cut_at < _at(e) < sc.settled_at]
        declined = sum(str(e.get("event", "")).startswith(DECLINED) for e in events)
        unanswered = sum("no answer to $JS.API.CONSUMER.CREATE" in str(e.get("error"))
                         for e in events)
        sc.note(f"{p.instance} ({'owner' if p is owner else 'standby'}) after the cut: "
                f"{declined} takeovers declined (the leader holds the pull), "
                f"{unanswered} consumer creates unanswered (the new consumer's leader "
                f"across the cut)")
    sc.note(f"owner changes {len(changes)} (seconds after the cut, new owner): {changes}; "
            f"takeover decisions (t, by, why, silent for): {takeovers}"
            + ("; the member came back to the cut-off instance" if returned else ""))
    sc.note(f"completed messages run again: {len(reruns)} "
            f"{[(n, v) for n, v in sorted(reruns.items())[:5]]}; per-key reorders of "
            f"completions: {len(reorders)} {reorders[:5]}")
    verdict = sc.verdict()  # the longest gap in completions is its max stall
    return RouteCut(verdict, reruns, reorders, changes, takeovers, returned)


@pytest.mark.parametrize("variant", VARIANTS, ids=[
    "fast_pings_leaders_on_c", "default_pings_leaders_on_c", "fast_pings_leaders_on_b"])
async def test_route_cut_between_the_owner_and_standby_servers(
        tmp_path: Path, variant: Variant) -> None:
    """Cut only the A-B route for 15 s under 200 msg/s keyed traffic while m1's owner
    is on A and its standby on B (see the module doc). Nothing lost, no completed message
    run again, every completion in per-key order; with the consumer leaders on C the live
    owner keeps the member (0 owner changes), with them on B at most one owner change and
    no ping-pong back to A."""
    env = {"FAULTS_DELAY": "0.01"}
    with three_namespaced_nodes(tmp_path, variant.config) as (net, cl):
        na, nb, nc_ = cl.servers
        async with Scenario(f"route_cut_{variant.name}", [nc_.url],
                            tmp_path / "scenario") as sc:
            # Acks the cut-off owner sends to leaders it cannot reach are lost.
            sc.lost_acks = variant.takeover
            sc.note(f"A {na.url}, B {nb.url}, C {nc_.url}")
            await _meta_leader_to(cl, C, sc)
            await sc.make_group(partitions=4, members=("m1",), replicas=3)
            assert sc.nc is not None
            for stream in (STREAM, WQ):
                await move_leader(sc.nc, f"STREAM.{stream}", nc_.server_name, sc.diagnostics)
            owner = sc.start("m1", netns=net.names[A], urls=[na.url], args=ARGS, env=env)
            assert await sc.wait_active("m1") is owner
            standby = sc.start("m1", netns=net.names[B], urls=[nb.url], args=ARGS, env=env)
            await sc.wait_joined([standby])
            sync = sync_consumer("g", "m1", False)
            data = [info["name"] for info in await jsapi.list_consumers(sc.nc, WQ)
                    if ConsumerInfo(info).meta(INSTANCE_KEY) == owner.instance
                    and info["name"] != sync]
            assert data, "the owner's data consumer"
            leader = cl.servers[variant.leaders_on].server_name
            for name in (sync, *data):
                await move_leader(sc.nc, f"CONSUMER.{WQ}.{name}", leader, sc.diagnostics)
            sc.note(f"streams and meta leader on C; m1's consumers {[sync, *data]} lead "
                    f"on {leader}")
            pub = sc.traffic(int(RATE * (BEFORE + CUT + AFTER)), keys=KEYS, rate=RATE)
            pub.start()
            await sc.wait_for(lambda: pub.published >= RATE * BEFORE, BEFORE + 30,
                              "traffic before the cut")
            routes = await asyncio.to_thread(_routes_between, cl, B, A)
            seen: list[tuple[float, str, int, float]] = []
            watch = asyncio.create_task(_watch_owner(sc.nc, [sync, *data], seen))
            try:
                net.cut(A, B)
                cut_at, cut_n = time.time(), pub.published
                await asyncio.sleep(CUT)  # the fault's duration, not a synchronisation
            finally:
                # Cancelled until it ends: nats-py's request can turn a cancellation that
                # arrives as its timeout fires into a TimeoutError, which the poll catches
                # (CI on 60bcecc: one cancel was swallowed and the test hung 300 s).
                await cancel_and_wait(watch)
            left = await asyncio.to_thread(_routes_between, cl, B, A)
            leaders = await _consumer_leaders(sc)
            net.heal(A, B)
            sc.note(f"A-B cut after {cut_n} published, for {CUT:g}s; "
                    f"B listed {routes} routes to A before, {left} at the heal; consumer "
                    f"leaders at the heal (consumer, instance, leader): {leaders}")
            sc.note(f"the owner's consumers' leaders during the cut: {_owner_seen(seen, cut_at)}")
            await sc.settle(timeout=60)
            cut = _judge(sc, [owner, standby], owner, cut_at)
            # The attack happened: the fast pings dropped the dead route, the defaults
            # kept it listed (silent).
            assert routes > 0
            assert (left == 0) if variant.config else (left > 0), left
            table = cut.verdict.table()
            if variant.takeover:
                # The rule where a takeover is unavoidable: one owner change.
                assert len(cut.changes) <= 1 and not cut.returned, table
            else:
                assert not cut.takeovers and not cut.changes, \
                    f"a live owner was replaced:\n{table}"
                # The owner kept its leaders and its member: no pause past a lease, and
                # no message handled twice (not even a run rolled back and redone).
                assert cut.verdict.stall <= SETTINGS.lease, table
                assert cut.verdict.duplicates == 0, table
            assert not cut.reruns, f"completed messages run again:\n{table}"
            assert not cut.reorders, f"completions out of key order:\n{table}"
            cut.verdict.assert_ok()
