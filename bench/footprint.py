"""Footprint of an idle member: RSS of the active instance and of a standby, and the CPU
each of them and the server burn while nothing is published (pulling, heartbeats,
self-checks, a standby's attempts to take over).

``--extra ARGS`` passes options to both instances (to measure a proposed default, e.g.
``--extra '--retry-interval 2'``), ``--settings`` member settings the command line lacks
(:mod:`bench.variant`, e.g. ``pull_expires=5,heartbeat=1``); ``--profile-standby``
samples the standby with py-spy over the idle window (``waiting_in_select_share`` is how
much of its sampled time it slept in the event loop) to say what wakes it up.

What the server's idle work is (``server_traffic``): over the same window, each client
connection's messages in and out per second (``/connz``, matched to the processes by
their sockets' ports), and what ``/varz`` counts beyond them (the server's own internal
clients: JetStream API replies, heartbeats, advisories); then, over a second window of
``--sniff`` seconds, a subscriber on ``>`` counts every message the account routes, by
kind (pull requests per consumer kind, heartbeats and pull timeouts by their status, API
requests by verb, acks, presence probes and answers).
Run: ``python -m bench.footprint [--seconds 10] [--extra ARGS] [--profile-standby]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg

from bench.common import (
    Members,
    connected,
    cpu_seconds,
    emit,
    keyed_group,
    machine,
    origin_stream,
    rss_mb,
    server,
    wait_for,
)
from bench.profile import analyse_py_spy, start_py_spy
from tests.support.natsserver import NatsServer, client_options
from tests.support.polling import within


def wakeups(pid: int) -> int:
    """Voluntary context switches of all of ``pid``'s threads so far: each is a sleep
    (an event loop's ``select``, a goroutine parking) that something woke up again, which
    is what an idle process's CPU is spent on."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of ``pid``'s sockets (its connections to the server)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def connz(srv: NatsServer) -> dict[int, dict[str, int]]:
    """Messages in and out so far of every client connection, by its client port."""
    out: dict[int, dict[str, int]] = {}
    offset = 0
    while True:
        page = srv.monitor(f"/connz?limit=1024&offset={offset}")
        for c in page.get("connections") or []:
            out[int(c["port"])] = {"in_msgs": int(c["in_msgs"]), "out_msgs": int(c["out_msgs"])}
        offset += len(page.get("connections") or [])
        if offset >= int(page.get("total", 0)) or not page.get("connections"):
            return out


def varz(srv: NatsServer) -> dict[str, int]:
    v = srv.monitor("/varz")
    return {"in_msgs": int(v["in_msgs"]), "out_msgs": int(v["out_msgs"])}


class ServerTraffic:
    """Per connection and per role (``roles``: pid -> role), what the server received
    and sent between :meth:`start` and :meth:`stop`, next to ``/varz``'s totals."""

    def __init__(self, srv: NatsServer, roles: Mapping[int, str]) -> None:
        self.srv = srv
        self.roles = dict(roles)

    def start(self) -> ServerTraffic:
        self._role_of = {port: role for pid, role in self.roles.items()
                         for port in local_ports(pid)}
        self._conns, self._varz, self._t = connz(self.srv), varz(self.srv), time.monotonic()
        return self

    def stop(self) -> dict[str, Any]:
        conns, totals, wall = connz(self.srv), varz(self.srv), time.monotonic() - self._t
        by_role: dict[str, dict[str, float]] = {}
        clients = {"in_msgs": 0.0, "out_msgs": 0.0}
        for port, now in conns.items():
            was = self._conns.get(port, {"in_msgs": 0, "out_msgs": 0})
            role = self._role_of.get(port, "other")
            into = by_role.setdefault(role, {"connections": 0, "in_msgs": 0.0,
                                             "out_msgs": 0.0})
            into["connections"] += 1
            for key in ("in_msgs", "out_msgs"):
                rate = (now[key] - was[key]) / wall
                into[key] += rate
                clients[key] += rate
        total = {k: (totals[k] - self._varz[k]) / wall for k in totals}
        return {
            "seconds": round(wall, 1),
            # A connection's in_msgs: what it published; out_msgs: what it was sent.
            "per_s_by_role": {role: {k: round(v, 1) for k, v in r.items()}
                              for role, r in sorted(by_role.items())},
            "clients_per_s": {k: round(v, 1) for k, v in clients.items()},
            "varz_per_s": {k: round(v, 1) for k, v in total.items()},
            # What the server's internal clients (JetStream) published and were sent.
            "internal_per_s": {k: round(total[k] - clients[k], 1) for k in total}}


def kind_of(msg: Msg) -> str:
    """What one routed message is, for the sniffer's counts."""
    subject = msg.subject
    if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
        consumer = subject.rsplit(".", 1)[1]
        return f"pull request ({'data' if '-' in consumer else 'sync/other'} consumer)"
    if subject.startswith("$JS.API."):
        verb = subject.split(".")[2:4]
        return "api " + ".".join(verb).lower()
    if subject.startswith("$JS.ACK."):
        return "ack"
    if subject.startswith("$JS.EVENT."):
        return "advisory"
    if subject.startswith("_CGROUPD.presence."):
        return "presence probe" + (" (quiet)" if msg.data == b"quiet" else " (asks)")
    status = (msg.headers or {}).get("Status")
    if status:
        return f"status {status} {(msg.headers or {}).get('Description', '')}".strip()
    if subject.startswith("_INBOX."):
        return "reply / delivery to an inbox"
    return subject.split(".")[0]


async def sniff(url: str, seconds: float) -> dict[str, float]:
    """Every message the account routes for ``seconds``, per second by kind (the
    sniffer's own traffic aside: it publishes nothing)."""
    counts: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        counts[kind_of(msg)] += 1

    nc = await nats.connect(servers=[url], **client_options())
    try:
        sub = await nc.subscribe(">", cb=count, pending_msgs_limit=1_000_000)
        await nc.flush()
        await asyncio.sleep(seconds)  # the sniffing window
        await sub.unsubscribe()
    finally:
        await nc.close()
    return {k: round(v / seconds, 2) for k, v in counts.most_common()}


def _pid(srv: NatsServer) -> int:
    assert srv.pid is not None
    return srv.pid


async def main(seconds: float, extra: tuple[str, ...] = (),
               profile_standby: bool = False, variant: str = "",
               sniff_seconds: float = 0.0, metrics: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "footprint", "seconds": seconds,
                              "metrics_server": metrics,
                              "options": " ".join(extra) or "(defaults)",
                              "settings": variant or "(defaults)",
                              "machine": machine()}
    with server() as srv:
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "g", 8, ("m1",))
            with tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp, \
                    Members(srv.url, "BENCH", "g", extra=extra, metrics=metrics,
                            logs=Path(tmp) / "logs") as procs:
                launcher = ("-m", "bench.variant", variant, "--") if variant else (
                    "-m", "cgroupd")
                procs.start("m1", launcher=launcher)
                procs.start("m1", launcher=launcher)
                await wait_for(lambda: asyncio.to_thread(procs.ready), 60, 0.05, "ready")
                active = await wait_for(lambda: next(
                    (p for _, p in procs.procs if procs.logged(p, "became active")), None),
                    30, 0.05)
                standby = next(p for _, p in procs.procs if p is not active)
                await asyncio.sleep(2)
                spy = None
                out = Path(tmp) / "standby.txt"
                if profile_standby:
                    spy = await start_py_spy(standby.pid, out, 1000)
                pids = (active.pid, standby.pid, _pid(srv))
                before = {pid: cpu_seconds(pid) for pid in pids}
                woke = {pid: wakeups(pid) for pid in pids}
                traffic = await asyncio.to_thread(ServerTraffic(srv, {
                    active.pid: "active", standby.pid: "standby"}).start)
                await asyncio.sleep(seconds)
                result["server_traffic"] = await asyncio.to_thread(traffic.stop)
                rates = {pid: round((wakeups(pid) - woke[pid]) / seconds, 1) for pid in pids}
                result["server_wakeups_per_s"] = rates[_pid(srv)]
                result["server_cpu_percent"] = round(
                    100 * (cpu_seconds(_pid(srv)) - before[_pid(srv)]) / seconds, 2)
                result["active"] = {
                    "rss_mb": round(rss_mb(active.pid), 1), "wakeups_per_s": rates[active.pid],
                    "cpu_percent": round(100 * (cpu_seconds(active.pid) - before[active.pid])
                                         / seconds, 2)}
                result["standby"] = {
                    "rss_mb": round(rss_mb(standby.pid), 1),
                    "wakeups_per_s": rates[standby.pid],
                    "cpu_percent": round(100 * (cpu_seconds(standby.pid)
                                                - before[standby.pid]) / seconds, 2)}
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    await within(spy.wait(), 60, "py-spy to write its profile")
                    result["standby"]["profile"] = analyse_py_spy(out, 0.0, 15)
                if sniff_seconds:
                    result["server_traffic"]["sniffed_per_s"] = await sniff(srv.url,
                                                                            sniff_seconds)
    result["machine"]["load_average_after"] = machine()["load_average_1_5_15_min"]
    rss = max(result["active"]["rss_mb"], result["standby"]["rss_mb"])
    result["targets"] = {
        "RSS <= 40 MB per instance": rss <= 40,
        "active <= 0.2% of a core": result["active"]["cpu_percent"] <= 0.2,
        "standby <= 0.2% of a core": result["standby"]["cpu_percent"] <= 0.2}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--extra", default="", help="cgroupd join options for both")
    parser.add_argument("--settings", default="", metavar="NAME=VALUE,...",
                        help="member settings the CLI lacks, via bench.variant "
                             "(e.g. pull_expires=5,heartbeat=1)")
    parser.add_argument("--profile-standby", action="store_true",
                        help="sample the standby with py-spy (pip install py-spy)")
    parser.add_argument("--sniff", type=float, default=10.0, metavar="SECONDS",
                        help="count what the server routes, by kind, after the idle window "
                             "(0: skip)")
    parser.add_argument("--metrics", action="store_true",
                        help="serve /metrics from both instances (default: none, as "
                             "`cgroupd join` at defaults)")
    a = parser.parse_args()
    emit(asyncio.run(main(a.seconds, tuple(shlex.split(a.extra)), a.profile_standby,
                          a.settings, a.sniff, a.metrics)))
