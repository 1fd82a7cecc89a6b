"""What each ordering starts when, with many messages held (the server sending ahead):
``partition`` one handler per partition whatever the keys, ``stream`` one handler for the
whole member in stream order; a held message never starts before an earlier one of its
partition (or, in ``stream``, of the member) settled. The dispatcher alone, no server."""

from __future__ import annotations

import asyncio
import random

import pytest

from cgroupd.core.settings import DEFAULT_CONCURRENCY, MemberSettings
from cgroupd.member.dispatch import Ordering
from cgroupd.nats.message import Message, ack_subject_fields
from tests.support.polling import eventually
from tests.unit.test_dispatch_unit import FakeConnection, delivery, dispatcher


class Trace:
    """Handler that records starts and ends and yields at random, so any overlap the
    ordering allows shows up."""

    def __init__(self, seed: int) -> None:
        self.events: list[tuple[str, int, int]] = []  # (start|end, partition, seq)
        self.running: dict[int, int] = {}  # partition -> handlers running now
        self.most = 0
        self.most_in_partition = 0
        self._rng = random.Random(seed)

    async def __call__(self, msg: Message) -> None:
        p = msg.partition if msg.partition is not None else -1
        self.events.append(("start", p, msg.stream_sequence))
        self.running[p] = self.running.get(p, 0) + 1
        self.most = max(self.most, sum(self.running.values()))
        self.most_in_partition = max(self.most_in_partition, self.running[p])
        for _ in range(self._rng.randrange(3)):
            await asyncio.sleep(0)
        if self._rng.random() < 0.2:
            await asyncio.sleep(0.001)
        self.running[p] -= 1
        self.events.append(("end", p, msg.stream_sequence))

    def starts(self, partition: int | None = None) -> list[int]:
        return [s for e, p, s in self.events if e == "start"
                and (partition is None or p == partition)]


def _submit_interleaved(nc: FakeConnection, d: object, count: int, partitions: int,
                        keys: int) -> None:
    for seq in range(1, count + 1):
        d.submit(delivery(nc, seq, f"k{seq % keys}",  # type: ignore[attr-defined]
                          partition=seq % partitions))


def test_every_ordering_holds_256_by_default() -> None:
    """The default max in flight is the server-sends-ahead one in every ordering
    (partition at 1 was one server round trip per message)."""
    for ordering in Ordering:
        assert MemberSettings(ordering=ordering).max_in_flight == DEFAULT_CONCURRENCY == 256
    assert MemberSettings(max_in_flight=1).max_in_flight == 1


async def test_partition_ordering_runs_one_handler_per_partition_whatever_the_keys() -> None:
    """Many keys per partition, 256 held: a partition's messages start one at a time in
    stream order, each after the previous one ended; partitions overlap."""
    nc = FakeConnection()
    trace = Trace(1)
    d, stats = dispatcher(nc, trace, ordering=Ordering.PARTITION, max_in_flight=256)
    d.pause()  # everything is held before anything starts: the worst case for order
    _submit_interleaved(nc, d, 400, partitions=4, keys=37)
    d.resume()
    await eventually(lambda: stats["acked"] == 400, 10)
    await d.drain(1)
    assert trace.most_in_partition == 1
    assert trace.most > 1  # partitions at once
    for p in range(4):
        seqs = trace.starts(p)
        assert seqs == sorted(seqs) and len(seqs) == 100, p
        # strictly one after another: each start follows the previous one's end
        events = [(e, s) for e, q, s in trace.events if q == p]
        assert events == [(e, s) for s in seqs for e in ("start", "end")], p


async def test_stream_ordering_runs_the_whole_member_one_at_a_time_in_stream_order() -> None:
    """``stream``: with 256 held, arriving out of order (a handed-back message after later
    ones), every message starts after the previous one ended, in stream order."""
    nc = FakeConnection()
    trace = Trace(2)
    d, stats = dispatcher(nc, trace, ordering=Ordering.STREAM, max_in_flight=256)
    order = list(range(1, 301))
    random.Random(5).shuffle(order[:40])  # redeliveries arriving late, before the start
    d.pause()
    for seq in order:
        d.submit(delivery(nc, seq, f"k{seq % 11}", partition=seq % 8))
    d.resume()
    await eventually(lambda: stats["acked"] == 300, 10)
    await d.drain(1)
    assert trace.most == 1
    assert trace.starts() == list(range(1, 301))
    acked = [int(ack_subject_fields(s)[3]) for s in nc.replies(b"+ACK")]
    assert acked == list(range(1, 301))


async def test_stream_ordering_retries_in_place_and_everything_waits() -> None:
    """A failing message in ``stream`` ordering holds the whole member: nothing later
    starts until it succeeded."""
    nc = FakeConnection()
    starts: list[int] = []
    failures = {3: 2}

    async def handler(msg: Message) -> None:
        starts.append(msg.stream_sequence)
        if failures.get(msg.stream_sequence, 0):
            failures[msg.stream_sequence] -= 1
            raise RuntimeError("not yet")

    d, stats = dispatcher(nc, handler, ordering=Ordering.STREAM, max_in_flight=64)
    for seq in range(1, 8):
        d.submit(delivery(nc, seq, f"k{seq}", partition=seq % 3))
    await eventually(lambda: stats["acked"] == 7, 5)
    await d.drain(1)
    assert starts == [1, 2, 3, 3, 3, 4, 5, 6, 7]


async def test_stream_ordering_hands_back_unstarted_messages_in_stream_order() -> None:
    """Stepping down with prefetched messages (a shared consumer): the running one is
    left alone, every unstarted one is nak'ed lowest stream sequence first."""
    nc = FakeConnection()
    release = asyncio.Event()

    async def handler(msg: Message) -> None:
        await release.wait()

    d, _ = dispatcher(nc, handler, ordering=Ordering.STREAM, max_in_flight=64,
                      hand_back_on_close=True)
    for seq in (1, 5, 3, 4, 2, 6):
        d.submit(delivery(nc, seq, f"k{seq}", partition=seq % 4))
    await asyncio.sleep(0.01)
    draining = asyncio.create_task(d.drain(0.05, hold_late=True))
    await asyncio.sleep(0.01)
    d.submit(delivery(nc, 7, "k7", partition=3))
    await draining
    assert await d.hand_back() == 6
    naked = [ack_subject_fields(s)[3] for s in nc.replies(b"-NAK")]
    assert naked == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("reply", [
    "$JS.ACK.S.C.3.17.9.1700000000000000000.4",
    "$JS.ACK.dom.acchash.S.C.3.17.9.1700000000000000000.4.rnd",
    "$JS.ACK.dom.acchash.S.C.3.17.9.1700000000000000000.4",
])
def test_ack_subject_fields_reads_both_forms(reply: str) -> None:
    assert ack_subject_fields(reply) == ("S", "C", 3, 17)


@pytest.mark.parametrize("reply", [
    None, "", "_INBOX.abc", "$JS.ACK.S.C.x.17.9.1.4", "$JS.ACK.S.C.3.\u0661\u0667.9.1.4",
    "$JS.ACK.S.C.3.17", "$JS.NAK.S.C.3.17.9.1.4",
])
def test_ack_subject_fields_refuses_what_is_not_one(reply: str | None) -> None:
    with pytest.raises(ValueError):
        ack_subject_fields(reply)
