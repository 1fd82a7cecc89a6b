"""What the operator commands and the demo show: tables, group configurations, status,
members, the live view, replay plans, events.

Pure (no I/O): data in (a group config, a :class:`~cgroupd.admin.GroupStatus`, discovered
instances, replay plans), JSON-ready dicts and text out, so the CLI stays a thin shell and
every rendering is unit-tested without a server or a terminal. One private module per
thing shown: ``_text`` (ranges, tables, durations), ``_groups`` (a group's configuration,
replay plans), ``_status`` (status and members), ``_watch`` (``status --watch``),
``_events`` (advisories).
"""

from cgroupd.views._events import event_line, pin_line
from cgroupd.views._groups import (
    assignment_text,
    group_data,
    group_kind,
    group_text,
    groups_text,
    listed_group_data,
    replay_text,
)
from cgroupd.views._status import members_data, members_text, status_data, status_text
from cgroupd.views._text import duration, ranges, table
from cgroupd.views._watch import BAR_WIDTH, watch_frame, watch_problem_frame

__all__ = [
    "BAR_WIDTH",
    "assignment_text",
    "duration",
    "event_line",
    "group_data",
    "group_kind",
    "group_text",
    "groups_text",
    "listed_group_data",
    "members_data",
    "members_text",
    "pin_line",
    "ranges",
    "replay_text",
    "status_data",
    "status_text",
    "table",
    "watch_frame",
    "watch_problem_frame",
]
