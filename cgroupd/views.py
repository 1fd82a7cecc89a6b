"""What the operator commands and the demo show: tables, group configurations, status,
members, the live view, replay plans, events.

Pure (no I/O): data in (a group config, a :class:`~cgroupd.admin.GroupStatus`, discovered
instances, replay plans), JSON-ready dicts and text out, so the CLI stays a thin shell and
every rendering is unit-tested without a server or a terminal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from cgroupd import events
from cgroupd.admin import GroupStatus
from cgroupd.config import ElasticGroupConfig, GroupConfig, StaticGroupConfig
from cgroupd.partitions import assignment

#: Characters of a lag bar in the live view.
BAR_WIDTH = 20


def ranges(partitions: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (``-`` when empty)."""
    parts = sorted(set(partitions))
    out: list[str] = []
    i = 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1] == parts[j] + 1:
            j += 1
        out.append(str(parts[i]) if i == j else f"{parts[i]}-{parts[j]}")
        i = j + 1
    return ",".join(out) or "-"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in cells]
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    """``0.4`` → ``0.4s``, ``75`` → ``1m15s``, ``7300`` → ``2h01m``, ``None`` → ``-``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def group_kind(config: GroupConfig) -> str:
    """``static`` or ``elastic``."""
    return "static" if isinstance(config, StaticGroupConfig) else "elastic"


def group_data(stream: str, group: str, config: GroupConfig,
               revision: int | None = None) -> dict[str, Any]:
    """``cgroupd group create|info|ls --json`` and the membership commands: a group's
    configuration and who owns which partitions."""
    data: dict[str, Any] = {
        "stream": stream, "group": group, "type": group_kind(config),
        "partitions": config.max_members, "members": list(config.members),
        "mappings": [{"member": m.member, "partitions": list(m.partitions)}
                     for m in config.member_mappings],
        "assignment": {m: list(ps) for m, ps in assignment(config).items()},
    }
    if isinstance(config, ElasticGroupConfig):
        data["filters"] = [{"filter": pf.filter, "wildcards": list(pf.partitioning_wildcards)}
                           for pf in config.partitioning_filters]
        data["max_buffered_msgs"] = config.max_buffered_msgs
        data["max_buffered_bytes"] = config.max_buffered_bytes
        data["consume_stream"] = f"{stream}-{group}"
    else:
        data["filters"] = [{"filter": f, "wildcards": []} for f in config.filters]
        data["consume_stream"] = stream
    if revision is not None:
        data["revision"] = revision
    return data


def assignment_text(config: GroupConfig) -> str:
    """Which member owns which partitions, as a table."""
    owned = assignment(config)
    if not owned:
        return "no members: no partition is consumed"
    return table(["MEMBER", "PARTITIONS"], [(m, ranges(ps)) for m, ps in sorted(owned.items())])


def group_text(stream: str, group: str, config: GroupConfig,
               revision: int | None = None) -> str:
    """``cgroupd group info``: the configuration, then the assignment."""
    if isinstance(config, ElasticGroupConfig):
        filters = ", ".join(
            pf.filter + (f" (wildcards {','.join(map(str, pf.partitioning_wildcards))})"
                         if pf.partitioning_wildcards else " (whole subject)")
            for pf in config.partitioning_filters)
        consume = f"{stream}-{group} (work queue)"
    else:
        filters = ", ".join(config.filters) or "-"
        consume = f"{stream} (subjects start with the partition)"
    if config.member_mappings:
        membership = "mapped: " + "  ".join(f"{m.member}={ranges(m.partitions)}"
                                            for m in config.member_mappings)
    else:
        membership = ", ".join(config.members) or "-"
    rows = [("group", f"{stream}/{group} ({group_kind(config)})"),
            ("partitions", str(config.max_members)),
            ("filters", filters),
            ("consumes", consume),
            ("members", membership)]
    if isinstance(config, ElasticGroupConfig) and (config.max_buffered_msgs
                                                   or config.max_buffered_bytes):
        rows.append(("buffer", f"{config.max_buffered_msgs or 'unlimited'} msgs, "
                               f"{config.max_buffered_bytes or 'unlimited'} bytes"))
    if revision is not None:
        rows.append(("revision", str(revision)))
    width = max(len(k) for k, _ in rows)
    head = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    return f"{head}\n\n{assignment_text(config)}"


def _by_instance(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(i.get("instance")): i for i in instances}


def _active_of(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per member, the discovered instance that says it is active."""
    return {str(i.get("member")): i for i in instances if i.get("state") == "active"}


