"""``cgroupd console``: the groups as a picture, live, in a browser.

A small web UI (aiohttp, with plain HTML/CSS/JS shipped as package data: no outside asset)
over the same admin and status code as the CLI: per group the partitions as a grid
coloured by member, lag per partition, members and their instances, the group's events as
a timeline (with the server's pin changes), its record, and, with ``allow_actions``, the
CLI's actions. Every page shares one status read per group per refresh interval
(:mod:`._watch`); the HTTP side and its guards are :mod:`._server`, the actions
:mod:`._actions`. docs/console.md tells what it shows and why it is safe to run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from cgroupd.console._actions import ACTIONS, Outcome, run_action
from cgroupd.console._server import (
    TOKEN_HEADER,
    Console,
    ConsoleOptions,
    allowed_host_names,
    server_label,
)
from cgroupd.console._watch import Shared, Timeline
from cgroupd.nats.jetstream import JetStream


async def serve(js: JetStream, options: ConsoleOptions, stop: asyncio.Event,
                ready: Callable[[Console, str], None] | None = None) -> None:
    """Serve the console until ``stop`` is set; ``ready(console, url)`` once listening."""
    console = Console(js, options)
    runner = web.AppRunner(console.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, options.host or None, options.port)
        await site.start()
        host = options.host if options.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        shown = f"[{host}]" if ":" in host else host
        port = options.port
        if port == 0 and runner.addresses:
            port = int(runner.addresses[0][1])
        if ready is not None:
            ready(console, f"http://{shown}:{port}/")
        await stop.wait()
    finally:
        await console.close()
        await runner.cleanup()


__all__ = [
    "ACTIONS",
    "TOKEN_HEADER",
    "Console",
    "ConsoleOptions",
    "Outcome",
    "Shared",
    "Timeline",
    "allowed_host_names",
    "run_action",
    "serve",
    "server_label",
]
