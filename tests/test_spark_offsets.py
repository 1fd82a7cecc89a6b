"""The Spark integration's pure parts: offsets, planning, rate shares, keys, options,
rows and the header parser. No Spark session, no server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from pyspark.sql.pandas.types import to_arrow_schema

from cgroupd.config import ElasticGroupConfig, MemberMapping, PartitioningFilter
from cgroupd.errors import ConfigError
from cgroupd.spark.directget import _fast_header_lines
from cgroupd.spark.lease import UNOWNED_CONSUMER, Claim, claims_for
from cgroupd.spark.offsets import (
    KeyExtractor,
    Range,
    allocate,
    decode,
    encode,
    parse_starting_offsets,
    plan,
)
from cgroupd.spark.options import SinkOptions, SourceOptions
from cgroupd.spark.rows import ARROW_SCHEMA, record_batch
from cgroupd.spark.source import SCHEMA


def test_encode_orders_keys_by_partition_whatever_the_input_order() -> None:
    """Spark compares offsets as JSON text, so equal offsets must serialise equally."""
    a = json.dumps(encode({10: 5, 2: 7, 0: 1}))
    b = json.dumps(encode({0: 1, 10: 5, 2: 7}))
    assert a == b == '{"0": 1, "2": 7, "10": 5}'


def test_decode_round_trips_and_rejects_bad_offsets() -> None:
    """Offsets come back as ints; a bad key or value is a ConfigError listing each."""
    assert decode(encode({3: 9, 1: 0})) == {1: 0, 3: 9}
    assert decode(None) == {}
    with pytest.raises(ConfigError) as err:
        decode({"x": 1, "2": -1, "3": True})
    assert len(err.value.problems) == 3


def test_starting_offsets_forms() -> None:
    """earliest/latest pass through; JSON fills missing partitions with 0 and refuses
    partitions the query does not read."""
    assert parse_starting_offsets("Earliest", (0, 1)) == "earliest"
    assert parse_starting_offsets(" latest ", (0, 1)) == "latest"
    assert parse_starting_offsets('{"1": 42}', (0, 1)) == {0: 0, 1: 42}
    with pytest.raises(ConfigError, match="does not read"):
        parse_starting_offsets('{"5": 1}', (0, 1))
    with pytest.raises(ConfigError, match="earliest"):
        parse_starting_offsets("yesterday", (0, 1))


def test_plan_groups_non_empty_ranges_in_partition_order() -> None:
    """Empty ranges make no task; tasks hold per_task partitions; same input, same plan."""
    start = {0: 10, 1: 5, 2: 7, 3: 0}
    end = {3: 4, 0: 20, 1: 5, 2: 9}
    tasks = plan(start, end, 2)
    assert tasks == [[Range(0, 10, 20), Range(2, 7, 9)], [Range(3, 0, 4)]]
    assert plan(start, end, 2) == tasks
    assert plan(start, end, 1) == [[Range(0, 10, 20)], [Range(2, 7, 9)], [Range(3, 0, 4)]]
    assert plan({0: 3}, {0: 3}, 1) == []


@given(st.dictionaries(st.integers(0, 20), st.integers(0, 10_000), max_size=12),
       st.integers(0, 5000))
def test_allocate_never_exceeds_limit_nor_backlog(available: dict[int, int],
                                                   limit: int) -> None:
    """Shares sum to min(limit, total) and no partition gets more than it has."""
    shares = allocate(available, limit)
    assert set(shares) == set(available)
    assert sum(shares.values()) == min(limit, sum(available.values()))
    assert all(0 <= shares[p] <= available[p] for p in available)


def test_allocate_is_proportional() -> None:
    """A partition with three times the backlog gets three times the share."""
    assert allocate({0: 300, 1: 100}, 100) == {0: 75, 1: 25}
    assert allocate({0: 1, 1: 1, 2: 1}, 2) == {0: 1, 1: 1, 2: 0}


def test_key_is_the_partitioning_tokens() -> None:
    """The key is what the server hashed: chosen wildcards, or the whole subject."""
    key = KeyExtractor([PartitioningFilter("sensors.*.*", (1,)),
                        PartitioningFilter("orders.*.*.>", (2, 1)),
                        PartitioningFilter("logs.>")])
    assert key("sensors.42.reading") == "42"
    assert key("orders.eu.7.created.v1") == "7.eu"
    assert key("logs.app.error") == "logs.app.error"
    assert key("other.subject") is None
    assert key("orders.eu.7") is None  # '>' needs at least one more token


def test_arrow_schema_is_what_spark_expects() -> None:
    """Spark rejects record batches whose schema differs from its own conversion."""
    assert to_arrow_schema(SCHEMA, timezone="UTC").equals(ARROW_SCHEMA)


def _reply(subject: str, seq: int, data: bytes, extra: dict[str, str]) -> Msg:
    headers = {"Nats-Stream": "S-g", "Nats-Subject": subject, "Nats-Sequence": str(seq),
               "Nats-Time-Stamp": "2026-11-21T18:27:26.238657582Z",
               "Nats-Num-Pending": "0", "Nats-Last-Sequence": "0", **extra}
    return Msg(_client=None, subject="_INBOX.x", data=data, headers=headers)  # type: ignore[arg-type]


def test_record_batch_rows() -> None:
    """Rows strip the partition token, keep the message's own headers only, and carry
    the timestamp to the microsecond."""
    key = KeyExtractor([PartitioningFilter("sensors.*.*", (1,))])
    batch = record_batch(2, [_reply("2.sensors.7.temp", 11, b"a", {"unit": "C"}),
                             _reply("2.sensors.9.temp", 15, b"b", {})], key)
    assert batch.schema.equals(ARROW_SCHEMA)
    rows = batch.to_pylist()
    assert [r["subject"] for r in rows] == ["sensors.7.temp", "sensors.9.temp"]
    assert [r["key"] for r in rows] == ["7", "9"]
    assert [r["stream_sequence"] for r in rows] == [11, 15]
    assert rows[0]["partition"] == 2 and rows[0]["data"] == b"a"
    assert rows[0]["headers"] == [("unit", "C")] and rows[1]["headers"] == []
    assert rows[0]["timestamp"].microsecond == 238657
    assert isinstance(batch.column(6), pa.TimestampArray)


@given(st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=12)), max_size=6))
def test_fast_header_parser_matches_nats_py(pairs: list[tuple[bytes, bytes]]) -> None:
    """The reader's header parser gives nats-py's answer for any header block."""
    raw = b"".join(k + b":" + v + b"\r\n" for k, v in pairs
                   if b"\r\n" not in k + v and b":" not in k)
    assert _fast_header_lines(raw) == Client._parse_header_lines(raw)


def test_source_options_parse_and_report_every_problem() -> None:
    """Options are case-insensitive; every problem is reported at once."""
    opts = SourceOptions.parse({"servers": "nats://a:4222, nats://b:4222", "stream": "S",
                                "group": "g", "MAXMESSAGESPERTRIGGER": "10",
                                "member": "m1", "partitionsPerTask": "2"})
    assert opts.connection.servers == ("nats://a:4222", "nats://b:4222")
    assert (opts.max_messages_per_trigger, opts.member, opts.partitions_per_task) == (
        10, "m1", 2)
    with pytest.raises(ConfigError) as err:
        SourceOptions.parse({"stream": "a.b", "maxMessagesPerTrigger": "0",
                             "token": "t", "user": "u", "leaseWaitTimeout": "soon"})
    text = str(err.value)
    for part in ("'group' is required", "must not contain .", "at least 1",
                 "one of creds, token", "leasewaittimeout"):
        assert part in text


def test_sink_options() -> None:
    """A wildcard subject cannot be published to."""
    assert SinkOptions.parse({"subject": "out.x", "idPrefix": "job"}).id_prefix == "job"
    with pytest.raises(ConfigError, match="not a valid publish subject"):
        SinkOptions.parse({"subject": "out.*"})


def test_claims_cover_members_and_unowned_partitions() -> None:
    """One claim per owning member with all its partitions; unowned ones together."""
    config = ElasticGroupConfig(max_members=6, members=("m1", "m2"),
                                partitioning_filters=(PartitioningFilter("s.*", (1,)),))
    assert claims_for(config, range(6)) == [Claim("m1", "m1", (0, 1, 2)),
                                            Claim("m2", "m2", (3, 4, 5))]
    assert claims_for(config, (3, 4, 5)) == [Claim("m2", "m2", (3, 4, 5))]
    mapped = config.with_mappings([MemberMapping("m1", (0, 1, 2, 3, 4, 5))])
    assert claims_for(mapped, (0,)) == [Claim("m1", "m1", (0, 1, 2, 3, 4, 5))]
    empty = config.with_members([])
    assert claims_for(empty, range(6)) == [Claim(UNOWNED_CONSUMER, None, tuple(range(6)))]
