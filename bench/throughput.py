"""Throughput of ``cgroupd join`` next to the peer (natsio-pcgroups) and a raw consumer.

One run, one nats-server, the same shape for every row: 4 members, 8 partitions, 64 keys,
20,000 messages, and the same recording handler everywhere (a ``start`` and an ``end``
event per message, the record file opened per event, as the peer's driver does; the
message is acked when the handler returns). Rows:

- ``defaults``: ``cgroupd join`` with no ordering options (``partition`` ordering, max
  in flight 256: a partition's messages one at a time in stream order, the server
  sending ahead);
- ``partition_max_in_flight_1``: ``--ordering partition --max-in-flight 1``: the old
  defaults, one server round trip per message;
- ``key``: ``--ordering key``;
- ``member_in_stream_order``: the whole member in stream order, one handler at a time
  (:data:`STREAM_ORDER_ARGS`: ``--ordering stream``, max in flight 256: held messages
  start strictly in stream order);
- ``peer``: natsio-pcgroups members (its ``elastic_consume``, max ack pending 1) run by
  :mod:`tests.support.peer_driver` processes in the peer's own venv (:mod:`tests.support.peer`);
- ``raw``: one plain nats-py pull consumer on the origin stream, batch 256, each message
  acked, no group (:mod:`bench.raw_consumer`); it handles one message at a time in
  stream order, with the server sending ahead;
- ``raw_round_trip``: the same with batch 1 and max ack pending 1, one server round trip
  per message: what one handler at a time costs on the wire, without cgroupd.

Each row gets a fresh origin stream and group. Its processes are started, joined and
warmed (one message per key, processed by every member) before the measured messages are
published, as fast as the server acknowledges them. ``msgs_per_s`` runs from the first
measured handler start to the last end (``msgs_per_s_from_publish`` from the first
publish); ``x_peer`` and ``x_raw`` divide it by the peer's and the raw consumer's.
``cpu_us_per_msg`` is the CPU (user + system, from /proc) all the row's consumer
processes used from the first publish until everything was processed, per message; the
server's likewise. Every row is checked: nothing lost, per-key order of every completion
(:func:`tests.support.groups.check`), duplicates counted.

With ``--rounds N`` the rows run N times round-robin and each reports its median round
(ratios: the median of the ratios within a round), so a burst of load from others falls
on one round of every row rather than on one row; ``--row NAME=ARGS`` adds a
``cgroupd join`` row with other options (to measure a proposed default).

With ``--baseline PATH`` (a directory holding another revision's ``cgroupd/``: see
:mod:`bench.revision`), every ``cgroupd join`` row gets a twin ``NAME@REV`` whose
processes import ``cgroupd`` from PATH (REV: its short hash), run right next to it in
each round (which goes first alternates); the row's ``x_baseline`` is its msg/s over the
twin's and ``x_baseline_by_cpu`` the twin's CPU per message (its processes' and the
server's) over the row's; both sides record the ``cgroupd_files`` they imported.

Run: ``python -m bench.throughput [--messages 20000] [--rows key,peer,raw] [--no-peer]
[--rounds 3] [--row 'p32=--ordering partition --max-in-flight 32'] [--baseline PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.js import api

from bench import revision
from bench.common import (
    ROOT,
    CpuMeter,
    Members,
    Records,
    emit,
    machine,
    publish_keyed,
    server,
    wait_processed,
)
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream
from tests.support.groups import check
from tests.support.natsserver import NatsServer, client_options
from tests.support.peer import PeerProcess, peer_python, why
from tests.support.polling import within

#: The strictest mode: the whole member in stream order, one handler at a time, with
#: prefetch (the default max in flight).
STREAM_ORDER_ARGS = ("--ordering", "stream")
#: The peer's members: max ack pending 1 (its default handler runs one message at a time).
PEER_MAX_ACK_PENDING = 1


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "cgroupd", "peer" or "raw"
    what: str
    args: tuple[str, ...] = ()
    #: Where its ``cgroupd`` comes from (:mod:`bench.revision`); None: ``-m cgroupd``.
    code: Path | None = None


ROWS = (
    Row("defaults", "cgroupd", "cgroupd join, no ordering options"),
    Row("partition_max_in_flight_1", "cgroupd", "cgroupd join --ordering partition "
        "--max-in-flight 1 (the defaults before 2026-11-23)",
        ("--ordering", "partition", "--max-in-flight", "1")),
    Row("key", "cgroupd", "cgroupd join --ordering key", ("--ordering", "key")),
    Row("member_in_stream_order", "cgroupd", "cgroupd join, the whole member in stream "
        f"order, one handler at a time ({' '.join(STREAM_ORDER_ARGS)})", STREAM_ORDER_ARGS),
    Row("peer", "peer", f"natsio-pcgroups elastic_consume, max ack pending "
        f"{PEER_MAX_ACK_PENDING}"),
    Row("raw", "raw", "one raw nats-py pull consumer on the origin stream, batch 256, "
        "ack each, no group"),
    Row("raw_round_trip", "raw", "the same raw consumer with batch 1 and max ack pending "
        "1: ack, then ask for the next (the wire protocol of one handler at a time today)",
        ("1", "1")),
)


@dataclass(frozen=True)
class Shape:
    members: int = 4
    partitions: int = 8
    keys: int = 64
    messages: int = 20_000


async def origin(js: JetStream, index: int) -> tuple[str, str]:
    """A fresh origin stream for one row: (name, subject prefix)."""
    stream = f"T{index}"
    await js.add_stream(api.StreamConfig(name=stream, subjects=[f"t{index}.*"]))
    return stream, f"t{index}"


async def measure(nc: Client, prefix: str, records: Records, pids: list[int],
                  server_pid: int, shape: Shape, instances: int) -> dict[str, Any]:
    """Warm the row's processes up, publish the measured messages, wait until all are
    processed; rates, CPU and the checks' verdict."""
    warm = await publish_keyed(nc, prefix, shape.keys, keys=shape.keys)
    await wait_processed(records, {n for _, n in warm}, 120, "the warm-up messages")
    warmed = {e["instance"] for e in records.ends()}
    if len(warmed) != instances:
        raise RuntimeError(f"{len(warmed)} of {instances} instances processed the warm-up: "
                           "a member owns no key's partition (use more keys)")
    meter = CpuMeter([*pids, server_pid]).start()
    t_publish = time.time()
    sent = await publish_keyed(nc, prefix, shape.messages, keys=shape.keys, start=shape.keys)
    published = time.time() - t_publish
    await wait_processed(records, {n for _, n in sent}, max(120, shape.messages / 100),
                         "the measured messages")
    cpu = meter.stop()
    records.poll()
    measured = [e for e in records.events if e["n"] >= shape.keys]
    first = min(e["t"] for e in measured if e["event"] == "start")
    last = max(e["t"] for e in measured if e["event"] == "end")
    verdict = check(records.as_record(), warm + sent)
    members_cpu = sum(cpu[pid] for pid in pids)
    return {
        "msgs_per_s": round(shape.messages / (last - first)),
        "msgs_per_s_from_publish": round(shape.messages / (last - t_publish)),
        "publish_s": round(published, 3),
        "seconds": round(last - first, 3),
        "cpu_us_per_msg": round(members_cpu / shape.messages * 1e6, 1),
        "cpu_us_per_msg_busiest_process": round(max(cpu[pid] for pid in pids)
                                                / shape.messages * 1e6, 1),
        "cpu_cores_used": round(members_cpu / meter.wall, 2),
        "server_cpu_us_per_msg": round(cpu[server_pid] / shape.messages * 1e6, 1),
        "processes": len(pids),
        "lost": len(verdict.lost),
        "order_violations": len(verdict.order_violations),
        "duplicates": verdict.duplicates,
    }


