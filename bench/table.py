"""Markdown tables from the benchmarks' JSON output, for docs/performance.md and the README.

Each benchmark prints one JSON object; this reads any of them (throughput, failover,
scale, profile, fleet_growth) and prints its figures as a Markdown table next to the
peer's, with the issue-15 targets as met / missed, so the documented numbers are pasted
from one run and never retyped. Files are told apart by their ``benchmark`` field.

Run: ``python -m bench.throughput > t.json && python -m bench.table t.json [more.json ...]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Rows of a profile's table (the JSON keeps more).
PROFILE_ROWS = 12


def _n(value: Any, digits: int = 0, unit: str = "") -> str:
    """A number for a table cell (a dash when absent)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        text = f"{value:,.{digits}f}"
        return f"{text}{unit}"
    return str(value)


def _get(data: Any, *path: str) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def machine_line(result: dict[str, Any]) -> str:
    m = result.get("machine", {})
    return (f"{m.get('cores')} cores, Python {m.get('python')}, {m.get('nats_server')}; "
            f"load average (1, 5, 15 min) {m.get('load_average_1_5_15_min')} before, "
            f"{m.get('load_average_after')} after")


def targets(result: dict[str, Any]) -> Iterator[str]:
    goals = result.get("targets") or {}
    if goals:
        yield ""
        yield "| issue 15 target | met |"
        yield "|---|---|"
        for name, met in goals.items():
            yield f"| {name} | {'not run' if met is None else _n(met)} |"


def throughput(result: dict[str, Any]) -> Iterator[str]:
    shape = result.get("shape", {})
    yield (f"Throughput: {shape.get('members')} members, {shape.get('partitions')} "
           f"partitions, {shape.get('keys')} keys, {_n(shape.get('messages'))} messages; "
           f"{machine_line(result)}.")
    yield ""
    yield ("| row | msg/s | x peer | x raw | consumer CPU µs/msg | server CPU µs/msg "
           "| x peer by CPU | lost / order violations / duplicates |")
    yield "|---|---|---|---|---|---|---|---|"
    for name, row in result.get("rows", {}).items():
        if "skipped" in row:
            yield f"| `{name}` | skipped: {row['skipped']} | | | | | | |"
            continue
        yield (f"| `{name}` | {_n(row.get('msgs_per_s'))} | {_n(row.get('x_peer'), 2)} | "
               f"{_n(row.get('x_raw'), 2)} | {_n(row.get('cpu_us_per_msg'), 1)} | "
               f"{_n(row.get('server_cpu_us_per_msg'), 1)} | "
               f"{_n(row.get('x_peer_by_cpu'), 2)} | {_n(row.get('lost'))} / "
               f"{_n(row.get('order_violations'))} / {_n(row.get('duplicates'))} |")
    yield from throughput_baseline(result)
    yield from targets(result)


def throughput_baseline(result: dict[str, Any]) -> Iterator[str]:
    """Each row against its twin on the baseline revision (``--baseline``)."""
    base = result.get("baseline")
    if not isinstance(base, dict):
        return
    yield ""
    yield (f"| row | against `{base.get('revision')}`: x msg/s | x by CPU | "
           "x msg/s of each round |")
    yield "|---|---|---|---|"
    for name in base.get("rows", {}):
        row = result.get("rows", {}).get(name, {})
        rounds = row.get("x_baseline_rounds")
        yield (f"| `{name}` | {_n(row.get('x_baseline'), 2)} | "
               f"{_n(row.get('x_baseline_by_cpu'), 2)} | "
               f"{', '.join(_n(x, 2) for x in rounds) if rounds else '-'} |")


def failover(result: dict[str, Any]) -> Iterator[str]:
    setup = result.get("setup", {})
    yield (f"Failover: {setup.get('trials')} trials, {setup.get('rate')} msg/s, "
           f"`cgroupd join` at defaults; {machine_line(result)}.")
    yield ""
    yield "| fault | p50 s | p99 s | max s |"
    yield "|---|---|---|---|"
    rows: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("kill -9 of the active instance", ("sigkill",)),
        ("SIGTERM handover", ("sigterm",)),
        ("SIGTERM right after a failover", ("sigterm", "right_after_failover")),
        ("peer: kill -9 of the processing instance", ("peer",)))
    rev = _get(result, "baseline", "revision")
    if rev:  # --baseline: the same parts on that revision, each under its own
        rows = tuple(row for label, path in rows[:3] for row in (
            (label, path), (f"{label}, on `{rev}`", (f"{path[0]}@{rev}", *path[1:])))
        ) + rows[3:]
    for label, path in rows:
        part = _get(result, *path)
        if isinstance(part, dict) and "p50_s" in part:
            yield (f"| {label} | {_n(part['p50_s'], 3)} | {_n(part.get('p99_s'), 3)} | "
                   f"{_n(part.get('max_s'), 3)} |")
        elif isinstance(part, dict) and "skipped" in part:
            yield f"| {label} | skipped: {part['skipped']} | | |"
    for kind, stall in (_get(result, "stall") or {}).items():
        if isinstance(stall, dict) and "takeovers" in stall:
            yield (f"| stall `{kind}`: takeovers / overlaps in {stall.get('trials')} trials "
                   f"| {stall['takeovers']} / {stall['overlaps']} | | |")
    for cut, part in (_get(result, "netns") or {}).items():
        if cut.startswith("cut_") and isinstance(part, dict):
            take = part.get("takeover", {})
            yield (f"| network cut {cut[4:]}: takeover (old owner's starts after it: "
                   f"{part.get('old_owner_starts_after_takeover')}) | "
                   f"{_n(take.get('p50_s'), 3)} | {_n(take.get('p99_s'), 3)} | "
                   f"{_n(take.get('max_s'), 3)} |")
    yield from targets(result)


