"""``cgroupd status --watch`` in a real terminal: tmux runs it, capture-pane reads the
screen as a person would see it, send-keys types Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import ROOT, JoinProcess, child_env
from tests.support.groups import make_group, publish_keyed
from tests.support.k8s_tools import in_ci
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

pytestmark = pytest.mark.slow


class Tmux:
    """A tmux server of our own (its own socket), one window of a fixed size."""

    def __init__(self, command: list[str], env: dict[str, str], width: int = 110,
                 height: int = 30) -> None:
        self.socket = f"cgroupd-test-{secrets.token_hex(4)}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()
                           if k in ("PATH", "PYTHONPATH", "HOME", "LANG"))
        self.run("new-session", "-d", "-x", str(width), "-y", str(height), "-s", "w",
                 f"cd {shlex.quote(str(ROOT))} && env {exports} TERM=xterm-256color "
                 f"{shlex.join(command)}; echo EXITED $?; sleep 30")

    def run(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args],
                              capture_output=True, text=True, timeout=10, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "w")

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", "w", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=10, check=False)


@pytest.fixture
def tmux_available() -> None:
    if shutil.which("tmux") is None:
        message = "tmux not found: apt-get install tmux"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


async def test_watch_view_in_a_real_terminal(tmux_available: None, nats_server: NatsServer,
                                             jetstream: JetStream, nc: Client,
                                             tmp_path: Path,
                                             closing: list[Any]) -> None:
    """With nobody consuming, the screen says the group is idle and shows every partition
    with its backlog and a lag bar; once an instance of m1 joins, its partitions show its
    host and drain to 0 while m2's stay unowned; Ctrl-C leaves the alternate screen and
    exits 0."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    await publish_keyed(jetstream, 40, keys=8)
    command = [sys.executable, "-m", "cgroupd", "--server", nats_server.url, "status",
               "ORDERS", "g", "--watch", "--interval", "0.3"]
    term = Tmux(command, child_env())
    try:
        idle = await eventually(
            lambda: "THE GROUP IS IDLE" in (s := term.screen()) and "PARTITION" in s and s,
            20, 0.1, "the idle view")
        lines = idle.splitlines()
        assert lines[0].startswith("ORDERS/g (elastic)")
        assert "pending 40" in lines[1]
        rows = [line.split() for line in lines if line[:1].isdigit()]
        assert [r[0] for r in rows] == ["0", "1", "2", "3"]
        assert all("(NO ACTIVE INSTANCE)" in line for line in lines if line[:1].isdigit())
        assert all(line.rstrip().endswith("#") for line in lines if line[:1].isdigit())
        assert "Ctrl-C to quit" in idle

        closing.append(JoinProcess(nats_server.url, tmp_path, "m1", "--stream", "ORDERS",
                                 "--group", "g", "--member", "m1", "--handler",
                                 "tests.support.handlers.record_handler:handle",
                                 record=tmp_path / "handled.jsonl"))

        def m1_drained() -> str | bool:
            screen = term.screen()
            rows = {line.split()[0]: line for line in screen.splitlines()
                    if line[:1].isdigit()}
            if len(rows) != 4 or "UNOWNED partitions 2-3" not in screen:
                return False
            mine = [rows[p] for p in ("0", "1")]
            if any("NO ACTIVE" in r or r.split()[3] != "0" for r in mine):
                return False
            return screen

        drained = await eventually(m1_drained, 30, 0.2, "m1's partitions to drain on screen")
        for line in drained.splitlines():
            if line[:3] in ("2  ", "3  "):
                assert "m2 (NO ACTIVE INSTANCE)" in line and line.rstrip().endswith("#")
        term.keys("C-c")
        after = await eventually(lambda: "EXITED" in (s := term.screen()) and s, 10, 0.1,
                                 "the view to exit")
        assert "EXITED 0" in after
        assert "PARTITION" not in after, "the alternate screen is left on exit"
    finally:
        term.close()


class Watcher:
    """``cgroupd --json status ORDERS g --watch`` in a child process (not on a terminal:
    one JSON object a line), its output in a file."""

    def __init__(self, url: str, path: Path) -> None:
        self.path = path
        self._out = open(path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cgroupd", "--server", url, "--json", "status", "ORDERS",
             "g", "--watch", "--interval", "0.2"], cwd=ROOT, env=child_env(),
            stdout=self._out, stderr=subprocess.DEVNULL)

    def frames(self) -> list[dict[str, Any]]:
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._out.close()


async def test_watch_outlives_a_server_restart_and_a_recreated_group(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path,
        closing: list[Any]) -> None:
    """A missing group fails at once (exit 1, one line). Once the view runs it never ends
    by itself: through a nats-server restart it comes back with fresh frames; while the
    group is deleted each refresh reports the error; the re-created group (other member,
    other partition count) is shown; Ctrl-C exits 0."""
    await make_group(jetstream, partitions=2, members=("m1",))
    missing = subprocess.run(
        [sys.executable, "-m", "cgroupd", "--server", nats_server.url, "status", "ORDERS",
         "nope", "--watch"], cwd=ROOT, env=child_env(), capture_output=True, text=True,
        timeout=30, check=False)
    assert missing.returncode == 1, missing
    assert missing.stdout == "" and missing.stderr.count("\n") == 1
    assert "no consumer group 'nope'" in missing.stderr

    watch = Watcher(nats_server.url, tmp_path / "watch.jsonl")
    closing.append(watch)
    await eventually(lambda: len(watch.frames()) >= 2, 20, 0.05, "the first frames")

    await asyncio.to_thread(nats_server.restart)
    after = len(watch.frames())
    await eventually(lambda: [f for f in watch.frames()[after:] if "error" not in f], 20,
                     0.05, "a frame after the restart")
    assert watch.proc.poll() is None

    await admin.delete_group(jetstream, "ORDERS", "g")
    errors = await eventually(
        lambda: [f for f in watch.frames() if "no consumer group 'g'" in f.get("error", "")],
        20, 0.05, "a refresh reporting the deleted group")
    assert errors[0]["time"].endswith("Z")
    config = ElasticGroupConfig(max_members=3, partitioning_filters=(
        PartitioningFilter("orders.*", (1,)),), members=("m9",))
    await admin.create_elastic_group(jetstream, "ORDERS", "g", config)

    def recreated() -> list[dict[str, Any]]:
        return [f for f in watch.frames() if "partitions" in f
                and [p["member"] for p in f["partitions"]] == ["m9", "m9", "m9"]]

    await eventually(recreated, 20, 0.05, "the re-created group on the view")
    watch.proc.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(watch.proc.wait, 10) == 0
