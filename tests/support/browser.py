"""A real headless Chromium (Debian's ``chromium``) driven over the Chrome DevTools
protocol with aiohttp's websocket client: no new dependency and no browser download.

``Chromium`` starts one browser process with its own throw-away profile and
``--remote-debugging-port=0`` (the port it picked is read back from ``DevToolsActivePort``);
``Tab`` is one page: navigate, evaluate JavaScript (the page's own DOM, read as a user
sees it), wait for a condition, take a PNG screenshot. Only the pid this module started is
ever signalled.

Availability: ``chromium_binary()`` finds it; without one, tests fail under CI (``CI=true``)
and are skipped elsewhere with the command that installs it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

#: Names Debian and others install Chromium under.
BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("Debian's chromium is not installed: apt-get install -y chromium "
                "(scripts/test.sh installs it when run as root)")


def chromium_binary() -> str | None:
    override = os.environ.get("CGROUPD_CHROMIUM")
    if override:
        return override
    return next((found for name in BINARIES if (found := shutil.which(name))), None)


def require_chromium() -> str:
    """The browser, or a failed test under CI and a skipped one elsewhere."""
    found = chromium_binary()
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and no Chromium: {INSTALL_HINT}")
        pytest.skip(INSTALL_HINT)
    return found


class BrowserError(AssertionError):
    """The browser did not start, or a page did not do what a test waited for."""


class Tab:
    """One page target, over its own DevTools websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                thrown = details.get("exception", {}).get("description")
                self.console.append(f"exception: {thrown or details.get('text')}")
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description")))
                                             for a in args))
            elif data.get("method") == "Log.entryAdded":
                entry = data["params"]["entry"]
                self.console.append(f"{entry.get('level')}: {entry.get('text')}")
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(BrowserError("the DevTools connection closed"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = future
        await self._ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
        async with asyncio.timeout(30):
            answer = await future
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0, what: str = "") -> Any:
        """Evaluate ``expression`` until it is truthy; its value. The page refreshes on
        its own timer: there is no event to await from here."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await self.evaluate(expression)
            if last:
                return last
            await asyncio.sleep(0.1)
        raise BrowserError(f"timed out after {timeout}s waiting for {what or expression} "
                           f"(last value {last!r}; page console: {self.console[-10:]})")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", 20, "the page to load")

    async def screenshot(self) -> bytes:
        """The whole page as a PNG."""
        shot = await self.send("Page.captureScreenshot", format="png",
                               captureBeyondViewport=True)
        return base64.b64decode(shot["data"])

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()


class Chromium:
    """One headless browser process and the tabs opened in it."""

    def __init__(self, binary: str, width: int = 1440, height: int = 1000) -> None:
        self.binary = binary
        self.width, self.height = width, height
        self.profile = Path(tempfile.mkdtemp(prefix="cgroupd-chromium-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.http: aiohttp.ClientSession | None = None
        self.tabs: list[Tab] = []
        self._log = open(self.profile / "chromium.log", "wb")  # closed in close()

    async def start(self) -> Chromium:
        self.proc = subprocess.Popen(
            [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-sync",
             "--disable-component-update", "--mute-audio", "--hide-scrollbars",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={self.profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (active.exists() and len(active.read_text().splitlines()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BrowserError("chromium did not open its DevTools port:\n"
                                   + self.log_tail())
            await asyncio.sleep(0.05)
        self.port = int(active.read_text().splitlines()[0])
        self.http = aiohttp.ClientSession()
        return self

    def log_tail(self) -> str:
        self._log.flush()
        return (self.profile / "chromium.log").read_text(errors="replace")[-3000:]

    async def new_tab(self, url: str | None = None) -> Tab:
        """A new page (navigated to ``url`` if given) at the browser's window size."""
        assert self.http is not None
        async with self.http.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json(content_type=None)
        ws = await self.http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        tab = Tab(ws)
        self.tabs.append(tab)
        await tab.send("Runtime.enable")
        await tab.send("Page.enable")
        await tab.send("Log.enable")
        await tab.send("Emulation.setDeviceMetricsOverride", width=self.width,
                       height=self.height, deviceScaleFactor=1, mobile=False)
        if url is not None:
            await tab.goto(url)
        return tab

    async def close(self) -> None:
        for tab in self.tabs:
            await tab.close()
        if self.http is not None:
            await self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)
