"""The rows the Spark source emits, built as Arrow record batches from raw replies.

One row per message:

==================  ==========================================  =========================
column              Spark type                                  value
==================  ==========================================  =========================
partition           int                                         group partition (0: plain)
stream_sequence     bigint                                      sequence in the stream read
origin_sequence     bigint                                      sequence in the origin
                                                                stream (``workqueue``: from
                                                                ``Nats-Stream-Source``)
subject             string                                      subject as published
key                 string                                      partitioning key
data                binary                                      payload
timestamp           timestamp                                   when the stream stored it
headers             array<struct<key:string,value:binary>>      only with ``includeHeaders``:
                                                                the message's own headers in
                                                                order, repeats kept (Kafka's
                                                                shape)
==================  ==========================================  =========================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from cgroupd.core.partitions import partition_of, strip_partition
from cgroupd.nats import jsapi
from cgroupd.spark.directget import Item
from cgroupd.spark.layout import HASHED, PLAIN, Layout
from cgroupd.spark.offsets import KeyExtractor, subject_allowed

#: Spark DDL of the source's schema, without and with ``includeHeaders``.
SCHEMA_DDL = (
    "partition INT, stream_sequence BIGINT, origin_sequence BIGINT, subject STRING, "
    "key STRING, data BINARY, timestamp TIMESTAMP"
)
HEADERS_DDL = "headers ARRAY<STRUCT<key: STRING, value: BINARY>>"

HEADER_TYPE = pa.list_(pa.field("element", pa.struct([
    pa.field("key", pa.string()), pa.field("value", pa.binary())])))
#: The Arrow form of :data:`SCHEMA_DDL`, exactly as pyspark's ``to_arrow_schema`` gives it
#: (Spark rejects batches whose schema differs in any way; a test compares them).
ARROW_SCHEMA = pa.schema([
    pa.field("partition", pa.int32()),
    pa.field("stream_sequence", pa.int64()),
    pa.field("origin_sequence", pa.int64()),
    pa.field("subject", pa.string()),
    pa.field("key", pa.string()),
    pa.field("data", pa.binary()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
])
ARROW_SCHEMA_WITH_HEADERS = ARROW_SCHEMA.append(pa.field("headers", HEADER_TYPE))

_SOURCE_LINE = b"\r\nNats-Stream-Source: "
_STAMP = pa.timestamp("ns", tz="UTC")
_US = pa.timestamp("us", tz="UTC")
#: Subjects remembered per task (partition, subject, key): most streams repeat a few.
_CACHE_LIMIT = 200_000


class RowBuilder:
    """Turns direct-get items into record batches for one layout.

    ``bounds``: ``partition -> (start, end]`` of what this batch reads of each; a message
    outside (another partition, another group's subject, a sequence its partition has
    read already) is not a row.
    """

    def __init__(self, layout: Layout, *, include_headers: bool = False,
                 bounds: Mapping[int, tuple[int, int]] | None = None) -> None:
        self.layout = layout
        self.include_headers = include_headers
        self.schema = ARROW_SCHEMA_WITH_HEADERS if include_headers else ARROW_SCHEMA
        self._bounds = dict(bounds or {})
        self._key = KeyExtractor(layout.partitioning)
        self._patterns = layout.patterns
        self._sourced = layout.workqueue
        self._cache: dict[bytes, tuple[int, str, str | None] | None] = {}

    def _describe(self, raw: bytes) -> tuple[int, str, str | None] | None:
        """(partition, subject, key) of a stored subject; None when not this query's."""
        text = raw.decode("utf-8", "replace")
        layout = self.layout
        if layout.kind == PLAIN:
            if self._patterns and not subject_allowed(self._patterns, text):
                return None
            return 0, text, text
        if layout.kind == HASHED:
            p = partition_of(text, layout.partitioning, layout.count)
            if p is None:
                return None
            return p, text, self._key(text)
        head, subject = strip_partition(text)
        if head is None:
            return None
        if self._patterns and not subject_allowed(self._patterns, subject):
            return None
        return head, subject, self._key(subject)

    def build(self, items: Sequence[Item]) -> pa.RecordBatch | None:
        """Rows for ``items`` (in order); None when none of them is a row."""
        cache = self._cache
        bounds = self._bounds
        partitions: list[int] = []
        sequences: list[int] = []
        origins: list[int] = []
        subjects: list[str] = []
        keys: list[str | None] = []
        data: list[bytes] = []
        stamps: list[bytes] = []
        headers: list[list[tuple[str, bytes]]] = []
        for seq, raw, stamp, hdr, end, payload in items:
            try:
                info = cache[raw]
            except KeyError:
                info = self._describe(raw)
                if len(cache) < _CACHE_LIMIT:
                    cache[raw] = info
            if info is None:
                continue
            lo_hi = bounds.get(info[0])
            if lo_hi is None or not lo_hi[0] < seq <= lo_hi[1]:
                continue
            origin = seq
            own_end = end
            if self._sourced:
                line = hdr.rfind(_SOURCE_LINE, 0, end)
                if line >= 0 and hdr.find(b"\r\n", line + 2, end) < 0:
                    own_end = line
                    fields = hdr[line + len(_SOURCE_LINE):end].split(b" ", 2)
                    if len(fields) > 1 and fields[1].isdigit():
                        origin = int(fields[1])
            partitions.append(info[0])
            sequences.append(seq)
            origins.append(origin)
            subjects.append(info[1])
            keys.append(info[2])
            data.append(payload)
            stamps.append(stamp)
            if self.include_headers:
                headers.append(jsapi.own_headers(hdr, own_end))
        if not sequences:
            return None
        times = pa.array(stamps, pa.string()).cast(_STAMP).cast(_US, safe=False)
        columns = [
            pa.array(partitions, pa.int32()),
            pa.array(sequences, pa.int64()),
            pa.array(origins, pa.int64()),
            pa.array(subjects, pa.string()),
            pa.array(keys, pa.string()),
            pa.array(data, pa.binary()),
            times,
        ]
        if self.include_headers:
            columns.append(pa.array(
                [[{"key": k, "value": v} for k, v in h] for h in headers], HEADER_TYPE))
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)
