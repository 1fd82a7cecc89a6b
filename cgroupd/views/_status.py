"""``cgroupd status`` and ``cgroupd member ls``: per partition and per member, who consumes
it now, how far behind it is, and which instances answered discovery."""

from __future__ import annotations

from typing import Any

from cgroupd.admin import ConsumerView, GroupStatus
from cgroupd.core.partitions import assignment
from cgroupd.views._groups import group_kind
from cgroupd.views._text import duration, ranges, table


def _by_instance(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(i.get("instance")): i for i in instances}


def _active_of(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per member, the discovered instance that says it is active."""
    return {str(i.get("member")): i for i in instances if i.get("state") == "active"}


def _held_by(st: GroupStatus) -> dict[str, ConsumerView]:
    """Per instance id, the synchronization consumer of a holder that is not a member
    instance (a Spark query's lease)."""
    return {str(c.instance): c for c in st.consumers if c.holder and c.instance}


def _holder_of(lease: ConsumerView | None, answer: dict[str, Any] | None
               ) -> dict[str, Any] | None:
    """``{"kind": "spark", "application": ..., "since": ...}`` for a partition a Spark
    query holds (None: a member instance, or nobody)."""
    if lease is None:
        return None
    return {"kind": lease.holder, "since": lease.since,
            "application": (answer or {}).get("application")}


def status_data(st: GroupStatus, instances: list[dict[str, Any]]) -> dict[str, Any]:
    """``cgroupd status --json``: per partition its member, active instance (and that
    instance's host when it answered discovery), lag in messages and seconds, in
    flight; the group's totals and maxima; the consumers; the discovered instances."""
    config = st.group.config
    by_id, active = _by_instance(instances), _active_of(instances)
    held = _held_by(st)

    def host(instance: str | None, member: str | None) -> str | None:
        # Pinned consumers name the pin, not the instance: fall back to the member's
        # instance that says it is active; a Spark query's lease records its host.
        found = by_id.get(str(instance)) or (active.get(str(member)) if instance else None)
        if found and found.get("host"):
            return str(found["host"])
        lease = held.get(str(instance))
        return lease.host if lease is not None else None

    rows = [{"partition": r.partition, "member": r.member, "instance": r.instance,
             "host": host(r.instance, r.member), "pending": r.pending,
             "lag_messages": r.pending, "lag_seconds": round(r.lag_seconds, 3),
             "in_flight": r.in_flight,
             "holder": _holder_of(held.get(str(r.instance)), by_id.get(str(r.instance)))}
            for r in st.partitions]
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
                       "pending": c.num_pending, "ack_pending": c.num_ack_pending,
                       "holder": c.holder, "host": c.host, "since": c.since}
                      for c in st.consumers],
        "instances": instances,
    }


def status_text(data: dict[str, Any], st: GroupStatus) -> str:
    config = st.group.config
    lines = [f"{data['stream']}/{data['group']} ({data['type']}): {config.max_members} "
             f"partitions, {data['pending']} pending",
             f"max lag {data['max_lag_messages']} messages, "
             f"{duration(data['max_lag_seconds'])}; {data['in_flight']} in flight", ""]
    spark = sorted({(r["instance"], r["member"] or "-", r["host"] or "-",
                     r["holder"].get("application") or "?", r["holder"].get("since") or "?")
                    for r in data["partitions"] if r.get("holder")}, key=str)
    lines.append(table(
        ["PARTITION", "MEMBER", "INSTANCE", "HOST", "PENDING", "LAG-TIME", "IN-FLIGHT"],
        [(r["partition"], r["member"] or "-", r["instance"] or "-", r["host"] or "-",
          r["pending"], duration(r["lag_seconds"]) if r["pending"] else "-",
          "-" if r["in_flight"] is None else r["in_flight"]) for r in data["partitions"]]))
    if spark:
        lines += ["", "held by Spark queries (mode=workqueue):"] + [
            f"  {member}: lease {lease} on {host}, application {app}, since {since}"
            for lease, member, host, app, since in spark]
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
                                                 "partitions", "in_flight", "version",
                                                 "holder", "application")}
                          for i in answered],
        })
    return rows


def _state_text(instance: dict[str, Any]) -> str:
    """An instance's state; a Spark query's lease says so, with its application."""
    state = str(instance.get("state") or "-")
    if instance.get("holder") == "spark":
        return f"{state} (Spark {instance.get('application') or 'query'})"
    return state


def members_text(stream: str, group: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"{stream}/{group} has no members"
    summary = table(
        ["MEMBER", "PARTITIONS", "ACTIVE INSTANCE", "PENDING", "LAG-TIME", "INSTANCES"],
        [(r["member"] + ("" if r["listed"] else " (not a member)"), ranges(r["partitions"]),
          r["active_instance"] or ("-" if not r["partitions"] else "NONE (not consumed)"),
          r["pending"], duration(r["lag_seconds"]) if r["pending"] else "-",
          len(r["instances"])) for r in rows])
    detail = [(r["member"], i["instance"], _state_text(i), i["host"] or "-",
               i["pid"] or "-", i["since"] or "-", ranges(i["partitions"] or []))
              for r in rows for i in r["instances"]]
    if not detail:
        return summary + ("\n\nno cgroupd join instance answered (instances of library "
                          "members do not; their active instance is shown above)")
    return summary + "\n\n" + table(
        ["MEMBER", "INSTANCE", "STATE", "HOST", "PID", "SINCE", "PARTITIONS"], detail)
