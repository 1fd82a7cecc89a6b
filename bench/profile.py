"""Where a member's CPU goes: one member of the ``key`` throughput case, profiled.

The shape of :mod:`bench.throughput`'s ``key`` row (4 ``cgroupd join --ordering key``
members, 8 partitions, 64 keys, the recording handler; ``--case defaults`` for its
``defaults`` row), with more messages so the profile has enough samples. Member ``m0``
is profiled over exactly the measured window (after the warm-up): with py-spy (a
sampling profiler attached to the process: little overhead, CPU samples only; ``pip
install py-spy``), or with cProfile switched on and off by signals
(:mod:`bench.cprofiled`; deterministic, but its per-call overhead inflates small
functions). The profiled member's CPU per message is read from /proc.

Printed: the top functions by own time (self) and including callees (inclusive), the
share of each area (the file a sample's innermost Python frame is in: nats-py, asyncio,
json, each cgroupd module, the benchmark's handler), and, for py-spy, the share of each
innermost cgroupd (or handler) frame: which part of the runtime the time is spent for,
nats-py and asyncio work it called included. Shares are of the profiled samples; times
are shares of the measured CPU µs per message.

Run: ``python -m bench.profile [--messages 100000] [--tool py-spy|cprofile] [--case key]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import nats
from nats.js import api

from bench.common import (
    CpuMeter,
    Members,
    Records,
    emit,
    machine,
    percentile,
    publish_keyed,
    read_records,
    server,
    wait_for,
    wait_processed,
)
from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream
from tests.support.natsserver import client_options
from tests.support.polling import within

MEMBERS = 4
PARTITIONS = 8
KEYS = 64
#: The cases that can be profiled: the issue's (key ordering), the defaults, and one
#: message in flight (a server round trip per message: the defaults before 2026-11-23).
CASES = {"key": ("--ordering", "key"), "defaults": (),
         "one_in_flight": ("--max-in-flight", "1")}
#: The launchers switched on and off by SIGUSR1 / SIGUSR2, per tool.
LAUNCHERS = {"cprofile": "cprofiled", "trace": "traced"}

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*)\)$")
_STDLIB = re.compile(r"^.*/lib/python3\.\d+/")


def py_spy() -> str | None:
    """The py-spy next to this Python, or on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def area(file: str) -> str:
    """What a source file belongs to, for the by-area shares."""
    if "/site-packages/nats/" in file or file.startswith("nats/"):
        return "nats-py"
    if "/cgroupd/" in file or file.startswith("cgroupd/"):
        return "cgroupd/" + file.rsplit("/cgroupd/", 1)[-1].removeprefix("cgroupd/")
    if file.endswith("bench/handlers.py"):
        return "handler (bench/handlers.py)"
    for name in ("asyncio", "json", "structlog", "prometheus_client", "aiohttp"):
        if f"/{name}/" in file:
            return name
    if "/site-packages/" in file:
        return "other packages"
    return "python stdlib (other)" if file.startswith("/") or "<" not in file else file


def short(frame: str) -> str:
    """``function (path)`` with the path cut to its package part."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    file = m["file"]
    if "/site-packages/" in file:  # first: a checkout named like a package holds the venv
        return f"{m['func']} ({file.rsplit('/site-packages/', 1)[1]})"
    for package in ("cgroupd", "bench", "tests"):
        if f"/{package}/" in file:
            return f"{m['func']} ({package}/{file.rsplit(f'/{package}/', 1)[1]})"
    return f"{m['func']} ({_STDLIB.sub('', file)})"


def read_py_spy(path: Path) -> tuple[Counter[tuple[str, ...]], int]:
    """Stacks (outermost first) and their sample counts from py-spy's raw format."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = tuple(f for f in stack.split(";") if not f.startswith("process ")
                           and not f.startswith("thread "))
            if frames:  # a sample without a Python frame says nothing about where
                stacks[frames] += int(count)
    return stacks, sum(stacks.values())


def task_frames(frames: tuple[str, ...]) -> tuple[str, ...]:
    """The frames of the callback or task the event loop was running (below its last
    ``Handle._run``); the innermost frame alone when it was in the loop itself (or in
    ``Handle._run`` itself, between a callback's frames)."""
    cut = max((i for i, f in enumerate(frames) if f.startswith("Handle._run ")), default=-1)
    return frames[cut + 1:] if 0 <= cut < len(frames) - 1 else frames[-1:]


