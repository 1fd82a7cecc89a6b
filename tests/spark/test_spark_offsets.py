"""The Spark integration's pure parts: offsets, starting/ending positions, planning,
keys, options, the direct-get reply rules, rows and the wire parser. No Spark session,
no server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

import itertools

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.pandas.types import to_arrow_schema

from cgroupd.core.config import ElasticGroupConfig, MemberMapping, PartitioningFilter
from cgroupd.core.errors import ConfigError
from cgroupd.nats import jsapi
from cgroupd.spark.layout import HASHED, PLAIN, PREFIXED, Layout, Mode
from cgroupd.spark.lease import UNOWNED_CONSUMER, Claim, claims_for
from cgroupd.spark.offsets import (
    KeyExtractor,
    Offset,
    ReadRange,
    parse_requested,
    plan_slices,
    resolve_end,
    resolve_start,
    split,
)
from cgroupd.spark.options import SinkOptions, SourceOptions, parse_duration
from cgroupd.spark.rows import ARROW_SCHEMA, ARROW_SCHEMA_WITH_HEADERS, RowBuilder
from cgroupd.spark.source import SCHEMA, SCHEMA_WITH_HEADERS
from cgroupd.spark.wire import FastParser


# -- offsets ------------------------------------------------------------------------------
def test_offset_text_is_stable_whatever_the_input_order() -> None:
    """Spark compares offsets as JSON text, so equal offsets must serialise equally."""
    a = Offset("S", "2026-01-01T00:00:00Z", 9, {10: 5, 2: 7, 0: 1})
    b = Offset("S", "2026-01-01T00:00:00Z", 9, {0: 1, 10: 5, 2: 7})
    assert json.dumps(a.to_json()) == json.dumps(b.to_json()) == (
        '{"stream": "S", "created": "2026-01-01T00:00:00Z", "position": 9, '
        '"partitions": {"0": 1, "2": 7, "10": 5}}')
    batch0 = Offset("S", "c", 9, {0: 9}, origin=Offset("S", "c", 3, {0: 3}))
    assert Offset.from_json(json.loads(json.dumps(batch0.to_json()))) == batch0


def test_offsets_without_identity_or_with_bad_values_are_refused() -> None:
    """A checkpoint from the old format (no stream identity) asks for a new checkpoint;
    bad partition keys and values are each named."""
    with pytest.raises(ConfigError, match="new checkpoint"):
        Offset.from_json({"0": 12, "1": 3})
    with pytest.raises(ConfigError) as err:
        Offset.from_json({"stream": "S", "partitions": {"x": 1, "2": -1, "3": True}})
    assert len(err.value.problems) == 3


def test_requested_offsets_have_kafkas_meaning() -> None:
    """JSON names every partition: a sequence is the first to read (start) or the first
    not to read (end); -2 earliest, -1 latest; Kafka's nested form is accepted."""
    parts = (0, 1, 2)
    req = parse_requested("startingOffsets", '{"0": 23, "1": -2, "2": -1}', "S", parts)
    assert resolve_start(req, parts, first_seq=5, last_seq=100) == {0: 22, 1: 4, 2: 100}
    nested = parse_requested("startingOffsets", '{"S": {"0": 1, "1": 0, "2": 7}}', "S",
                             parts)
    assert resolve_start(nested, parts, 1, 9) == {0: 0, 1: 0, 2: 6}
    assert resolve_start(parse_requested("s", " Earliest ", "S", parts), parts, 5, 9) == {
        0: 4, 1: 4, 2: 4}
    assert resolve_start(parse_requested("s", "latest", "S", parts), parts, 5, 9) == {
        0: 9, 1: 9, 2: 9}
    end = parse_requested("endingOffsets", '{"0": 50, "1": -1, "2": 1}', "S", parts,
                          ending=True)
    assert resolve_end(end, parts, {0: 99, 1: 99, 2: 99}) == {0: 49, 1: 99, 2: 0}
    for bad, match in (('{"0": 1}', "every partition"), ('{"7": 1}', "does not read"),
                       ('{"0": -3, "1": 1, "2": 1}', "one of"), ("yesterday", "JSON"),
                       ("[1]", "JSON object")):
        with pytest.raises(ConfigError, match=match):
            parse_requested("startingOffsets", bad, "S", parts)
    with pytest.raises(ConfigError, match="cannot be 'earliest'"):
        parse_requested("endingOffsets", "earliest", "S", parts, ending=True)
    with pytest.raises(ConfigError, match="one of"):
        parse_requested("endingOffsets", '{"0": -2, "1": 1, "2": 1}', "S", parts,
                        ending=True)


