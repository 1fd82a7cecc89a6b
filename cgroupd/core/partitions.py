"""Which member owns which partition, and the subjects that express it.

Pure core: no I/O. The automatic distribution is exactly the ADR's algorithm (and the Go
reference's ``GeneratePartitionFilters``) so that cgroupd and Go members agree on every
assignment: de-duplicate, sort, cap at ``max_members``, contiguous blocks of
``partitions // members``, the remainder dealt out by modulo. Mappings, when present, win.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping

from cgroupd.core.config import ElasticGroupConfig, GroupConfig, PartitioningFilter

#: Token put in front of the synchronization consumer's filters. It is not a number, so
#: the filters match no message, yet two such consumers for one partition still overlap.
SYNC_PREFIX = "sync"


def assignment_ranges(config: GroupConfig) -> dict[str, tuple[tuple[int, int], ...]]:
    """Inclusive ``(first, last)`` partition ranges of every member that owns one, in
    partition order, computed in time linear in the members (not the partitions: a
    reference group may have up to 2**31-1). With ``c`` members and ``n`` partitions
    member ``k`` (sorted) owns the block ``k*per .. (k+1)*per-1`` (``per = n // c``),
    plus partition ``c*per + k`` when ``k`` is below the remainder ``n - c*per``."""
    if config.member_mappings:
        return {m.member: _ranges(sorted(set(m.partitions))) for m in config.member_mappings}
    n = config.max_members
    members = sorted(set(config.members))[:n]
    if not members:
        return {}
    count = len(members)
    per = n // count
    extra = n - count * per
    out: dict[str, tuple[tuple[int, int], ...]] = {}
    for k, member in enumerate(members):
        block = ((k * per, (k + 1) * per - 1),)
        out[member] = block + (((count * per + k,) * 2,) if k < extra else ())
    return out


def _ranges(partitions: list[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for p in partitions:
        if out and out[-1][1] == p - 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return tuple(out)


def assignment(config: GroupConfig) -> dict[str, tuple[int, ...]]:
    """Partitions of every member that owns at least one, in partition order."""
    if config.member_mappings:
        return {m.member: tuple(sorted(m.partitions)) for m in config.member_mappings}
    return {m: tuple(p for first, last in spans for p in range(first, last + 1))
            for m, spans in assignment_ranges(config).items()}


def member_partitions(config: GroupConfig, member: str) -> tuple[int, ...]:
    """The partitions ``member`` owns under ``config`` (empty if it owns none)."""
    return assignment(config).get(member, ())


def owners(config: GroupConfig) -> dict[int, str]:
    """Owner of each partition that has one."""
    return {p: m for m, ps in assignment(config).items() for p in ps}


def partition_filters(partitions: Iterable[int]) -> list[str]:
    """Data consumer filters: every subject of these partitions of the work-queue stream."""
    return [f"{p}.>" for p in partitions]


def member_filters(config: GroupConfig, member: str) -> list[str]:
    """The filters the reference gives ``member``'s consumer, which pinned mode shares
    with it (same name, same filters, so neither side rewrites the other's consumer).

    With a member list: ``<partition>.<filter>`` for each of the group's filters (the
    partitioning filters of an elastic group; a static group's ``filters``, or ``>``),
    filter by filter, partitions ascending. With mappings: ``<partition>.>`` in the
    mapping's order. Repeats are dropped (the server refuses overlapping filters).
    """
    if config.member_mappings:
        # As listed in the mapping (the reference compares filter lists in order).
        listed = [p for m in config.member_mappings if m.member == member
                  for p in m.partitions]
        return reference_filters(config, listed)
    return reference_filters(config, member_partitions(config, member))


def group_subjects(config: GroupConfig) -> list[str]:
    """The subjects (behind the partition token) a reference member consumer filters on:
    the group's filters with a member list, ``>`` with mappings."""
    if config.member_mappings:
        return [">"]
    if isinstance(config, ElasticGroupConfig):
        return [pf.filter for pf in config.partitioning_filters] or [">"]
    return list(config.filters) or [">"]


def reference_filters(config: GroupConfig, partitions: Iterable[int]) -> list[str]:
    """The reference's filters for a member consumer delivering ``partitions`` (in the
    order given for mappings, ascending otherwise): filter by filter, partition by
    partition. Repeats are dropped (the server refuses overlapping filters)."""
    subjects = group_subjects(config)
    parts = list(partitions) if config.member_mappings else sorted(partitions)
    return list(dict.fromkeys(f"{p}.{subject}" for subject in subjects for p in parts))


def fnv1a_32(data: bytes) -> int:
    """32-bit FNV-1a, the hash nats-server's ``partition()`` transform uses."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def partition_of(subject: str, filters: Iterable[PartitioningFilter],
                 partitions: int) -> int | None:
    """The partition an elastic group's transform (:func:`transform_destination`) puts
    ``subject`` in, computed as nats-server does; None when no filter matches.

    The key is the selected wildcard tokens' bytes concatenated with no separator, in the
    order the filter lists them (so ``a.bc`` and ``ab.c`` share a key), or the whole
    subject when the filter selects none; the partition is its FNV-1a hash modulo
    ``partitions``. The first matching filter decides (the server refuses overlapping
    ones). Pinned by test vectors and checked against the server and the reference.
    """
    for pf in filters:
        if not subject_matches(pf.filter, subject):
            continue
        if not pf.partitioning_wildcards:
            return fnv1a_32(subject.encode()) % partitions
        tokens = subject.split(".")
        stars = [i for i, t in enumerate(pf.filter.split(".")) if t == "*"]
        key = b"".join(tokens[stars[w - 1]].encode() for w in pf.partitioning_wildcards)
        return fnv1a_32(key) % partitions
    return None


def sync_filters(partitions: Iterable[int]) -> list[str]:
    """Synchronization consumer filters: overlap like the data filters, match nothing."""
    return [f"{SYNC_PREFIX}.{p}.>" for p in partitions]


def sync_claimed(filters: Iterable[str]) -> set[int]:
    """The partitions a synchronization consumer's filters claim."""
    claimed: set[int] = set()
    for f in filters:
        head, _, rest = f.partition(".")
        number = rest.partition(".")[0]
        if head == SYNC_PREFIX and number.isascii() and number.isdigit():
            claimed.add(int(number))
    return claimed


#: Token of a filter that claims a partition without receiving its messages: on a
#: work-queue stream it overlaps the partition's filter (so nobody else can take it), yet
#: matches no message. Pinned mode holds partitions with it while it finishes or takes them.
HOLD_TOKEN = "_cgroupd_hold"
#: First token of the filter of a member consumer that owns no partition (it matches
#: nothing and overlaps nothing; a consumer needs at least one filter).
IDLE_PREFIX = "_cgroupd_idle"


def hold_filters(partitions: Iterable[int], subjects: Iterable[str] = (">",)) -> list[str]:
    """Filters that claim ``partitions`` without delivering any of their messages.

    One per partition and subject: the subject with each wildcard replaced by the hold
    token. Such a literal overlaps the partition's filter of that subject, in any form a
    claim may take (``<p>.>`` or the reference's ``<p>.<filter>``), so a work queue
    refuses a second claim; it matches only a subject made of hold tokens.
    """
    held = [".".join(HOLD_TOKEN if t in ("*", ">") else t for t in s.split("."))
            for s in subjects]
    return list(dict.fromkeys(f"{p}.{h}" for p in partitions for h in held))


def idle_filter(member: str) -> str:
    return f"{IDLE_PREFIX}.{member}"


def member_consumer_filters(filters: Iterable[str]) -> tuple[set[int], set[int]]:
    """(partitions delivered, partitions held) by a member consumer's filters."""
    real: set[int] = set()
    held: set[int] = set()
    for f in filters:
        head, _, rest = f.partition(".")
        if head.isascii() and head.isdigit():
            (held if rest.rsplit(".", 1)[-1] == HOLD_TOKEN else real).add(int(head))
    return real, held


def transform_destination(pf: PartitioningFilter, partitions: int) -> str:
    """Subject transform that prefixes the partition number to a matching subject.

    ``foo.*.*`` with wildcards ``[2]`` and 8 partitions gives
    ``{{Partition(8,2)}}.foo.{{Wildcard(1)}}.{{Wildcard(2)}}``; with no wildcards the whole
    subject is hashed (``{{Partition(8)}}``). Spelled as the reference spells it, so
    either side re-creating the other's group finds an identical stream.
    """
    args = ",".join(str(i) for i in (partitions, *pf.partitioning_wildcards))
    tokens = []
    star = 0
    for token in pf.filter.split("."):
        if token == "*":
            star += 1
            tokens.append(f"{{{{Wildcard({star})}}}}")
        else:
            tokens.append(token)
    return f"{{{{Partition({args})}}}}." + ".".join(tokens)


def strip_partition(subject: str) -> tuple[int | None, str]:
    """Split ``"3.orders.17"`` into ``(3, "orders.17")``; a subject with no numeric first
    token comes back whole with partition ``None``."""
    head, sep, rest = subject.partition(".")
    if sep and head.isascii() and head.isdigit():  # str.isdigit also accepts '²', '٣'...
        return int(head), rest
    return None, subject


def moved_partitions(before: GroupConfig, after: GroupConfig) -> set[int]:
    """Partitions whose owner differs between two configs (including gaining/losing one)."""
    a, b = owners(before), owners(after)
    return {p for p in set(a) | set(b) if a.get(p) != b.get(p)}


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` is one token, a final ``>`` one or more."""
    ptoks, stoks = pattern.split("."), subject.split(".")
    for i, p in enumerate(ptoks):
        if p == ">":
            return len(stoks) > i
        if i >= len(stoks) or (p != "*" and p != stoks[i]):
            return False
    return len(ptoks) == len(stoks)


def key_function(spec: str, config: GroupConfig | None) -> Callable[[str, Mapping[str, str],
                                                                     int | None], str]:
    """How messages are grouped for in-order processing (``--key``).

    ``auto``: the partitioning tokens of the subject (the group's partitioning wildcards;
    the whole subject when a filter hashes it all). ``subject``: the whole subject.
    ``partition``: the partition number. ``tokens:1,3``: those 1-based subject tokens.
    ``header:NAME``: that header's value (the subject when absent). The function takes
    the subject with the partition token stripped, the headers and the partition.
    """
    kind, _, arg = spec.partition(":")
    if kind == "subject":
        return lambda subject, headers, partition: subject
    if kind == "partition":
        return lambda subject, headers, partition: str(partition)
    if kind == "header":
        if not arg:
            raise ValueError("key 'header:' needs a header name, e.g. header:Order-Id")
        return lambda subject, headers, partition: headers.get(arg) or subject
    if kind == "tokens":
        try:
            positions = [int(t) for t in arg.split(",")]
        except ValueError:
            raise ValueError(f"key {spec!r}: tokens are 1-based integers, e.g. tokens:1,3") \
                from None
        if not positions or min(positions) < 1:
            raise ValueError(f"key {spec!r}: tokens are 1-based integers, e.g. tokens:1,3")

        def by_tokens(subject: str, headers: Mapping[str, str], partition: int | None) -> str:
            toks = subject.split(".")
            return ".".join(toks[i - 1] if i <= len(toks) else "" for i in positions)

        return by_tokens
    if kind != "auto":
        raise ValueError(f"unknown key {spec!r}: use auto, subject, partition, "
                         "tokens:1,2 or header:NAME")
    filters = getattr(config, "partitioning_filters", ()) or ()

    @functools.lru_cache(maxsize=65536)
    def of_subject(subject: str) -> str:
        for pf in filters:
            if subject_matches(pf.filter, subject):
                if not pf.partitioning_wildcards:
                    return subject
                toks = subject.split(".")
                stars = [i for i, t in enumerate(pf.filter.split(".")) if t == "*"]
                return ".".join(toks[stars[w - 1]] for w in pf.partitioning_wildcards)
        return subject

    def auto(subject: str, headers: Mapping[str, str], partition: int | None) -> str:
        return of_subject(subject)

    return auto
