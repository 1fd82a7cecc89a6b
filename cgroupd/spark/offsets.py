"""Offsets, read planning and message keys for the Spark source. Pure: no I/O, no pyspark.

An offset is, per group partition, the last stream sequence of the group's work-queue
stream that Spark has been given for that partition: ``{"0": 812, "1": 790, ...}``.
Partition ``p`` holds the subjects ``<p>.>`` of that stream; sequences are shared by all
partitions, so a partition's sequences are increasing but not contiguous.

Spark keeps offsets as JSON text and compares them *as text* to decide whether a new
batch exists; :func:`encode` therefore always emits the keys in ascending partition order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cgroupd.config import PartitioningFilter
from cgroupd.errors import ConfigError

Offsets = dict[int, int]

EARLIEST = "earliest"
LATEST = "latest"


def encode(offsets: Mapping[int, int]) -> dict[str, int]:
    """The JSON-ready form Spark stores: string keys in ascending partition order."""
    return {str(p): int(offsets[p]) for p in sorted(offsets)}


def decode(raw: Mapping[str, object] | None) -> Offsets:
    """Read back an offset dict from Spark (or a user's ``startingOffsets``)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"an offset must be a JSON object, not {raw!r}")
    out: Offsets = {}
    problems = []
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            problems.append(f"offset key {key!r} is not a partition number")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"offset of partition {key} must be a non-negative integer, "
                            f"not {value!r}")
            continue
        out[int(key)] = value
    if problems:
        raise ConfigError(problems)
    return out


def parse_starting_offsets(value: str, partitions: Sequence[int]) -> str | Offsets:
    """``earliest``, ``latest``, or a JSON object naming some of ``partitions``.

    Partitions missing from the JSON start at the earliest message still queued.
    """
    text = value.strip()
    if text.lower() in (EARLIEST, LATEST):
        return text.lower()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"startingOffsets must be 'earliest', 'latest' or a JSON object "
                          f"like {{\"0\": 42}}, not {value!r}") from exc
    offsets = decode(raw)
    unknown = sorted(set(offsets) - set(partitions))
    if unknown:
        raise ConfigError(f"startingOffsets names partitions this query does not read: "
                          f"{unknown} (it reads {list(partitions)})")
    return {p: offsets.get(p, 0) for p in partitions}


@dataclass(frozen=True)
class Range:
    """Messages of one partition with stream sequence in ``(start, end]``."""

    partition: int
    start: int
    end: int


def plan(start: Mapping[int, int], end: Mapping[int, int], per_task: int) -> list[list[Range]]:
    """Group the non-empty ranges of a batch into tasks of at most ``per_task`` partitions.

    A pure function of its arguments, so a batch replayed after a failure is planned into
    exactly the same tasks.
    """
    if per_task < 1:
        raise ValueError("per_task must be at least 1")
    ranges = [Range(p, start.get(p, 0), end[p]) for p in sorted(end)
              if end[p] > start.get(p, 0)]
    return [ranges[i:i + per_task] for i in range(0, len(ranges), per_task)]


def allocate(available: Mapping[int, int], limit: int) -> dict[int, int]:
    """Share ``limit`` messages among partitions in proportion to what each has waiting.

    Like Spark's Kafka source: each partition gets ``limit * available / total`` rounded
    down; the remainder goes to the largest fractions (then the longest backlog, then the
    lowest partition), so the total is exactly ``min(limit, total)`` and a partition with
    a backlog never starves for long: its share grows as the others drain.
    """
    if limit < 0:
        raise ValueError("limit must not be negative")
    total = sum(available.values())
    if total <= limit:
        return dict(available)
    shares: dict[int, int] = {}
    fractions = []
    for p, n in available.items():
        exact = limit * n
        shares[p] = exact // total
        fractions.append((-(exact % total), -n, p))
    left = limit - sum(shares.values())
    for _, _, p in sorted(fractions)[:left]:
        shares[p] += 1
    return shares


def _matches(pattern: list[str], tokens: list[str]) -> bool:
    if pattern and pattern[-1] == ">":
        head = pattern[:-1]
        if len(tokens) <= len(head):
            return False
        tokens = tokens[:len(head)]
        pattern = head
    return len(pattern) == len(tokens) and all(
        p == "*" or p == t for p, t in zip(pattern, tokens, strict=True))


class KeyExtractor:
    """The partitioning key of an original subject under a group's partitioning filters.

    The key is what the server hashed to choose the partition: the tokens at the filter's
    partitioning wildcards, joined with ``.`` (``sensors.*.*`` keyed on wildcard 1 gives
    ``"42"`` for ``sensors.42.reading``). A filter with no partitioning wildcards hashes the
    whole subject, so the key is the subject. None when no filter matches.
    """

    def __init__(self, filters: Iterable[PartitioningFilter]) -> None:
        self._filters = [(pf.filter.split("."), tuple(pf.partitioning_wildcards))
                         for pf in filters]
        self._cache: dict[str, str | None] = {}

    def __call__(self, subject: str) -> str | None:
        try:
            return self._cache[subject]
        except KeyError:
            pass
        key = self._compute(subject)
        if len(self._cache) < 100_000:
            self._cache[subject] = key
        return key

    def _compute(self, subject: str) -> str | None:
        tokens = subject.split(".")
        for pattern, wildcards in self._filters:
            if not _matches(pattern, tokens):
                continue
            if not wildcards:
                return subject
            stars = [i for i, t in enumerate(pattern) if t == "*"]
            return ".".join(tokens[stars[w - 1]] for w in wildcards)
        return None
