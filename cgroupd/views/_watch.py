"""The screens of ``cgroupd status --watch``: totals, rates and one lag bar per partition,
fitted to the terminal, and what it shows while refreshing fails."""

from __future__ import annotations

from typing import Any

from cgroupd.views._text import duration, ranges, table

#: Characters of a lag bar in the live view.
BAR_WIDTH = 20


def _bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    if top <= 0 or value <= 0 or width <= 0:
        return ""
    filled = max(1, round(width * value / top))
    return "#" * min(width, filled)


def watch_frame(data: dict[str, Any], previous: dict[str, Any] | None, elapsed: float,
                width: int, height: int, clock: str) -> str:
    """One screen of ``cgroupd status --watch``: the group's totals and rates (messages in
    and processed per second since the previous frame), then one row per partition with
    its owner, lag bar, lag in messages and time and its trend; the partitions furthest
    behind first when they do not all fit."""
    rows = data["partitions"]
    top = max((r["pending"] for r in rows), default=0)
    prev = {r["partition"]: r for r in (previous or {}).get("partitions", [])}
    rate_in = rate_out = None
    if previous is not None and elapsed > 0 and "appended" in data and "appended" in previous:
        rate_in = max(0.0, (data["appended"] - previous["appended"]) / elapsed)
        rate_out = max(0.0, rate_in - (data["pending"] - previous["pending"]) / elapsed)
    head = [f"{data['stream']}/{data['group']} ({data['type']})   {clock}   every "
            f"{elapsed:.1f}s" if previous is not None else
            f"{data['stream']}/{data['group']} ({data['type']})   {clock}",
            f"pending {data['pending']}   max lag {data['max_lag_messages']} msgs / "
            f"{duration(data['max_lag_seconds'])}   in {_rate(rate_in)}   processed "
            f"{_rate(rate_out)}   in flight {data['in_flight']}",
            _ownership_line(data), ""]
    body_rows = []
    for r in rows:
        before = prev.get(r["partition"])
        trend = ("" if before is None or elapsed <= 0 else
                 f"{(r['pending'] - before['pending']) / elapsed:+.0f}/s")
        owner = r["member"] or "-"
        if r["instance"] is None and r["member"] is not None:
            owner += " (NO ACTIVE INSTANCE)"
        body_rows.append((r["partition"], owner, r["host"] or r["instance"] or "-",
                          r["pending"], duration(r["lag_seconds"]) if r["pending"] else "-",
                          trend))
    room = max(1, height - len(head) - 4)  # table header, note, blank, hint
    shown = body_rows
    note = ""
    if len(body_rows) > room:
        shown = sorted(body_rows, key=lambda row: (-int(row[3]), int(row[0])))[:room]
        shown.sort(key=lambda row: int(row[0]))
        note = (f"... {len(body_rows) - room} more partitions (showing the {room} "
                f"furthest behind)")
    headers = ["PARTITION", "OWNER", "HOST", "PENDING", "LAG-TIME", "TREND"]
    used = max((len(line) for line in table(headers, shown).splitlines()), default=0)
    bar = max(0, min(BAR_WIDTH, width - used - 2))  # the bars shrink to fit the width
    text = table([*headers, "LAG"],
                 [(*row, _bar(float(row[3]), top, bar)) for row in shown])
    lines = head + text.splitlines() + ([note] if note else []) + ["", "Ctrl-C to quit"]
    return "\n".join(line[:width] for line in lines)


def watch_problem_frame(stream: str, group: str, problem: str, clock: str,
                        last_clock: str, last_frame: str | None, width: int,
                        height: int) -> str:
    """The screen of ``status --watch`` while refreshing fails: what failed and that it
    is retried, then (on a terminal) the last good view under it, marked as such."""
    lines = [f"{stream}/{group}   {clock}   CANNOT REFRESH: {problem}",
             f"retrying; the view below is from {last_clock}" if last_frame is not None
             else f"retrying; last refreshed at {last_clock}"]
    if last_frame is not None:
        lines += ["", *last_frame.splitlines()]
    return "\n".join(line[:width] for line in lines[:max(2, height - 1)])


def _ownership_line(data: dict[str, Any]) -> str:
    unowned = data["unowned_partitions"]
    if data["idle"]:
        return "THE GROUP IS IDLE: no partition has an active instance"
    if unowned:
        return (f"UNOWNED partitions {ranges(unowned)} (members without an active "
                f"instance: {', '.join(data['members_without_instance']) or '-'})")
    return "every partition has an active instance"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}/s"
