"""Unit tests for ``cgroupd.core.partitions``: who owns which partition, and the subjects for it.

Pure: no I/O, no server. The distribution must be exactly the ADR's (and the Go
reference's ``GeneratePartitionFilters``), or cgroupd and Go members of one group would
consume overlapping or missing partitions.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgroupd.core.config import (
    ElasticGroupConfig,
    MemberMapping,
    PartitioningFilter,
    StaticGroupConfig,
)
from cgroupd.core.errors import ConfigError
from cgroupd.core.partitions import (
    HOLD_TOKEN,
    SYNC_PREFIX,
    assignment,
    fnv1a_32,
    group_subjects,
    hold_filters,
    idle_filter,
    member_consumer_filters,
    member_filters,
    member_partitions,
    moved_partitions,
    owners,
    partition_filters,
    partition_of,
    reference_filters,
    strip_partition,
    subject_matches,
    sync_filters,
    transform_destination,
)

FAST = settings(database=None, deadline=None, max_examples=300)


def group(n: int, members: list[str] | tuple[str, ...] = ()) -> ElasticGroupConfig:
    """An elastic group of ``n`` partitions with this member list."""
    return ElasticGroupConfig(
        max_members=n,
        partitioning_filters=[PartitioningFilter("orders.*", (1,))],
        members=list(members),
    )


def mapped(n: int, **parts: list[int]) -> ElasticGroupConfig:
    """An elastic group of ``n`` partitions with these member mappings."""
    return ElasticGroupConfig(
        max_members=n,
        partitioning_filters=[PartitioningFilter("orders.*", (1,))],
        member_mappings=[MemberMapping(m, p) for m, p in parts.items()],
    )


def go_get_partition_filters(members: list[str], max_members: int, member: str) -> list[str]:
    """Line-by-line transcription of the ADR's Go ``GetPartitionFilters``, as the oracle."""
    members = sorted(set(members))  # deduplicateStringSlice, then slices.Sort
    if len(members) > max_members:
        members = members[:max_members]
    num_members = len(members)
    if num_members > 0:
        num_per = max_members // num_members
        my_filters = []
        for i in range(max_members):
            member_index = i // num_per
            if i < num_members * num_per:
                if members[member_index % num_members] == member:
                    my_filters.append(f"{i}.>")
            else:
                if members[(i - num_members * num_per) % num_members] == member:
                    my_filters.append(f"{i}.>")
        return my_filters
    return []


# --------------------------------------------------------------------------------------
# The ADR algorithm, by hand
# --------------------------------------------------------------------------------------

#: (partitions, members as configured, expected assignment), each worked out by hand from
#: the ADR's Go code: sort, cap at N, blocks of N // members, remainder dealt by modulo.
WORKED = [
    pytest.param(
        8, ["b", "c", "a"], {"a": (0, 1, 6), "b": (2, 3, 7), "c": (4, 5)}, id="8-over-3-unsorted"
    ),
    pytest.param(
        8, ["d", "a", "c", "b"], {"a": (0, 1), "b": (2, 3), "c": (4, 5), "d": (6, 7)}, id="8-over-4"
    ),
    pytest.param(7, ["c", "a", "b"], {"a": (0, 1, 6), "b": (2, 3), "c": (4, 5)}, id="7-over-3"),
    pytest.param(
        11,
        ["a", "b", "c", "d"],
        {"a": (0, 1, 8), "b": (2, 3, 9), "c": (4, 5, 10), "d": (6, 7)},
        id="11-over-4",
    ),
    pytest.param(
        5, ["c", "b", "a"], {"a": (0, 3), "b": (1, 4), "c": (2,)}, id="5-over-3-blocks-of-1"
    ),
    pytest.param(8, ["solo"], {"solo": tuple(range(8))}, id="one-member-owns-all"),
    pytest.param(
        3, ["d", "c", "b", "a", "e"], {"a": (0,), "b": (1,), "c": (2,)}, id="capped-at-max-members"
    ),
    pytest.param(1, ["b", "a"], {"a": (0,)}, id="one-partition"),
    pytest.param(
        6,
        ["m9", "m10", "m2"],
        {"m10": (0, 1), "m2": (2, 3), "m9": (4, 5)},
        id="plain-string-order-not-natural",
    ),
    pytest.param(3, ["b", "a", "B"], {"B": (0,), "a": (1,), "b": (2,)}, id="uppercase-sorts-first"),
    pytest.param(4, [], {}, id="no-members"),
]


