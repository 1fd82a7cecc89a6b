"""``cgroupd join`` runs lean (issue 15 §3, RSS <= 40 MB): once the CLI has checked the
arguments, the process becomes ``python -m cgroupd.join.run`` (same pid), without typer
and the pydantic it parses options with (~10 MB). ``CGROUPD_JOIN_EXEC=0`` keeps the CLI's
process (and shows that the check below can fail)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cgroupd.nats.jetstream import JetStream
from tests.support.cli import ROOT, child_env
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

pytestmark = pytest.mark.slow


def _inspect(pid: int) -> tuple[list[bytes], bool]:
    """The process's command line, and whether pydantic's compiled core is loaded."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv, "pydantic_core" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("lean", [True, False])
async def test_join_drops_the_cli_once_started(nats_server: NatsServer, jetstream: JetStream,
                                               tmp_path: Path, lean: bool) -> None:
    await make_group(jetstream, partitions=2, members=("m1",))
    log = tmp_path / "join.log"
    env = child_env() if lean else child_env(CGROUPD_JOIN_EXEC="0")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cgroupd", "--server", nats_server.url, "join", "--stream",
             "ORDERS", "--group", "g", "--member", "m1", "--handler",
             "tests.support.handlers.record_handler:handle"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        await eventually(lambda: '"became active"' in log.read_text(errors="replace"), 30,
                         what="the instance to become active")
        argv, pydantic = _inspect(proc.pid)
        # The same process (pid), still saying which member it is.
        assert (b"cgroupd.join.run" in argv) is lean, argv
        assert b"--member" in argv and b"m1" in argv
        assert pydantic is not lean
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log.read_text(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
