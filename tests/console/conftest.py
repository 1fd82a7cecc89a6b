"""Fixtures of the console tests: a ``cgroupd console`` process, a console served in the
test's own loop, a headless Chromium."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from cgroupd.console import Console, ConsoleOptions, serve
from cgroupd.nats.jetstream import JetStream
from tests.support.browser import Chromium, require_chromium
from tests.support.cli import ROOT, child_env
from tests.support.natsserver import find_free_port
from tests.support.polling import eventually


class ConsoleProcess:
    """``python -m cgroupd --server URL console ...`` as a child process."""

    def __init__(self, url: str, workdir: Path, *args: str) -> None:
        self.port = find_free_port()
        self.log_path = workdir / "console.log"
        self._log = open(self.log_path, "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cgroupd", "--server", url, "console",
             "--listen", f"127.0.0.1:{self.port}", *args],
            cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    async def ready(self, http: aiohttp.ClientSession) -> None:
        async def answers() -> bool:
            assert self.proc.poll() is None, self.log_text()
            try:
                async with http.get(self.url + "api/groups") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(answers, 20, what="the console to answer")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def console_process(tmp_path: Path) -> Iterator[Callable[..., ConsoleProcess]]:
    started: list[ConsoleProcess] = []

    def start(url: str, *args: str) -> ConsoleProcess:
        proc = ConsoleProcess(url, tmp_path, *args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()


class Served:
    """A console served in the test's loop: its object (reads counted) and base URL."""

    def __init__(self, console: Console, url: str) -> None:
        self.console = console
        self.url = url


@pytest_asyncio.fixture
async def served_console() -> AsyncIterator[Callable[..., Any]]:
    """``await start(js, **options)`` serves a console on a free port until the test ends."""
    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(js: JetStream, **options: Any) -> Served:
        got: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        options.setdefault("port", 0)
        task = asyncio.create_task(serve(js, ConsoleOptions(**options), stop,
                                         lambda c, u: got.set_result(Served(c, u))))
        stops.append((stop, task))
        done, _ = await asyncio.wait({got, task}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        return got.result()

    yield start
    for stop, task in stops:
        stop.set()
        await task


@pytest_asyncio.fixture
async def chromium() -> AsyncIterator[Chromium]:
    browser = Chromium(require_chromium())
    try:
        await browser.start()
        yield browser
    finally:
        await browser.close()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