@pytest.mark.parametrize(("n", "members", "expected"), WORKED)
def test_worked_examples(n: int, members: list[str], expected: dict[str, tuple[int, ...]]) -> None:
    """The distribution matches examples computed by hand from the ADR's Go code, and the
    Go transcription agrees with both."""
    config = group(n, members)
    assert assignment(config) == expected
    for member in members:
        want = expected.get(member, ())
        assert member_partitions(config, member) == want
        assert partition_filters(want) == go_get_partition_filters(members, n, member)


def test_member_not_listed_owns_nothing() -> None:
    """A member missing from the config gets no partitions (and so consumes nothing)."""
    config = group(8, ["a", "b"])
    assert member_partitions(config, "zed") == ()
    assert "zed" not in assignment(config)
    assert member_partitions(group(8), "a") == ()


def test_members_beyond_max_members_own_nothing() -> None:
    """Only the first ``max_members`` members in sorted order own partitions; the others
    are standbys that own nothing until a member before them leaves."""
    config = group(2, ["d", "c", "b", "a"])
    assert assignment(config) == {"a": (0,), "b": (1,)}
    assert member_partitions(config, "c") == ()
    assert member_partitions(config, "d") == ()
    assert assignment(config.with_members(["d", "c", "b"])) == {"b": (0,), "c": (1,)}


def test_input_order_does_not_matter() -> None:
    """The member list is sorted first, so every permutation gives the same assignment."""
    assert assignment(group(8, ["c", "a", "b"])) == assignment(group(8, ["a", "b", "c"]))
    assert assignment(group(8, ["b", "c", "a"])) == assignment(group(8, ["c", "b", "a"]))


def test_duplicate_members_cannot_reach_the_algorithm() -> None:
    """De-duplication is part of the ADR algorithm, but the config already rejects repeated
    members, so a duplicate can only be seen by the Go transcription, where it is a no-op."""
    with pytest.raises(ConfigError, match="repeated"):
        group(8, ["a", "b", "a"])
    for m in ("a", "b"):
        assert go_get_partition_filters(["a", "b", "a"], 8, m) == go_get_partition_filters(
            ["a", "b"], 8, m
        )


def test_mappings_win() -> None:
    """With mappings the automatic distribution is not used: each member owns exactly its
    mapped partitions, listed in partition order."""
    config = mapped(4, a=[3, 2], b=[0, 1])
    assert assignment(config) == {"a": (2, 3), "b": (0, 1)}
    assert member_partitions(config, "a") == (2, 3)
    assert member_partitions(config, "c") == ()
    assert owners(config) == {0: "b", 1: "b", 2: "a", 3: "a"}
    assert assignment(config) != assignment(group(4, ["a", "b"]))


def test_uneven_mappings_are_kept_as_given() -> None:
    """Mappings may be as uneven as the administrator likes."""
    config = mapped(5, big=[0, 1, 2, 4], small=[3])
    assert assignment(config) == {"big": (0, 1, 2, 4), "small": (3,)}


def test_static_groups_use_the_same_algorithm() -> None:
    """Static groups distribute their partitions the same way."""
    config = StaticGroupConfig(max_members=8, filters=["orders.>"], members=["b", "c", "a"])
    assert assignment(config) == {"a": (0, 1, 6), "b": (2, 3, 7), "c": (4, 5)}


def test_owners_inverts_assignment() -> None:
    """``owners`` maps each owned partition to its member."""
    assert owners(group(5, ["c", "b", "a"])) == {0: "a", 1: "b", 2: "c", 3: "a", 4: "b"}
    assert owners(group(5)) == {}


# --------------------------------------------------------------------------------------
# Properties of the automatic distribution
# --------------------------------------------------------------------------------------

names = st.text(alphabet="abcAB1-", min_size=1, max_size=3)
member_lists = st.lists(names, max_size=20, unique=True)
partition_counts = st.integers(1, 64)


