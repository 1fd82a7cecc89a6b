"""``cgroupd join`` without the command line's weight: the process the CLI turns into.

typer (and the pydantic it coerces option values with) costs a ``join`` process about
8 MB of its ~40 MB, for work that is over once the arguments are checked. So the CLI
parses and checks everything (the same help, errors and exit codes as every command),
then replaces its own process image (same pid, same signals) with ``python -P -m
cgroupd.join.run FD``, handing over what it decided through an inherited file descriptor
(never on the command line or in the environment: it may hold a password or token). This
module imports nothing of the CLI: it loads the handler again, runs the daemon, and turns
what the daemon raises into one line on stderr and an exit code, as the CLI does.

Process hygiene (issue 25 row 12):

- ``-P``: the working directory is not put first on ``sys.path``, so a ``secrets.py`` or
  ``pickle.py`` planted where ``join`` is started cannot shadow the standard library or an
  installed package. Handler modules are still found in the working directory, as
  documented (the image's ``/app``), but it goes *last* on ``sys.path``
  (:func:`add_working_directory`): a handler module can be found there, a standard
  module name cannot be taken over.
- The new command line names the member (``ps`` says which instance this is) and nothing
  else: no ``--password``, ``--token``, URL userinfo or webhook credentials.
- The spec goes through an anonymous in-memory file (``memfd``; an unlinked temporary
  file elsewhere), read from its start: any size, where a pipe blocks the writer past its
  64 KiB buffer before the reader exists.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cgroupd.core.exits import FAILURE, INTERRUPTED, error_line

if TYPE_CHECKING:
    from cgroupd.core.settings import MemberSettings
    from cgroupd.join.handlers import DeadLetterOptions, WebhookOptions
    from cgroupd.join.options import JoinOptions
    from cgroupd.nats.connect import ConnectionOptions

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


def add_working_directory() -> None:
    """Let handler modules be imported from the working directory, after everything else
    (standard library, installed packages): a module planted there cannot shadow them."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def _spec_file(data: bytes) -> int:
    """An inheritable descriptor of an anonymous file holding ``data``, at offset 0."""
    try:
        fd = os.memfd_create("cgroupd-join", 0)  # Linux: never on disk, never named
    except (AttributeError, OSError):
        import tempfile

        with tempfile.TemporaryFile() as tmp:  # unlinked at once on POSIX
            fd = os.dup(tmp.fileno())
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd


def _package_root_path() -> dict[str, str]:
    """The environment that lets ``-P -m cgroupd.join.run`` find this cgroupd when only
    the working directory made it importable (``python -m cgroupd`` in a checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = os.getcwd()
    if root != cwd or any(os.path.abspath(p) == root for p in sys.path if p not in ("", cwd)):
        return {}
    current = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root if not current else f"{current}{os.pathsep}{root}"}


def exec_join(spec: JoinSpec) -> None:
    """Replace this process with a lean one running ``spec`` (does not return)."""
    fd = _spec_file(pickle.dumps(spec))
    sys.stdout.flush()
    sys.stderr.flush()
    # Only who this is, for `ps`: never the original arguments (they may hold secrets).
    shown = ["join", "--stream", spec.options.stream, "--group", spec.options.group,
             "--member", spec.options.member]
    if spec.options.instance_id is not None:
        shown += ["--instance-id", spec.options.instance_id]
    env = {**os.environ, **_package_root_path()}
    os.execve(sys.executable, [sys.executable, "-P", "-m", "cgroupd.join.run", str(fd),
                               *shown], env)


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

    from cgroupd.core import logs
    from cgroupd.core.errors import CgroupdError
    from cgroupd.join.daemon import run_join
    from cgroupd.join.handlers import HandlerOptions, load_handler

    logs.configure(spec.log_level)
    try:
        function = None
        if spec.handler is not None:
            add_working_directory()
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
    # The spec was pickled as cgroupd.join.run's, not __main__'s: read it through that one.
    from cgroupd.join import run as joinrun

    sys.exit(joinrun.run(joinrun.read_spec(int(sys.argv[1]))))