def analyse_py_spy(path: Path, us_per_msg: float, top: int) -> dict[str, Any]:
    """Shares of the samples that were not waiting in the event loop's ``select``: py-spy
    keeps a thread it finds runnable, and one that just woke in ``select`` (or is
    runnable but waits for a core on a busy machine) is not using CPU, so those samples
    are counted apart (``waiting_in_select_share``) and the rest scaled to the measured
    CPU µs/msg. On a loaded machine the shares still lean to places where a thread gets
    preempted (right after a socket write wakes the server); compare with cProfile's."""
    stacks, total = read_py_spy(path)
    if not total:
        return {"samples": 0}
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    owner: Counter[str] = Counter()
    waiting = 0
    for frames, n in stacks.items():
        leaf = frames[-1]
        if leaf.startswith(("EpollSelector.select ", "select ")) and "selectors" in leaf:
            waiting += n
            continue
        own[short(leaf)] += n
        m = _FRAME.match(leaf)
        areas[area(m["file"] if m else leaf)] += n
        task = task_frames(frames)
        for f in set(task):
            inclusive[short(f)] += n
        mine = [f for f in task if "/cgroupd/" in f or "bench/handlers.py" in f]
        owner[short(mine[-1]) if mine else f"(no cgroupd frame) {short(task[0])}"] += n
    busy = total - waiting

    def table(counts: Counter[str]) -> list[dict[str, Any]]:
        return [{"what": k, "share": round(v / busy, 3),
                 "us_per_msg": round(us_per_msg * v / busy, 1)}
                for k, v in counts.most_common(top)]

    return {"samples": total, "waiting_in_select_share": round(waiting / total, 3),
            "self": table(own), "inclusive_within_loop_callbacks": table(inclusive),
            "by_area": table(areas), "by_innermost_cgroupd_frame": table(owner)}


#: What :mod:`bench.traced` records (counted per message: how many socket writes, pulls).
STEPS = ("receive", "submit", "ack", "pull", "write")
#: The steps between two messages of a one-at-a-time member, from :mod:`bench.traced`:
#: (name, from step, to step). ``end`` and ``start`` are the handler's record events.
SEGMENTS = (
    ("settle: handler returned -> ack queued", "end", "ack"),
    ("refill: ack queued -> pull request queued", "ack", "pull"),
    ("flush: pull request queued -> socket write", "pull", "write"),
    ("server round trip: write -> next message read", "write", "receive"),
    ("puller: message read -> dispatcher", "receive", "submit"),
    ("dispatch: dispatcher -> handler start", "submit", "start"),
)


def wall_split(records: list[dict[str, Any]], steps: list[dict[str, Any]],
               instance: str) -> dict[str, Any]:
    """Where a one-at-a-time member's wall time goes per message: its handler, then each
    step from one handler's end to the next one's start (the first of each step after the
    one before). A gap where the next message was already there (received before the
    previous handler ended) is not a round trip; it is counted apart."""
    mine = sorted((e for e in records if e["instance"] == instance), key=lambda e: e["t"])
    starts = [e for e in mine if e["event"] == "start"]
    ends = [e for e in mine if e["event"] == "end"]
    marks = sorted((s["t"], s["step"]) for s in steps)
    handler = [(e["t"] - s["t"]) * 1e6 for s, e in zip(starts, ends, strict=False)
               if s["n"] == e["n"]]
    split: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    prefetched = overlapped = 0
    for end, nxt in zip(ends, starts[1:], strict=False):
        if nxt["t"] < end["t"]:
            overlapped += 1
            continue
        between = [(t, step) for t, step in marks if end["t"] <= t <= nxt["t"]]
        at = {"end": end["t"]}
        for _, first, then in SEGMENTS[:-1]:
            after = at.get(first)
            found = next((t for t, step in between if step == then and after is not None
                          and t >= after), None)
            if found is not None:
                at[then] = found
        if "receive" not in at:
            prefetched += 1
            continue
        at["start"] = nxt["t"]
        for name, first, then in SEGMENTS:
            if first in at and then in at:
                split[name].append((at[then] - at[first]) * 1e6)
    span = (ends[-1]["t"] - starts[0]["t"]) if starts and ends else 0.0

    def summary(values: list[float]) -> dict[str, Any]:
        return {"count": len(values), "mean_us": round(sum(values) / len(values), 1),
                "p50_us": round(percentile(values, 50), 1)} if values else {"count": 0}

    return {"messages": len(ends),
            "wall_us_per_msg": round(span / len(ends) * 1e6, 1) if ends else None,
            "handler": summary(handler),
            "between_messages": {name: summary(v) for name, v in split.items()},
            "steps_per_message": {step: round(sum(1 for _, s in marks if s == step)
                                              / len(ends), 2) for step in STEPS}
            if ends else {},
            "gaps_with_message_already_received": prefetched,
            "handlers_overlapping": overlapped}


def analyse_cprofile(path: Path, us_per_msg: float, top: int) -> dict[str, Any]:
    stats = pstats.Stats(str(path))
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in entries.values()) or 1.0
    own: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    for (file, _, func), (_, _, tottime, cumtime, _) in entries.items():
        name = short(f"{func} ({file})")
        own[name] += tottime
        cumulative[name] = max(cumulative[name], cumtime)
        areas[area(file)] += tottime

    def table(counts: Counter[str]) -> list[dict[str, Any]]:
        return [{"what": k, "share": round(v / total, 3),
                 "us_per_msg": round(us_per_msg * v / total, 1)}
                for k, v in counts.most_common(top)]

    return {"profiled_seconds": round(total, 3), "self": table(own),
            "inclusive": table(cumulative), "by_area": table(areas)}