async def cgroupd_row(srv: NatsServer, nc: Client, js: JetStream, index: int, row: Row,
                      shape: Shape, tmp: Path) -> dict[str, Any]:
    stream, prefix = await origin(js, index)
    names = tuple(f"m{i}" for i in range(shape.members))
    await admin.create_elastic_group(js, stream, "g", ElasticGroupConfig(
        max_members=shape.partitions, members=names,
        partitioning_filters=(PartitioningFilter(f"{prefix}.*", (1,)),)))
    records = Records(tmp / row.name)
    # As a user runs it: no metrics server, default log level (to files here).
    with Members(srv.url, stream, "g", handler="bench.handlers:events", extra=row.args,
                 records=tmp / row.name, logs=tmp / f"{row.name}-logs",
                 metrics=False, code=row.code) as procs:
        for name in names:
            procs.start(name)
        result = await measure(nc, prefix, records, [p.pid for _, p in procs.procs],
                               _pid(srv), shape, shape.members)
        if row.code is not None:
            result["cgroupd_files"] = procs.imported()
    await admin.delete_group(js, stream, "g")
    await js.delete_stream(stream)
    return result


async def peer_row(srv: NatsServer, nc: Client, js: JetStream, index: int, python: str,
                   shape: Shape, tmp: Path) -> dict[str, Any]:
    stream, prefix = await origin(js, index)
    names = [f"m{i}" for i in range(shape.members)]
    (tmp / "peer").mkdir()
    peers = [PeerProcess(python, srv.url, tmp / f"peer-{name}.log") for name in names]
    try:
        for peer in peers:
            await peer.start()
        await peers[0].call("create_elastic", stream=stream, group="g",
                            max_members=shape.partitions, filters=[[f"{prefix}.*", [1]]])
        await peers[0].call("add_members", stream=stream, group="g", members=names)
        for name, peer in zip(names, peers, strict=True):
            await peer.call("consume", kind="elastic", stream=stream, group="g", member=name,
                            record=str(tmp / "peer" / f"{name}.jsonl"),
                            max_ack_pending=PEER_MAX_ACK_PENDING)
        result = await measure(nc, prefix, Records(tmp / "peer"), [p.pid for p in peers],
                               _pid(srv), shape, shape.members)
        await peers[0].call("stop")
        await peers[0].call("delete", kind="elastic", stream=stream, group="g")
    finally:
        for peer in peers:
            await peer.close()
    await js.delete_stream(stream)
    return result


