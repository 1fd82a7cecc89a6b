"""Handlers for benchmark member processes (``cgroupd join --handler bench.handlers:...``)."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: a --baseline revision may keep Message elsewhere
    from cgroupd.nats.message import Message

_record = open(os.environ["BENCH_RECORD"], "a", buffering=1) if os.environ.get(  # noqa: SIM115
    "BENCH_RECORD") else None


async def ack(message: Message) -> None:
    """Acknowledge at once (returning acks)."""


async def record(message: Message) -> None:
    """Write (pid, partition, stream sequence, time) and acknowledge."""
    if _record is not None:
        _record.write(json.dumps({"pid": os.getpid(), "p": message.partition,
                                  "seq": message.stream_sequence,
                                  "d": message.delivery_count, "t": time.time()}) + "\n")


def _event(event: str, message: Message, body: dict[str, object]) -> None:
    # Opened per event, as the peer's recording handler (tests/support/peer_driver.py) does, so
    # every side of a comparison pays the same for its records.
    line = json.dumps({"event": event, "instance": f"cgroupd-{os.getpid()}",
                       "t": time.time(), "subject": body["key"], "n": body["n"],
                       "seq": message.stream_sequence, "partition": message.partition,
                       "delivered": message.delivery_count})
    with open(os.environ["BENCH_RECORD"], "a", encoding="utf-8") as out:
        out.write(line + "\n")


def _first_to_block(body: dict[str, object]) -> float:
    """Seconds to block for a message marked ``"block": S``: only the first handler of any
    instance that sees it blocks (a marker file in ``BENCH_HOLD_DIR``), so a standby that
    takes the message over does not stall too."""
    seconds = float(body.get("block") or 0)  # type: ignore[arg-type]
    if not seconds:
        return 0.0
    try:
        fd = os.open(os.path.join(os.environ["BENCH_HOLD_DIR"], f"block-{body['n']}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return 0.0
    os.close(fd)
    return seconds


async def events(message: Message) -> None:
    """Record ``start`` and ``end`` (:class:`tests.support.groups.Record` format, as the peer's
    driver records) of a ``{"key": ..., "n": ...}`` message, then acknowledge. A message
    marked ``"block": S`` blocks the event loop S seconds once (``time.sleep`` in an async
    handler: what a long GC pause or a blocking call does to a member)."""
    body = json.loads(message.data)
    _event("start", message, body)
    stall = _first_to_block(body)
    if stall:
        time.sleep(stall)  # noqa: ASYNC251 - blocking the loop is the point
    _event("end", message, body)
