"""Group configuration: the records kept in the consumer-group KV buckets, and their rules.

Pure core: no I/O. Records are read and written with the exact field names the Go
reference (orbit.go ``pcgroups``) uses, so a group created by either is usable by both. Two
older shapes are read too: the Go reference's single-``filter`` record and the ADR's
revision-1 record (``partitioning-wildcards``, ``msg-buffer-size``, ``member-mappings``).
Fields this version does not know are kept in ``extra`` and written back unchanged, and
:class:`WireForm` remembers how a stored record was spelled (``null``/``[]``/missing,
key order, separators, escapes) so that writing it back changes only what changed: the
reference and its ports (orbit.java, orbit.net, natsio-pcgroups) each spell "nothing"
their own way, and the reference's members stop when a fixed setting changes spelling.
An elastic group without partitioning filters partitions on the whole subject.

Reading is as tolerant as the reference (natsio-pcgroups, orbit.go): ``-1``, ``0``,
``null`` or an absent buffering limit all mean "no limit" and are written back as they
were; a member list may repeat names or name members cgroupd would not create. Writing
(the CLI, the admin API) keeps cgroupd's stricter rules. Validation is linear in the
record's size, and a record is bounded: at most :data:`MAX_PARTITIONS` partitions and
:data:`MAX_LISTED_MEMBERS` listed members. :mod:`cgroupd.core.records` reads records.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self, TypeAlias

from cgroupd.core.errors import ConfigError

ELASTIC_BUCKET = "elastic-consumer-groups"
STATIC_BUCKET = "static-consumer-groups"

#: Longest stream, group or member name; keeps ``<stream>-<group>`` and data consumer
#: names (``<member>~<slot>``; earlier versions ``<member>-<instance id>``) within the
#: server's 255-character limit.
MAX_NAME_LENGTH = 100
#: Characters valid in a KV key token, so ``<stream>.<group>`` is always a valid key.
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-=]+$")
_FORBIDDEN_IN_NAME = (".", "*", ">", "/", "\\")

#: Most partitions (``max_members``) a group may have: what the reference allows. Its
#: records hold any ``uint`` (Go) or ``int`` (Java), but the work-queue stream's
#: ``{{Partition(N)}}`` transform refuses ``N`` over 2**31-1 (nats-server
#: ``subject_transform.go``: ``> math.MaxInt32``), so no reference group can have more.
#: Consuming that many is another matter: each member's consumer filters one subject per
#: partition it holds, and nats-server takes ~0.1 s to create a work-queue consumer with
#: 1,024 filters, 1-2 s with 4,096 and 5-11 s with 10,000 (2.15, measured).
MAX_PARTITIONS = 2**31 - 1
#: Most partitions one member may own for ``cgroupd join`` to consume them (the bound
#: every group had before records of any size were read): one consumer filter each.
MAX_MEMBER_PARTITIONS = 1024
#: Most member names a record may list. The ADR caps the list at ``max_members`` when it
#: assigns partitions (extra names own nothing), so longer lists only slow every reader.
MAX_LISTED_MEMBERS = 10_000
#: Error messages list at most this many offending items.
_SHOWN = 10


def validate_name(kind: str, name: object) -> str:
    """Return ``name`` if usable as a stream, group or member name, else raise ConfigError."""
    problems = name_problems(kind, name)
    if problems:
        raise ConfigError(problems)
    assert isinstance(name, str)
    return name


def name_problems(kind: str, name: object) -> list[str]:
    """Every rule ``name`` breaks, one message each."""
    if not isinstance(name, str) or name == "":
        return [f"{kind} name must be a non-empty string"]
    problems = []
    if any(ch.isspace() for ch in name):
        problems.append(f"{kind} name {name!r} must not contain whitespace")
    bad = [c for c in _FORBIDDEN_IN_NAME if c in name]
    if bad:
        problems.append(f"{kind} name {name!r} must not contain {' '.join(bad)}")
    if not problems and not _NAME_RE.match(name):
        problems.append(
            f"{kind} name {name!r} may only use letters, digits, '-', '_' and '='"
        )
    if len(name) > MAX_NAME_LENGTH:
        problems.append(f"{kind} name is {len(name)} characters long; at most {MAX_NAME_LENGTH}")
    return problems


def consumer_name_problems(kind: str, name: object) -> list[str]:
    """What nats-server refuses in a consumer name: the rules a member name written by
    another implementation must meet for that member to consume at all."""
    if not isinstance(name, str) or name == "":
        return [f"{kind} name must be a non-empty string"]
    if any(ch.isspace() or not ch.isprintable() for ch in name) or any(
            c in name for c in _FORBIDDEN_IN_NAME):
        return [f"{kind} name {name!r} is not a valid consumer name"]
    return []


def _shown(items: Iterable[object], sep: str = ", ") -> str:
    listed = [str(i) for i in items]
    more = len(listed) - _SHOWN
    return sep.join(listed[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _repeated(items: Iterable[object]) -> list[object]:
    """Items present more than once, in first-seen order (linear)."""
    return [item for item, n in Counter(items).items() if n > 1]


#: How a list field was spelled in a stored record: a JSON list, ``null``, or left out.
#: Go's ``reflect.DeepEqual`` tells ``null`` (nil) from ``[]``: the reference's members
#: compare each new record with the one they started on and stop on "a bad change in
#: the configuration" when a writer turns one into the other.
LIST, NULL, ABSENT = "list", "null", "absent"


@dataclass(frozen=True)
class WireForm:
    """How a stored record was written (its key order, ``null`` versus ``[]`` versus a
    missing list, Go's HTML escaping of ``>``), so that writing it back changes only
    what the change is about: the reference's writers differ (see docs/interop.md)."""

    #: The record's keys in the order they were written.
    keys: tuple[str, ...] = ()
    #: ``partitioning_filters`` (elastic) or ``filters`` (static) as stored: ``LIST``,
    #: ``NULL`` or ``ABSENT``.
    filters: str = LIST
    #: ``members`` as stored when empty (Go leaves it out, older writers put ``[]``).
    members: str = ABSENT
    #: A static group's filter as a single ``filter`` string (orbit.java) rather than a
    #: ``filters`` list.
    single_filter: bool = False
    #: JSON text style: item and key separators (Go, Java, .NET: compact; Python's
    #: ``json.dumps``, natsio-pcgroups: ``", "`` and ``": "``), the escaping of
    #: HTML-sensitive characters (``GO``: ``\\u003e``, as ``json.Marshal``; ``DOTNET``:
    #: ``\\u003E`` and ``'`` ``+`` too, as System.Text.Json), non-ASCII as ``\\u`` escapes.
    separators: tuple[str, str] = (",", ":")
    escape: str = ""
    ascii: bool = False


#: Escaping styles of :class:`WireForm`.
GO_ESCAPE, DOTNET_ESCAPE = "go", "dotnet"
_ESCAPES = {
    GO_ESCAPE: (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")),
    DOTNET_ESCAPE: (("&", "\\u0026"), ("<", "\\u003C"), (">", "\\u003E"),
                    ("'", "\\u0027"), ("+", "\\u002B")),
}


#: The form of a record cgroupd writes from scratch: orbit.go's (``partitioning_filters``
#: ``null`` for a whole-subject group, as ``cg elastic create`` without a filter writes it).
NEW_RECORD = WireForm(filters=NULL)


def dump_record(record: dict[str, Any], form: WireForm | None) -> bytes:
    """A record as JSON text in ``form``'s style, its keys in the order ``form`` saw them
    (new keys after, in the reference's order)."""
    form = form or WireForm()
    if form.keys:
        order = {k: i for i, k in enumerate(form.keys)}
        ranked = sorted(enumerate(record), key=lambda ik: (order.get(ik[1], len(order)), ik[0]))
        record = {k: record[k] for _, k in ranked}
    text = json.dumps(record, separators=form.separators, ensure_ascii=form.ascii)
    # These characters occur in JSON text only inside strings: escaping them there is safe.
    for char, code in _ESCAPES.get(form.escape, ()):
        text = text.replace(char, code)
    return text.encode()


@dataclass(frozen=True)
class PartitioningFilter:
    """A subject filter of the origin stream and which of its ``*`` wildcards form the key.

    ``partitioning_wildcards`` are 1-based indexes of the filter's ``*`` tokens; empty
    means the whole subject is hashed.
    """

    filter: str
    partitioning_wildcards: tuple[int, ...] = ()
    #: ``partitioning_wildcards`` as stored when empty: ``[]`` (``LIST``), ``null``
    #: (Go's nil slice) or left out (orbit.java); written back the same way.
    wildcards_form: str = field(default=LIST, compare=False, repr=False)
    #: Keys of the filter object this version does not know, written back unchanged.
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "partitioning_wildcards", tuple(self.partitioning_wildcards))

    def problems(self) -> list[str]:
        """Every rule this filter breaks."""
        out: list[str] = []
        tokens = self.filter.split(".") if self.filter else []
        if not self.filter:
            return ["filter must not be empty"]
        if any(t == "" for t in tokens) or any(ch.isspace() for ch in self.filter):
            out.append(f"filter {self.filter!r} is not a valid subject (empty token or space)")
        if ">" in tokens[:-1] or any((">" in t or "*" in t) and len(t) > 1 for t in tokens):
            out.append(f"filter {self.filter!r}: '*' and '>' must be whole tokens, '>' last")
        stars = self.wildcard_count
        if stars == 0 and tokens[-1] != ">":
            out.append(f"filter {self.filter!r} needs at least one '*' or a trailing '>'")
        seen: set[int] = set()
        for idx in self.partitioning_wildcards:
            if not isinstance(idx, int) or isinstance(idx, bool):
                out.append(f"filter {self.filter!r}: wildcard index {idx!r} is not an integer")
            elif idx in seen:
                out.append(f"filter {self.filter!r}: wildcard index {idx} is listed twice")
            elif not 1 <= idx <= stars:
                out.append(
                    f"filter {self.filter!r}: wildcard index {idx} is outside 1..{stars} "
                    f"(the filter has {stars} '*' wildcard(s))"
                )
            if isinstance(idx, int):
                seen.add(idx)
        return out

    @property
    def wildcard_count(self) -> int:
        """How many ``*`` tokens the filter has."""
        return self.filter.split(".").count("*")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"filter": self.filter}
        if self.partitioning_wildcards or self.wildcards_form == LIST:
            out["partitioning_wildcards"] = list(self.partitioning_wildcards)
        elif self.wildcards_form == NULL:
            out["partitioning_wildcards"] = None
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out


