"""The server's cost of an ack on a work-queue stream, by how many consumers the stream has.

Issue 27: at 1,000 msg/s the server's CPU and every message's wait grew with the fleet
(docs/performance.md, "The same fleet on 16 cores"). The suspect, from nats-server's
source: an ack on a work-queue stream walks every consumer of the stream, under the
stream's lock, to ask whether it still needs the message. This measures it without
cgroupd: one work-queue stream over ``p.<n>`` subjects, ``N`` idle pull consumers each
filtered on a subject of its own (as a fleet's members are), and one consumer on
``p.0`` that pulls and acks ``--rate`` messages a second published to ``p.0``. Per
``N``: the server's CPU (% of one core) and the publish-to-ack seconds (p50, p99).
(nats-server caps a stream at 1,000 consumers unless told otherwise: 998 idle ones and
the worker fit.)

Run: ``python -m bench.ack_cost [--consumers 0,250,500,998] [--rate 1000] [--seconds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import nats
from nats.js import api

from bench.common import CpuMeter, machine, server
from tests.support.natsserver import NatsServer, client_options


async def one_size(srv: NatsServer, idle_consumers: int, rate: float,
                   seconds: float) -> dict[str, Any]:
    """A fresh stream with ``idle_consumers`` filtered consumers, then the acked traffic."""
    nc = await nats.connect(srv.url, **client_options())
    try:
        js = nc.jetstream()
        name = f"ACKS{idle_consumers}"
        await js.add_stream(name=name, subjects=[f"{name}.p.>"],
                            retention=api.RetentionPolicy.WORK_QUEUE,
                            storage=api.StorageType.FILE)
        for i in range(1, idle_consumers + 1):
            await js.add_consumer(name, api.ConsumerConfig(
                durable_name=f"idle{i}", filter_subject=f"{name}.p.{i}",
                ack_policy=api.AckPolicy.EXPLICIT))
        sub = await js.pull_subscribe(f"{name}.p.0", durable="worker", stream=name)
        waits: list[float] = []
        done = asyncio.Event()
        total = int(rate * seconds)

        async def consume() -> None:
            while len(waits) < total:
                try:
                    msgs = await sub.fetch(64, timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    await msg.ack()
                    waits.append(time.time() - float(msg.data))
            done.set()

        worker = asyncio.ensure_future(consume())
        assert srv.pid is not None
        meter = CpuMeter([srv.pid]).start()
        began = time.monotonic()
        for i in range(total):
            delay = began + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await nc.publish(f"{name}.p.0", str(time.time()).encode())
        await asyncio.wait({worker}, timeout=30)
        used = meter.stop()
        worker.cancel()
        waits.sort()
        return {"idle_consumers": idle_consumers, "acked": len(waits),
                "server_cpu_pct": round(100 * used[srv.pid] / meter.wall, 1),
                "wait_s_p50": round(statistics.median(waits), 4) if waits else None,
                "wait_s_p99": round(waits[int(0.99 * (len(waits) - 1))], 4) if waits else None}
    finally:
        await nc.close()


async def run(sizes: list[int], rate: float, seconds: float) -> dict[str, Any]:
    with server() as srv:
        rows = [await one_size(srv, n, rate, seconds) for n in sizes]
    return {"bench": "ack_cost", "rate": rate, "seconds": seconds, "rows": rows,
            "machine": machine()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--consumers", default="0,250,500,998",
                   help="idle filtered consumers on the stream, one run per number")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    sizes = [int(x) for x in a.consumers.split(",")]
    print(json.dumps(asyncio.run(run(sizes, a.rate, a.seconds)), indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
