"""Replay's arithmetic without a server: ``--shift-by`` per partition, clamped at the
ends, reading only as far back as the shift needs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from cgroupd.admin import StoredGroup
from cgroupd.admin.replay import _shift_index, _shifted
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.partitions import partition_of

CONFIG = ElasticGroupConfig(max_members=2, members=("a",),
                            partitioning_filters=(PartitioningFilter("orders.*", (1,)),))
STORED = StoredGroup("ORDERS", "g", CONFIG, 1)


class Stream:
    """``scan_subjects`` over a list of subjects (sequence = index + 1); records where
    each scan started."""

    def __init__(self, subjects: list[str]) -> None:
        self.subjects = subjects
        self.scans: list[int] = []

    async def scan_subjects(self, stream: str, filters: list[str],
                            start_seq: int) -> AsyncIterator[tuple[int, str]]:
        self.scans.append(start_seq)
        for seq in range(start_seq, len(self.subjects) + 1):
            yield seq, self.subjects[seq - 1]


def keys_of(partition: int, count: int) -> list[str]:
    found = [f"orders.k{i}" for i in range(1000)
             if partition_of(f"orders.k{i}", CONFIG.partitioning_filters, 2) == partition]
    return [found[i % len(found)] for i in range(count)]


async def test_a_small_shift_back_reads_only_a_window() -> None:
    """10,000 messages alternating between the two partitions, both at the end: a shift of
    -3 reads one window before the positions, not the stream, and lands 3 messages of
    each partition back."""
    zero, one = keys_of(0, 5000), keys_of(1, 5000)
    stream = Stream([s for pair in zip(zero, one, strict=True) for s in pair])
    end = 10001
    since, _, per = await _shift_index(stream, STORED, {0: end, 1: end}, -3, 1)  # type: ignore[arg-type]
    assert stream.scans == [end - 1024] and since == end - 1024
    notes: list[str] = []
    assert [_shifted(per[p], end, -3, end, p, notes) for p in (0, 1)] == [9995, 9996]
    assert notes == []


async def test_a_shift_past_a_partitions_first_message_reads_back_to_it_and_clamps() -> None:
    """Partition 1 has one message, at the start: the window grows (x4) until it reaches
    the stream's first message; -5 clamps there and says so; +5 from its position is
    the end, also said."""
    stream = Stream(keys_of(1, 1) + keys_of(0, 6000))
    end = 6002
    since, _, per = await _shift_index(stream, STORED, {0: end, 1: end}, -5, 1)  # type: ignore[arg-type]
    assert stream.scans == [end - 1024, end - 4096, 1] and since == 1
    notes: list[str] = []
    assert _shifted(per[1], end, -5, end, 1, notes) == 1
    assert _shifted(per[0], end, -5, end, 0, notes) == end - 5
    assert _shifted(per[0], end - 2, 5, end, 0, notes) == end
    assert [n.split(":")[0] for n in notes] == ["partition 1", "partition 0"]
    assert "from its first one, 1" in notes[0] and "at the end (6002)" in notes[1]
