"""``cgroupd replay``: move where a group's partitions resume (Kafka's reset offsets)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from cgroupd import views
from cgroupd.admin import replay
from cgroupd.cli.context import check_names, emit, run_admin
from cgroupd.cli.errors import CliError, UsageError
from cgroupd.cli.options import Stream
from cgroupd.cli.parsers import parse_duration, parse_time
from cgroupd.nats.jetstream import JetStream

TARGETS = ("--to-earliest, --to-sequence, --to-time, --by-duration, --to-latest, "
           "--to-current, --shift-by or --from-file")


def target_of(to_earliest: bool, to_sequence: int | None, to_time: str | None,
              by_duration: str | None, *, to_latest: bool = False, to_current: bool = False,
              shift_by: int | None = None, from_file: bool = False) -> replay.Target:
    """Where a replay restarts, from the command's options (and the console's form, with
    the same checks and messages); UsageError when not exactly one is given or one is
    malformed. A plan read ``from_file`` carries its own positions."""
    try:
        when = (parse_time(to_time) if to_time is not None else
                time.time() - parse_duration(by_duration) if by_duration is not None
                else None)
        given = sum([to_earliest, to_sequence is not None, when is not None, to_latest,
                     to_current, shift_by is not None, from_file])
        if given != 1:
            raise ValueError("exactly one")
        if from_file:
            return replay.Target(current=True)
        return replay.Target(earliest=to_earliest, sequence=to_sequence, time=when,
                             latest=to_latest, current=to_current, shift=shift_by)
    except ValueError as exc:
        raise UsageError(str(exc) if "exactly one" not in str(exc) else
                         f"give exactly one of {TARGETS}") from exc


def replay_(
    ctx: typer.Context,
    stream: Stream,
    group: Annotated[str | None, typer.Argument(
        metavar="[GROUP]", help="Group name (leave out with --all-groups).")] = None,
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
    to_latest: Annotated[bool, typer.Option(
        "--to-latest", help="To the end: skip every message that waits now.")] = False,
    to_current: Annotated[bool, typer.Option(
        "--to-current", help="Where each partition is now (changes nothing; with "
                             "--export, saves the positions).")] = False,
    shift_by: Annotated[int | None, typer.Option(
        "--shift-by", metavar="N",
        help="Move each partition by N of its own messages (negative: back, to process "
             "them again); clamped at the stream's first message and at the end.")] = None,
    from_file: Annotated[Path | None, typer.Option(
        "--from-file", metavar="FILE", dir_okay=False,
        help="The positions in a plan written by --export; refused if the group or its "
             "stream changed since.")] = None,
    all_groups: Annotated[bool, typer.Option(
        "--all-groups", help="Every group of the stream (all of them, or none).")] = False,
    export: Annotated[Path | None, typer.Option(
        "--export", metavar="FILE", dir_okay=False,
        help="Write the plan (where each partition resumes) to FILE as JSON, for review "
             "and --from-file.")] = None,
    members: Annotated[list[str] | None, typer.Option(
        "--member", metavar="M", help="Static groups: only this member (repeatable).")] = None,
    execute: Annotated[bool, typer.Option(
        "--execute", help="Do it (default: a dry run that only shows the plan).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Only show the plan (the default).")] = False,
) -> None:
    """Move where a group's partitions resume ("reset offsets"): a static group's member
    consumers move there, an elastic group's work-queue stream is sourced again. Shows per
    partition where it is, where it resumes and what is processed again or skipped;
    changes nothing without --execute, and refuses while the group's instances run.
    Exact meaning of each option, next to Kafka's: docs/replay.md."""
    check_names(stream=stream, group=[group] if group else [], member=members or [])
    if execute and dry_run:
        raise UsageError("give --execute or --dry-run, not both")
    if all_groups == (group is not None):
        raise UsageError("give a GROUP or --all-groups (not both)")
    if all_groups and members:
        raise UsageError("--member names members of one group; leave it out with "
                         "--all-groups")
    if export is not None and not export.parent.is_dir():
        raise UsageError(f"--export: directory {export.parent} does not exist")
    imported = _read_file(from_file, stream, group) if from_file is not None else None
    target = target_of(to_earliest, to_sequence, to_time, by_duration, to_latest=to_latest,
                       to_current=to_current, shift_by=shift_by,
                       from_file=imported is not None)

    async def op(js: JetStream) -> list[replay.Plan]:
        if imported is not None:
            plans = [await replay.plan(js, stream, i.group, i.target, members or None,
                                       i.expected) for i in imported]
        elif all_groups:
            plans = await replay.plan_all(js, stream, target)
        else:
            assert group is not None
            plans = [await replay.plan(js, stream, group, target, members or None)]
        if execute:
            return await replay.execute_all(js, plans)
        return plans

    done = run_admin(ctx, op)
    if export is not None:
        try:
            export.write_text(replay.export_document(done))
        except OSError as exc:
            raise CliError(f"--export: cannot write {export}: {exc.strerror}") from exc
    if len(done) == 1 and not all_groups:
        data: Any = done[0].to_json()
        emit(ctx, data, lambda: views.replay_text(data))
        return
    rendered = [p.to_json() for p in done]
    emit(ctx, {"stream": stream, "plans": rendered},
         lambda: "\n\n".join(views.replay_text(p) for p in rendered))


def _read_file(path: Path, stream: str, group: str | None) -> list[replay.Imported]:
    """The entries of an exported plan for ``stream`` (and ``group``, when given)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"--from-file: cannot read {path}: {exc.strerror}") from exc
    try:
        entries = replay.read_document(text, str(path))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    picked = [e for e in entries if e.stream == stream and group in (None, e.group)]
    if not picked:
        raise UsageError(f"{path} has no plan for {stream}/{group or '*'} (it has "
                         f"{', '.join(sorted({f'{e.stream}/{e.group}' for e in entries}))})")
    return picked
