"""The daemon's HTTP probes (``/metrics``, ``/healthz``, ``/readyz``): what Kubernetes and
Prometheus ask a running instance.

A small HTTP/1.1 server of its own on non-blocking sockets and the event loop's reader
and writer callbacks (no aiohttp: ~10 MB resident less, see :mod:`cgroupd.nats.natsload`),
built to keep answering probes while the port is attacked (issue 25 row 11):

* the kernel accepts a connection only once its first bytes have arrived (Linux
  ``TCP_DEFER_ACCEPT``, :data:`DEFER_ACCEPT` s; a handshake waiting for them holds no
  file of ours), and a connection is read the moment it is accepted: a probe has sent
  its whole request by then, so it is answered at once and cannot be taken for a flood;
* one that has not sent a complete request head holds one of ``max_connections`` slots
  (clamped to a share of the process's file limit, so a flood never makes NATS or the
  webhook fail with "Too many open files") for at most ``read_timeout``; a newcomer
  beyond the cap closes the *oldest that sent part of a request and no more* (a
  slow-loris client), so a real client that is slow to send gets a turn too; one that
  has sent nothing yet is spared for :data:`SILENT_GRACE` (a probe's client starved
  between its connect and its write), the slots overshooting by at most the cap again;
* the answer must be read within ``read_timeout`` again (a client that never reads
  cannot hold the slot either);
* requests are GET or HEAD without a body, heads at most 8 KiB; each answer closes its
  connection (no idle keep-alive connections to hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
from collections.abc import Callable
from typing import Any

from cgroupd.core import logs
from cgroupd.core.errors import StartupError
from cgroupd.join.metrics import Metrics
from cgroupd.join.options import HTTP_MAX_CONNECTIONS as MAX_CONNECTIONS
from cgroupd.join.options import HTTP_READ_TIMEOUT as READ_TIMEOUT

log = logs.get_logger("cgroupd.probes")

#: Longest request head (request line and headers).
MAX_HEAD = 8 * 1024
#: Connections accepted per wakeup, and queued by the kernel meanwhile.
ACCEPT_BATCH = 64
LISTEN_QUEUE = 4096
#: Seconds the kernel keeps a handshake that sent nothing before handing it to us anyway
#: (Linux rounds up to its SYN-ACK retransmits: about 1 s).
DEFER_ACCEPT = 1
#: Seconds a connection that sent nothing since it was accepted cannot be closed for a
#: newcomer: its request may be on the way (its client was starved between connecting
#: and writing), and closing it would drop a probe.
SILENT_GRACE = 0.5
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def connection_cap(wanted: int) -> int:
    """``wanted``, but at most an eighth of the soft open-file limit (at least 4): the
    rest is for NATS, the webhook and the handler, whatever the port is sent."""
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
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Open connections, oldest first (dicts keep insertion order).
        self._open: dict[_Connection, None] = {}
        self._accept_failed = False

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; StartupError when that is not possible."""
        loop = self._loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            family, kind, proto, _, address = (await loop.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "TCP_DEFER_ACCEPT") and family in (socket.AF_INET,
                                                                 socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT)
            sock.bind(address)
            sock.listen(LISTEN_QUEUE)
            sock.setblocking(False)
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise StartupError(f"cannot listen on {host}:{port}: "
                               f"{exc.strerror or exc}") from exc
        self._listener = sock
        loop.add_reader(sock.fileno(), self._accept)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def stop(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for conn in list(self._open):
            conn.close()

    # -- connections ----------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of files (cannot happen from this port's own connections, which
                # the cap keeps well below the limit) or the like: the next wakeup
                # tries again; say so once.
                if not self._accept_failed:
                    self._accept_failed = True
                    log.warning("http accept failed", error=exc.strerror or repr(exc))
                return
            self._accept_failed = False
            self.serve(sock)

    def serve(self, sock: socket.socket) -> None:
        """Serve one accepted connection (the tests hand in one of a socket pair)."""
        assert self._loop is not None
        _Connection(self, self._loop, sock).start()

    def _hold(self, conn: _Connection) -> bool:
        """Give ``conn`` a slot (False: it was closed instead).

        At the cap, a newcomer that sent part of a request is closed at once (one more
        slow sender; the cheapest answer to a flood of them). Any other newcomer (one
        whose request has not arrived yet, or whose answer is being read) closes the
        oldest connection that sent part of a request and no more, else the oldest that
        sent nothing for :data:`SILENT_GRACE` since it was accepted, else the oldest
        whose answer is written.

        One that sent nothing yet and is younger than that is never closed for a
        newcomer: it may be a probe whose client was starved between its connect and its
        write (CI on b1e7bf5: a /healthz reset under the 2,000-connection flood, because
        flood connections accepted in the same batch found it the oldest that sent
        nothing). The slots overshoot for those instead, by at most the cap again (twice
        the cap is still a quarter of the file limit); at that bound a newcomer that sent
        nothing is closed at once, like a slow sender at the cap, so a probe already
        held keeps its slot. Under a flood that keeps the bound full, a probe's
        connection is then closed only if its request is not there when it is accepted,
        which the kernel's deferred accept makes rare (see :meth:`start`)."""
        if len(self._open) >= self.max_connections and conn.partial and not conn.answered:
            self._metrics.http_dropped("limit")
            conn.close()
            return False
        if len(self._open) >= 2 * self.max_connections and not conn.answered:
            self._metrics.http_dropped("limit")
            conn.close()
            return False
        self._open[conn] = None
        while len(self._open) > self.max_connections:
            grace_ended = self._loop_time() - SILENT_GRACE
            victim = (next((c for c in self._open if c.partial and not c.answered), None)
                      or next((c for c in self._open if not c.answered
                               and c.accepted_at <= grace_ended), None)
                      or next((c for c in self._open if c.answered), None))
            if victim is None:
                break  # only young silent ones over the cap: the bounded overshoot
            if not victim.answered:
                # Its request may have arrived since its last read (a starved loop runs
                # reader callbacks late): answer it rather than drop a probe. A flood's
                # slow sender stays partial and is the one closed (tests/security/
                # test_http_port.py: a probe reset under 2,000 connections at load 3).
                victim.read_now()
                if victim.answered or victim.closed:
                    continue
                self._metrics.http_dropped("limit")
            victim.close()
        return conn in self._open

    def _loop_time(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _closed(self, conn: _Connection) -> None:
        self._open.pop(conn, None)

    def _dropped(self, reason: str) -> None:
        self._metrics.http_dropped(reason)

    # -- answers --------------------------------------------------------------------
    def answer(self, method: str, path: str) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` for a GET or HEAD of ``path``."""
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


class _Connection:
    """One client: read its request head within the deadline, answer once, close."""

    def __init__(self, server: ProbeServer, loop: asyncio.AbstractEventLoop,
                 sock: socket.socket) -> None:
        self._server = server
        self._loop = loop
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._buffer = bytearray()
        self._out = b""
        self._reading = self._writing = False
        self._timer: asyncio.TimerHandle | None = None
        #: When it was accepted (loop time): one that sent nothing is spared a while.
        self.accepted_at = loop.time()
        #: Part of a request arrived, not all of it.
        self.partial = False
        #: The request was read: an answer is being written (or the socket drained).
        self.answered = False

    def start(self) -> None:
        """Read what already arrived (a probe's whole request, usually) and answer it;
        a connection that must wait (for its request, or for the client to read or hang
        up) takes a slot and a deadline."""
        assert self._sock is not None
        self._sock.setblocking(False)
        self._read()
        if self._sock is None or not self._server._hold(self):
            return
        self._timer = self._loop.call_later(self._server.read_timeout, self._timed_out)
        self._settle()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def read_now(self) -> None:
        """Read what arrived since the last read, answering a request now complete."""
        self._read()
        self._settle()

    def _settle(self) -> None:
        """Wait for what this connection waits for: its request, the client reading the
        answer, or the client hanging up after it."""
        if self._sock is not None:
            self._watch(not self._out, bool(self._out))

    def close(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        if self._reading:
            self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sock.close()
        self._server._closed(self)

    def _timed_out(self) -> None:
        self._timer = None
        if not self.answered:
            self._server._dropped("timeout")
        self.close()

    def _watch(self, read: bool, write: bool) -> None:
        if read != self._reading:
            if read:
                self._loop.add_reader(self._fd, self._readable)
            else:
                self._loop.remove_reader(self._fd)
            self._reading = read
        if write != self._writing:
            if write:
                self._loop.add_writer(self._fd, self._writable)
            else:
                self._loop.remove_writer(self._fd)
            self._writing = write

    def _readable(self) -> None:
        self._read()
        self._settle()

    def _read(self) -> None:
        if self._sock is None:
            return
        try:
            data = self._sock.recv(MAX_HEAD + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:  # the client is gone (or, after our answer, done)
            self.close()
            return
        if self.answered:
            return  # drained: what a client sends after its request is not read
        self._buffer += data
        self._parse()

    def _parse(self) -> None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0 or end > MAX_HEAD:
            if len(self._buffer) > MAX_HEAD:
                self._server._dropped("invalid")
                self._send(431, b"request head too large\n")
            else:
                self.partial = True
            return
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._server._dropped("invalid")
            self._send(400, b"bad request\n")
            return
        method, path, _ = parts
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            self._send(405, b"only GET and HEAD\n", extra="Allow: GET, HEAD\r\n")
            return
        if headers.get("content-length", "0") not in ("", "0") or (
                "transfer-encoding" in headers):
            self._server._dropped("invalid")
            self._send(400, b"no request body expected\n")
            return
        try:
            status, content_type, body = self._server.answer(method, path)
        except Exception as exc:  # noqa: BLE001 - a probe answers, whatever broke
            status, content_type, body = _json({"problems": [f"probe failed: {exc!r}"]},
                                               503)
        self._send(status, body, content_type=content_type, head_only=method == "HEAD")

    def _send(self, status: int, body: bytes, *, content_type: str = "text/plain",
              head_only: bool = False, extra: str = "") -> None:
        self.answered = True
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\nCache-Control: no-store\r\n{extra}\r\n").encode()
        self._out = head if head_only else head + body
        if self._timer is not None:  # a fresh deadline to read the answer
            self._timer.cancel()
            self._timer = self._loop.call_later(self._server.read_timeout, self._timed_out)
        self._write()

    def _writable(self) -> None:
        self._write()
        self._settle()

    def _write(self) -> None:
        if self._sock is None:
            return
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        self._out = self._out[sent:]
        if not self._out:
            # All written: end our side, and close once the client has read it and
            # ended its own (closing with unread input would reset the connection and
            # could destroy the answer before the client reads it).
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)

