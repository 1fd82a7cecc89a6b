"""Handlers for ``cgroupd join --handler tests.fixtures_cli.record_handler:...`` in tests.

Each handled message appends one JSON line to the file named by ``CGROUPD_TEST_RECORD``
(flushed at once, so a test can poll it while the process runs).
"""

from __future__ import annotations

import json
import os
import time

from cgroupd.message import Message


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


async def block_loop(message: Message) -> None:
    """An async handler that blocks the event loop for the payload's ``block`` seconds
    (``time.sleep`` in an ``async def``: the bug a /healthz must reveal)."""
    _record(message, "block")
    time.sleep(float(json.loads(message.data).get("block", 0)))  # noqa: ASYNC251


def hang(message: Message) -> None:
    """A sync handler that does not return for the payload's ``hang`` seconds."""
    _record(message, "hang")
    time.sleep(float(json.loads(message.data).get("hang", 0)))
