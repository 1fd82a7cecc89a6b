"""A nats-py client that hands the raw replies of chosen subscriptions to a callback.

The Spark source reads hundreds of thousands of direct-get replies per second. nats-py
turns each into a :class:`~nats.aio.msg.Msg` with a parsed header dict (which merges a
status line with the message's own headers, see :mod:`cgroupd.nats.jsapi`) and hands it to a
subscription queue and task: about 35 µs a message here. :class:`ReaderClient` keeps
nats-py for everything it does well (connecting, credentials, TLS, reconnects, PING/PONG,
every other subscription) and replaces its protocol parser with :class:`FastParser`,
which delivers ``(header bytes, payload)`` of a *raw* subscription straight to a plain
function, without a Msg, a header dict, a queue or a task switch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import ProtocolError
from nats.protocol.parser import MAX_CONTROL_LINE_SIZE, Parser

#: What a raw subscription's callback gets: subject, header block (None without), payload.
RawCallback = Callable[[bytes, bytes | None, bytes], None]

_CONTROL = 1
_PAYLOAD = 2


class FastParser(Parser):
    """The NATS client protocol (MSG, HMSG, PING, PONG, +OK, -ERR, INFO), parsed with
    offsets into one buffer that is trimmed once per read rather than once per message."""

    def __init__(self, nc: Any) -> None:
        super().__init__(nc)
        #: Subscription id -> callback for raw delivery.
        self.raw: dict[int, RawCallback] = {}

    def reset(self) -> None:
        super().reset()
        self._sid = 0
        self._subject = b""
        self._reply = b""
        self._hsize = 0
        self._size = 0

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while True:
                if self.state == _CONTROL:
                    end = buf.find(b"\r\n", pos)
                    if end < 0:
                        if len(buf) - pos > MAX_CONTROL_LINE_SIZE:
                            raise ProtocolError("nats: control line too long")
                        return
                    line = bytes(buf[pos:end])
                    pos = end + 2
                    if line[:5] == b"HMSG ":
                        args = line[5:].split()
                        if len(args) == 5:
                            self._reply = args[2]
                        elif len(args) == 4:
                            self._reply = b""
                        else:
                            raise ProtocolError("nats: malformed HMSG")
                        self._subject = args[0]
                        self._sid = int(args[1])
                        self._hsize = int(args[-2])
                        self._size = int(args[-1])
                        self.state = _PAYLOAD
                    elif line[:4] == b"MSG ":
                        args = line[4:].split()
                        if len(args) == 4:
                            self._reply = args[2]
                        elif len(args) == 3:
                            self._reply = b""
                        else:
                            raise ProtocolError("nats: malformed MSG")
                        self._subject = args[0]
                        self._sid = int(args[1])
                        self._hsize = 0
                        self._size = int(args[-1])
                        self.state = _PAYLOAD
                    else:
                        await self._control(line)
                else:
                    size = self._size
                    if len(buf) - pos < size + 2:
                        return
                    hsize = self._hsize
                    hdr = bytes(buf[pos:pos + hsize]) if hsize else None
                    payload = bytes(buf[pos + hsize:pos + size])
                    pos += size + 2
                    self.state = _CONTROL
                    callback = self.raw.get(self._sid)
                    if callback is not None:
                        callback(self._subject, hdr, payload)
                    else:
                        await self.nc._process_msg(self._sid, self._subject, self._reply,
                                                   payload, hdr)
        finally:
            if pos:
                del buf[:pos]

    async def _control(self, line: bytes) -> None:
        op = line.split(b" ", 1)[0].upper()
        if op == b"PING":
            await self.nc._process_ping()
        elif op == b"PONG":
            await self.nc._process_pong()
        elif op == b"+OK":
            pass
        elif op == b"-ERR":
            await self.nc._process_err(line[5:].decode("utf-8", "replace").strip().lower())
        elif op == b"INFO":
            await self.nc._process_info(json.loads(line[5:].decode()))
        else:
            raise ProtocolError("nats: unknown protocol")


class ReaderClient(Client):
    """A nats-py client with :class:`FastParser` and raw subscriptions."""

    def __init__(self) -> None:
        super().__init__()
        self._ps: FastParser = FastParser(self)

    async def raw_subscribe(self, subject: str, callback: RawCallback) -> Subscription:
        """Subscribe ``subject``; every message on it goes to ``callback`` as raw bytes.

        The subscription survives reconnects as any other (nats-py re-sends it with the
        same id); unsubscribe it with :meth:`raw_unsubscribe`.
        """
        sub = await self.subscribe(subject, pending_msgs_limit=0, pending_bytes_limit=0)
        self._ps.raw[sub._id] = callback
        return sub

    async def raw_unsubscribe(self, sub: Subscription) -> None:
        self._ps.raw.pop(sub._id, None)
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - the connection is closed already
            pass
