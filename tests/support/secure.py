"""One end-to-end run of cgroupd with a given way to connect (tests/security/): the admin
commands in-process (``group create``, ``group ls --json``, a failing ``group info``),
then a real ``cgroupd join`` process that handles one message, with its metrics scraped and
its command line read while it runs. Everything the run printed is kept, so a test can
check that it worked and grep it all for the secret it used."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from nats.js import api
from typer.testing import Result

from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import ROOT, child_env, cli
from tests.support.natsserver import find_free_port
from tests.support.polling import eventually

#: The ``cgroupd`` console script of this environment (what users run).
CGROUPD = str(Path(sys.executable).with_name("cgroupd"))


@dataclass
class Run:
    """What one run printed, by where it came from."""

    outputs: dict[str, str] = field(default_factory=dict)

    def add(self, where: str, text: str) -> None:
        self.outputs[where] = self.outputs.get(where, "") + text

    def containing(self, secret: str) -> list[str]:
        """Where ``secret`` appears (empty: nowhere)."""
        return [where for where, text in self.outputs.items() if secret in text]


def cmdline(pid: int) -> str:
    """What ``ps`` shows of process ``pid``: its arguments, space-separated."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


async def make_stream(options: ConnectionOptions, stream: str = "ORDERS") -> None:
    nc = await connect(options)
    try:
        await JetStream(nc).add_stream(api.StreamConfig(name=stream,
                                                        subjects=[f"{stream.lower()}.>"]))
    finally:
        await nc.close()


async def publish(options: ConnectionOptions, subject: str, data: bytes) -> None:
    nc = await connect(options)
    try:
        await JetStream(nc).publish(subject, data)
    finally:
        await nc.close()


def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    """The command line in-process, off the test's event loop (it runs its own)."""
    return cli(None, *args, env=env)


async def admin_round_trip(args: list[str], run: Run, env: dict[str, str] | None = None
                           ) -> None:
    """``group create`` and ``group ls --json`` with the connection ``args``; asserts they
    worked, keeps what they printed; then an error path (an unknown group)."""
    created = await asyncio.to_thread(
        run_cli, *args, "--json", "group", "create", "ORDERS", "g", "--partitions", "2",
        "--filter", "orders.*", "--wildcards", "1", "--member", "m1", env=env)
    run.add("group create", created.output)
    assert created.exit_code == 0, created.output
    listed = await asyncio.to_thread(run_cli, *args, "--json", "group", "ls", "ORDERS",
                                     env=env)
    run.add("group ls --json", listed.output)
    assert listed.exit_code == 0, listed.output
    assert [g["group"] for g in json.loads(listed.stdout)] == ["g"]
    missing = await asyncio.to_thread(run_cli, *args, "group", "info", "ORDERS", "nope",
                                      env=env)
    run.add("group info (error)", missing.output)
    assert missing.exit_code != 0


async def join_handles_one(args: list[str], options: ConnectionOptions, tmp: Path, run: Run,
                           env: dict[str, str] | None = None,
                           during: Callable[[Path], Awaitable[None]] | None = None) -> None:
    """A ``cgroupd ARGS join`` process handles one published message; its log, /metrics
    and /proc/<pid>/cmdline go into ``run``. ``during(log_path)`` runs while it is
    active (after the message was handled), e.g. a server restart."""
    record = tmp / "handled.jsonl"
    record.touch()
    log_path = tmp / "join.log"
    port = find_free_port()
    cmd = [CGROUPD, *args, "join", "--stream", "ORDERS", "--group", "g", "--member", "m1",
           "--handler", "tests.support.handlers.record_handler:handle",
           "--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                env=child_env(CGROUPD_TEST_RECORD=str(record), **(env or {})))
    try:
        await eventually(lambda: b'"became active"' in log_path.read_bytes()
                         or proc.poll() is not None, 30, what="join to become active")
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        run.add("ps (join's /proc cmdline)", cmdline(proc.pid))
        await publish(options, "orders.k1", b"hello")
        await eventually(lambda: "hello" in record.read_text(), 30,
                         what="the message to be handled")
        if during is not None:
            await during(log_path)
        async with aiohttp.ClientSession() as session:
            for path in ("/metrics", "/healthz", "/readyz"):
                async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
                    run.add(path, await resp.text())
        proc.send_signal(signal.SIGTERM)
        await eventually(lambda: proc.poll() is not None, 20, what="join to exit on SIGTERM")
        assert proc.returncode == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        run.add("join log", log_path.read_text(errors="replace"))
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert [x["data"] for x in lines] == ["hello"]
