"""``cgroupd group create|delete|ls|info``: a stream's consumer groups."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from cgroupd import admin, views
from cgroupd.cli.context import check_names, emit, run_admin
from cgroupd.cli.errors import CliError, UsageError, bad_arguments
from cgroupd.cli.options import Group, Stream
from cgroupd.cli.parsers import pair_filters, parse_wildcards
from cgroupd.core.config import (
    ElasticGroupConfig,
    GroupConfig,
    PartitioningFilter,
    StaticGroupConfig,
)
from cgroupd.core.errors import StreamNotFound
from cgroupd.nats.jetstream import JetStream

#: Where :class:`PairedFiltersCommand` leaves the ``(filter, wildcards)`` pairs.
FILTERS_KEY = "cgroupd.filters"


class PairedFiltersCommand(TyperCommand):
    """Keeps each ``--filter`` paired with the ``--wildcards`` after it (click does not
    record the order across different options)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with bad_arguments():
            ctx.meta[FILTERS_KEY] = pair_filters(args)
        return super().parse_args(ctx, args)


def create(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    partitions: Annotated[int, typer.Option(
        "--partitions", min=1, metavar="N",
        help="Number of partitions: the most members that can consume at once.")],
    filter_: Annotated[list[str] | None, typer.Option(
        "--filter", metavar="SUBJECT",
        help="Subject filter to partition (repeatable). Without one, an elastic group "
             "partitions every subject of the stream, hashing the whole subject "
             "(nats-server >= 2.12).")] = None,
    wildcards: Annotated[list[str] | None, typer.Option(
        "--wildcards", metavar="1,2",
        help="Which '*' of the preceding --filter form the key (default: whole "
             "subject).")] = None,
    members: Annotated[list[str] | None, typer.Option(
        "--member", metavar="M", help="Initial member (repeatable).")] = None,
    static: Annotated[bool, typer.Option(
        "--static", help="The stream's subjects already start with the partition "
                         "number: no work-queue stream.")] = False,
    max_buffered_msgs: Annotated[int, typer.Option(
        "--max-buffered-msgs", min=0, metavar="N",
        help="Limit of the group's work-queue stream (0: none).")] = 0,
    max_buffered_bytes: Annotated[int, typer.Option(
        "--max-buffered-bytes", min=0, metavar="N",
        help="Limit of the group's work-queue stream (0: none).")] = 0,
) -> None:
    """Create a group (re-creating an identical one is a no-op)."""
    check_names(stream=stream, group=group, member=members or [])
    pairs: list[tuple[str, str | None]] = ctx.meta.get(FILTERS_KEY, [])
    config: GroupConfig
    if static:
        if wildcards or any(w is not None for _, w in pairs):
            raise UsageError("--wildcards applies to elastic groups only")
        if max_buffered_msgs or max_buffered_bytes:
            raise UsageError("--max-buffered-* applies to elastic groups only")
        config = StaticGroupConfig(max_members=partitions, filters=tuple(filter_ or ()),
                                   members=tuple(members or ()))
    else:
        with bad_arguments():
            filters = tuple(PartitioningFilter(f, parse_wildcards(w) if w else ())
                            for f, w in pairs)
        config = ElasticGroupConfig(
            max_members=partitions, partitioning_filters=filters,
            members=tuple(members or ()), max_buffered_msgs=max_buffered_msgs,
            max_buffered_bytes=max_buffered_bytes)

    async def op(js: JetStream) -> None:
        if isinstance(config, StaticGroupConfig):
            await admin.create_static_group(js, stream, group, config)
        else:
            await admin.create_elastic_group(js, stream, group, config)

    run_admin(ctx, op)
    emit(ctx, views.group_data(stream, group, config),
         lambda: f"created {views.group_kind(config)} group {stream}/{group} with "
                 f"{partitions} partitions\n\n{views.assignment_text(config)}")


def delete(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", "-f", help="Also delete a record that cannot be read (with the "
                              "group's work-queue stream or member consumers).")] = False,
) -> None:
    """Delete a group: its members stop, its work-queue stream is removed."""
    check_names(stream=stream, group=group)
    if not yes and not typer.confirm(
            f"Delete consumer group {stream}/{group} and its buffered messages?"):
        raise CliError("not deleted")
    run_admin(ctx, lambda js: admin.delete_group(js, stream, group, force=force))
    emit(ctx, {"stream": stream, "group": group, "deleted": True},
         f"deleted group {stream}/{group}")


def ls(ctx: typer.Context, stream: Stream) -> None:
    """List the groups of a stream."""
    check_names(stream=stream)

    async def op(js: JetStream) -> list[dict[str, Any]]:
        if await js.stream_info(stream) is None:
            raise StreamNotFound(f"stream {stream!r} does not exist")
        return [views.listed_group_data(stream, listed)
                for listed in await admin.list_group_records(js, stream)]

    groups = run_admin(ctx, op)
    emit(ctx, groups, lambda: views.groups_text(stream, groups))
    bad = [g["group"] for g in groups if g.get("error")]
    if bad:  # listed all the same (exit 0): one bad record never hides the others
        typer.echo(f"cgroupd: warning: {len(bad)} group record(s) of {stream} cannot be "
                   f"read: {', '.join(bad)} ('cgroupd group delete --force' removes one)",
                   err=True)


def info(ctx: typer.Context, stream: Stream, group: Group) -> None:
    """Show a group's configuration and who owns which partitions."""
    check_names(stream=stream, group=group)
    stored = run_admin(ctx, lambda js: admin.get_group(js, stream, group))
    emit(ctx, views.group_data(stream, group, stored.config, stored.revision),
         lambda: views.group_text(stream, group, stored.config, stored.revision))
