"""The dispatcher alone (no server): per-key order, in-place retries, redelivery dedupe,
settling a set of partitions, and what happens to messages once it is closing."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from nats.aio.msg import Msg

from cgroupd.dispatch import Dispatcher, Ordering
from cgroupd.message import Message
from cgroupd.partitions import key_function
from tests.groups import eventually


class FakeConnection:
    """Records what the dispatcher publishes (acks, naks, in-progress) and requests
    (settlement confirmations, answered as a consumer that applied them would)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.requests: list[tuple[str, bytes]] = []
        self.stats = {"reconnects": 0}

    async def publish(self, subject: str, payload: bytes = b"", **_: Any) -> None:
        self.published.append((subject, payload))

    async def request(self, subject: str, payload: bytes = b"", **_: Any) -> Msg:
        self.requests.append((subject, payload))
        return Msg(self, subject="reply", data=b"")  # type: ignore[arg-type]

    def replies(self, payload_prefix: bytes) -> list[str]:
        return [s for s, p in self.published if p.startswith(payload_prefix)]


def delivery(nc: FakeConnection, seq: int, key: str, partition: int = 0,
             delivered: int = 1) -> Msg:
    """A JetStream delivery as nats-py hands it over (the reply subject carries seq)."""
    return Msg(nc, subject=f"{partition}.orders.{key}",  # type: ignore[arg-type]
               reply=f"$JS.ACK.S.C.{delivered}.{seq}.{seq}.1700000000000000000.0",
               data=str(seq).encode())


def dispatcher(nc: FakeConnection, handler: Any, ordering: Ordering = Ordering.KEY,
               max_in_flight: int = 64) -> tuple[Dispatcher, dict[str, int]]:
    stats = {k: 0 for k in ("delivered", "acked", "naked", "termed", "retries", "duplicates")}

    async def allowed() -> bool:
        return True

    async def settled() -> None:
        return None

    d = Dispatcher(nc, handler, ordering=ordering, max_in_flight=max_in_flight,  # type: ignore[arg-type]
                   ack_wait=30.0, backoff=lambda n: 0.001, key_of=key_function("tokens:2", None),
                   before_start=allowed, on_settled=settled,
                   log=_Log(), stats=stats)
    d.start()
    return d, stats


class _Log:
    def warning(self, *args: Any, **kwargs: Any) -> None:
        return None


async def test_same_key_in_order_different_keys_at_once() -> None:
    """Random handler latencies: each key's messages finish in stream order while keys
    overlap in time."""
    nc = FakeConnection()
    done: list[tuple[str, int]] = []
    running = {"now": 0, "max": 0}
    rng = random.Random(3)

    async def handler(msg: Message) -> None:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        await asyncio.sleep(rng.uniform(0, 0.003))
        running["now"] -= 1
        done.append((msg.subject, msg.stream_sequence))

    d, stats = dispatcher(nc, handler)
    for seq in range(1, 301):
        d.submit(delivery(nc, seq, f"k{seq % 10}"))
    await eventually(lambda: len(done) == 300, 10)
    await d.drain(1)
    for key in {s for s, _ in done}:
        seqs = [q for s, q in done if s == key]
        assert seqs == sorted(seqs), key
    assert running["max"] > 1
    assert stats["acked"] == 300 and len(nc.replies(b"+ACK")) == 300


async def test_a_failing_message_is_retried_in_place_and_holds_only_its_key() -> None:
    """A message that fails twice is retried before any later message of its key; other
    keys carry on meanwhile; its delivery count grows with each attempt."""
    nc = FakeConnection()
    done: list[int] = []
    attempts: dict[int, list[int]] = {}

    async def handler(msg: Message) -> None:
        attempts.setdefault(msg.stream_sequence, []).append(msg.delivery_count)
        if msg.stream_sequence == 1 and len(attempts[1]) < 3:
            raise RuntimeError("not yet")
        done.append(msg.stream_sequence)

    d, stats = dispatcher(nc, handler)
    d.submit(delivery(nc, 1, "a"))
    d.submit(delivery(nc, 2, "a"))
    d.submit(delivery(nc, 3, "b"))
    await eventually(lambda: len(done) == 3, 5)
    await d.drain(1)
    assert done.index(1) < done.index(2)
    assert attempts[1] == [1, 2, 3]
    assert stats["retries"] == 2 and stats["naked"] == 0
    assert not nc.replies(b"-NAK")