@given(st.dictionaries(st.integers(0, 9), st.tuples(st.integers(0, 50_000),
                                                     st.integers(0, 50_000)), min_size=1),
       st.integers(1, 12))
def test_slices_cover_the_run_once_and_are_a_function_of_the_offsets(
        bounds: dict[int, tuple[int, int]], tasks: int) -> None:
    """The slices of a batch tile the run from the lowest start to the highest end,
    without gaps or overlaps; the same offsets always give the same slices."""
    start = {p: min(a, b) for p, (a, b) in bounds.items()}
    end = {p: max(a, b) for p, (a, b) in bounds.items()}
    slices = plan_slices(">", start, end, tasks=tasks)
    assert slices == plan_slices(">", dict(reversed(start.items())), end, tasks=tasks)
    lo, hi = min(start.values()), max(end.values())
    if hi == lo:
        assert slices == []
        return
    assert slices[0].start == lo and slices[-1].end == hi
    assert all(a.end == b.start for a, b in itertools.pairwise(slices))
    assert len(slices) <= tasks and all(s.end > s.start for s in slices)


def test_split_cuts_by_sequence() -> None:
    assert split(ReadRange(">", 10, 20), 3) == [
        ReadRange(">", 10, 13), ReadRange(">", 13, 16), ReadRange(">", 16, 20)]
    assert split(ReadRange(">", 10, 12), 5) == [ReadRange(">", 10, 11), ReadRange(">", 11, 12)]


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
    assert KeyExtractor([])("any.subject") == "any.subject"


# -- options --------------------------------------------------------------------------------
def test_source_options_parse_and_report_every_problem() -> None:
    """Options are case-insensitive; every problem is reported at once."""
    opts = SourceOptions.parse({"servers": "nats://a:4222, nats://b:4222", "stream": "S",
                                "group": "g", "MAXMESSAGESPERTRIGGER": "10",
                                "member": "m1", "minPartitions": "3",
                                "maxTriggerDelay": "2m", "includeHeaders": "TRUE"})
    assert opts.connection.servers == ("nats://a:4222", "nats://b:4222")
    assert (opts.max_offsets_per_trigger, opts.member, opts.min_partitions) == (10, "m1", 3)
    assert opts.max_trigger_delay == 120 and opts.include_headers and opts.mode is Mode.READ
    assert opts.fail_on_data_loss
    with pytest.raises(ConfigError) as err:
        SourceOptions.parse({"stream": "a.b", "maxOffsetsPerTrigger": "0", "token": "t",
                             "user": "u", "leaseWaitTimeout": "soon", "mode": "consume",
                             "failOnDataLoss": "maybe", "member": "m"})
    text = str(err.value)
    for part in ("must not contain .", "at least 1", "one of creds, token",
                 "leaseWaitTimeout", "'read' or 'workqueue'", "true or false",
                 "'member' needs the 'group'"):
        assert part in text, part
    with pytest.raises(ConfigError, match="'stream' is required"):
        SourceOptions.parse({})


def test_unknown_options_are_refused_naming_the_close_match() -> None:
    """A misspelt or Kafka-only option is an error, not silently ignored (an unknown
    maxOffsetsPerTrigger used to read without any limit)."""
    cases = {"maxOffsetPerTrigger": "maxOffsetsPerTrigger",
             "startingOffset": "startingOffsets", "failondataloss2": "failOnDataLoss",
             "kafka.bootstrap.servers": "servers", "subscribe": "stream",
             "includeHeader": "includeHeaders", "partitionsPerTask": "minPartitions"}
    for given_name, suggestion in cases.items():
        with pytest.raises(ConfigError) as err:
            SourceOptions.parse({"stream": "S", given_name: "1"})
        assert f"unknown source option {given_name!r}; did you mean {suggestion!r}?" in str(
            err.value)
    with pytest.raises(ConfigError, match="unknown sink option 'idprefx'; did you mean "
                                          "'idPrefix'"):
        SinkOptions.parse({"idprefx": "a"})
    with pytest.raises(ConfigError, match="unknown source option 'zzz' \\(known"):
        SourceOptions.parse({"stream": "S", "zzz": "1"})