async def raw_row(srv: NatsServer, nc: Client, js: JetStream, index: int, shape: Shape,
                  tmp: Path, args: tuple[str, ...] = ()) -> dict[str, Any]:
    stream, prefix = await origin(js, index)
    record = tmp / "raw.jsonl"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.raw_consumer", srv.url, stream, f"{prefix}.*",
        str(record), *args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = await within(proc.stdout.readline(), 60, "the raw consumer to be ready")
        if line.strip() != b"ready":
            raise RuntimeError(f"the raw consumer did not start (exit {await proc.wait()})")
        result = await measure(nc, prefix, Records(files=[record]), [proc.pid], _pid(srv),
                               shape, 1)
        proc.stdin.close()
        await within(proc.wait(), 10, "the raw consumer to exit")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await js.delete_stream(stream)
    return result


def _pid(srv: NatsServer) -> int:
    assert srv.pid is not None
    return srv.pid


def peer_or_reason() -> tuple[str | None, str]:
    """The peer's Python, or None and why not."""
    try:
        python = peer_python()
    except RuntimeError as exc:
        return None, str(exc)
    return python, "" if python else why()


def with_baseline(rows: list[Row], path: Path, rev: str) -> tuple[list[Row], dict[str, str]]:
    """Each ``cgroupd`` row preceded by its twin on the baseline at ``path`` (named
    ``NAME@REV``), both launched through :mod:`bench.revision`; and which twin is whose."""
    out: list[Row] = []
    twins: dict[str, str] = {}
    for row in rows:
        if row.kind == "cgroupd":
            twin = Row(f"{row.name}@{rev}", "cgroupd", f"{row.what}, on {rev} ({path})",
                       row.args, path)
            out.append(twin)
            twins[row.name] = twin.name
            row = dataclasses.replace(row, code=ROOT)
        out.append(row)
    return out, twins


def in_turn(rows: list[Row], twins: dict[str, str], turn: int) -> list[Row]:
    """The rows of one round: on odd rounds each row runs before its baseline twin, so
    neither side always comes first."""
    if turn % 2 == 0 or not twins:
        return rows
    out = list(rows)
    for i, row in enumerate(out):
        if row.name in twins and i > 0 and out[i - 1].name == twins[row.name]:
            out[i - 1], out[i] = row, out[i - 1]
    return out