@FAST
@given(member_lists, partition_counts)
def test_every_partition_has_exactly_one_owner(members: list[str], n: int) -> None:
    """With at least one member, partitions 0..N-1 are each owned by exactly one member;
    with none, nobody owns anything."""
    owned = assignment(group(n, members))
    all_parts = [p for parts in owned.values() for p in parts]
    if members:
        assert sorted(all_parts) == list(range(n))
    else:
        assert all_parts == []


@FAST
@given(member_lists, partition_counts)
def test_sizes_differ_by_at_most_one(members: list[str], n: int) -> None:
    """Owning members hold floor(N/k) or ceil(N/k) partitions, k = min(members, N)."""
    owned = assignment(group(n, members))
    sizes = [len(parts) for parts in owned.values()]
    if sizes:
        assert max(sizes) - min(sizes) <= 1
        k = min(len(members), n)
        assert set(sizes) <= {n // k, math.ceil(n / k)}


@FAST
@given(member_lists, partition_counts)
def test_owners_are_the_first_sorted_members(members: list[str], n: int) -> None:
    """Exactly the first min(len, N) members in sorted order own partitions."""
    owned = assignment(group(n, members))
    assert sorted(owned) == sorted(members)[:n]


@FAST
@given(member_lists, partition_counts)
def test_member_partitions_agrees_with_assignment_and_go(members: list[str], n: int) -> None:
    """``member_partitions``, ``assignment``, ``owners`` and the Go transcription agree for
    every member, listed or not; partitions come in increasing order."""
    config = group(n, members)
    owned = assignment(config)
    by_partition = owners(config)
    for member in [*members, "not-listed"]:
        parts = member_partitions(config, member)
        assert parts == owned.get(member, ())
        assert list(parts) == sorted(parts)
        assert all(by_partition[p] == member for p in parts)
        assert partition_filters(parts) == go_get_partition_filters(members, n, member)


# --------------------------------------------------------------------------------------
# Movement when membership changes
# --------------------------------------------------------------------------------------


def test_worst_case_one_join_moves_every_partition() -> None:
    """Pinned worst case: the ADR says it minimises movement, but it does not. With 8
    partitions, adding ``a`` in front of ``b, c, d`` gives every partition a new owner
    (b:0,1,6 c:2,3,7 d:4,5 → a:0,1 b:2,3 c:4,5 d:6,7: every block shifts). Because any
    single join or leave can move everything, issue 9 (rebalances without pauses) hands
    over only the partitions in ``moved_partitions`` and keeps every other consumer
    running, instead of stopping all consumers as the Go reference does. If this test
    fails the algorithm changed: Go members of the same group would then disagree."""
    before = group(8, ["b", "c", "d"])
    after = group(8, ["a", "b", "c", "d"])
    assert moved_partitions(before, after) == set(range(8))
    assert moved_partitions(after, before) == set(range(8))


def test_join_sorting_last_can_move_few() -> None:
    """The same join with a member sorting last moves only the two remainder partitions,
    so what moves depends on names, not just counts."""
    before = group(8, ["a", "b", "c"])
    after = group(8, ["a", "b", "c", "d"])
    assert moved_partitions(before, after) == {6, 7}


@FAST
@given(member_lists, partition_counts, names)
def test_join_movement_bounds(members: list[str], n: int, joiner: str) -> None:
    """The bound actually guaranteed when one member joins m others (not minimal
    movement): at most N partitions move; every partition the joiner gains is among
    them; it gains at most ceil(N/(m+1)); and when m >= N and the joiner sorts after the
    first N members, nothing moves."""
    if joiner in members:
        members = [m for m in members if m != joiner]
    m = len(members)
    before, after = group(n, members), group(n, [*members, joiner])
    moved = moved_partitions(before, after)
    gained = set(member_partitions(after, joiner))
    assert moved <= set(range(n))
    assert gained <= moved
    assert len(gained) <= math.ceil(n / (m + 1))
    if m >= n and joiner > sorted(members)[n - 1]:
        assert moved == set()
        assert gained == set()


@FAST
@given(st.data(), st.integers(1, 12))
def test_join_after_a_full_list_moves_nothing(data: st.DataObject, n: int) -> None:
    """When the member list already has at least N members, a joiner sorting after the
    first N is a standby: nothing moves and it owns nothing."""
    members = data.draw(
        st.lists(st.text("abc", min_size=1, max_size=4), min_size=n, max_size=n + 5, unique=True)
    )
    joiner = "z" + data.draw(st.text("abc", max_size=3))
    before, after = group(n, members), group(n, [*members, joiner])
    assert moved_partitions(before, after) == set()
    assert member_partitions(after, joiner) == ()


@FAST
@given(member_lists.filter(bool), partition_counts, st.data())
def test_leave_movement_bounds(members: list[str], n: int, data: st.DataObject) -> None:
    """When one member leaves, at most N partitions move and every partition the leaver
    owned is among them (they must go to someone else, or to nobody if it was the last)."""
    leaver = data.draw(st.sampled_from(members))
    before = group(n, members)
    after = group(n, [m for m in members if m != leaver])
    moved = moved_partitions(before, after)
    lost = set(member_partitions(before, leaver))
    assert moved <= set(range(n))
    assert lost <= moved
    assert member_partitions(after, leaver) == ()


def test_moved_partitions_cases() -> None:
    """No change moves nothing; gaining or losing an owner counts as a move; a swap of
    mappings moves exactly the swapped partitions."""
    config = group(4, ["a", "b"])
    assert moved_partitions(config, config) == set()
    assert moved_partitions(group(4), config) == {0, 1, 2, 3}
    assert moved_partitions(config, group(4)) == {0, 1, 2, 3}
    assert moved_partitions(mapped(4, a=[0, 1], b=[2, 3]), mapped(4, a=[0, 2], b=[1, 3])) == {
        1,
        2,
    }
    assert moved_partitions(config, mapped(4, a=[0, 1], b=[2, 3])) == set()


# --------------------------------------------------------------------------------------
# Subjects: consumer filters, the partitioning transform, stripping the partition
# --------------------------------------------------------------------------------------


def test_partition_filters() -> None:
    """Data consumers filter ``<p>.>`` for each owned partition, in the given order, from
    any iterable."""
    assert partition_filters([0, 3]) == ["0.>", "3.>"]
    assert partition_filters(range(3)) == ["0.>", "1.>", "2.>"]
    assert partition_filters(()) == []


def test_sync_filters_match_no_partition_subject() -> None:
    """Sync consumers filter ``sync.<p>.>``: the first token is not a number, so they can
    match no work-queue message, yet two sync consumers for one partition overlap."""
    assert sync_filters([0, 3]) == [f"{SYNC_PREFIX}.0.>", f"{SYNC_PREFIX}.3.>"]
    assert not SYNC_PREFIX.isdigit()
    for f in sync_filters(range(5)):
        assert strip_partition(f)[0] is None
    assert sync_filters([2]) == sync_filters([2])
    assert set(sync_filters([1, 2])).isdisjoint(partition_filters([1, 2]))


TRANSFORMS = [
    pytest.param(
        PartitioningFilter("orders.*", (1,)),
        8,
        "{{Partition(8,1)}}.orders.{{Wildcard(1)}}",
        id="one-wildcard",
    ),
    pytest.param(
        PartitioningFilter("foo.*.*", (2,)),
        8,
        "{{Partition(8,2)}}.foo.{{Wildcard(1)}}.{{Wildcard(2)}}",
        id="subset-2",
    ),
    pytest.param(
        PartitioningFilter("foo.*.*", (1, 2)),
        4,
        "{{Partition(4,1,2)}}.foo.{{Wildcard(1)}}.{{Wildcard(2)}}",
        id="both",
    ),
    pytest.param(
        PartitioningFilter("foo.*.*", (2, 1)),
        4,
        "{{Partition(4,2,1)}}.foo.{{Wildcard(1)}}.{{Wildcard(2)}}",
        id="index-order-kept",
    ),
    pytest.param(
        PartitioningFilter("foo.*", ()),
        8,
        "{{Partition(8)}}.foo.{{Wildcard(1)}}",
        id="no-indexes-whole-subject",
    ),
    pytest.param(PartitioningFilter("foo.>"), 8, "{{Partition(8)}}.foo.>", id="trailing-gt"),
    pytest.param(
        PartitioningFilter("*.bar.*.>", (2,)),
        16,
        "{{Partition(16,2)}}.{{Wildcard(1)}}.bar.{{Wildcard(2)}}.>",
        id="stars-and-gt",
    ),
]


@pytest.mark.parametrize(("pf", "n", "expected"), TRANSFORMS)
def test_transform_destination(pf: PartitioningFilter, n: int, expected: str) -> None:
    """The stream-source transform prefixes ``{{Partition(N,indexes...)}}`` and keeps the
    rest of the subject, each ``*`` as its ``{{Wildcard(i)}}``; no indexes hashes the whole
    subject."""
    assert pf.problems() == []
    assert transform_destination(pf, n) == expected


STRIPS: list[Any] = [
    pytest.param("3.orders.17", (3, "orders.17"), id="typical"),
    pytest.param("0.a", (0, "a"), id="zero"),
    pytest.param("12.a.b.c", (12, "a.b.c"), id="two-digits"),
    pytest.param("orders.17", (None, "orders.17"), id="no-partition"),
    pytest.param("sync.3.x", (None, "sync.3.x"), id="sync-prefix"),
    pytest.param("-1.a", (None, "-1.a"), id="negative"),
    pytest.param("3a.x", (None, "3a.x"), id="alnum-head"),
    pytest.param("\u00b2.x", (None, "\u00b2.x"), id="superscript-digit"),
    pytest.param("\u0663.x", (None, "\u0663.x"), id="arabic-indic-digit"),
    pytest.param("3", (None, "3"), id="no-dot"),
    pytest.param("", (None, ""), id="empty"),
    pytest.param("3.", (3, ""), id="empty-rest"),
]


@pytest.mark.parametrize(("subject", "expected"), STRIPS)
def test_strip_partition(subject: str, expected: tuple[int | None, str]) -> None:
    """The partition number is split off only when the first token is ASCII digits;
    anything else comes back whole with partition None (and never raises)."""
    assert strip_partition(subject) == expected


@FAST
@given(st.integers(0, 10**6), st.text(max_size=20))
def test_strip_partition_undoes_the_prefix(p: int, rest: str) -> None:
    """For any partition and original subject, stripping ``<p>.<subject>`` gives both back."""
    assert strip_partition(f"{p}.{rest}") == (p, rest)


@FAST
@given(st.text(max_size=20))
def test_strip_partition_never_raises(subject: str) -> None:
    """Any subject gives a partition or None, and the subject survives either way."""
    p, rest = strip_partition(subject)
    if p is None:
        assert rest == subject
    else:
        assert subject == f"{subject.partition('.')[0]}.{rest}"
        assert int(subject.partition(".")[0]) == p


# -- the server's partition hash -----------------------------------------------------------
def test_fnv1a_32_reference_vectors() -> None:
    """FNV-1a 32-bit, as published (the offset basis for the empty input)."""
    assert fnv1a_32(b"") == 0x811C9DC5
    assert fnv1a_32(b"a") == 0xE40C292C
    assert fnv1a_32(b"foobar") == 0xBF9CF968


#: (subject, filter, wildcards, partitions, partition nats-server 2.15 put it in).
PARTITION_VECTORS = [
    ("foo.17", "foo.*", (1,), 4, 1),
    ("foo.0", "foo.*", (1,), 4, 3),
    ("foo.1", "foo.*", (1,), 4, 0),
    ("o.ab.c", "o.*.*", (2, 1), 7, 2),  # key "cab": the tokens in the order listed
    ("o.a.bc", "o.*.*", (2, 1), 7, 6),
    ("o.17.x", "o.*.*", (2, 1), 7, 5),
    ("o.ключ.🙂", "o.*.*", (2, 1), 7, 5),
    ("o.ab.c", "o.*.*", (), 7, 3),  # no wildcards: the whole subject, dots included
    ("o.a.bc", "o.*.*", (), 7, 1),
    ("o.17.x", "o.*.*", (), 7, 6),
    ("o.ключ.🙂", "o.*.*", (), 7, 3),
    ("o.x.y.z", "o.>", (), 7, 2),
]


@pytest.mark.parametrize(("subject", "pattern", "wildcards", "n", "expected"),
                         PARTITION_VECTORS)
def test_partition_of_matches_the_servers_vectors(subject: str, pattern: str,
                                                  wildcards: tuple[int, ...], n: int,
                                                  expected: int) -> None:
    """The partition nats-server's transform chose for these subjects (observed), which
    readers that compute partitions themselves (Spark's non-destructive read) rely on."""
    assert partition_of(subject, [PartitioningFilter(pattern, wildcards)], n) == expected


def test_partition_of_concatenates_tokens_and_takes_the_first_matching_filter() -> None:
    """Selected tokens are joined without a separator (a.bc and ab.c share a key); a
    subject no filter matches has no partition; the first matching filter decides."""
    by_both = [PartitioningFilter("o.*.*", (1, 2))]
    assert partition_of("o.ab.c", by_both, 1000) == partition_of("o.a.bc", by_both, 1000)
    assert partition_of("x.a", by_both, 4) is None
    assert partition_of("o.a", by_both, 4) is None
    two = [PartitioningFilter("o.*", (1,)), PartitioningFilter("p.*", ())]
    assert partition_of("p.17", two, 7) == fnv1a_32(b"p.17") % 7
    assert partition_of("o.17", two, 7) == fnv1a_32(b"17") % 7


def test_member_filters_are_the_references() -> None:
    """Pinned mode shares the member's consumer with the reference, so it uses the
    reference's filters: <p>.<filter> per partitioning filter (or static filter, or >)
    for a member list, <p>.> in the mapping's order for mappings."""
    elastic = ElasticGroupConfig(max_members=4, members=("a", "b"), partitioning_filters=(
        PartitioningFilter("o.*", (1,)), PartitioningFilter("q.*.>", (1,))))
    assert member_filters(elastic, "b") == ["2.o.*", "3.o.*", "2.q.*.>", "3.q.*.>"]
    assert member_filters(elastic, "nobody") == []
    static = StaticGroupConfig(max_members=2, members=("a",), filters=("p.*",))
    assert member_filters(static, "a") == ["0.p.*", "1.p.*"]
    assert member_filters(StaticGroupConfig(max_members=2, members=("a",)), "a") == [
        "0.>", "1.>"]
    mapped = StaticGroupConfig(max_members=3, filters=("p.*", "r.*"), member_mappings=(
        MemberMapping("a", (2, 0)), MemberMapping("b", (1,))))
    assert member_filters(mapped, "a") == ["2.>", "0.>"]


def test_hold_and_idle_filters_read_back() -> None:
    """A member consumer's filters: partitions delivered, partitions held (claimed, no
    message matches), and the idle filter of a member without partitions."""
    filters = partition_filters([0, 2]) + hold_filters([5]) + [idle_filter("m1")]
    assert member_consumer_filters(filters) == ({0, 2}, {5})
    assert member_consumer_filters([]) == (set(), set())
    # A held partition's filter overlaps the partition's own (so a work queue refuses a
    # second claim) but matches no message of it.
    assert subject_matches("5.>", f"5.{HOLD_TOKEN}")
    assert not subject_matches(f"5.{HOLD_TOKEN}", "5.orders.k1")


def test_hold_filters_overlap_every_claim_form_yet_match_only_hold_subjects() -> None:
    """Pinned mode claims partitions with hold filters while it finishes or takes them;
    the member consumer's delivering filters take the reference's form <p>.<filter>. A
    hold must overlap a claim in either form (a work queue then refuses a second claim)
    and be read back as held, while matching no ordinary subject."""
    config = ElasticGroupConfig(max_members=4, members=("a", "b"), partitioning_filters=(
        PartitioningFilter("o.*", (1,)), PartitioningFilter("q.*.>", (1,))))
    subjects = group_subjects(config)
    holds = hold_filters([2], subjects)
    assert holds == [f"2.o.{HOLD_TOKEN}", f"2.q.{HOLD_TOKEN}.{HOLD_TOKEN}"]
    for claim in [*reference_filters(config, [2]), "2.>"]:
        assert any(subject_matches(claim, h) for h in holds), claim
    assert not any(subject_matches(h, "2.o.k1") for h in holds)
    assert member_consumer_filters(reference_filters(config, [2, 3]) + holds) == (
        {2, 3}, {2})
    assert reference_filters(config, [3, 2]) == ["2.o.*", "3.o.*", "2.q.*.>", "3.q.*.>"]