#: The filter of a group with no partitioning filter (whole-subject partitioning): the
#: reference sources ``>`` into ``{{Partition(N)}}.>`` (nats-server >= 2.12).
WHOLE_SUBJECT = PartitioningFilter(">")


@dataclass(frozen=True)
class MemberMapping:
    """An administratively chosen set of partitions for one member."""

    member: str
    partitions: tuple[int, ...]
    #: ``partitions`` as stored when empty (Go writes a nil list as ``null``).
    partitions_form: str = field(default=LIST, compare=False, repr=False)
    #: Keys of the mapping object this version does not know, written back unchanged.
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "partitions", tuple(self.partitions))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"member": self.member}
        if self.partitions or self.partitions_form == LIST:
            out["partitions"] = list(self.partitions)
        elif self.partitions_form == NULL:
            out["partitions"] = None
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out


@dataclass(frozen=True)
class _GroupBase:
    """Fields and rules shared by elastic and static groups."""

    max_members: int
    members: tuple[str, ...] = ()
    member_mappings: tuple[MemberMapping, ...] = ()
    #: Unknown record fields, written back unchanged.
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: Read from a stored record: accept what the reference accepts (repeated member
    #: names, names cgroupd would not create, a mapping to no partitions).
    lenient: bool = field(default=False, compare=False, repr=False)
    #: How the stored record was spelled (None: a new record, written as orbit.go does).
    form: WireForm | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so configs compare and hash by value.
        for name in ("members", "member_mappings", "partitioning_filters", "filters"):
            value = getattr(self, name, None)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        for name in ("max_buffered_msgs", "max_buffered_bytes"):
            if type(getattr(self, name, None)) is int and getattr(self, name) == -1:
                object.__setattr__(self, name, 0)  # JetStream's "no limit", as is 0
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    @property
    def partitions(self) -> int:
        """Number of partitions: the maximum number of members that can own some."""
        return self.max_members

    def _membership_problems(self) -> list[str]:
        out: list[str] = []
        if isinstance(self.max_members, bool) or not isinstance(self.max_members, int):
            return [f"max_members must be an integer, not {self.max_members!r}"]
        if self.max_members < 1:
            out.append(f"max_members must be at least 1, not {self.max_members}")
        if self.max_members > MAX_PARTITIONS:
            return [f"max_members is {self.max_members}; at most {MAX_PARTITIONS} "
                    "(nats-server's partition(N) transform takes no more)"]
        if len(self.members) > MAX_LISTED_MEMBERS:
            return [f"the group lists {len(self.members)} members; at most "
                    f"{MAX_LISTED_MEMBERS} (only the first max_members of them, sorted, "
                    "would own partitions)"]
        if self.members and self.member_mappings:
            out.append("give either members or member_mappings, not both")
        check = consumer_name_problems if self.lenient else name_problems
        bad = [p for m in self.members for p in check("member", m)]
        out.extend(bad[:_SHOWN])
        if len(bad) > _SHOWN:
            out.append(f"and {len(bad) - _SHOWN} more bad member names")
        dupes = _repeated(self.members)
        if dupes and not self.lenient:
            out.append(f"member names must be unique; repeated: {_shown(sorted(map(str, dupes)))}")
        if self.member_mappings:
            out.extend(_mapping_problems(self.member_mappings, self.max_members,
                                         self.lenient))
        return out

    def problems(self) -> list[str]:
        return self._membership_problems()

    def with_members(self, members: Iterable[str]) -> Self:
        """A copy with this member list (and no mappings). A record's leniency is kept
        (its names were there before); callers check the names they add."""
        return replace(self, members=tuple(members), member_mappings=())

    def with_mappings(self, mappings: Iterable[MemberMapping]) -> Self:
        """A copy with these mappings (and no member list), held to cgroupd's own rules:
        the mappings are all the caller's."""
        return replace(self, members=(), member_mappings=tuple(mappings), lenient=False)

    @property
    def member_names(self) -> tuple[str, ...]:
        """Members named by the config, whether listed or mapped."""
        if self.member_mappings:
            return tuple(m.member for m in self.member_mappings)
        return self.members

    def _membership_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        form = self.form or NEW_RECORD
        if self.members or (form.members == LIST and not self.member_mappings):
            out["members"] = list(self.members)
        elif form.members == NULL and not self.member_mappings:
            out["members"] = None
        if self.member_mappings:
            out["member_mappings"] = [m.to_json() for m in self.member_mappings]
        return out

    def to_json(self) -> bytes:
        raise NotImplementedError


def _mapping_problems(mappings: tuple[MemberMapping, ...], n: int,
                      lenient: bool = False) -> list[str]:
    """Every partition 0..n-1 mapped exactly once, each member once. Linear in the
    number of mappings and listed partitions; never enumerates 0..n-1."""
    out: list[str] = []
    if len(mappings) > n:
        return [f"{len(mappings)} member mappings for {n} partitions; at most one per "
                "partition"]
    owners: dict[int, list[str]] = {}
    check = consumer_name_problems if lenient else name_problems
    for mapping in mappings:
        out.extend(check("member", mapping.member))
        if not mapping.partitions and not lenient:
            out.append(f"member {mapping.member!r} is mapped to no partitions")
        for p in mapping.partitions:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n:
                out.append(f"member {mapping.member!r}: partition {p!r} is outside 0..{n - 1}")
            else:
                owners.setdefault(p, []).append(mapping.member)
    dupes = _repeated(m.member for m in mappings)
    if dupes:
        out.append(f"each member may be mapped once; repeated: {_shown(sorted(map(str, dupes)))}")
    twice = [f"partition {p} is mapped more than once ({_shown(who)})"
             for p, who in sorted(owners.items()) if len(who) > 1]
    out.extend(twice[:_SHOWN])
    if len(twice) > _SHOWN:
        out.append(f"and {len(twice) - _SHOWN} more partitions mapped more than once")
    # Gaps between mapped partitions, without enumerating 0..n-1 (n comes from the record).
    gaps: list[str] = []
    prev = -1
    for p in [*sorted(owners), n]:
        if p > prev + 1:
            gaps.append(str(prev + 1) if p == prev + 2 else f"{prev + 1}-{p - 1}")
        prev = p
    if gaps:
        out.append(f"partitions not mapped to any member: {_shown(gaps, ',')}")
    return out


@dataclass(frozen=True)
class ElasticGroupConfig(_GroupBase):
    """A group whose own work-queue stream ``<stream>-<group>`` sources and partitions
    the origin stream. Only the membership may change after creation."""

    partitioning_filters: tuple[PartitioningFilter, ...] = ()
    #: Limits of the group's work-queue stream (0 or -1: unlimited); full stream
    #: discards new.
    max_buffered_msgs: int = 0
    max_buffered_bytes: int = 0

    @property
    def whole_subject(self) -> bool:
        """No partitioning filter: every subject of the stream, hashed whole."""
        return not self.partitioning_filters

    @property
    def effective_filters(self) -> tuple[PartitioningFilter, ...]:
        """The filters the group's transforms use: its own, or ``>`` hashed whole."""
        return self.partitioning_filters or (WHOLE_SUBJECT,)

    def problems(self) -> list[str]:
        out = self._membership_problems()
        for pf in self.partitioning_filters:
            out.extend(pf.problems())
        dupes = _repeated(pf.filter for pf in self.partitioning_filters)
        if dupes:
            out.append(f"partitioning filters must be unique; repeated: "
                       f"{_shown(sorted(map(str, dupes)))}")
        for name in ("max_buffered_msgs", "max_buffered_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                out.append(f"{name} must be a non-negative integer or -1 (no limit), "
                           f"not {value!r}")
        return out

    def same_shape(self, other: ElasticGroupConfig) -> bool:
        """True when the two differ at most in membership (what may change after create)."""
        return (
            self.max_members == other.max_members
            and self.partitioning_filters == other.partitioning_filters
            and self.max_buffered_msgs == other.max_buffered_msgs
            and self.max_buffered_bytes == other.max_buffered_bytes
        )

    def to_json(self) -> bytes:
        form = self.form or NEW_RECORD
        record: dict[str, Any] = {"max_members": self.max_members}
        if self.partitioning_filters or form.filters == LIST:
            record["partitioning_filters"] = [pf.to_json() for pf in self.partitioning_filters]
        elif form.filters == NULL:
            record["partitioning_filters"] = None
        # "No limit" as it was stored (-1, 0, null) is in ``extra``.
        for name, value in (("max_buffered_msg", self.max_buffered_msgs),
                            ("max_buffered_bytes", self.max_buffered_bytes)):
            if value:
                record[name] = value
            elif name in self.extra:
                record[name] = self.extra[name]
        record.update(self._membership_json())
        for key, value in self.extra.items():
            record.setdefault(key, value)
        return dump_record(record, self.form)


@dataclass(frozen=True)
class StaticGroupConfig(_GroupBase):
    """A group on a stream whose subjects already start with the partition number.

    ``filters`` is recorded as the Go reference records it; members consume ``<p>.>``.
    """

    filters: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        out = self._membership_problems()
        for f in self.filters:
            if not isinstance(f, str) or not f or any(ch.isspace() for ch in f):
                out.append(f"static filter {f!r} is not a valid subject")
        return out

    def same_shape(self, other: StaticGroupConfig) -> bool:
        """True when the two differ at most in membership."""
        return self.max_members == other.max_members and self.filters == other.filters

    def to_json(self) -> bytes:
        form = self.form or WireForm(filters=ABSENT)  # Go: omitempty
        record: dict[str, Any] = {"max_members": self.max_members}
        if form.single_filter and len(self.filters) == 1:
            record["filter"] = self.filters[0]
        elif self.filters or form.filters == LIST:
            record["filters"] = list(self.filters)
        elif form.filters == NULL:
            record["filters"] = None
        record.update(self._membership_json())
        for key, value in self.extra.items():
            record.setdefault(key, value)
        return dump_record(record, self.form)


GroupConfig: TypeAlias = ElasticGroupConfig | StaticGroupConfig



def group_key(stream: str, group: str) -> str:
    """The KV key of a group's record."""
    return f"{stream}.{group}"


def work_queue_stream(stream: str, group: str) -> str:
    """Name of an elastic group's work-queue stream."""
    return f"{stream}-{group}"
