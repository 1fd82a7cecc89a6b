"""Handlers for ``cgroupd join --handler tests.support.handlers.record_handler:...`` in tests.

Each handled message appends one JSON line to the file named by ``CGROUPD_TEST_RECORD``
(flushed at once, so a test can poll it while the process runs).
"""

from __future__ import annotations

import json
import os
import time

from cgroupd.nats.message import Message


def _record(message: Message, how: str) -> None:
    line = json.dumps({
        "subject": message.subject, "partition": message.partition,
        "seq": message.stream_sequence, "deliveries": message.delivery_count,
        "data": message.data.decode(), "pid": os.getpid(), "how": how, "t": time.time(),
    })
    with open(os.environ["CGROUPD_TEST_RECORD"], "a") as out:
        out.write(line + "\n")


def handle(message: Message) -> None:
    """A sync handler (run in a thread by the runtime): record, return → ack."""
    _record(message, "sync")


async def handle_async(message: Message) -> None:
    """An async handler: record, return → ack."""
    _record(message, "async")


def _event(event: str, message: Message) -> None:
    body = json.loads(message.data)
    line = json.dumps({
        "event": event, "instance": f"cgroupd-{os.getpid()}", "t": time.time(),
        "subject": body["key"], "n": body["n"], "seq": message.stream_sequence,
        "partition": message.partition, "deliveries": message.delivery_count,
    })
    with open(os.environ["CGROUPD_TEST_RECORD"], "a") as out:
        out.write(line + "\n")


async def handle_events(message: Message) -> None:
    """Record ``start`` and ``end`` events (:class:`tests.support.groups.Record`) of a
    ``{"key": ..., "n": ...}`` message (the payloads of ``tests.support.groups.publish_keyed``)."""
    _event("start", message)
    _event("end", message)


class Boom(BaseException):
    """Not an Exception."""


def _odd_first(message: Message) -> object:
    """On a message's first delivery, one of the things a handler should not do (by
    ``n``): raise SystemExit, KeyboardInterrupt, GeneratorExit, a BaseException, its own
    CancelledError, or return a generator. Afterwards: succeed."""
    if message.delivery_count > 1:
        return None
    n = json.loads(message.data)["n"]
    kind = n % 7
    if kind == 0:
        raise SystemExit(3)
    if kind == 1:
        raise KeyboardInterrupt
    if kind == 2:
        raise GeneratorExit
    if kind == 3:
        raise Boom("boom")
    if kind == 4:
        import asyncio
        raise asyncio.CancelledError
    if kind == 5:
        return (x for x in [n])
    return None


async def misbehave_async(message: Message) -> object:
    """An async handler misbehaving once per message (see _odd_first), recording events."""
    _event("start", message)
    result = _odd_first(message)
    if result is None:
        _event("end", message)
    return result


def misbehave_sync(message: Message) -> object:
    """A sync handler (run in a thread) misbehaving once per message."""
    _event("start", message)
    result = _odd_first(message)
    if result is None:
        _event("end", message)
    return result
async def block_loop(message: Message) -> None:
    """An async handler that blocks the event loop for the payload's ``block`` seconds
    (``time.sleep`` in an ``async def``: the bug a /healthz must reveal)."""
    _record(message, "block")
    time.sleep(float(json.loads(message.data).get("block", 0)))  # noqa: ASYNC251


def hang(message: Message) -> None:
    """A sync handler that does not return for the payload's ``hang`` seconds."""
    _record(message, "hang")
    time.sleep(float(json.loads(message.data).get("hang", 0)))
