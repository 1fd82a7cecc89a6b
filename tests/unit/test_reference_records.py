"""Records exactly as the reference implementations write them (orbit.go, orbit.java,
orbit.net, natsio-pcgroups; tests/fixtures/reference-records/index.json names each one's
source): read, understood, and written back byte for byte, also after a membership change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cgroupd.core.config import (
    MAX_PARTITIONS,
    ElasticGroupConfig,
    GroupConfig,
    PartitioningFilter,
    StaticGroupConfig,
)
from cgroupd.core.partitions import (
    assignment,
    assignment_ranges,
    fnv1a_32,
    member_filters,
    partition_of,
)
from cgroupd.core.records import elastic_from_json, static_from_json
from cgroupd.nats.groupstreams import transforms, whole_subject_problem
from cgroupd.views import group_data, group_text

FIXTURES = Path(__file__).parent.parent / "fixtures" / "reference-records"
INDEX = json.loads((FIXTURES / "index.json").read_text())["records"]


def _decode(entry: dict[str, Any], raw: bytes) -> GroupConfig:
    return (static_from_json(raw) if entry["bucket"] == "static" else elastic_from_json(raw))


@pytest.fixture(params=INDEX, ids=[e["record"].removesuffix(".record") for e in INDEX])
def entry(request: pytest.FixtureRequest) -> dict[str, Any]:
    out = dict(request.param)
    out["raw"] = (FIXTURES / out["record"]).read_bytes()
    return out


def test_every_fixture_names_its_source() -> None:
    """Each fixture says which repository, version and writer it comes from."""
    assert len(INDEX) >= 12
    for e in INDEX:
        assert {"repo", "version", "file"} <= set(e["source"]), e
        assert e["written_by"] and (FIXTURES / e["record"]).is_file()


def test_reads_what_the_writer_meant(entry: dict[str, Any]) -> None:
    """Partitions, filters (none: whole subject), members as the writer meant them."""
    config = _decode(entry, entry["raw"])
    want = entry["expect"]
    assert config.max_members == want["partitions"]
    assert list(config.members) == want["members"]
    if isinstance(config, ElasticGroupConfig):
        assert config.whole_subject is want["whole_subject"]
        assert [[pf.filter, list(pf.partitioning_wildcards)]
                for pf in config.partitioning_filters] == want["filters"]
    else:
        assert list(config.filters) == want["filters"]


def test_written_back_byte_for_byte(entry: dict[str, Any]) -> None:
    """Unchanged, a record is written back exactly as its writer wrote it: ``null`` stays
    ``null``, ``[]`` stays ``[]``, a missing list stays missing, limits (-1, 0) as they
    were, unknown fields kept, key order, separators and escapes (Go's ``\\u003e``,
    .NET's ``\\u003E``, Python's ``", "``) kept."""
    assert _decode(entry, entry["raw"]).to_json() == entry["raw"]


def _style(raw: bytes) -> tuple[str, str]:
    return (", ", ": ") if b'", "' in raw or b'": ' in raw else (",", ":")


def test_member_change_changes_only_the_members(entry: dict[str, Any]) -> None:
    """Adding a member rewrites only the member list: every other byte is the writer's
    (the reference's members compare the fixed settings with reflect.DeepEqual and stop
    when ``null`` became ``[]`` or a limit changed spelling)."""
    raw = entry["raw"]
    config = _decode(entry, raw)
    if config.member_mappings:
        pytest.skip("a mapped group changes through its mappings")
    new = config.with_members([*config.members, "z"]).to_json()
    item, key = _style(raw)
    added = item.join(json.dumps(m) for m in [*config.members, "z"])
    if config.members:
        old = item.join(json.dumps(m) for m in config.members)
        expected = raw.replace(f"[{old}]".encode(), f"[{added}]".encode())
    else:
        expected = raw[:-1] + f'{item}"members"{key}[{added}]}}'.encode()
    assert new == expected
    # And the reference reads the same fixed settings back.
    again = _decode(entry, new)
    assert again == config.with_members([*config.members, "z"])
    assert again.to_json() == new


def test_null_wildcards_stay_null_through_changes() -> None:
    """``"partitioning_wildcards":null`` (a Go nil slice) is not turned into ``[]``."""
    raw = (b'{"max_members":2,"partitioning_filters":[{"filter":"o.*",'
           b'"partitioning_wildcards":null}]}')
    out = elastic_from_json(raw).with_members(["a"]).to_json()
    assert out == (b'{"max_members":2,"partitioning_filters":[{"filter":"o.*",'
                   b'"partitioning_wildcards":null}],"members":["a"]}')


def test_a_new_whole_subject_record_is_written_as_go_cli_writes_it() -> None:
    """cgroupd's own whole-subject group: ``partitioning_filters`` ``null``, no limits,
    as ``cg elastic create`` without a filter writes it (so a re-create by the Go CLI
    finds an identical record)."""
    config = ElasticGroupConfig(max_members=10)
    assert config.to_json() == b'{"max_members":10,"partitioning_filters":null}'
    assert elastic_from_json(config.to_json()) == config
    assert ElasticGroupConfig(max_members=2, members=("a",),
                              partitioning_filters=(PartitioningFilter("o.*", (1,)),)
                              ).to_json() == (
        b'{"max_members":2,"partitioning_filters":[{"filter":"o.*",'
        b'"partitioning_wildcards":[1]}],"members":["a"]}')
    assert StaticGroupConfig(max_members=2, members=("a",)).to_json() == \
        b'{"max_members":2,"members":["a"]}'


def test_the_three_filterless_shapes_are_one_group() -> None:
    """null, [] and a missing list are the same whole-subject group (a create by one
    writer finds the other's record identical)."""
    shapes = [b'{"max_members":3,"partitioning_filters":null}',
              b'{"max_members":3,"partitioning_filters":[]}', b'{"max_members":3}']
    configs = [elastic_from_json(s) for s in shapes]
    assert configs[0] == configs[1] == configs[2] == ElasticGroupConfig(max_members=3)
    assert [c.to_json() for c in configs] == shapes


def test_whole_subject_stream_is_spelled_as_the_reference() -> None:
    """The work-queue stream of a whole-subject group sources ``>`` into
    ``{{Partition(N)}}.>``, as orbit.go's CreateElastic (getPartitioningTransformDest of
    the filter ``>`` with no wildcards) does."""
    config = elastic_from_json(b'{"max_members":10,"partitioning_filters":null}')
    assert [(t.src, t.dest) for t in transforms(config)] == [(">", "{{Partition(10)}}.>")]
    assert member_filters(config.with_members(["a", "b"]), "b") == [
        f"{p}.>" for p in range(5, 10)]


def test_whole_subject_partition_is_fnv1a_of_the_subject() -> None:
    """nats-server's shorthand partition(N) hashes the subject's tokens joined with '.'
    (subject_transform.go: strings.Join(tokens, ".")): the subject itself."""
    config = ElasticGroupConfig(max_members=7)
    for subject in ("a", "orders.1", "x.y.z.w", "ünï.cödé"):
        assert partition_of(subject, config.effective_filters, 7) == \
            fnv1a_32(subject.encode()) % 7
    # FNV-1a 32 test vectors: the empty input and "a".
    assert fnv1a_32(b"") == 0x811C9DC5 and fnv1a_32(b"a") == 0xE40C292C


def test_older_servers_are_refused_clearly_for_whole_subject() -> None:
    """A whole-subject group on nats-server < 2.12 is refused, naming the version; with
    filters, or on 2.12+, or when the version is unknown, nothing is said."""
    whole = ElasticGroupConfig(max_members=2)
    problem = whole_subject_problem(whole, (2, 11, 9))
    assert problem is not None and "2.12" in problem and "2.11.9" in problem
    assert whole_subject_problem(whole, (2, 12, 0)) is None
    assert whole_subject_problem(whole, None) is None
    filtered = ElasticGroupConfig(max_members=2,
                                  partitioning_filters=(PartitioningFilter("o.*", (1,)),))
    assert whole_subject_problem(filtered, (2, 10, 0)) is None


@pytest.mark.timeout(10)
def test_largest_reference_group_is_listed_and_shown_quickly() -> None:
    """A record with as many partitions as the reference can have (2**31-1) is read,
    changed and shown at once: the assignment is computed as ranges, not partition by
    partition."""
    raw = (FIXTURES / "go-large-max-members.record").read_bytes()
    started = time.monotonic()
    config = elastic_from_json(raw)
    assert config.max_members == MAX_PARTITIONS
    spans = assignment_ranges(config)
    per = MAX_PARTITIONS // 3
    assert spans == {"a": ((0, per - 1), (3 * per, 3 * per)), "b": ((per, 2 * per - 1),),
                     "c": ((2 * per, 3 * per - 1),)}
    data = group_data("S", "g", config)
    assert "assignment" not in data and data["assignment_ranges"]["b"] == [[per, 2 * per - 1]]
    assert "0-715827881,2147483646" in group_text("S", "g", config)
    config.with_members(["a", "b", "c", "d"]).to_json()
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 31])
def test_ranges_agree_with_the_partition_by_partition_assignment(n: int) -> None:
    """The range form is the ADR's algorithm: expanded, it is partition for partition
    what the loop over every partition gives."""
    for count in range(1, n + 3):
        members = [f"m{i}" for i in range(count)]
        config = ElasticGroupConfig(max_members=n, members=tuple(members))
        expanded = {m: tuple(p for a, b in spans for p in range(a, b + 1))
                    for m, spans in assignment_ranges(config).items()}
        owned = sorted(members)[:n]
        per = n // len(owned)
        brute: dict[str, list[int]] = {}
        for p in range(n):
            k = p // per if p < len(owned) * per else p - len(owned) * per
            brute.setdefault(owned[k], []).append(p)
        assert expanded == {m: tuple(ps) for m, ps in brute.items()} == assignment(config)


