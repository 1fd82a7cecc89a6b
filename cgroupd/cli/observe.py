"""``cgroupd status`` (a table, ``--members``, ``--watch``) and ``cgroupd events``: a
running group as its operators see it."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from typing import Annotated, Any

import typer

from cgroupd import admin, views
from cgroupd.cli.context import check_names, emit, globals_of, run_admin, stop_on_signals
from cgroupd.cli.errors import CliError
from cgroupd.cli.options import Group, Stream
from cgroupd.core import logs
from cgroupd.core.errors import CgroupdError
from cgroupd.core.tasks import cancel_and_wait, nap
from cgroupd.nats import events
from cgroupd.nats.connect import connect
from cgroupd.nats.jetstream import JetStream

#: Seconds ``status`` listens for instances answering discovery (hosts, standbys).
STATUS_DISCOVERY_WAIT = 0.25


def status(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    members: Annotated[bool, typer.Option(
        "--members", help="Per member and instance instead (as `member ls`).")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch", "-w", help="Refresh until Ctrl-C: lag bars, trends, rates.")] = False,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.2, max=3600, metavar="SEC",
        help="Seconds between refreshes of --watch.")] = 2.0,
) -> int:
    """Per partition: member, active instance and its host, lag in messages and time,
    in flight."""
    check_names(stream=stream, group=group)
    if members:
        show_members(ctx, stream, group)
        return 0
    if watch:
        return _watch_status(ctx, stream, group, interval)

    async def op(js: JetStream) -> tuple[admin.GroupStatus, list[dict[str, Any]]]:
        return await status_and_instances(js, stream, group)

    st, instances = run_admin(ctx, op)
    data = views.status_data(st, instances)
    emit(ctx, data, lambda: views.status_text(data, st))
    return 0


def show_members(ctx: typer.Context, stream: str, group: str) -> None:
    """``member ls`` and ``status --members``: per member and instance."""
    check_names(stream=stream, group=group)

    async def op(js: JetStream) -> tuple[admin.GroupStatus, list[dict[str, Any]]]:
        return await status_and_instances(js, stream, group, events.DISCOVERY_WAIT)

    st, instances = run_admin(ctx, op)
    rows = views.members_data(st, instances)
    emit(ctx, rows, lambda: views.members_text(stream, group, rows))


async def status_and_instances(js: JetStream, stream: str, group: str,
                               wait: float = STATUS_DISCOVERY_WAIT
                               ) -> tuple[admin.GroupStatus, list[dict[str, Any]]]:
    """One status read, as ``cgroupd status`` and the console make it: the group's
    record, consumers and lag (in flight included), and the instances answering
    discovery within ``wait``."""
    st = await admin.group_status(js, stream, group, in_flight=True)
    found = await events.discover(js.nc, stream, group, wait) if wait > 0 else []
    return st, found


def _watch_status(ctx: typer.Context, stream: str, group: str, interval: float) -> int:
    """``status --watch``: a full-screen view redrawn every ``interval`` on a terminal
    (alternate screen, like ``top``); one frame after another, or one JSON object per
    line with ``--json``, when not on a terminal. Once the first view is shown, a failed
    refresh (server restarting, group deleted and re-created) is shown and retried, never
    the end of the view; logs stay off the live screen unless --debug."""
    g = globals_of(ctx)
    out = sys.stdout
    live = out.isatty() and not g.json
    if live and not g.debug:
        logs.configure("critical")  # the screen itself says what goes wrong

    async def go() -> int:
        nc = await connect(g.connection)
        stop = stop_on_signals()
        previous: dict[str, Any] | None = None
        shown: str | None = None
        last = 0.0
        last_clock = ""
        if live:
            out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide the cursor
        try:
            js = JetStream(nc)
            while not stop.is_set():
                started = time.monotonic()
                clock = time.strftime("%H:%M:%S")
                size = shutil.get_terminal_size((100, 40))
                try:
                    data = await _watch_read(js, stream, group)
                except Exception as exc:  # shown, then retried
                    if previous is None:
                        raise  # nothing shown yet: a typo or no server, fail at once
                    problem_text = problem(exc)
                    if g.json:
                        frame = json.dumps({"time": events.iso(time.time()),
                                            "error": problem_text})
                    else:
                        frame = views.watch_problem_frame(
                            stream, group, problem_text, clock, last_clock,
                            shown if live else None, size.columns, size.lines)
                else:
                    now = time.monotonic()
                    if g.json:
                        data["time"] = events.iso(time.time())
                        frame = json.dumps(data)
                    else:
                        frame = shown = views.watch_frame(
                            data, previous, now - last if last else 0.0, size.columns,
                            size.lines, clock)
                    previous, last, last_clock = data, now, clock
                if live:
                    out.write("\x1b[H\x1b[2J" + frame + "\n")
                else:
                    out.write(frame + ("\n" if g.json else "\n\n"))
                out.flush()
                # A steady cadence: the refresh itself (discovery wait included) counts.
                pause = max(0.05, interval - (time.monotonic() - started))
                await nap(pause, stop)
        finally:
            if live:
                out.write("\x1b[?25h\x1b[?1049l")
                out.flush()
            await nc.close()
        return 0

    return asyncio.run(go())


async def _watch_read(js: JetStream, stream: str, group: str) -> dict[str, Any]:
    """One refresh of ``status --watch``: the status view plus the work stream's last
    sequence (for the rates)."""
    st, instances = await status_and_instances(js, stream, group)
    data = views.status_data(st, instances)
    info = await js.stream_info(st.group.consume_stream)
    data["appended"] = int(info.state.last_seq) if info is not None else 0
    return data


def problem(exc: BaseException) -> str:
    """A one-line description of a failed refresh (``status --watch``, the console)."""
    if isinstance(exc, CgroupdError):
        return str(exc)
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def events_(
    ctx: typer.Context,
    stream: Stream,
    group: Group,
    count: Annotated[int, typer.Option(
        "--count", "-n", min=0, metavar="N", help="Exit after N events (0: never).")] = 0,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0, metavar="SEC",
        help="Exit (code 1) if fewer than --count events came within this (0: wait "
             "forever).")] = 0,
) -> None:
    """Follow the group's advisories (became active, stepped down, partitions moved,
    partitions nobody consumes), like `nats events`; --json prints one object a line."""
    check_names(stream=stream, group=group)
    g = globals_of(ctx)

    async def go() -> None:
        nc = await connect(g.connection)
        seen = 0
        stop = stop_on_signals()

        def ready() -> None:
            # On stderr in both forms: once it shows, no later event is missed.
            typer.echo(f"following events of {stream}/{group} "
                       f"({events.events_filter(stream, group)}); Ctrl-C to stop", err=True)

        async def consume() -> None:
            nonlocal seen
            async for event in events.follow(nc, stream, group, ready):
                typer.echo(json.dumps(event) if g.json else views.event_line(event))
                seen += 1
                if count and seen >= count:
                    return

        try:
            await admin.get_group(JetStream(nc), stream, group)  # a typo fails at once
            following = asyncio.ensure_future(consume())
            stopping = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({following, stopping}, timeout=timeout or None,
                                         return_when=asyncio.FIRST_COMPLETED)
            # Let them end before the connection closes (the follower unsubscribes),
            # cancelled until they do (see cgroupd.core.tasks).
            await asyncio.gather(cancel_and_wait(following), cancel_and_wait(stopping))
            await asyncio.gather(following, stopping, return_exceptions=True)
            if following in done:
                following.result()
            elif count and stopping not in done:
                raise CliError(f"{seen} of {count} events within {timeout:g}s")
        finally:
            await nc.close()

    asyncio.run(go())
