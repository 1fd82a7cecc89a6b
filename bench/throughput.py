"""Throughput of a group against the plain pull consumers a user would otherwise write.

Same run, same origin stream (64 keys, ``--messages`` pre-published): a group of 8
partitions consumed by 1, 2, 4 and 8 members (one ``cgroupd join`` process each, handler
acks at once) in strict ``partition`` ordering, 4 members in ``key`` ordering, and the
baselines (a) one plain pull consumer, max_ack_pending 1, fetching one message at a time,
and (b) one plain pull consumer, batch 256, max_ack_pending 1000, acking each (the
unordered ceiling of one Python process).

Member processes are started before they are members, then added in one config write, so
every case starts with all processes warm. A case's rate runs from the first message
consumed to the group's work-queue stream being empty (as the baselines run from their
first fetch); ``msgs_per_s_including_election`` also counts the time from the membership
write to the first delivery. Run: ``python -m bench.throughput [--messages 20000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from nats.js import api

from bench.common import (
    Members,
    connected,
    emit,
    keyed_group,
    machine,
    origin_stream,
    publish,
    server,
    stream_messages,
    wait_for,
)
from cgroupd import admin

PARTITIONS = 8


async def group_case(url: str, js: Any, name: str, members: int, messages: int,
                     extra: tuple[str, ...]) -> tuple[float, float]:
    """msgs/s of ``members`` processes draining a fresh group of ``messages``: from the
    first message consumed, and from the membership write (including the election)."""
    await keyed_group(js, name, PARTITIONS)
    wq = f"BENCH-{name}"
    await wait_for(lambda: _count_is(js, wq, messages), 120, 0.05, "sourcing")
    names = [f"m{i}" for i in range(members)]
    with Members(url, "BENCH", name, extra=extra) as procs:
        for member in names:
            procs.start(member)
        # Warm: every process has joined (as a non-member, so it waits) before the clock.
        await wait_for(lambda: asyncio.to_thread(procs.ready), 60, 0.05, "member processes")
        t0 = time.perf_counter()
        await admin.add_members(js, "BENCH", name, names)
        first = None
        deadline = t0 + 600
        while (left := await stream_messages(js, wq)) > 0:
            if first is None and left < messages:
                first = time.perf_counter()
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name} not drained")
            await asyncio.sleep(0.002)
        end = time.perf_counter()
    await admin.delete_group(js, "BENCH", name)
    return messages / (end - (first or t0)), messages / (end - t0)


async def _count_is(js: Any, stream: str, n: int) -> bool:
    return await stream_messages(js, stream) == n


async def baseline(js: Any, name: str, messages: int, batch: int, max_ack_pending: int) -> float:
    """msgs/s of one plain durable pull consumer on the origin stream."""
    psub = await js.js.pull_subscribe(
        "bench.>", durable=name, stream="BENCH",
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT,
                                  max_ack_pending=max_ack_pending))
    got = 0
    t0 = time.perf_counter()
    while got < messages:
        for msg in await psub.fetch(batch, timeout=5):
            await msg.ack()
            got += 1
    elapsed = time.perf_counter() - t0
    await psub.unsubscribe()
    return messages / elapsed


async def main(messages: int) -> dict[str, Any]:
    results: dict[str, Any] = {"benchmark": "throughput", "messages": messages, "keys": 64,
                               "partitions": PARTITIONS, "machine": machine()}
    with server() as srv:
        async with connected(srv.url) as js:
            await origin_stream(js)
            await publish(js, messages)
            rates: dict[str, float] = {}
            rates["baseline_a_fetch1_map1"] = await baseline(js, "a", messages, 1, 1)
            rates["baseline_b_batch256_map1000"] = await baseline(js, "b", messages, 256, 1000)
            with_join: dict[str, float] = {}
            cases = [(f"partition_{n}_members", f"p{n}", n, ()) for n in (1, 2, 4, 8)]
            cases.append(("key_4_members", "k4", 4, ("--ordering", "key")))
            for label, group, n, extra in cases:
                rates[label], with_join[label] = await group_case(
                    srv.url, js, group, n, messages, extra)
    a = rates["baseline_a_fetch1_map1"]
    b = rates["baseline_b_batch256_map1000"]
    results["msgs_per_s"] = {k: round(v) for k, v in rates.items()}
    results["msgs_per_s_including_election"] = {k: round(v) for k, v in with_join.items()}
    results["ratio_to_a"] = {k: round(v / a, 2) for k, v in rates.items()}
    results["ratio_to_b"] = {k: round(v / b, 2) for k, v in rates.items()}
    results["targets"] = {
        "partition_4_members >= 2x a": rates["partition_4_members"] >= 2 * a,
        "key_4_members >= 0.8x b": rates["key_4_members"] >= 0.8 * b,
        "key_4_members >= 5x a": rates["key_4_members"] >= 5 * a,
    }
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20000)
    emit(asyncio.run(main(parser.parse_args().messages)))
