"""``cgroupd member add|drop|ls``, ``mapping set|clear`` and ``step-down``: who consumes
which partitions, and handing a member over to its standby."""

from __future__ import annotations

from typing import Annotated

import typer

from cgroupd import admin, views
from cgroupd.cli.context import check_names, emit, run_admin
from cgroupd.cli.errors import CliError, bad_arguments
from cgroupd.cli.observe import show_members
from cgroupd.cli.options import Group, Stream
from cgroupd.cli.parsers import parse_mappings
from cgroupd.core.config import GroupConfig


def membership_text(stream: str, group: str, config: GroupConfig, verb: str) -> str:
    """What a membership change prints (the CLI) or answers (the console)."""
    return (f"{verb}; members of {stream}/{group}: "
            f"{', '.join(config.member_names) or '-'}\n\n{views.assignment_text(config)}")


def no_active_instance(stream: str, group: str, member: str) -> CliError:
    """A step-down of a member that has no active instance (the CLI and the console)."""
    return CliError(f"member {member} of {stream}/{group} has no active instance")


def _membership_out(ctx: typer.Context, stream: str, group: str, config: GroupConfig,
                    verb: str) -> None:
    emit(ctx, views.group_data(stream, group, config),
         lambda: membership_text(stream, group, config, verb))


def add(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    members: Annotated[list[str], typer.Argument(metavar="MEMBER...", help="Members to add.")],
) -> None:
    """Add members (partitions are redistributed)."""
    check_names(stream=stream, group=group, member=members)
    config = run_admin(ctx, lambda js: admin.add_members(js, stream, group, members))
    _membership_out(ctx, stream, group, config, f"added {', '.join(members)}")


def drop(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    members: Annotated[list[str], typer.Argument(metavar="MEMBER...",
                                                 help="Members to drop.")],
) -> None:
    """Drop members (their partitions move to the others)."""
    check_names(stream=stream, group=group, member=members)
    config = run_admin(ctx, lambda js: admin.drop_members(js, stream, group, members))
    _membership_out(ctx, stream, group, config, f"dropped {', '.join(members)}")


def ls(ctx: typer.Context, stream: Stream, group: Group) -> None:
    """Members (like Kafka's --describe --members): partitions, lag, active instance, and
    every running instance with its state, host, pid, since when and partitions."""
    show_members(ctx, stream, group)


def mapping_set(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    mappings: Annotated[list[str], typer.Argument(
        metavar="MEMBER=PARTITIONS...", help="e.g. m1=0,1 m2=2-3")],
) -> None:
    """Replace the membership with explicit member=partitions mappings."""
    check_names(stream=stream, group=group)
    with bad_arguments():
        chosen = parse_mappings(mappings)
    config = run_admin(ctx, lambda js: admin.set_mappings(js, stream, group, chosen))
    _membership_out(ctx, stream, group, config, "mappings set")


def mapping_clear(ctx: typer.Context, stream: Stream, group: Group) -> None:
    """Drop the mappings; their members are distributed automatically."""
    check_names(stream=stream, group=group)
    config = run_admin(ctx, lambda js: admin.clear_mappings(js, stream, group))
    _membership_out(ctx, stream, group, config, "mappings cleared")


def step_down(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    member: Annotated[str, typer.Argument(
        metavar="MEMBER", help="Member whose active instance steps down.")],
) -> None:
    """Ask a member's active instance to hand over to a standby (exit 1 if none).

    The instance finishes its running handlers, then hands over. Pinned mode: a holder
    that does not answer within 1 s (another implementation's, a frozen one) is
    unpinned instead; what it still runs is refused and run again by the new holder.
    """
    check_names(stream=stream, group=group, member=member)
    done = run_admin(ctx, lambda js: admin.step_down(js, stream, group, member))
    if not done:
        raise no_active_instance(stream, group, member)
    emit(ctx, {"stream": stream, "group": group, "member": member, "stepped_down": True},
         f"asked the active instance of {member} to step down")