def test_spark_read_of_a_whole_subject_group_hashes_the_whole_subject() -> None:
    """Spark ``mode=read`` on a whole-subject group (partitions computed client side from
    the origin stream) uses the group's effective filter ``>``: every subject is read,
    in the partition the server's ``{{Partition(N)}}.>`` gives it, keyed by the subject.
    (It used to find no filter and read nothing.)"""
    from cgroupd.admin import StoredGroup
    from cgroupd.spark.layout import HASHED, Mode, resolve
    from cgroupd.spark.rows import RowBuilder

    config = elastic_from_json(b'{"max_members":5,"partitioning_filters":null,'
                               b'"members":["a","b"]}')
    layout = resolve("S", StoredGroup("S", "g", config, 1), Mode.READ, None, ">")
    assert layout.kind == HASHED and layout.count == 5
    rows = RowBuilder(layout)
    for subject in ("orders.1", "a", "x.y.z", "ключ.7"):
        described = rows._describe(subject.encode())
        assert described == (fnv1a_32(subject.encode()) % 5, subject, subject)


def test_views_of_whole_subject_groups_and_unreadable_records() -> None:
    """``group info`` says a whole-subject group partitions every subject; ``group ls``
    marks an unreadable record in its row and keeps the others."""
    from cgroupd.views import groups_text

    config = elastic_from_json(b'{"max_members":4,"partitioning_filters":null,'
                               b'"members":["a"]}')
    text = group_text("S", "g", config)
    assert "none: every subject, hashed whole" in text and "a       0-3" in text
    data = group_data("S", "g", config)
    assert data["whole_subject"] is True and data["filters"] == []
    rows = [data, {"stream": "S", "group": "bad", "type": "elastic", "error": "not JSON"}]
    listed = groups_text("S", rows).splitlines()
    assert listed[1].split()[:4] == ["g", "elastic", "4", "a"]
    assert listed[2].split()[:3] == ["bad", "elastic", "?"] and "UNREADABLE: not JSON" in \
        listed[2]
