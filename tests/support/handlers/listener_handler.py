"""A handler module with partition listener hooks, for ``cgroupd join --handler
tests.support.handlers.listener_handler:handle``: every handler start and end and every
hook call appends one JSON line to ``CGROUPD_TEST_RECORD`` (one ``write`` of an
``O_APPEND`` file per line: the lines of several processes interleave in the order they
happened). ``assigned`` is async, ``revoked`` and ``lost`` are sync (run in a thread)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from cgroupd.nats.message import Message


def _line(**fields: Any) -> None:
    data = (json.dumps({"pid": os.getpid(), "t": time.time(), **fields}) + "\n").encode()
    fd = os.open(os.environ["CGROUPD_TEST_RECORD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def handle(message: Message) -> None:
    body = json.loads(message.data)
    _line(event="start", partition=message.partition, n=body["n"], key=body["key"],
          seq=message.stream_sequence)
    await asyncio.sleep(0.02)  # in flight for a while: a move has something to wait for
    _line(event="end", partition=message.partition, n=body["n"], key=body["key"],
          seq=message.stream_sequence)


async def on_partitions_assigned(partitions: tuple[int, ...]) -> None:
    _line(event="assigned", partitions=list(partitions))


def on_partitions_revoked(partitions: tuple[int, ...]) -> None:
    _line(event="revoked", partitions=list(partitions))


def on_partitions_lost(partitions: tuple[int, ...]) -> None:
    _line(event="lost", partitions=list(partitions))
