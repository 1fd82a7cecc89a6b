"""``cgroupd`` with its per-message steps timestamped, switched on and off from outside.

A sampling profiler says where CPU goes; a member that runs one handler at a time is
bound by waiting as much as by CPU, so this says where its *wall* time goes between two
messages. The launcher wraps, at run time and without changing cgroupd, the points one
message passes: the dispatcher's ``submit`` (a message arrived from the puller), the ack
(``Message.ack``), a pull request (``Puller._pull`` when it sent one), the client's
socket writes (nats-py's flusher) and data messages received (``Puller._receive``). Each
is a ``(time.time(), step)`` pair kept in memory; SIGUSR1 starts recording, SIGUSR2
writes them to OUT (JSON lines) and stops. The wrappers cost a few µs per step, so
absolute figures are a little high; the split between steps is what this is for.

Usage: ``python -m bench.traced OUT -- <cgroupd arguments>``.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

#: The steps recorded, in the order one message of a one-at-a-time member meets them.
STEPS = ("receive", "submit", "ack", "pull", "write")

_events: list[tuple[float, str]] = []
_on = False


def _mark(step: str) -> None:
    if _on:
        _events.append((time.time(), step))


def _wrap_async(owner: Any, name: str, step: str,
                when: Callable[..., bool] | None = None) -> None:
    """Record ``step`` as ``owner.name`` is called (if ``when(self, *args)`` says so)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if when is None or when(self, *args):
            _mark(step)
        return await original(self, *args, **kwargs)

    setattr(owner, name, wrapper)


def install() -> None:
    """Wrap the steps (imports here: the launcher must not load cgroupd before main)."""
    from nats.aio import transport

    from cgroupd.member.dispatch import Dispatcher
    from cgroupd.nats import jsapi
    from cgroupd.nats.message import Message
    from cgroupd.nats.pull import Puller

    submit = Dispatcher.submit

    @functools.wraps(submit)
    def submit_marked(self: Dispatcher, raw: Any) -> None:
        _mark("submit")
        submit(self, raw)

    Dispatcher.submit = submit_marked  # type: ignore[method-assign]
    _wrap_async(Message, "ack", "ack")
    _wrap_async(Puller, "_receive", "receive",
                lambda _self, msg: jsapi.server_status(msg) is None)
    pull = Puller._pull

    @functools.wraps(pull)
    async def pull_marked(self: Puller, batch: int) -> None:
        before = self._pending
        sent_at = time.time()
        await pull(self, batch)
        if _on and self._pending > before:  # it did send a request
            _events.append((sent_at, "pull"))

    Puller._pull = pull_marked  # type: ignore[method-assign]
    writelines: Callable[[Any, Any], None] = transport.TcpTransport.writelines

    @functools.wraps(writelines)
    def writelines_marked(self: Any, payload: Any) -> None:
        _mark("write")
        writelines(self, payload)

    transport.TcpTransport.writelines = writelines_marked  # type: ignore[method-assign]


def run(out: str, argv: list[str]) -> None:
    def start(signum: int, frame: FrameType | None) -> None:
        global _on
        _events.clear()
        _on = True

    def stop(signum: int, frame: FrameType | None) -> None:
        global _on
        _on = False
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"t": t, "step": step}) + "\n" for t, step in _events)

    install()
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from cgroupd.cli import main
    main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: python -m bench.traced OUT -- <cgroupd arguments>")
    run(sys.argv[1], sys.argv[3:])
