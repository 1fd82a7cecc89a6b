"""What every command shares: the global options it was given, the name checks, one admin
call on a fresh connection, and printing a result as JSON or text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import typer

from cgroupd.cli.errors import UsageError
from cgroupd.core.config import name_problems
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream

T = TypeVar("T")


@dataclass(frozen=True)
class Globals:
    """The options given before (or, for --json and --debug, after) the command."""

    connection: ConnectionOptions
    json: bool
    debug: bool


def globals_of(ctx: typer.Context) -> Globals:
    obj = ctx.find_root().obj
    assert isinstance(obj, Globals)
    return obj


def check_names(**names: str | Sequence[str]) -> None:
    """Every rule the given stream, group, member or instance names break, in one usage
    error; nothing when they are all valid."""
    problems: list[str] = []
    for kind, value in names.items():
        for name in ([value] if isinstance(value, str) else value):
            problems += name_problems(kind, name)
    if problems:
        raise UsageError("; ".join(problems))


def run_admin(ctx: typer.Context, op: Callable[[JetStream], Awaitable[T]]) -> T:
    """Connect (failing fast), run one admin operation, disconnect."""
    g = globals_of(ctx)

    async def go() -> T:
        nc = await connect(g.connection)
        try:
            return await op(JetStream(nc))
        finally:
            await nc.close()

    return asyncio.run(go())


def emit(ctx: typer.Context, data: Any, human: str | Callable[[], str]) -> None:
    """Print ``data`` as JSON with --json, else the text ``human`` renders."""
    if globals_of(ctx).json:
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(human() if callable(human) else human)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM: Ctrl-C ends a following command normally (exit 0).
    Outside the main thread (tests) the default handling stays."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop
