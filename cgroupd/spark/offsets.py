"""Offsets, starting and ending positions, and read plans of the Spark source.

Pure: no I/O, no pyspark.

An offset says, for one stream (named, and identified by its creation time, so that a
recreated stream or another group's checkpoint is recognised), how far the query has
read: ``partitions`` maps each partition to the last stream sequence read for it, and
``position`` is the stream sequence up to which the stream has been looked at (every
message at or below it was either read or is not the query's). Data loss is what falls
below ``position`` before it was read. As JSON::

    {"stream": "ORDERS", "created": "2026-01-01T12:00:00.1Z", "position": 812,
     "partitions": {"0": 812, "1": 790}}

Spark keeps offsets as JSON text and compares them *as text* to decide whether a new batch
exists; :meth:`Offset.to_json` therefore always emits the same keys in the same order.

Spark never logs a batch's start, only its end, and asks :meth:`initialOffset` again when
batch 0 is replayed after a failure: a ``latest`` or timestamp start would then be
evaluated anew and the replay would skip what batch 0 held. So batch 0's end carries the
start it was planned from (``from``), and the reader plans from that.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cgroupd.core.config import PartitioningFilter
from cgroupd.core.errors import ConfigError

EARLIEST = "earliest"
LATEST = "latest"
#: Kafka's per-partition markers in startingOffsets / endingOffsets JSON.
KAFKA_EARLIEST = -2
KAFKA_LATEST = -1


@dataclass(frozen=True)
class Offset:
    """How far a query has read one stream (see the module docstring)."""

    stream: str
    created: str
    position: int
    partitions: Mapping[int, int]
    #: Only on batch 0's end: the start that batch was planned from.
    origin: Offset | None = None
    #: The offset :meth:`initialOffset` returned (not yet the end of any batch).
    initial: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stream": self.stream,
            "created": self.created,
            "position": int(self.position),
            "partitions": {str(p): int(self.partitions[p]) for p in sorted(self.partitions)},
        }
        if self.initial:
            out["initial"] = True
        if self.origin is not None:
            out["from"] = self.origin.to_json()
        return out

    @classmethod
    def from_json(cls, raw: Any) -> Offset:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"an offset must be a JSON object, not {raw!r}")
        if "stream" not in raw:
            raise ConfigError(
                "this checkpoint holds offsets written by an older cgroupd source (no stream "
                f"identity: {json.dumps(raw)[:200]}); start the query with a new checkpoint")
        try:
            parts = decode_partitions(raw.get("partitions") or {})
            origin = raw.get("from")
            return cls(str(raw["stream"]), str(raw.get("created", "")),
                       int(raw.get("position", 0)), parts,
                       cls.from_json(origin) if origin is not None else None,
                       bool(raw.get("initial", False)))
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"unreadable offset {json.dumps(raw)[:200]}: {exc}") from exc

    def same_stream(self, other: Offset) -> bool:
        return self.stream == other.stream and self.created == other.created

    def plain(self) -> Offset:
        """This offset without the batch-0 and initial marks."""
        return Offset(self.stream, self.created, self.position, dict(self.partitions))


def decode_partitions(raw: Mapping[str, object]) -> dict[int, int]:
    """``{"0": 12}`` to ``{0: 12}``, every problem named."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"partitions must be a JSON object, not {raw!r}")
    out: dict[int, int] = {}
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


@dataclass(frozen=True)
class Requested:
    """A ``startingOffsets``/``endingOffsets`` value: ``earliest``, ``latest``, or per
    partition a sequence (Kafka's meaning: the first sequence to read for a start, the
    first *not* to read for an end) or one of Kafka's markers -2 (earliest), -1 (latest).
    """

    kind: str  # EARLIEST, LATEST or "json"
    sequences: Mapping[int, int] | None = None


def parse_requested(option: str, value: str, stream: str, partitions: Sequence[int],
                    *, ending: bool = False) -> Requested:
    """Parse ``startingOffsets`` / ``endingOffsets`` as Spark's Kafka source does.

    JSON is ``{"<partition>": n}`` or Kafka's ``{"<stream>": {"<partition>": n}}``, and,
    as in Kafka, names every partition the query reads.
    """
    text = value.strip()
    if text.lower() in (EARLIEST, LATEST):
        if ending and text.lower() == EARLIEST:
            raise ConfigError(f"{option} cannot be 'earliest' (Kafka's rule too): use "
                              "'latest' or per-partition sequences")
        return Requested(text.lower())
    example = '{"0": 23, "1": -2}'
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{option} must be 'earliest', 'latest' or a JSON object like "
                          f"{example}, not {value!r}") from exc
    if isinstance(raw, dict) and list(raw) == [stream] and isinstance(raw[stream], dict):
        raw = raw[stream]  # Kafka's {"topic": {"0": 23}}
    if not isinstance(raw, dict):
        raise ConfigError(f"{option} must be a JSON object like {example}, not {value!r}")
    out: dict[int, int] = {}
    problems = []
    allowed = (KAFKA_LATEST,) if ending else (KAFKA_EARLIEST, KAFKA_LATEST)
    for key, seq in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            problems.append(f"{option}: {key!r} is not a partition number")
        elif isinstance(seq, bool) or not isinstance(seq, int) or (
                seq < 0 and seq not in allowed):
            problems.append(f"{option}: partition {key} must be a sequence (>= 0) or one of "
                            f"{list(allowed)}, not {seq!r}")
        else:
            out[int(key)] = seq
    unknown = sorted(set(out) - set(partitions))
    if unknown:
        problems.append(f"{option} names partitions this query does not read: {unknown} "
                        f"(it reads {list(partitions)})")
    missing = sorted(set(partitions) - set(out))
    if missing and not problems:
        problems.append(f"{option} must name every partition the query reads (as Kafka's "
                        f"source requires); missing: {missing}")
    if problems:
        raise ConfigError(problems)
    return Requested("json", out)


def resolve_start(requested: Requested, partitions: Sequence[int], first_seq: int,
                  last_seq: int) -> dict[int, int]:
    """Per partition, the last sequence considered read before the query starts."""
    earliest = max(first_seq - 1, 0)
    if requested.kind == EARLIEST:
        return {p: earliest for p in partitions}
    if requested.kind == LATEST:
        return {p: last_seq for p in partitions}
    seqs = requested.sequences or {}
    out = {}
    for p in partitions:
        seq = seqs[p]
        if seq == KAFKA_EARLIEST:
            out[p] = earliest
        elif seq == KAFKA_LATEST:
            out[p] = last_seq
        else:
            out[p] = max(seq - 1, 0)  # the first sequence to read is seq
    return out


def resolve_end(requested: Requested, partitions: Sequence[int],
                latest: Mapping[int, int]) -> dict[int, int]:
    """Per partition, the last sequence to read (``endingOffsets`` is exclusive)."""
    if requested.kind == LATEST:
        return dict(latest)
    seqs = requested.sequences or {}
    return {p: latest[p] if seqs[p] == KAFKA_LATEST else max(seqs[p] - 1, 0)
            for p in partitions}


# -- planning ----------------------------------------------------------------------------
#: What every read asks direct get for: all subjects. The server serves ``>`` from its
#: sequence index (~2 µs a message here); a subject with wildcards, or one partition's
#: ``<p>.>`` in a stream where partitions interleave, makes it scan and match every
#: message again for each request (9-25 µs a message delivered, nats-server 2.15 file
#: store). So a read takes the run of the stream and keeps the query's messages itself.
READ_SUBJECT = ">"


@dataclass(frozen=True)
class ReadRange:
    """Messages on ``subject`` with stream sequence in ``(start, end]``."""

    subject: str
    start: int
    end: int


def split(rng: ReadRange, parts: int) -> list[ReadRange]:
    """``rng`` cut into ``parts`` runs of equal sequence span."""
    span = rng.end - rng.start
    parts = max(1, min(parts, span))
    out = []
    lo = rng.start
    for i in range(parts):
        hi = rng.start + span * (i + 1) // parts
        out.append(ReadRange(rng.subject, lo, hi))
        lo = hi
    return out


def plan_slices(subject: str, start: Mapping[int, int], end: Mapping[int, int], *,
                tasks: int, min_span: int = 2000) -> list[ReadRange]:
    """The stream run from the lowest start to the highest end, cut by sequence into
    ``tasks`` slices (Kafka's ``minPartitions``) of at least ``min_span`` sequences. Each
    message's partition is known when it is read; a task keeps those of its partitions'
    ``(start, end]``."""
    if not end:
        return []
    lo = min(start.get(p, 0) for p in end)
    hi = max(end.values())
    if hi <= lo:
        return []
    parts = max(1, min(tasks, -(-(hi - lo) // max(1, min_span))))
    return split(ReadRange(subject, lo, hi), parts)


# -- keys ---------------------------------------------------------------------------------
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

    The key is what the server hashed to choose the partition, shown readably: the tokens
    at the filter's partitioning wildcards, joined with ``.`` (``sensors.*.*`` keyed on
    wildcard 1 gives ``"42"`` for ``sensors.42.reading``). A filter with no partitioning
    wildcards hashes the whole subject, so the key is the subject. None when no filter
    matches; the subject itself when there are no filters (static groups, plain streams).
    """

    def __init__(self, filters: Iterable[PartitioningFilter]) -> None:
        self._filters = [(pf.filter.split("."), tuple(pf.partitioning_wildcards))
                         for pf in filters]

    def __call__(self, subject: str) -> str | None:
        if not self._filters:
            return subject
        tokens = subject.split(".")
        for pattern, wildcards in self._filters:
            if not _matches(pattern, tokens):
                continue
            if not wildcards:
                return subject
            stars = [i for i, t in enumerate(pattern) if t == "*"]
            return ".".join(tokens[stars[w - 1]] for w in wildcards)
        return None


def subject_allowed(patterns: Sequence[str], subject: str) -> bool:
    """Whether ``subject`` matches one of ``patterns`` (all subjects when there are none)."""
    if not patterns:
        return True
    tokens = subject.split(".")
    return any(_matches(p.split("."), tokens) for p in patterns)
