"""A group as ``cgroupd group create|info|ls`` and the membership commands show it (its
configuration and who owns which partitions), and a replay plan as ``cgroupd replay`` shows
it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cgroupd.core.config import ElasticGroupConfig, GroupConfig, StaticGroupConfig
from cgroupd.core.partitions import assignment, assignment_ranges
from cgroupd.views._text import ranges, table

if TYPE_CHECKING:
    from cgroupd.admin import ListedGroup


#: Most partitions ``group_data`` lists one by one (``assignment``).
LISTED_PARTITIONS = 65_536


def _span_text(spans: tuple[tuple[int, int], ...]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "-"


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
    }
    spans = assignment_ranges(config)
    # Every partition listed, up to LISTED_PARTITIONS (a reference group may have up to
    # 2**31-1); "assignment_ranges" always, as inclusive [first, last] pairs.
    if config.max_members <= LISTED_PARTITIONS:
        data["assignment"] = {m: list(ps) for m, ps in assignment(config).items()}
    data["assignment_ranges"] = {m: [list(r) for r in rs] for m, rs in spans.items()}
    if isinstance(config, ElasticGroupConfig):
        data["filters"] = [{"filter": pf.filter, "wildcards": list(pf.partitioning_wildcards)}
                           for pf in config.partitioning_filters]
        data["whole_subject"] = config.whole_subject
        data["max_buffered_msgs"] = config.max_buffered_msgs
        data["max_buffered_bytes"] = config.max_buffered_bytes
        data["consume_stream"] = f"{stream}-{group}"
    else:
        data["filters"] = [{"filter": f, "wildcards": []} for f in config.filters]
        data["consume_stream"] = stream
    if revision is not None:
        data["revision"] = revision
    return data


def listed_group_data(stream: str, listed: ListedGroup) -> dict[str, Any]:
    """One row of ``cgroupd group ls --json``: the group, or why its record is unreadable
    (``error``; the other rows are still listed)."""
    if listed.stored is None:
        return {"stream": stream, "group": listed.group, "type": listed.kind,
                "error": listed.error}
    return group_data(stream, listed.group, listed.stored.config, listed.stored.revision)


def groups_text(stream: str, groups: list[dict[str, Any]]) -> str:
    """``cgroupd group ls``: one row per group; an unreadable one says so."""
    if not groups:
        return f"no consumer groups on stream {stream}"
    return table(["GROUP", "TYPE", "PARTITIONS", "MEMBERS"],
                 [(g["group"], g["type"], "?", f"UNREADABLE: {g['error']}") if g.get("error")
                  else (g["group"], g["type"], g["partitions"],
                        ", ".join(g["assignment_ranges"]) or "-") for g in groups])


def assignment_text(config: GroupConfig) -> str:
    """Which member owns which partitions, as a table."""
    owned = assignment_ranges(config)
    if not owned:
        return "no members: no partition is consumed"
    return table(["MEMBER", "PARTITIONS"],
                 [(m, _span_text(spans)) for m, spans in sorted(owned.items())])


def group_text(stream: str, group: str, config: GroupConfig,
               revision: int | None = None) -> str:
    """``cgroupd group info``: the configuration, then the assignment."""
    if isinstance(config, ElasticGroupConfig):
        filters = ", ".join(
            pf.filter + (f" (wildcards {','.join(map(str, pf.partitioning_wildcards))})"
                         if pf.partitioning_wildcards else " (whole subject)")
            for pf in config.partitioning_filters) or "none: every subject, hashed whole"
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


def replay_text(plan: dict[str, Any]) -> str:
    """A replay plan (dry run) or its result, one row per partition."""
    executed = plan["executed"]
    target = plan["target"]
    point = not target.startswith(("the latest", "the current", "a shift", "the positions"))
    if point:
        head = (f"{'replayed' if executed else 'DRY RUN: would replay'} {plan['stream']}/"
                f"{plan['group']} ({plan['type']}) from {target}"
                + (f" (sequence {plan['sequence']})" if plan["sequence"] is not None else ""))
    else:
        head = (f"{'moved' if executed else 'DRY RUN: would move'} {plan['stream']}/"
                f"{plan['group']} ({plan['type']}) to {target}")
    elastic = plan["type"] == "elastic"

    def seq(value: Any) -> str:
        return "-" if value is None else str(value)

    headers = ["PARTITION", "MEMBER", "NOW AT", "FROM SEQ", "AGAIN", "SKIPPED"]
    headers += ["WAITING (KEPT IN ORDER)"] if elastic else []
    rows = table(headers, [
        (p["partition"], p["member"] or "-", seq(p.get("current")), seq(p["from_sequence"]),
         p["reprocess"], p["skip"], *([p["dropped_pending"]] if elastic else []))
        for p in plan["partitions"]])
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