async def test_a_redelivery_of_a_held_message_is_not_run_twice() -> None:
    """The server redelivering a message we still hold (ack wait passed) is dropped."""
    nc = FakeConnection()
    release = asyncio.Event()
    runs: list[int] = []

    async def handler(msg: Message) -> None:
        runs.append(msg.stream_sequence)
        await release.wait()

    d, stats = dispatcher(nc, handler)
    d.submit(delivery(nc, 7, "a"))
    await eventually(lambda: runs == [7], 5)
    d.submit(delivery(nc, 7, "a", delivered=2))
    release.set()
    await eventually(lambda: stats["acked"] == 1, 5)
    await d.drain(1)
    assert runs == [7] and stats["duplicates"] == 1


async def test_settle_waits_for_the_partitions_messages_only() -> None:
    """settle() returns once the given partitions hold nothing, ignoring the others."""
    nc = FakeConnection()
    gate = {0: asyncio.Event(), 1: asyncio.Event()}

    async def handler(msg: Message) -> None:
        assert msg.partition is not None
        await gate[msg.partition].wait()

    d, _ = dispatcher(nc, handler)
    d.submit(delivery(nc, 1, "a", partition=0))
    d.submit(delivery(nc, 2, "b", partition=1))
    settling = asyncio.create_task(d.settle({0}, 5))
    await asyncio.sleep(0.01)
    assert not settling.done()
    gate[0].set()
    assert await settling is True
    assert d.holding == 1
    gate[1].set()
    await eventually(lambda: d.holding == 0, 5)
    await d.drain(1)


async def test_closing_hands_new_deliveries_back_and_leaves_unstarted_ones_unacked() -> None:
    """After drain starts, a new delivery is nak'ed at once (no ack-wait delay for the
    next owner) and messages that had not started are neither acked nor nak'ed."""
    nc = FakeConnection()
    release = asyncio.Event()

    async def handler(msg: Message) -> None:
        await release.wait()

    d, stats = dispatcher(nc, handler, ordering=Ordering.PARTITION, max_in_flight=1)
    d.submit(delivery(nc, 1, "a"))
    d.submit(delivery(nc, 2, "a"))
    await asyncio.sleep(0.01)
    draining = asyncio.create_task(d.drain(5))
    await asyncio.sleep(0.01)
    d.submit(delivery(nc, 3, "a"))
    release.set()
    await draining
    assert stats["acked"] == 1
    acked = {s.split(".")[5] for s in nc.replies(b"+ACK")}
    naked = {s.split(".")[5] for s in nc.replies(b"-NAK")}
    assert acked == {"1"} and naked == {"3"}


async def test_unordered_failures_are_naked_with_backoff() -> None:
    """``none`` ordering: a failure is nak'ed (with a delay) for the server to redeliver."""
    nc = FakeConnection()

    async def handler(msg: Message) -> None:
        if msg.stream_sequence == 2:
            raise RuntimeError("boom")

    d, stats = dispatcher(nc, handler, ordering=Ordering.NONE)
    for seq in (1, 2, 3):
        d.submit(delivery(nc, seq, "a"))
    await eventually(lambda: stats["acked"] == 2 and stats["naked"] == 1, 5)
    await d.drain(1)
    naks = [p for s, p in nc.published if p.startswith(b"-NAK")]
    assert naks and b'"delay"' in naks[0]
