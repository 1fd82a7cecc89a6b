"""The console's actions: each one is the CLI command's own checks and admin call (the
name checks, the parsers, :mod:`cgroupd.admin`, :mod:`cgroupd.admin.replay`), so a page gets
the same refusals with the same messages as a terminal."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cgroupd import admin, views
from cgroupd.admin import replay
from cgroupd.cli.context import check_names
from cgroupd.cli.errors import CliError, UsageError, bad_arguments
from cgroupd.cli.members import membership_text, no_active_instance
from cgroupd.cli.parsers import parse_mappings
from cgroupd.cli.replay import target_of
from cgroupd.core.config import GroupConfig
from cgroupd.core.errors import CgroupdError, ConfigError
from cgroupd.nats.jetstream import JetStream


@dataclass(frozen=True)
class Outcome:
    """What an action did: the CLI's text and its ``--json`` data; or, with a ``status``
    other than 200, why it was refused (the CLI's message)."""

    message: str
    data: Any = None
    status: int = 200

    @property
    def ok(self) -> bool:
        return self.status == 200


#: One action: the page's JSON body in, the CLI's outcome out.
Action = Callable[[JetStream, str, str, dict[str, Any]], Awaitable[Outcome]]


def _names(body: dict[str, Any], key: str) -> list[str]:
    value = body.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{key}: give one or more names")
    return [v.strip() for v in value]


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{key}: required")
    return value.strip()


async def _step_down(js: JetStream, stream: str, group: str,
                     body: dict[str, Any]) -> Outcome:
    member = _text(body, "member")
    check_names(stream=stream, group=group, member=member)
    if not await admin.step_down(js, stream, group, member):
        raise no_active_instance(stream, group, member)
    return Outcome(f"asked the active instance of {member} to step down",
                   {"stream": stream, "group": group, "member": member,
                    "stepped_down": True})


def _membership(change: Callable[[JetStream, str, str, list[str]], Awaitable[GroupConfig]],
                verb: str) -> Action:
    """Adding or dropping members: the same form (a list of names) and the same answer
    as ``cgroupd member add`` / ``drop``."""
    async def run(js: JetStream, stream: str, group: str, body: dict[str, Any]) -> Outcome:
        members = _names(body, "members")
        check_names(stream=stream, group=group, member=members)
        config = await change(js, stream, group, members)
        return Outcome(membership_text(stream, group, config, f"{verb} {', '.join(members)}"),
                       views.group_data(stream, group, config))

    return run


async def _mapping_set(js: JetStream, stream: str, group: str,
                       body: dict[str, Any]) -> Outcome:
    check_names(stream=stream, group=group)
    with bad_arguments():
        chosen = parse_mappings(_text(body, "mappings").split())
    config = await admin.set_mappings(js, stream, group, chosen)
    return Outcome(membership_text(stream, group, config, "mappings set"),
                   views.group_data(stream, group, config))


async def _mapping_clear(js: JetStream, stream: str, group: str,
                         body: dict[str, Any]) -> Outcome:
    check_names(stream=stream, group=group)
    config = await admin.clear_mappings(js, stream, group)
    return Outcome(membership_text(stream, group, config, "mappings cleared"),
                   views.group_data(stream, group, config))


def _target(body: dict[str, Any]) -> replay.Target:
    """The replay form's "from" choice as the command's options."""
    kind, value = body.get("from"), body.get("value")
    text = value.strip() if isinstance(value, str) else ""
    sequence: int | None = None
    if kind == "sequence":
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"sequence {text!r}: give a stream sequence of at least 1")
        sequence = int(text)
    elif kind not in ("earliest", "time", "duration"):
        raise UsageError("from: earliest, sequence, time or duration")
    return target_of(kind == "earliest", sequence, text if kind == "time" else None,
                     text if kind == "duration" else None)


def _replay(execute: bool) -> Action:
    async def run(js: JetStream, stream: str, group: str, body: dict[str, Any]) -> Outcome:
        members = _names(body, "members") if body.get("members") else []
        check_names(stream=stream, group=group, member=members)
        target = _target(body)
        done = await (replay.execute if execute else replay.plan)(
            js, stream, group, target, members or None)
        data = done.to_json()
        return Outcome(views.replay_text(data), data)

    return run


#: Every action a page may ask for, by its name in the URL.
ACTIONS: dict[str, Action] = {
    "step-down": _step_down,
    "member-add": _membership(admin.add_members, "added"),
    "member-drop": _membership(admin.drop_members, "dropped"),
    "mapping-set": _mapping_set,
    "mapping-clear": _mapping_clear,
    "replay-plan": _replay(False),
    "replay-execute": _replay(True),
}


async def run_action(js: JetStream, stream: str, group: str, action: str,
                     body: dict[str, Any]) -> Outcome:
    """Run one action: its outcome, or a refusal with the CLI's message (status 400 for
    what the CLI calls a usage error, 409 for what it calls a failure, 404 for no such
    action)."""
    op = ACTIONS.get(action)
    if op is None:
        return Outcome(f"no action {action!r}", status=404)
    try:
        return await op(js, stream, group, body)
    except (UsageError, ConfigError) as exc:
        return Outcome(str(exc), status=400)
    except (CliError, CgroupdError) as exc:
        return Outcome(str(exc), status=409)
