"""``cgroupd replay``: process messages again from a point (Kafka's reset offsets)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from cgroupd import replay, views
from cgroupd.cli.context import check_names, emit, run_admin
from cgroupd.cli.errors import UsageError
from cgroupd.cli.options import Group, Stream
from cgroupd.cli.parsers import parse_duration, parse_time
from cgroupd.jetstream import JetStream


def target_of(to_earliest: bool, to_sequence: int | None, to_time: str | None,
              by_duration: str | None) -> replay.Target:
    """Where a replay restarts, from the command's options (and the console's form, with
    the same checks and messages); UsageError when not exactly one is given or one is
    malformed."""
    try:
        when = (parse_time(to_time) if to_time is not None else
                time.time() - parse_duration(by_duration) if by_duration is not None
                else None)
        return replay.Target(earliest=to_earliest, sequence=to_sequence, time=when)
    except ValueError as exc:
        raise UsageError(
            str(exc) if "exactly one" not in str(exc) else
            "give exactly one of --to-earliest, --to-sequence, --to-time or --by-duration"
        ) from exc


def replay_(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    to_earliest: Annotated[bool, typer.Option(
        "--to-earliest", help="From the oldest message still stored.")] = False,
    to_sequence: Annotated[int | None, typer.Option(
        "--to-sequence", min=1, metavar="SEQ",
        help="From this stream sequence (of the origin stream).")] = None,
    to_time: Annotated[str | None, typer.Option(
        "--to-time", metavar="TIME",
        help="From the first message stored at or after this ISO 8601 time "
             "(2026-05-01T10:00:00Z; local time without an offset).")] = None,
    by_duration: Annotated[str | None, typer.Option(
        "--by-duration", metavar="DURATION",
        help="From this long ago: 90s, 1h30m, 2d or PT1H30M.")] = None,
    members: Annotated[list[str] | None, typer.Option(
        "--member", metavar="M", help="Static groups: only this member (repeatable).")] = None,
    execute: Annotated[bool, typer.Option(
        "--execute", help="Do it (default: a dry run that only shows the plan).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Only show the plan (the default).")] = False,
) -> None:
    """Process messages again from a point ("reset offsets"): a static group's member
    consumers move there, an elastic group's work-queue stream is sourced again from
    there. Shows per partition what would be processed again; changes nothing without
    --execute, and refuses while the group's instances run."""
    check_names(stream=stream, group=group, member=members or [])
    if execute and dry_run:
        raise UsageError("give --execute or --dry-run, not both")
    target = target_of(to_earliest, to_sequence, to_time, by_duration)

    async def op(js: JetStream) -> replay.Plan:
        if execute:
            return await replay.execute(js, stream, group, target, members or None)
        return await replay.plan(js, stream, group, target, members or None)

    done = run_admin(ctx, op)
    data = done.to_json()
    emit(ctx, data, lambda: views.replay_text(data))