def test_workqueue_mode_starts_where_the_queue_starts() -> None:
    """In a work queue a later start would leave messages for the next commit to purge
    unread: refused, as is a work queue without a group."""
    base = {"stream": "S", "group": "g", "mode": "workqueue"}
    assert SourceOptions.parse(base).mode is Mode.WORKQUEUE
    for extra in ({"startingOffsets": "latest"}, {"startingTimestamp": "1"},
                  {"startingOffsets": '{"0": 5}'}):
        with pytest.raises(ConfigError, match="purge them first"):
            SourceOptions.parse({**base, **extra})
    with pytest.raises(ConfigError, match="give the 'group' option"):
        SourceOptions.parse({"stream": "S", "mode": "workqueue"})


def test_durations_in_kafkas_format() -> None:
    problems: list[str] = []
    assert parse_duration("d", "15m", problems) == 900
    assert parse_duration("d", "500ms", problems) == 0.5
    assert parse_duration("d", "250", problems) == 0.25  # a bare number is milliseconds
    assert parse_duration("d", "2 minutes", problems) == 120
    assert parse_duration("d", "1h", problems) == 3600 and not problems
    assert parse_duration("d", "soon", problems) is None and problems


def test_sink_options() -> None:
    """A wildcard subject cannot be published to; the trigger interval is read."""
    opts = SinkOptions.parse({"subject": "out.x", "idPrefix": "job",
                              "triggerInterval": "5 minutes", "checkpointLocation": "/x"})
    assert opts.id_prefix == "job" and opts.trigger_interval == 300
    assert SinkOptions.parse({"triggerInterval": "30"}).trigger_interval == 30
    with pytest.raises(ConfigError, match="not a valid publish subject"):
        SinkOptions.parse({"subject": "out.*"})


# -- direct-get replies ------------------------------------------------------------------------
def _server_reply(own: bytes | None, subject: bytes, seq: int, stream: bytes = b"S",
                  batch: bool = True) -> bytes:
    """A direct-get reply as nats-server builds it: the stored header block (or a bare
    NATS/1.0 line) with the trailer appended (genHeader)."""
    block = own[:-2] if own else b"NATS/1.0\r\n"
    trailer = (b"Nats-Stream: " + stream + b"\r\nNats-Subject: " + subject +
               b"\r\nNats-Sequence: %d\r\nNats-Time-Stamp: 2026-11-21T18:27:26.238657582Z\r\n"
               % seq)
    if batch:
        trailer += b"Nats-Num-Pending: 3\r\nNats-Last-Sequence: 0\r\n"
    return block + trailer + b"\r\n"


_HEADER_NAME = st.sampled_from(["Status", "Description", "Nats-Sequence", "Nats-Subject",
                                "Nats-Stream", "Nats-Time-Stamp", "Nats-Num-Pending",
                                "Nats-Last-Sequence", "Nats-Pin-Id", "X", "a b"])
_HEADER_VALUE = st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b)


@given(st.lists(st.tuples(_HEADER_NAME, _HEADER_VALUE), max_size=8),
       st.sampled_from([b"NATS/1.0\r\n", b"NATS/1.0 404 No Messages\r\n",
                        b"NATS/1.0 204 EOB\r\n", b"NATS/1.0 503\r\n"]),
       st.integers(1, 10**12), st.booleans())
