"""``cgroupd demo``: the command around :mod:`cgroupd.demo`."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer

from cgroupd.cli.errors import UsageError, bad_arguments
from cgroupd.cli.parsers import parse_listen


def demo(
    server: Annotated[str | None, typer.Option(
        "--server", metavar="URL",
        help="Use this server instead of an embedded nats-server.")] = None,
    duration: Annotated[float, typer.Option(
        "--duration", min=1, metavar="SEC", help="Run this long (Ctrl-C ends early).")] = 20,
    members: Annotated[int, typer.Option(
        "--members", min=1, max=20, metavar="N", help="Members, each with a standby.")] = 3,
    partitions: Annotated[int, typer.Option(
        "--partitions", min=1, max=64, metavar="N", help="Partitions.")] = 6,
    rate: Annotated[float, typer.Option(
        "--rate", min=1, max=5000, metavar="N", help="Messages published per second.")] = 50,
    console: Annotated[bool, typer.Option(
        "--console", help="Serve `cgroupd console` for the demo's group (on "
                          "--console-listen; actions enabled).")] = False,
    console_listen: Annotated[str, typer.Option(
        "--console-listen", metavar="HOST:PORT",
        help="Where --console listens.")] = "127.0.0.1:8480",
) -> int:
    """Watch a group at work: embedded server, members with standbys, keyed traffic, and a
    killed active instance failing over."""
    from cgroupd.demo import DemoOptions, run_demo

    if partitions < members:
        raise UsageError(f"--partitions ({partitions}) must be at least --members "
                         f"({members})")
    listen = None
    if console:
        with bad_arguments():
            listen = parse_listen(console_listen)
    options = DemoOptions(server=server, duration=duration, members=members,
                          partitions=partitions, rate=rate, interactive=sys.stdout.isatty(),
                          console=listen)
    return asyncio.run(run_demo(options))
