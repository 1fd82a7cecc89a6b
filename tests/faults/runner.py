"""``python -m cgroupd join ...`` member processes for fault scenarios.

Each process runs one member instance with a recording handler
(:mod:`tests.faults.recorder`), a known instance id (``--instance-id``, so rows, logs and
consumers name the same instance) and its own SQLite file. Its JSON log (stderr) goes to
a file the test reads to follow its state ("became active", "stepped down", "stopped").
A process can run inside a network namespace (``ip netns exec``, which execs in place,
so the pid we signal is the Python process itself).

Only pids started here are ever signalled; :meth:`JoinProc.close` always reaps.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.cli import child_env
from tests.support.procs import live_processes

ROOT = Path(__file__).resolve().parents[2]

#: Handler references of the two recording variants.
HANDLERS = {
    "at_least_once": "tests.faults.recorder:at_least_once",
    "exactly_once": "tests.faults.recorder:exactly_once",
}

#: Every process started here and not yet reaped (the conftest leak check reads it).
LIVE: set[subprocess.Popen[bytes]] = set()


class JoinProc:
    """One ``cgroupd join`` process."""

    def __init__(self, urls: Sequence[str], workdir: Path, *, stream: str, group: str,
                 member: str, variant: str, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, netns: str | None = None,
                 label: str | None = None) -> None:
        self.member = member
        self.instance = f"{member}-{secrets.token_hex(3)}"
        self.label = label or self.instance
        self.variant = variant
        self.netns = netns
        self.log_path = workdir / "logs" / f"{self.instance}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        extra = {
            "FAULTS_DB": str(workdir / "db" / f"{self.instance}.db"),
            "FAULTS_INSTANCE": self.instance,
            "FAULTS_MEMBER": member,
            "FAULTS_HOLD_DIR": str(workdir),
            **(env or {}),
        }
        cmd = [sys.executable, "-m", "cgroupd", "--server", ",".join(urls), "join",
               "--stream", stream, "--group", group, "--member", member,
               "--instance-id", self.instance, "--handler", HANDLERS[variant],
               "--log-level", "info", *args]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(**extra),
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        LIVE.add(self.proc)
        self.suspended = False
        #: Whether it was sent SIGKILL (it lost whatever it had not flushed).
        self.killed = False

    def __repr__(self) -> str:
        return f"<JoinProc {self.instance} pid={self.proc.pid} rc={self.proc.poll()}>"

    # -- observation ----------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far (a line cut by SIGKILL is skipped)."""
        out: list[dict[str, Any]] = []
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def count(self, event: str) -> int:
        return sum(e.get("event") == event for e in self.events())

    def state(self) -> str | None:
        """``active``, ``standby`` (joined or stepped down) or ``stopped``; None before."""
        state = None
        for e in self.events():
            name = e.get("event")
            if name == "became active":
                state = "active"
            elif name == "stepped down" or (name == "joined" and state is None):
                state = "standby"
            elif name in ("stopped", "group deleted; exiting"):
                state = "stopped"
        return state

    @property
    def active(self) -> bool:
        return self.alive and self.state() == "active"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "<no log>"

    # -- faults ---------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)
            if sig == signal.SIGSTOP:
                self.suspended = True
            elif sig in (signal.SIGCONT, signal.SIGKILL):
                self.suspended = False
            self.killed |= sig == signal.SIGKILL

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def close(self) -> None:
        """Never leave the process behind (SIGCONT first: a stopped one must die too)."""
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        finally:
            LIVE.discard(self.proc)
            self._log.close()


def own_children() -> list[int]:
    """Pids of live (non-zombie) processes whose parent is this test process."""
    me = str(os.getpid())
    return live_processes(lambda fields: fields[1] == me)