def test_a_message_is_told_from_a_status_by_the_servers_trailer(
        headers: list[tuple[str, bytes]], first: bytes, seq: int, batch: bool) -> None:
    """Whatever headers a publisher gave a message (a status line, Status,
    Nats-Sequence, even a whole fake trailer), the reply carrying it is a message with
    the server's sequence and subject; the message's own headers come back as sent."""
    own = first + b"".join(k.encode() + b": " + v + b"\r\n" for k, v in headers) + b"\r\n"
    reply = _server_reply(own, b"orders.k1", seq, batch=batch)
    found = jsapi.direct_message(reply, b"S", batch)
    assert found is not None
    end, subject, got_seq, stamp, _ = found
    assert (subject, got_seq, stamp) == (b"orders.k1", seq, b"2026-11-21T18:27:26.238657582Z")
    # As sent, less the spaces around a value (ASCII only: the bytes are kept).
    assert jsapi.own_headers(reply, end) == [(k, v.strip()) for k, v in headers]


def test_server_statuses_are_statuses() -> None:
    """What the server sends instead of a message has no trailer (checked against
    nats-server 2.15.1: see cgroupd.nats.jsapi)."""
    for reply, code in ((b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 0\r\n"
                         b"Nats-Last-Sequence: 2\r\n\r\n", "204"),
                        (b"NATS/1.0 404 Message Not Found\r\n\r\n", "404"),
                        (b"NATS/1.0 408 Empty Request\r\n\r\n", "408"),
                        (b"NATS/1.0 503\r\nNats-Subject: $JS.API.DIRECT.GET.S\r\n\r\n", "503")):
        assert jsapi.direct_message(reply, b"S") is None
        assert jsapi.direct_status(reply)[0] == code
    assert jsapi.direct_status(b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 7\r\n\r\n")[2] == {
        "Nats-Num-Pending": "7"}
    # Another stream's reply, or a truncated trailer, is not a message of this stream.
    assert jsapi.direct_message(_server_reply(None, b"a", 1, b"T"), b"S") is None
    assert jsapi.direct_message(_server_reply(None, b"a", 1), b"S", batch=False) is None
    assert jsapi.direct_message(_server_reply(None, b"a", 1, batch=False), b"S",
                                batch=False) is not None


# -- rows -----------------------------------------------------------------------------------
def test_arrow_schemas_are_what_spark_expects() -> None:
    """Spark rejects record batches whose schema differs from its own conversion."""
    assert to_arrow_schema(SCHEMA, timezone="UTC").equals(ARROW_SCHEMA)
    assert to_arrow_schema(SCHEMA_WITH_HEADERS, timezone="UTC").equals(
        ARROW_SCHEMA_WITH_HEADERS)


def _item(subject: bytes, seq: int, data: bytes, own: bytes | None = None,
          stream: bytes = b"S") -> tuple[int, bytes, bytes, bytes, int, bytes]:
    reply = _server_reply(own, subject, seq, stream)
    found = jsapi.direct_message(reply, stream)
    assert found is not None
    return seq, subject, found[3], reply, found[0], data


def test_rows_of_a_work_queue() -> None:
    """Rows strip the partition token, keep only the partitions' (start, end], take the
    origin sequence from Nats-Stream-Source and drop that header, keep the others in
    order, and carry the time to the microsecond."""
    layout = Layout("S-g", "S", "g", Mode.WORKQUEUE, PREFIXED, (0, 1, 2), 3,
                    partitioning=(PartitioningFilter("sensors.*.*", (1,)),))
    rows = RowBuilder(layout, include_headers=True, bounds={2: (10, 20), 0: (0, 99)})
    source = b"Nats-Stream-Source: S 77 sensors.* {{Partition(3,1)}} sensors.7.t ab\r\n"
    batch = rows.build([
        _item(b"2.sensors.7.temp", 11, b"a", b"NATS/1.0\r\nunit: C\r\nunit: K\r\n" + source
              + b"\r\n"),
        _item(b"2.sensors.9.temp", 25, b"late"),  # beyond partition 2's end
        _item(b"1.sensors.8.temp", 12, b"no bounds for 1"),
        _item(b"0.sensors.5.temp", 13, b"", b"NATS/1.0\r\n" + source + b"\r\n"),
        _item(b"x.not.partitioned", 14, b""),
    ])
    assert batch is not None and batch.schema.equals(ARROW_SCHEMA_WITH_HEADERS)
    got = batch.to_pylist()
    assert [r["subject"] for r in got] == ["sensors.7.temp", "sensors.5.temp"]
    assert [r["key"] for r in got] == ["7", "5"]
    assert [(r["partition"], r["stream_sequence"], r["origin_sequence"]) for r in got] == [
        (2, 11, 77), (0, 13, 77)]
    assert got[0]["headers"] == [{"key": "unit", "value": b"C"},
                                 {"key": "unit", "value": b"K"}]
    assert got[1]["headers"] == []
    assert got[0]["timestamp"].microsecond == 238657
    assert isinstance(batch.column(6), pa.TimestampArray)
    assert rows.build([_item(b"2.sensors.9.temp", 25, b"late")]) is None