def scale(result: dict[str, Any]) -> Iterator[str]:
    yield f"Scale: {machine_line(result)}."
    yield ""
    yield "| | cgroupd | peer |"
    yield "|---|---|---|"
    mine = _get(result, "cgroupd", "idle") or {}
    peer = _get(result, "peer", "idle") or {}
    rows = (("instances", ("processes",), 0, ""),
            ("server CPU, idle", ("server_cpu_percent",), 2, " %"),
            ("CPU per instance, idle (mean)", ("member_cpu_percent_each", "mean"), 2, " %"),
            ("CPU per instance, idle (max)", ("member_cpu_percent_each", "max"), 2, " %"),
            ("active CPU each (mean)", ("active", "cpu_percent_each", "mean"), 2, " %"),
            ("standby CPU each (mean)", ("standby", "cpu_percent_each", "mean"), 2, " %"),
            ("RSS per instance (max)", ("rss_mb_each", "max"), 1, " MB"))
    for label, path, digits, unit in rows:
        yield (f"| {label} | {_n(_get(mine, *path), digits, unit)} | "
               f"{_n(_get(peer, *path), digits, unit)} |")
    added = _get(result, "cgroupd", "add_members") or {}
    for label, key, digits in (("members added under traffic", "added_members", 0),
                               ("re-owned in (s)", "reowned_s", 2),
                               ("longest gap of a partition (s)", "longest_gap_s", 2),
                               ("longest gap before (s)", "longest_gap_before_s", 2),
                               ("duplicates / lost / order violations", "duplicates", 0)):
        raw = added.get(key)
        if isinstance(raw, dict):  # a gap: {"partition": p, "seconds": s}
            raw = raw.get("seconds")
        value = _n(raw, digits)
        if key == "duplicates":
            value = f"{value} / {_n(added.get('lost'))} / {_n(added.get('order_violations'))}"
        yield f"| {label} | {value} | |"
    yield from targets(result)


#: The steps between two messages in the order one message meets them (bench.profile).
_STEP_ORDER = ["settle", "refill", "flush", "server round trip", "puller", "dispatch"]


def profile(result: dict[str, Any]) -> Iterator[str]:
    member = result.get("profiled_member", {})
    yield (f"Profile ({result.get('tool')}): {result.get('case')}; the profiled member ran "
           f"{_n(member.get('messages'))} messages at {_n(member.get('cpu_us_per_msg'), 1)} "
           f"CPU µs/msg; {machine_line(result)}.")
    yield ""
    split = result.get("wall_split")
    if split:
        yield f"| per message (wall {_n(split.get('wall_us_per_msg'), 0)} µs) | mean µs | p50 µs |"
        yield "|---|---|---|"
        handler = split.get("handler", {})
        yield (f"| handler (the recording handler) | {_n(handler.get('mean_us'), 0)} | "
               f"{_n(handler.get('p50_us'), 0)} |")
        counts = split.get("steps_per_message")
        if counts:
            yield ("| (per message: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                   + ") | | |")
        steps = split.get("between_messages", {})
        for name, part in sorted(steps.items(), key=lambda item: _STEP_ORDER.index(
                item[0].split(":")[0]) if item[0].split(":")[0] in _STEP_ORDER else 99):
            yield f"| {name} | {_n(part.get('mean_us'), 0)} | {_n(part.get('p50_us'), 0)} |"
        return
    table = _get(result, "profile", "by_innermost_cgroupd_frame") or _get(
        result, "profile", "self") or []
    yield "| where (innermost cgroupd or handler frame) | share | µs/msg |"
    yield "|---|---|---|"
    waiting = _get(result, "profile", "waiting_in_select_share")
    if waiting is not None:
        share = _n(waiting * 100, 1, " %")
        yield f"| (samples waiting in `select`, left out of the shares) | {share} | |"
    for row in table[:PROFILE_ROWS]:
        yield f"| {row['what']} | {_n(row['share'] * 100, 1, ' %')} | {_n(row['us_per_msg'], 1)} |"


