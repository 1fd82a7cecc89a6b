"""Steady keyed traffic from a process of its own, so that nothing the benchmark does
(reading records, starting processes) delays a publish and shows up as a gap.

Publishes ``{"key": subject, "n": n}`` to ``PREFIX.k<n % KEYS>`` at RATE msg/s, each
acknowledged (through :class:`bench.common.Publisher`). Commands on stdin, one JSON object
a line, answered on stdout in order:

- ``{"mark": {...}}``: the next message not yet published carries these fields too;
  answers ``{"n": N}``;
- ``{"stop": true}``: stop, wait for every acknowledgement; answers ``{"sent": COUNT}``
  (messages ``0 .. COUNT-1``) and exits.

It prints ``{"ready": true}`` once connected. Usage:
``python -m bench.traffic URL PREFIX RATE KEYS [stamp]``; with ``stamp`` every payload
carries ``"pt"``, its publish time (``time.time()``), so a reader can tell how long a
message waited.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import nats

from bench.common import Publisher, keyed_payload


async def main(url: str, prefix: str, rate: float, keys: int, stamp: bool = False) -> None:
    nc = await nats.connect(servers=[url], connect_timeout=2, reconnect_time_wait=0.1,
                            max_reconnect_attempts=-1)
    extra: dict[int, dict[str, Any]] = {}
    stop = asyncio.Event()
    n = 0

    async def commands() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command = json.loads(line)
            if "mark" in command:
                # n is being published or next: the one after it carries the fields.
                extra[n + 1] = command["mark"]
                answer(n=n + 1)
            elif command.get("stop"):
                break
        stop.set()

    def answer(**fields: Any) -> None:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()

    listener = asyncio.create_task(commands())
    answer(ready=True)
    async with Publisher(nc, window=max(100, int(rate))) as pub:
        began = time.monotonic()
        while not stop.is_set():
            subject = f"{prefix}.k{n % keys}"
            fields = extra.pop(n, {})
            if stamp:
                fields["pt"] = time.time()
            await pub.send(subject, keyed_payload(subject, n, **fields))
            n += 1
            delay = began + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        await pub.settle()
    await listener
    await nc.close()
    answer(sent=n)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                     sys.argv[5:6] == ["stamp"]))