def test_rows_of_an_origin_stream_hash_each_message() -> None:
    """Read mode: the partition is computed (the server's partition function), messages
    no filter matches are not the group's."""
    from cgroupd.core.partitions import partition_of

    filters = (PartitioningFilter("orders.*", (1,)),)
    layout = Layout("S", "S", "g", Mode.READ, HASHED, (0, 1, 2, 3), 4, partitioning=filters)
    rows = RowBuilder(layout, bounds={p: (0, 100) for p in range(4)})
    items = [_item(f"orders.k{i}".encode(), i + 1, b"") for i in range(20)]
    items.append(_item(b"invoices.k1", 30, b""))
    got = rows.build(items)
    assert got is not None
    assert [(r["subject"], r["partition"]) for r in got.to_pylist()] == [
        (f"orders.k{i}", partition_of(f"orders.k{i}", filters, 4)) for i in range(20)]
    assert got.schema.equals(ARROW_SCHEMA)
    plain = RowBuilder(Layout("S", "S", None, Mode.READ, PLAIN, (0,), 1, subject="orders.>"),
                       bounds={0: (0, 100)}).build(items)
    assert plain is not None and plain.num_rows == 20


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


# -- the wire parser ----------------------------------------------------------------------------
class _Recorder:
    """Stands in for the client: records what the parser hands over."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           hdr: bytes | None) -> None:
        self.calls.append(("msg", sid, subject, reply, hdr, data))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_err(self, err: str) -> None:
        self.calls.append(("err", err))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.calls.append(("info", info))


_STREAM = (b"INFO {\"server_id\":\"x\"}\r\nPING\r\n+OK\r\n"
           b"MSG a.b 1 5\r\nhello\r\nMSG a.b 1 reply.to 0\r\n\r\n"
           b"HMSG _R.1 2 18 21\r\nNATS/1.0\r\nA: b\r\n\r\nxyz\r\n"
           b"HMSG _R.2 2 re.ply 12 12\r\nNATS/1.0\r\n\r\n\r\n"
           b"PONG\r\n-ERR 'Stale Connection'\r\nMSG big 1 3\r\n\r\n\r\r\n")


@given(st.lists(st.integers(1, len(_STREAM) - 1), max_size=8, unique=True))
def test_wire_parser_gives_the_same_result_however_reads_are_split(cuts: list[int]) -> None:
    """The protocol arrives in arbitrary chunks; raw subscriptions get (subject, header
    block, payload), others go to nats-py as before, control lines to their handlers."""
    nc = _Recorder()
    parser = FastParser(nc)
    raw: list[tuple[bytes, bytes | None, bytes]] = []
    parser.raw[2] = lambda subject, hdr, data: raw.append((subject, hdr, data))
    edges = [0, *sorted(cuts), len(_STREAM)]

    async def feed() -> None:
        for a, b in itertools.pairwise(edges):
            await parser.parse(_STREAM[a:b])

    asyncio.run(feed())
    assert raw == [(b"_R.1", b"NATS/1.0\r\nA: b\r\n\r\n", b"xyz"),
                   (b"_R.2", b"NATS/1.0\r\n\r\n", b"")]
    assert nc.calls == [("info", {"server_id": "x"}), ("ping",),
                        ("msg", 1, b"a.b", b"", None, b"hello"),
                        ("msg", 1, b"a.b", b"reply.to", None, b""), ("pong",),
                        ("err", "'stale connection'"),
                        ("msg", 1, b"big", b"", None, b"\r\n\r")]
    assert parser.buf == bytearray()
