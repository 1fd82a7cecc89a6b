"""Handlers for benchmark member processes (``cgroupd join --handler bench.handlers:...``)."""

from __future__ import annotations

import json
import os
import time

from cgroupd.message import Message

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