def footprint(result: dict[str, Any]) -> Iterator[str]:
    yield (f"Footprint, idle, one member (active + standby): options {result.get('options')}, "
           f"settings {result.get('settings')}; {machine_line(result)}.")
    yield ""
    yield "| process | CPU % of a core | wakeups/s | RSS MB |"
    yield "|---|---|---|---|"
    for name in ("active", "standby"):
        part = result.get(name, {})
        yield (f"| {name} | {_n(part.get('cpu_percent'), 2)} | {_n(part.get('wakeups_per_s'), 1)} "
               f"| {_n(part.get('rss_mb'), 1)} |")
    yield (f"| nats-server | {_n(result.get('server_cpu_percent'), 2)} | "
           f"{_n(result.get('server_wakeups_per_s'), 1)} | |")


def fleet_growth(result: dict[str, Any]) -> Iterator[str]:
    """One row per size of ``bench.fleet_growth`` (a size not measured yet says so), and
    the fitted growth exponent of each total (1: grows linearly with the instances)."""
    settings = result.get("settings", {})
    m = result.get("machine", {})
    yield (f"Fleet growth: {settings.get('copies')} instances per member, "
           f"{settings.get('processes')} worker processes, {settings.get('idle_s')} s at rest "
           f"per size; {m.get('cores')} cores, Python {m.get('python')}, "
           f"{m.get('nats_server')}.")
    yield ""
    yield ("| instances (members) | load 1 min before / after | all active s (ms per member) "
           "/ all settled s "
           "| first round served s | died / workers exited | server CPU % (per instance) "
           "| API requests/s (per member) | instances' CPU % (per instance) |")
    yield "|---|---|---|---|---|---|---|---|"
    for row in result.get("sizes", []):
        size = f"{_n(row.get('instances'))} ({_n(row.get('members'))})"
        if row.get("pending"):
            yield (f"| {size} | **to be measured** (quiet machine: `python -m bench.fleet_growth "
                   f"--sizes {row.get('instances')}`) | | | | | | |")
            continue
        load = row.get("load_average_1min") or [None, None]
        cells = [
            f"{_n(load[0], 2)} / {_n(load[1], 2)}",
            f"{_n(row.get('all_active_s'), 2)} ({_n(row.get('all_active_ms_per_member'), 1)}) "
            f"/ {_n(row.get('all_settled_s'), 2)}",
            _n(row.get("first_round_served_s"), 2),
            f"{_n(row.get('died'))} / {_n(row.get('workers_exited'))}",
            f"{_n(row.get('idle_server_cpu_pct'), 1)} "
            f"({_n(row.get('server_cpu_pct_per_instance'), 4)})",
            f"{_n(row.get('idle_api_per_s'), 1)} ({_n(row.get('api_per_s_per_member'), 2)})",
            f"{_n(row.get('idle_workers_cpu_pct'), 1)} "
            f"({_n(row.get('idle_cpu_per_instance_pct'), 4)})",
        ]
        if row.get("error"):
            cells[1] = f"failed: {row['error']}"
        yield f"| {size} | " + " | ".join(cells) + " |"
    grown = result.get("growth") or {}
    yield ("| growth exponent (1 = linear, 0 = flat) | | "
           f"{_n(grown.get('all_active_s'), 2)} / {_n(grown.get('all_settled_s'), 2)} | "
           f"{_n(grown.get('first_round_served_s'), 2)} | "
           f"| {_n(grown.get('idle_server_cpu_pct'), 2)} | {_n(grown.get('idle_api_per_s'), 2)} "
           f"| {_n(grown.get('idle_workers_cpu_pct'), 2)} |")
    fits = result.get("lines") or {}

    def line(key: str) -> str:
        fit = fits.get(key)
        if not isinstance(fit, dict):
            return "-"
        fixed, slope = float(fit["fixed"]), float(fit["per_instance"])
        sign = "-" if slope < 0 else "+"
        fixed = round(fixed, 2) + 0.0  # -0.0 + 0.0 is 0.0: no "-0.00"
        return f"{_n(fixed, 2)} {sign} {abs(slope):.5f} n"

    yield (f"| least-squares line (n instances) | | {line('all_active_s')} / "
           f"{line('all_settled_s')} | "
           f"{line('first_round_served_s')} | | {line('idle_server_cpu_pct')} | "
           f"{line('idle_api_per_s')} | {line('idle_workers_cpu_pct')} |")


RENDER = {"throughput": throughput, "failover": failover, "scale": scale,
          "profile": profile, "footprint": footprint, "fleet_growth": fleet_growth}


def render(result: dict[str, Any]) -> str:
    kind = result.get("benchmark")
    if kind not in RENDER:
        raise ValueError(f"not a benchmark's output (benchmark: {kind!r})")
    return "\n".join(RENDER[kind](result))


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: python -m bench.table RESULT.json [RESULT.json ...]", file=sys.stderr)
        return 2
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
            print(render(result))
        except (OSError, ValueError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 1
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