def status_data(st: GroupStatus, instances: list[dict[str, Any]]) -> dict[str, Any]:
    """``cgroupd status --json``: per partition its member, active instance (and that
    instance's host when it answered discovery), lag in messages and seconds, in
    flight; the group's totals and maxima; the consumers; the discovered instances."""
    config = st.group.config
    by_id, active = _by_instance(instances), _active_of(instances)

    def host(instance: str | None, member: str | None) -> str | None:
        # Pinned consumers name the pin, not the instance: fall back to the member's
        # instance that says it is active.
        found = by_id.get(str(instance)) or (active.get(str(member)) if instance else None)
        return found.get("host") if found else None

    rows = [{"partition": r.partition, "member": r.member, "instance": r.instance,
             "host": host(r.instance, r.member), "pending": r.pending,
             "lag_messages": r.pending, "lag_seconds": round(r.lag_seconds, 3),
             "in_flight": r.in_flight} for r in st.partitions]
    owned = [r for r in st.partitions if r.instance is not None]
    return {
        "stream": st.group.stream, "group": st.group.group, "type": group_kind(config),
        "partitions": rows,
        "pending": sum(r.pending for r in st.partitions),
        "max_lag_messages": max((r.pending for r in st.partitions), default=0),
        "max_lag_seconds": round(max((r.lag_seconds for r in st.partitions), default=0.0),
                                 3),
        "in_flight": sum(r.in_flight or 0 for r in st.partitions),
        "unowned_partitions": st.unowned_partitions,
        "members_without_instance": st.members_without_instance,
        "idle": not owned and config.max_members > 0,
        "consumers": [{"name": c.name, "member": c.member, "instance": c.instance,
                       "role": c.role, "partitions": list(c.partitions),
                       "pending": c.num_pending, "ack_pending": c.num_ack_pending}
                      for c in st.consumers],
        "instances": instances,
    }


def status_text(data: dict[str, Any], st: GroupStatus) -> str:
    config = st.group.config
    lines = [f"{data['stream']}/{data['group']} ({data['type']}): {config.max_members} "
             f"partitions, {data['pending']} pending",
             f"max lag {data['max_lag_messages']} messages, "
             f"{duration(data['max_lag_seconds'])}; {data['in_flight']} in flight", ""]
    lines.append(table(
        ["PARTITION", "MEMBER", "INSTANCE", "HOST", "PENDING", "LAG-TIME", "IN-FLIGHT"],
        [(r["partition"], r["member"] or "-", r["instance"] or "-", r["host"] or "-",
          r["pending"], duration(r["lag_seconds"]) if r["pending"] else "-",
          "-" if r["in_flight"] is None else r["in_flight"]) for r in data["partitions"]]))
    if st.members_without_instance:
        owned = assignment(config)
        lines += ["", "members with no active instance (partitions not consumed): "
                  + ", ".join(f"{m} ({ranges(owned.get(m, ()))})"
                              for m in st.members_without_instance)]
    unassigned = [r["partition"] for r in data["partitions"] if r["member"] is None]
    if unassigned:
        lines += ["", f"partitions with no member: {ranges(unassigned)}"]
    if data["idle"]:
        lines += ["", "the group is IDLE: no partition has an active instance"]
    elif not st.unowned_partitions:
        lines += ["", "every partition has an active instance"]
    return "\n".join(lines)


