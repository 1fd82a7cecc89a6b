"""The daemon's HTTP probes (``/metrics``, ``/healthz``, ``/readyz``): what Kubernetes and
Prometheus ask a running instance.

A small HTTP/1.1 server of its own on asyncio (no aiohttp: ~10 MB resident less, see
:mod:`cgroupd.natsload`), built to keep answering probes when the port is attacked
(issue 25 row 11):

* every connection must send its whole request head within ``read_timeout`` and read the
  answer within the same time again, or it is closed (slow-loris clients are dropped);
* at most ``max_connections`` are open at once (clamped to a share of the process's file
  limit, so a flood can never make NATS or the webhook fail with "Too many open
  files"); a new connection beyond that closes the *oldest one still sending its
  request*, so a probe, which sends its request at once, is answered even while a
  flood holds every slot;
* requests are GET or HEAD without a body, heads at most 8 KiB; each answer closes its
  connection (no idle keep-alive connections to hold).
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Callable
from typing import Any

from cgroupd.errors import StartupError
from cgroupd.joinoptions import HTTP_MAX_CONNECTIONS as MAX_CONNECTIONS
from cgroupd.joinoptions import HTTP_READ_TIMEOUT as READ_TIMEOUT
from cgroupd.metrics import Metrics

#: Longest request head (request line and headers).
MAX_HEAD = 8 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


def connection_cap(wanted: int) -> int:
    """``wanted``, but at most an eighth of the soft open-file limit (at least 4): the
    accept queue can add as many again before the oldest are closed."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return wanted
    return max(4, min(wanted, soft // 8))


class ProbeServer:
    """Serves ``/metrics`` (Prometheus text), ``/healthz`` (200 while ``problems()`` is
    empty, else 503 listing them) and ``/readyz`` (200 while ``ready()``), each with the
    instance's ``state()`` as JSON."""

    def __init__(self, metrics: Metrics, *, problems: Callable[[], list[str]],
                 ready: Callable[[], bool], state: Callable[[], dict[str, Any]],
                 read_timeout: float = READ_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._metrics = metrics
        self._problems = problems
        self._ready = ready
        self._state = state
        self.read_timeout = read_timeout
        self.max_connections = connection_cap(max_connections)
        self._server: asyncio.Server | None = None
        #: Open connections, oldest first (dicts keep insertion order).
        self._open: dict[_Connection, None] = {}

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; StartupError when that is not possible."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self), host, port, reuse_address=True,
                backlog=self.max_connections)
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: "
                               f"{exc.strerror or exc}") from exc

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._open):
                conn.abort()
            await self._server.wait_closed()
            self._server = None

    # -- connections ----------------------------------------------------------------
    def _opened(self, conn: _Connection) -> None:
        self._open[conn] = None
        if len(self._open) > self.max_connections:
            victim = next((c for c in self._open if not c.answered), None)
            if victim is None:  # every slot is being answered: the newcomer waits no turn
                victim = conn
            self._metrics.http_dropped("limit")
            victim.abort()

    def _closed(self, conn: _Connection) -> None:
        self._open.pop(conn, None)

    def _dropped(self, reason: str) -> None:
        self._metrics.http_dropped(reason)

    # -- answers --------------------------------------------------------------------
    def answer(self, method: str, path: str) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` for a request."""
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return 200, self._metrics.content_type, self._metrics.render()
        if path == "/healthz":
            problems = self._problems()
            return _json({**self._state(), "problems": problems}, 503 if problems else 200)
        if path == "/readyz":
            return _json(self._state(), 200 if self._ready() else 503)
        return 404, "text/plain; charset=utf-8", b"not found\n"


def _json(body: dict[str, Any], status: int) -> tuple[int, str, bytes]:
    return status, "application/json; charset=utf-8", json.dumps(body).encode()


class _Connection(asyncio.Protocol):
    """One client: read its request head within the deadline, answer once, close."""

    def __init__(self, server: ProbeServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        #: The request was read: an answer is being written.
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._server.read_timeout, self._timed_out)
        self._server._opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        self._server._closed(self)

    def abort(self) -> None:
        """Close at once (the slot is free now, not when the loop reports the loss)."""
        self._server._closed(self)
        if self._transport is not None:
            self._transport.abort()

    def _timed_out(self) -> None:
        self._timer = None
        if not self.answered:
            self._server._dropped("timeout")
        self.abort()

    def eof_received(self) -> bool:
        if not self.answered:
            self.abort()
        return True  # keep the transport open until the answer is written

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # a pipelined or trailing request: each connection gets one answer
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD:
                self._server._dropped("invalid")
                self._send(431, "text/plain", b"request head too large\n", head_only=False)
            return
        if end > MAX_HEAD:
            self._server._dropped("invalid")
            self._send(431, "text/plain", b"request head too large\n", head_only=False)
            return
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._server._dropped("invalid")
            self._send(400, "text/plain", b"bad request\n", head_only=False)
            return
        method, path, _ = parts
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        has_body = (headers.get("content-length", "0") not in ("", "0")
                    or "transfer-encoding" in headers)
        if method not in ("GET", "HEAD"):
            self._send(405, "text/plain", b"only GET and HEAD\n", head_only=False,
                       extra="Allow: GET, HEAD\r\n")
            return
        if has_body:
            self._server._dropped("invalid")
            self._send(400, "text/plain", b"no request body expected\n", head_only=False)
            return
        try:
            status, content_type, body = self._server.answer(method, path)
        except Exception as exc:  # noqa: BLE001 - a probe answers, whatever broke
            status, content_type, body = _json({"problems": [f"probe failed: {exc!r}"]},
                                               503)
        self._send(status, content_type, body, head_only=method == "HEAD")

    def _send(self, status: int, content_type: str, body: bytes, *, head_only: bool,
              extra: str = "") -> None:
        transport = self._transport
        if transport is None:
            return
        self.answered = True
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\nCache-Control: no-store\r\n{extra}\r\n").encode()
        transport.write(head if head_only else head + body)
        transport.close()  # after the buffer is written; the timer bounds that too
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._server.read_timeout,
                                                            self.abort)