async def start_py_spy(pid: int, out: Path, rate: int) -> asyncio.subprocess.Process:
    """py-spy recording ``pid`` until SIGINT. It says nothing reliable when it has
    attached, so give it a second and check it is still running (it sometimes fails to
    read a process at the first attempt: then try again)."""
    error = b""
    for _ in range(3):
        spy = await asyncio.create_subprocess_exec(
            str(py_spy()), "record", "--pid", str(pid), "--format", "raw", "--output",
            str(out), "--rate", str(rate), "--full-filenames", "--nolineno",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        try:
            await within(spy.wait(), 1.0, "py-spy to fail at once")
        except TimeoutError:
            return spy
        assert spy.stderr is not None
        error = await spy.stderr.read()
    raise RuntimeError(f"py-spy could not record {pid}: {error[-500:]!r}")


async def main(messages: int, tool: str, rate: int, top: int,
               members: int = MEMBERS, case: str = "key") -> dict[str, Any]:
    args = CASES[case]
    result: dict[str, Any] = {"benchmark": "profile", "tool": tool, "messages": messages,
                              "case": f"{members} members, {PARTITIONS} partitions, {KEYS} "
                                      f"keys, cgroupd join {' '.join(args) or '(defaults)'}",
                              "machine": machine()}
    with server() as srv, tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        work = Path(tmp)
        nc = await nats.connect(servers=[srv.url], **client_options())
        js = JetStream(nc, timeout=10)
        try:
            await js.add_stream(api.StreamConfig(name="PROF", subjects=["prof.*"]))
            names = tuple(f"m{i}" for i in range(members))
            await admin.create_elastic_group(js, "PROF", "g", ElasticGroupConfig(
                max_members=PARTITIONS, members=names,
                partitioning_filters=(PartitioningFilter("prof.*", (1,)),)))
            records = Records(work / "records")
            out = work / {"py-spy": "profile.txt", "cprofile": "profile.pstats",
                          "trace": "steps.jsonl"}[tool]
            with Members(srv.url, "PROF", "g", handler="bench.handlers:events", extra=args,
                         records=work / "records", logs=work / "logs",
                         metrics=False) as procs:
                launcher = (("-m", "cgroupd") if tool == "py-spy"
                            else ("-m", f"bench.{LAUNCHERS[tool]}", str(out), "--"))
                target = procs.start(names[0], launcher=launcher)
                for name in names[1:]:
                    procs.start(name)
                warm = await publish_keyed(nc, "prof", KEYS, keys=KEYS)
                await wait_processed(records, {n for _, n in warm}, 120, "the warm-up")
                spy = None
                if tool == "py-spy":
                    spy = await start_py_spy(target.pid, out, rate)
                else:
                    os.kill(target.pid, signal.SIGUSR1)
                meter = CpuMeter([target.pid]).start()
                sent = await publish_keyed(nc, "prof", messages, keys=KEYS, start=KEYS)
                await wait_processed(records, {n for _, n in sent}, max(120, messages / 100),
                                     "the measured messages")
                cpu = meter.stop()[target.pid]
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    await within(spy.wait(), 60, "py-spy to write its profile")
                else:
                    os.kill(target.pid, signal.SIGUSR2)
                    await wait_for(lambda: out.exists() and out.stat().st_size > 0, 30, 0.1,
                                   "the profile to be written")
                    await asyncio.sleep(0.5)  # dump_stats writes in one go; let it finish
            mine = sum(1 for e in records.ends() if e["instance"] == f"cgroupd-{target.pid}"
                       and e["n"] >= KEYS)
            us = cpu / mine * 1e6 if mine else float("nan")
            result["profiled_member"] = {
                "messages": mine, "cpu_s": round(cpu, 2), "cpu_us_per_msg": round(us, 1),
                "wall_s": round(meter.wall, 2)}
            if tool == "py-spy":
                result["profile"] = analyse_py_spy(out, us, top)
            elif tool == "cprofile":
                result["profile"] = analyse_cprofile(out, us, top)
            else:
                result["wall_split"] = wall_split(
                    [e for e in records.events if e["n"] >= KEYS], read_records(out),
                    f"cgroupd-{target.pid}")
        finally:
            await nc.close()
    result["machine"]["load_average_after"] = machine()["load_average_1_5_15_min"]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--tool", choices=("py-spy", "cprofile", "trace"), default=None,
                        help="default: py-spy when installed, else cprofile; trace: the "
                             "wall time between two messages, step by step (bench.traced; "
                             "for --case one_in_flight, one handler at a time)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=20, help="rows per table")
    parser.add_argument("--members", type=int, default=MEMBERS,
                        help="members of the group (1: the profiled one alone)")
    parser.add_argument("--case", choices=sorted(CASES), default="key",
                        help="which throughput case (default: key, as issue 15 asks)")
    a = parser.parse_args()
    tool = a.tool or ("py-spy" if py_spy() else "cprofile")
    if tool == "py-spy" and not py_spy():
        sys.exit("py-spy is not installed (pip install py-spy), or use --tool cprofile")
    emit(asyncio.run(main(a.messages, tool, a.rate, a.top, members=a.members, case=a.case)))
