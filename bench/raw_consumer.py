"""The baseline a user would write by hand: one plain nats-py pull consumer, no group.

One process, one durable pull consumer on the origin stream (batch 256, max ack pending
1000, each message acked), the same recording as the benchmark's member processes
(``start`` and ``end`` events, the file opened per event). It runs until stdin closes.
Messages are handled one at a time in stream order either way: with batch 1 and max ack
pending 1 it is the wire protocol of a member that runs one handler at a time today (ack,
then ask for the next: one server round trip per message); with the defaults it is the
same order with the server sending ahead (prefetch).

Usage: ``python -m bench.raw_consumer URL STREAM SUBJECTS RECORD [BATCH MAX_ACK_PENDING]``;
prints ``ready`` once its consumer exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import nats
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api

BATCH = 256
MAX_ACK_PENDING = 1000


def _event(path: str, event: str, msg: Msg, body: dict[str, object]) -> None:
    meta = msg.metadata
    line = json.dumps({"event": event, "instance": f"raw-{os.getpid()}", "t": time.time(),
                       "subject": body["key"], "n": body["n"], "seq": meta.sequence.stream,
                       "partition": None, "delivered": meta.num_delivered})
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")


async def main(url: str, stream: str, subjects: str, record: str, batch_size: int = BATCH,
               max_ack_pending: int = MAX_ACK_PENDING) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    psub = await js.pull_subscribe(
        subjects, durable="raw", stream=stream,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT,
                                  max_ack_pending=max_ack_pending))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    stdin_closed = asyncio.create_task(reader.read())  # EOF: the benchmark is done with us
    stdin_closed.add_done_callback(lambda _: stop.set())
    print("ready", flush=True)
    try:
        while not stop.is_set():
            try:
                batch = await psub.fetch(batch_size, timeout=0.5)
            except NatsTimeout:
                continue
            for msg in batch:
                body = json.loads(msg.data)
                _event(record, "start", msg, body)
                _event(record, "end", msg, body)
                await msg.ack()
    finally:
        await nc.close()


if __name__ == "__main__":
    url, stream, subjects, record = sys.argv[1:5]
    asyncio.run(main(url, stream, subjects, record, *(int(a) for a in sys.argv[5:7])))
