"""Fleet beside the reference: :mod:`bench.fleet`'s shape for cgroupd and natsio-pcgroups.

One run measures both sides one after the other, each on a fresh nats-server of its own
(cgroupd first, then the reference), and gives the reference's numbers as ratios to
cgroupd's (``x_cgroupd``: reference / cgroupd, above 1 means the reference takes longer
or costs more). The shape, the server, the mass start, the idle window, the traffic and
every measure are :mod:`bench.fleet`'s (its docstring defines each field); on the
reference's side

- each worker is a :mod:`tests.support.peer_driver` process in host mode (the peer's own
  Python, >= 3.12: :func:`tests.support.peer.peer_python`), ``--processes`` of them, with
  one NATS connection per instance (the server sees ``members x copies`` clients, as on
  cgroupd's side) and one ``elastic_consume`` session per instance;
- the group is the reference's elastic group (``max_members`` = partitions, one per
  member, partitioned on the subject's second token, as cgroupd's side), created and
  changed (``--add``) by the reference itself; each member's consumer has max ack pending
  ``--peer-max-ack-pending`` (1, as in the throughput and scale benchmarks) and the
  default ack wait (5 s);
- "active" is what the reference can tell: the instance holds its member's consumer and
  pulls (every instance of a member pulls; the server delivers to the pinned one), so
  ``all_active_s`` is the time until every member has a consuming instance, and
  ``first_round_served_s`` (8 messages per member, all processed) is the measure both
  sides share end to end;
- a reference instance whose start failed (``elastic_consume`` raised: the reference does
  not retry) or whose session ended by itself counts in ``died`` and its connection is
  closed, as its process would exit; with ``--peer-restart SECONDS`` it is started again
  after that long, doubling up to 5 minutes, as Kubernetes restarts a crashed pod
  (``restarts``: how many times);
- ``--kill``: the reference fails over when the pinned TTL (its ack wait, 5 s) runs out;
  ``--restart``: natsio reconnects as configured by default. Both run as on cgroupd's side.

Run: ``python -m bench.fleet_peer --members 50 --copies 2 --processes 2 --idle 20
[--add 5] [--no-cgroupd | --no-peer]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import traceback
from pathlib import Path
from typing import Any

from bench import fleet
from bench.common import emit, load_average, machine, server
from bench.fleet import GROUP, STREAM, Fleet, Plan, add_plan_arguments, drive, plan_of
from cgroupd.nats.connect import ConnectionOptions, connect
from tests.support.peer import DRIVER, PEER_PACKAGE, PEER_VERSION, PeerProcess, peer_python, why

#: The reference's members, as in the throughput and scale benchmarks.
PEER_MAX_ACK_PENDING = 1

#: The measures compared (reference / cgroupd).
COMPARED = ("all_active_s", "all_settled_s", "first_round_served_s", "idle_server_cpu_pct",
            "idle_api_per_s", "idle_cpu_per_instance_pct", "reowned_s_p50", "reowned_s_max",
            "moved_latency_s_p50", "moved_latency_s_max", "failover_s_p50", "failover_s_max",
            "after_restart_served_s", "traffic_server_cpu_pct")


async def _origin(url: str) -> None:
    nc = await connect(ConnectionOptions(servers=(url,)))
    try:
        await nc.jetstream().add_stream(name=STREAM, subjects=[f"{STREAM.lower()}.>"])
    finally:
        await nc.close()


async def peer_side(plan: Plan, processes: int, python: str, workdir: Path,
                    max_ack_pending: int = PEER_MAX_ACK_PENDING, restart_after: float = 0.0
                    ) -> dict[str, Any]:
    """The reference at the plan's shape, on a server of its own; with ``restart_after``,
    an instance that failed to start or whose session ended is started again (as a
    supervisor restarts a crashed process)."""
    with server() as srv:
        await _origin(srv.url)
        async with PeerProcess(python, srv.url, workdir / "admin.log") as admin_peer:
            await admin_peer.call("create_elastic", stream=STREAM, group=GROUP,
                                  max_members=plan.partitions,
                                  filters=[[f"{STREAM.lower()}.*", [1]]])
            await admin_peer.call("add_members", stream=STREAM, group=GROUP,
                                  members=plan.names())

            async def add_members(members: list[str]) -> Any:
                return await admin_peer.call("add_members", stream=STREAM, group=GROUP,
                                             members=members)

            peers = Fleet(srv.url, workdir, command=[python, str(DRIVER), "host"],
                          extra=[STREAM, GROUP, str(max_ack_pending), str(restart_after)],
                          add_members=add_members)
            try:
                result = await drive(srv, peers, plan, processes)
                # Each a crash: a start that failed or a session that ended.
                result["restarts"] = sum(s.get("restarts", 0) for s in peers.states().values())
            finally:
                peers.stop()
    restarted = (f", an instance that failed restarted after {restart_after:g} s doubling"
                 if restart_after > 0 else ", an instance that failed stays dead")
    return {"what": f"{PEER_PACKAGE} {PEER_VERSION}, {processes} tests/support/"
                    "peer_driver.py host processes, one connection and one elastic_consume "
                    f"per instance, max ack pending {max_ack_pending}, ack wait 5 s"
                    + restarted, **result}


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """Reference / cgroupd for each measure both have (None where one is missing or 0)."""
    out: dict[str, float | None] = {}
    for key in COMPARED:
        a, b = ours.get(key), theirs.get(key)
        if a is None and b is None:
            continue
        out[key] = round(b / a, 2) if isinstance(a, int | float) and isinstance(
            b, int | float) and a > 0 else None
    return out


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    plan = plan_of(args)
    if plan.kill and (plan.copies < 2 or plan.kill > plan.members):
        raise SystemExit("--kill needs --copies >= 2 and at most --members victims")
    result: dict[str, Any] = {"bench": "fleet_peer", "machine": machine(),
                              "plan": {**plan.__dict__, "processes": args.processes}}
    if not args.no_cgroupd:
        before = load_average()
        try:
            result["cgroupd"] = await fleet.run(args)
            result["cgroupd"].pop("machine", None)
        except Exception as exc:  # noqa: BLE001 - the reference's side still runs
            result["cgroupd"] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc().splitlines()[-12:]}
        result["cgroupd"]["load_average_before_after"] = [before, load_average()]
    if not args.no_peer:
        try:
            python = peer_python()
            reason = "" if python else why()
        except RuntimeError as exc:
            python, reason = None, str(exc)
        if python is None:
            result["peer"] = {"skipped": reason}
        else:
            before = load_average()
            (workdir / "peer").mkdir(exist_ok=True)
            try:
                result["peer"] = await peer_side(plan, args.processes, python,
                                                 workdir / "peer", args.peer_max_ack_pending,
                                                 args.peer_restart)
            except Exception as exc:  # noqa: BLE001 - cgroupd's side is still worth printing
                result["peer"] = {"error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc().splitlines()[-12:]}
            result["peer"]["load_average_before_after"] = [before, load_average()]
    if "all_active_s" in result.get("peer", {}) and "all_active_s" in result.get("cgroupd", {}):
        result["x_cgroupd"] = ratios(result["cgroupd"], result["peer"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_plan_arguments(p, processes_help="worker processes per side")
    p.add_argument("--peer-max-ack-pending", type=int, default=PEER_MAX_ACK_PENDING)
    p.add_argument("--peer-restart", type=float, default=0.0, metavar="SECONDS",
                   help="restart a reference instance whose start failed or whose session "
                        "ended after SECONDS, doubling (as Kubernetes restarts a crashed "
                        "pod: 10); 0: it stays dead, counted in died")
    p.add_argument("--no-cgroupd", action="store_true", help="the reference's side only")
    p.add_argument("--no-peer", action="store_true", help="cgroupd's side only")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the reference's worker logs and records here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-peer-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        emit(asyncio.run(run(args, workdir)))


if __name__ == "__main__":
    main()