async def main(shape: Shape, names: list[str], with_peer: bool = True, rounds: int = 1,
               extra: tuple[Row, ...] = (), baseline: Path | None = None) -> dict[str, Any]:
    """Run the rows ``rounds`` times, round-robin (so load from others falls on every row
    alike); each row reports its median round, and each ratio the median of the ratios
    taken within a round. With ``baseline``, every ``cgroupd`` row also runs on that
    checkout's ``cgroupd`` (:func:`with_baseline`)."""
    rows = [row for row in ROWS if row.name in names] + list(extra)
    result: dict[str, Any] = {"benchmark": "throughput", "shape": shape.__dict__,
                              "rounds": rounds, "machine": machine(), "rows": {}}
    twins: dict[str, str] = {}
    if baseline is not None:
        path = revision.check(baseline)
        rev = revision.name(path)
        rows, twins = with_baseline(rows, path, rev)
        result["baseline"] = {"path": str(path), "revision": rev, "rows": dict(twins)}
    python, reason = peer_or_reason() if with_peer else (None, "--no-peer")
    runs: list[dict[str, dict[str, Any]]] = []
    with server() as srv, tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        nc = await _connect(srv.url)
        js = JetStream(nc, timeout=10)
        try:
            for turn in range(rounds):
                done: dict[str, dict[str, Any]] = {}
                for index, row in enumerate(in_turn(rows, twins, turn),
                                            start=turn * len(rows)):
                    where = Path(tmp) / f"{row.name}-{turn}"
                    where.mkdir()
                    measured: dict[str, Any] = {"what": row.what}
                    if row.name in twins:
                        measured["baseline"] = twins[row.name]
                    if row.kind == "cgroupd":
                        measured |= await cgroupd_row(srv, nc, js, index, row, shape, where)
                    elif row.kind == "raw":
                        measured |= await raw_row(srv, nc, js, index, shape, where, row.args)
                    elif python is None:
                        measured["skipped"] = reason
                    else:
                        measured |= await peer_row(srv, nc, js, index, python, shape, where)
                    done[row.name] = measured
                ratios(done, twins)
                runs.append(done)
        finally:
            await nc.close()
    result["rows"] = merge_rounds(runs)
    if twins:
        result["baseline"]["x_baseline"] = {
            name: result["rows"][name].get("x_baseline") for name in twins}
    result["machine"]["load_average_after"] = machine()["load_average_1_5_15_min"]
    result["targets"] = targets(result["rows"])
    return result


