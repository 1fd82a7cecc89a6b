"""``cgroupd join`` without the command line's weight: the process the CLI turns into.

typer (and the pydantic it coerces option values with) costs a ``join`` process about
8 MB of its ~40 MB, for work that is over once the arguments are checked. So the CLI
parses and checks everything (the same help, errors and exit codes as every command),
then replaces its own process image (same pid, same signals) with ``python -m
cgroupd.joinrun FD``, handing over what it decided through an inherited pipe (never on
the command line or in the environment: it may hold a password or token). This module
imports nothing of the CLI: it loads the handler again, runs the daemon, and turns what
the daemon raises into one line on stderr and an exit code, as the CLI does.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cgroupd.exits import FAILURE, INTERRUPTED, error_line

if TYPE_CHECKING:
    from cgroupd.connect import ConnectionOptions
    from cgroupd.handlers import DeadLetterOptions, WebhookOptions
    from cgroupd.joinoptions import JoinOptions
    from cgroupd.settings import MemberSettings

#: Set to 0 to run ``join`` inside the CLI's process instead (debuggers, profilers).
EXEC_ENV = "CGROUPD_JOIN_EXEC"


@dataclass(frozen=True)
class JoinSpec:
    """Everything the CLI decided for one ``join``, checked already."""

    connection: ConnectionOptions
    options: JoinOptions
    settings: MemberSettings
    handler: str | None
    webhook: WebhookOptions | None
    dead_letter: DeadLetterOptions
    log_level: str
    debug: bool


def exec_join(spec: JoinSpec) -> None:
    """Replace this process with a lean one running ``spec`` (does not return)."""
    data = pickle.dumps(spec)
    read, write = os.pipe()
    # Small (well under a pipe's buffer): written whole before the exec, never blocks.
    os.write(write, data)
    os.close(write)
    os.set_inheritable(read, True)
    sys.stdout.flush()
    sys.stderr.flush()
    # The original arguments follow, unread: `ps` still says which member this is.
    os.execv(sys.executable, [sys.executable, "-m", "cgroupd.joinrun", str(read),
                              *sys.argv[1:]])


def read_spec(fd: int) -> JoinSpec:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    spec = pickle.loads(b"".join(chunks))
    assert isinstance(spec, JoinSpec)
    return spec


def run(spec: JoinSpec) -> int:
    """Run the daemon; its exit code, or the CLI's for what it raised."""
    import asyncio
    import traceback

    from cgroupd import logs
    from cgroupd.daemon import run_join
    from cgroupd.errors import CgroupdError
    from cgroupd.handlers import HandlerOptions, load_handler

    logs.configure(spec.log_level)
    try:
        function = None
        if spec.handler is not None:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            function = load_handler(spec.handler)
        handler = HandlerOptions(function=function, reference=spec.handler,
                                 webhook=spec.webhook, dead_letter=spec.dead_letter)
        return asyncio.run(run_join(spec.connection, spec.options, spec.settings, handler))
    except KeyboardInterrupt:
        _error_line("interrupted")
        return INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place errors become codes
        if spec.debug:
            traceback.print_exception(exc)
        if isinstance(exc, CgroupdError):
            _error_line(str(exc))
        else:
            hint = "" if spec.debug else " (run with --debug for the traceback)"
            _error_line(f"unexpected {type(exc).__name__}: {exc}{hint}")
        return FAILURE


def _error_line(message: str) -> None:
    print(error_line(message), file=sys.stderr, flush=True)


if __name__ == "__main__":
    # The spec was pickled as cgroupd.joinrun's, not __main__'s: read it through that one.
    from cgroupd import joinrun

    sys.exit(joinrun.run(joinrun.read_spec(int(sys.argv[1]))))
