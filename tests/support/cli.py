"""Helpers for the CLI, daemon and handler tests: real ``cgroupd join`` processes, their
metrics, a scriptable webhook server, and log-config isolation."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner, Result

from cgroupd.cli import app
from tests.support.natsserver import find_free_port
from tests.support.procs import live_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """The CLI configures structlog and the root logger globally: undo it after each test
    so other test modules (``capture_logs`` users) see the configuration they expect."""
    was_configured = structlog.is_configured()
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    if was_configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()
    root.handlers, root.level = handlers, level


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a ``python -m cgroupd`` child: no stray CGROUPD_*/NATS_URL."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CGROUPD_") and k != "NATS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels without stream/group/member): value}``."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("stream", "group", "member")))
            out[(s.name, labels)] = s.value
    return out


class JoinProcess:
    """``python -m cgroupd --server URL join ...`` as a child process with a metrics port."""

    def __init__(self, url: str, workdir: Path, name: str, *args: str,
                 record: Path | None = None, metrics: bool = True) -> None:
        self.port = find_free_port() if metrics else 0
        self.log_path = workdir / f"{name}.log"
        extra = {"CGROUPD_TEST_RECORD": str(record)} if record else {}
        cmd = [sys.executable, "-m", "cgroupd", "--server", url, "join", *args]
        if metrics:
            cmd += ["--metrics-port", str(self.port), "--metrics-host", "127.0.0.1"]
        self._log = open(self.log_path, "wb")  # closed in close()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(**extra),
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def get(self, session: aiohttp.ClientSession, path: str) -> tuple[int, str]:
        """Status and body of a probe endpoint; (0, error) while nothing listens."""
        try:
            async with session.get(self.base + path,
                                   timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, repr(exc)

    async def metrics(self, session: aiohttp.ClientSession) -> dict[Any, float]:
        status, text = await self.get(session, "/metrics")
        return parse_metrics(text) if status == 200 else {}

    async def metric(self, session: aiohttp.ClientSession, name: str,
                     **labels: str) -> float | None:
        return (await self.metrics(session)).get((name, tuple(sorted(labels.items()))))

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` log lines, headed by the instance's name (for failures)."""
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- {self.log_path.stem} (last {lines} lines) ---\n{tail}"

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines (stderr is not a TTY, so logs are JSON)."""
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    async def wait_exit(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"join did not exit within {timeout}s:\n"
                                     f"{self.log_text()[-3000:]}")
            await asyncio.sleep(0.02)
        return self.proc.returncode

    def close(self) -> None:
        """Never leave the process behind."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


@dataclass
class Hit:
    """One request the webhook server received."""

    key: str
    headers: dict[str, str]
    body: bytes
    peer: Any


@dataclass
class WebhookServer:
    """A local aiohttp server; ``script[key]`` lists the statuses for successive requests
    carrying that key (payload JSON ``{"key": ...}``); 200 once the list runs out."""

    script: dict[str, list[int]] = field(default_factory=dict)
    delay: float = 0.0
    hits: list[Hit] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            key = str(json.loads(body).get("key"))
        except ValueError:
            key = body.decode(errors="replace")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.hits.append(Hit(key, dict(request.headers), body, peer))
        if self.delay:
            await asyncio.sleep(self.delay)
        statuses = self.script.get(key, [])
        status = statuses.pop(0) if statuses else 200
        return web.Response(status=status, text=f"status {status}")

    async def start(self) -> WebhookServer:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        # Do not wait for slow handlers (tests of stuck webhooks) when stopping.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        self.port = find_free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def for_key(self, key: str) -> list[Hit]:
        return [h for h in self.hits if h.key == key]


def session_processes(sid: int) -> list[int]:
    """Pids of live processes in session ``sid`` (zombies excluded)."""
    return live_processes(lambda fields: fields[3] == str(sid))


# -- the command line in-process (typer's CliRunner) --------------------------------------
_runner = CliRunner()


def cli(url: str | None, *args: str, input: str | None = None,
        env: dict[str, str] | None = None) -> Result:
    """Run ``cgroupd [--server url] args...`` in-process."""
    argv = (["--server", url] if url else []) + list(args)
    clean = {k: None for k in os.environ if k.startswith("CGROUPD_") or k == "NATS_URL"}
    return _runner.invoke(app, argv, input=input, env={**clean, **(env or {})})


def assert_one_line_error(result: Result, code: int, *fragments: str) -> None:
    """The documented exit code, one line on stderr, no traceback."""
    assert result.exit_code == code, result.output
    err = result.stderr.strip()
    assert err.startswith("cgroupd: error: "), err
    assert "\n" not in err, err
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in err, err