def merge_rounds(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One row from its rounds: the median round's figures (of an even number, the
    slower of the middle two), each ratio's median over the rounds, the figures of every
    round, and the checks summed (a loss in any round shows)."""
    if len(runs) == 1:
        return runs[0]
    merged: dict[str, dict[str, Any]] = {}
    for name in runs[0]:
        mine = [run[name] for run in runs]
        if "msgs_per_s" not in mine[0]:
            merged[name] = mine[0]
            continue
        ordered = sorted(mine, key=lambda r: r["msgs_per_s"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        for label in ("x_peer", "x_raw", "x_peer_by_cpu", "x_baseline",
                      "x_baseline_by_cpu"):
            values = [r[label] for r in mine if label in r]
            if values:
                row[label] = round(statistics.median(values), 2)
                row[f"{label}_rounds"] = values
        for label in ("msgs_per_s", "cpu_us_per_msg", "server_cpu_us_per_msg"):
            row[f"{label}_rounds"] = [r[label] for r in mine]
        for label in ("lost", "order_violations", "duplicates"):
            row[label] = sum(r[label] for r in mine)
        merged[name] = row
    return merged


async def _connect(url: str) -> Client:
    import nats
    return await nats.connect(servers=[url], **client_options())


def ratios(rows: dict[str, dict[str, Any]], twins: dict[str, str] | None = None) -> None:
    """``x_peer`` and ``x_raw`` of every row (when that row ran), and ``x_peer_by_cpu``:
    the peer's CPU per message (its processes' and the server's) over the row's. On a
    machine whose cores are all busy, throughput is cores over CPU per message, and CPU
    per message hardly moves with other users' load while msg/s does (2x between two
    rounds here): the CPU ratio says what the rate ratio would be on a quiet machine
    that is CPU-bound; it misses waiting (a round trip per message) when it is not.
    With ``twins`` (row -> its baseline twin): ``x_baseline`` and ``x_baseline_by_cpu``,
    the same two ratios of a row against its twin."""
    for base, label in (("peer", "x_peer"), ("raw", "x_raw")):
        rate = rows.get(base, {}).get("msgs_per_s")
        if rate:
            for row in rows.values():
                if "msgs_per_s" in row:
                    row[label] = round(row["msgs_per_s"] / rate, 2)

    def measured(row: dict[str, Any]) -> bool:
        # A short run can show no CPU at all (clock ticks of 10 ms): no ratio then.
        return row.get("cpu_us_per_msg", 0) + row.get("server_cpu_us_per_msg", 0) > 0 \
            and "cpu_us_per_msg" in row and "server_cpu_us_per_msg" in row

    def cost(row: dict[str, Any]) -> float:
        return float(row["cpu_us_per_msg"] + row["server_cpu_us_per_msg"])

    peer = rows.get("peer", {})
    if measured(peer):
        for row in rows.values():
            if measured(row):
                row["x_peer_by_cpu"] = round(cost(peer) / cost(row), 2)
    for name, twin in (twins or {}).items():
        mine, theirs = rows.get(name, {}), rows.get(twin, {})
        if mine.get("msgs_per_s") and theirs.get("msgs_per_s"):
            mine["x_baseline"] = round(mine["msgs_per_s"] / theirs["msgs_per_s"], 2)
        if measured(mine) and measured(theirs):
            mine["x_baseline_by_cpu"] = round(cost(theirs) / cost(mine), 2)


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """Issue 15's targets (None when a row it needs did not run)."""

    def ratio(name: str, label: str) -> float | None:
        value = rows.get(name, {}).get(label)
        return float(value) if value is not None else None

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    key_cpu = rows.get("key", {}).get("cpu_us_per_msg")
    return {
        "defaults >= 4x peer": at_least(ratio("defaults", "x_peer"), 4),
        "member_in_stream_order >= 2.5x peer": at_least(
            ratio("member_in_stream_order", "x_peer"), 2.5),
        "key >= 1.2x raw": at_least(ratio("key", "x_raw"), 1.2),
        "key cpu_us_per_msg <= 62.5 (half of ~125)": (
            None if key_cpu is None else key_cpu <= 62.5),
        "every row: nothing lost, per-key order, no duplicates": all(
            row.get("lost", 0) == 0 and row.get("order_violations", 0) == 0
            and row.get("duplicates", 0) == 0 for row in rows.values()),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--messages", type=int, default=Shape.messages)
    parser.add_argument("--members", type=int, default=Shape.members)
    parser.add_argument("--partitions", type=int, default=Shape.partitions)
    parser.add_argument("--keys", type=int, default=Shape.keys)
    parser.add_argument("--rows", default=",".join(row.name for row in ROWS),
                        help="comma-separated rows to run")
    parser.add_argument("--no-peer", action="store_true", help="skip the peer's row")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the rows this many times round-robin; medians reported")
    parser.add_argument("--row", action="append", default=[], metavar="NAME=ARGS",
                        help="an extra cgroupd join row, e.g. "
                             "'p32=--ordering partition --max-in-flight 32' (repeatable)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="PATH",
                        help="run every cgroupd row also with the cgroupd/ package in PATH "
                             "(another revision: python -m bench.revision checkout REV PATH)")
    args = parser.parse_args()
    if args.baseline is not None:
        try:
            revision.check(args.baseline)
        except ValueError as exc:
            parser.error(str(exc))
    extra = []
    for spec in args.row:
        name, sep, options = spec.partition("=")
        if not sep or not name:
            parser.error(f"--row wants NAME=ARGS, not {spec!r}")
        extra.append(Row(name, "cgroupd", f"cgroupd join {options}", tuple(shlex.split(options))))
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    emit(asyncio.run(main(Shape(args.members, args.partitions, args.keys, args.messages),
                          args.rows.split(","), not args.no_peer, args.rounds, tuple(extra),
                          args.baseline)))