def members_data(st: GroupStatus, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``cgroupd member ls`` / ``status --members`` (Kafka's ``--describe --members``):
    per member its partitions, lag, active instance, and every instance that answered
    discovery (active or standby, host, since when, partitions)."""
    config = st.group.config
    owned = assignment(config)
    rows: list[dict[str, Any]] = []
    for name in dict.fromkeys([*config.member_names, *owned,
                               *(str(i.get("member")) for i in instances)]):
        parts = owned.get(name, ())
        holders = {r.instance for r in st.partitions
                   if r.member == name and r.instance is not None}
        mine = [r for r in st.partitions if r.member == name]
        answered = [i for i in instances if i.get("member") == name]
        rows.append({
            "member": name, "partitions": list(parts),
            "active_instance": sorted(holders)[0] if holders else None,
            "pending": sum(r.pending for r in mine),
            "lag_seconds": round(max((r.lag_seconds for r in mine), default=0.0), 3),
            "listed": name in config.member_names or name in owned,
            "instances": [{k: i.get(k) for k in ("instance", "state", "host", "pid", "since",
                                                 "partitions", "in_flight", "version")}
                          for i in answered],
        })
    return rows


def members_text(stream: str, group: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"{stream}/{group} has no members"
    summary = table(
        ["MEMBER", "PARTITIONS", "ACTIVE INSTANCE", "PENDING", "LAG-TIME", "INSTANCES"],
        [(r["member"] + ("" if r["listed"] else " (not a member)"), ranges(r["partitions"]),
          r["active_instance"] or ("-" if not r["partitions"] else "NONE (not consumed)"),
          r["pending"], duration(r["lag_seconds"]) if r["pending"] else "-",
          len(r["instances"])) for r in rows])
    detail = [(r["member"], i["instance"], i["state"], i["host"] or "-", i["pid"] or "-",
               i["since"] or "-", ranges(i["partitions"] or []))
              for r in rows for i in r["instances"]]
    if not detail:
        return summary + ("\n\nno cgroupd join instance answered (instances of library "
                          "members do not; their active instance is shown above)")
    return summary + "\n\n" + table(
        ["MEMBER", "INSTANCE", "STATE", "HOST", "PID", "SINCE", "PARTITIONS"], detail)


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


def replay_text(plan: dict[str, Any]) -> str:
    """A replay plan (dry run) or its result, one row per partition."""
    executed = plan["executed"]
    head = (f"{'replayed' if executed else 'DRY RUN: would replay'} {plan['stream']}/"
            f"{plan['group']} ({plan['type']}) from {plan['target']}"
            + (f" (sequence {plan['sequence']})" if plan["sequence"] is not None else ""))
    elastic = plan["type"] == "elastic"
    headers = ["PARTITION", "MEMBER", "FROM SEQ", "AGAIN",
               "WAITING (KEPT IN ORDER)" if elastic else "SKIPPED"]
    rows = table(headers, [
        (p["partition"], p["member"] or "-",
         p["from_sequence"] if p["from_sequence"] is not None else "-", p["reprocess"],
         p["dropped_pending"] if elastic else p["skip"]) for p in plan["partitions"]])
    total = sum(p["reprocess"] for p in plan["partitions"])
    skipped = sum(p["skip"] for p in plan["partitions"])
    verb = "are" if executed else "would be"
    tail = [f"{total} messages {verb} processed again"
            + (f", {skipped} skipped" if skipped else "")]
    tail += plan.get("notes", [])
    if plan["blockers"]:
        tail += ["", "REFUSED now:" if not executed else "blocked:"]
        tail += [f"  - {b}" for b in plan["blockers"]]
    if not executed:
        tail.append("nothing changed; run again with --execute to replay")
    return "\n".join([head, "", rows, "", *tail])


def event_line(event: dict[str, Any]) -> str:
    """One human line for an event (``cgroupd events``), in the manner of ``nats events``.
    Anyone allowed to publish can put anything on the advisory subjects: what does not
    read as an advisory is shown as such (INVALID, UNKNOWN, MALFORMED), never raised."""
    stamp = str(event.get("timestamp", ""))
    when = stamp[11:23] if len(stamp) >= 23 else stamp
    kind = events.kind_of(event)
    if kind == "invalid":
        return (f"[{when or '-'}] INVALID advisory (not a JSON object) on "
                f"{event.get('subject')}: {event.get('data')}")
    if kind not in events.KINDS:
        return f"[{when or '-'}] UNKNOWN advisory: {json.dumps(event, sort_keys=True)[:500]}"
    try:
        return _advisory_line(event, kind, when)
    except (TypeError, ValueError, AttributeError):
        return (f"[{when or '-'}] MALFORMED {kind} advisory: "
                f"{json.dumps(event, sort_keys=True)[:500]}")


def _partitions(event: dict[str, Any], key: str) -> str:
    """A partition list field as ranges; ValueError unless a list of partition numbers."""
    value = event.get(key) or []
    if not isinstance(value, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in value):
        raise ValueError(f"{key} is not a list of partitions")
    return ranges(value)


def _advisory_line(event: dict[str, Any], kind: str, when: str) -> str:
    where = f"{event.get('stream')}/{event.get('group')}"
    who = (f"{event.get('member')} instance {event.get('instance')}"
           f" on {event.get('host') or '?'}")
    parts = _partitions(event, "partitions")
    if kind == "active":
        text = f"{who} became active: partitions {parts}"
    elif kind == "stepped_down":
        text = f"{who} stepped down ({event.get('reason')}): released partitions {parts}"
    elif kind == "rebalanced":
        text = (f"{who} rebalanced in {float(event.get('seconds') or 0):.3f}s: now "
                f"{parts} (gained {_partitions(event, 'gained')}, lost "
                f"{_partitions(event, 'lost')})")
    elif kind == "unowned":
        missing = ", ".join(event.get("members_without_instance") or []) or "-"
        idle = " THE GROUP IS IDLE:" if event.get("idle") else ""
        text = (f"{idle} partitions {_partitions(event, 'unowned_partitions')} have "
                f"no active instance (members without one: {missing}; "
                f"{event.get('pending', 0)} messages waiting there)").lstrip()
    return f"[{when}] {where} {kind.upper()} {text}"
