"""``cgroupd console``: the groups of a stream (or of every stream) in a browser."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from cgroupd.cli.context import check_names, globals_of, stop_on_signals
from cgroupd.cli.errors import CliError, bad_arguments
from cgroupd.cli.parsers import parse_listen
from cgroupd.nats.connect import connect
from cgroupd.nats.jetstream import JetStream

#: Where the console listens unless told: this machine only.
DEFAULT_LISTEN = "127.0.0.1:8480"


def console(
    ctx: typer.Context,
    streams: Annotated[list[str] | None, typer.Option(
        "--stream", envvar="CGROUPD_STREAM", metavar="STREAM",
        help="Show this stream's groups (repeatable). Default: every group the "
             "credentials can read.")] = None,
    listen: Annotated[str, typer.Option(
        "--listen", envvar="CGROUPD_LISTEN", metavar="HOST:PORT",
        help="Address to serve on (:PORT for every address).")] = DEFAULT_LISTEN,
    interval: Annotated[float, typer.Option(
        "--interval", envvar="CGROUPD_INTERVAL", min=0.2, max=3600, metavar="SEC",
        help="Seconds between refreshes: one status read per watched group each, however "
             "many browsers watch.")] = 2.0,
    allow_actions: Annotated[bool, typer.Option(
        "--allow-actions", envvar="CGROUPD_ALLOW_ACTIONS",
        help="Offer step-down, member add/drop, mappings and replay in the page "
             "(default: read-only).")] = False,
    allow_hosts: Annotated[list[str] | None, typer.Option(
        "--allow-host", envvar="CGROUPD_ALLOW_HOST", metavar="NAME",
        help="Another name browsers reach the console by (repeatable); any other Host "
             "header is refused.")] = None,
) -> None:
    """Serve a web console: per group the partitions as a grid coloured by member, lag,
    members and instances, the events as a timeline, the record; with --allow-actions
    the CLI's actions, confirmed in the page. Runs until Ctrl-C."""
    # Imported here: the console brings aiohttp, which no other command loads at start.
    from cgroupd.console import Console, ConsoleOptions, serve

    check_names(stream=streams or [])
    with bad_arguments():
        host, port = parse_listen(listen)
    options = ConsoleOptions(streams=tuple(streams or ()), host=host, port=port,
                             interval=interval, allow_actions=allow_actions,
                             allowed_hosts=tuple(allow_hosts or ()))
    g = globals_of(ctx)

    def ready(_: Console, url: str) -> None:
        mode = "actions enabled" if allow_actions else "read-only"
        scope = ", ".join(options.streams) or "every stream"
        typer.echo(f"cgroupd console on {url} ({mode}; groups of {scope}); Ctrl-C to stop",
                   err=True)

    async def go() -> None:
        nc = await connect(g.connection)
        try:
            stop = stop_on_signals()
            try:
                await serve(JetStream(nc), options, stop, ready)
            except OSError as exc:
                raise CliError(f"cannot listen on {listen}: {exc.strerror or exc}") from exc
        finally:
            await nc.close()

    asyncio.run(go())
