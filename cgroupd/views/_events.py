"""``cgroupd events``: one human line per advisory; hostile or malformed ones are shown as
such, never raised."""

from __future__ import annotations

import json
from typing import Any

from cgroupd.nats import events
from cgroupd.views._text import ranges


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


def pin_line(event: dict[str, Any], stream: str, group: str, member: str | None) -> str:
    """One human line for a pin change the server announced (``events.follow_pins``):
    the pinned-client mode's takeovers, whoever's instances hold the pins."""
    stamp = str(event.get("timestamp") or "")
    when = stamp[11:23] if len(stamp) >= 23 else (stamp or "-")
    who = f"member {member}" if member else f"consumer {event.get('consumer')}"
    if event.get("type") == "pinned":
        text = f"{who}: the server pinned a new instance (a takeover)"
    else:
        text = f"{who}: the server removed the pin ({event.get('reason') or 'no reason given'})"
    return f"[{when}] {stream}/{group} {str(event.get('type')).upper()} {text}"
