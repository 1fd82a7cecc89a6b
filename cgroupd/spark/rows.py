"""The rows the Spark source emits, built as Arrow record batches.

One row per message of the group's work-queue stream:

==================  ==================  ===============================================
column              Spark type          value
==================  ==================  ===============================================
partition           int                 group partition (first subject token)
stream_sequence     bigint              sequence in the group's work-queue stream
subject             string              original subject (partition token stripped)
key                 string              partitioning key (see ``KeyExtractor``)
data                binary              payload
headers             map<string,string>  the message's headers (direct-get ones removed)
timestamp           timestamp           when the message entered the group's stream
==================  ==================  ===============================================
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from nats.aio.msg import Msg

from cgroupd.partitions import strip_partition
from cgroupd.spark.directget import REPLY_HEADERS, SEQUENCE, SUBJECT, TIMESTAMP
from cgroupd.spark.offsets import KeyExtractor

#: Spark DDL of the source's schema.
SCHEMA_DDL = (
    "partition INT, stream_sequence BIGINT, subject STRING, key STRING, data BINARY, "
    "headers MAP<STRING, STRING>, timestamp TIMESTAMP"
)

HEADERS_TYPE = pa.map_(pa.string(), pa.string())
#: The Arrow form of :data:`SCHEMA_DDL`, exactly as pyspark's ``to_arrow_schema`` gives it
#: (Spark rejects batches whose schema differs in any way).
ARROW_SCHEMA = pa.schema([
    pa.field("partition", pa.int32()),
    pa.field("stream_sequence", pa.int64()),
    pa.field("subject", pa.string()),
    pa.field("key", pa.string()),
    pa.field("data", pa.binary()),
    pa.field("headers", HEADERS_TYPE),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
])


def sequence_of(msg: Msg) -> int:
    return int((msg.headers or {})[SEQUENCE])


def record_batch(partition: int, msgs: Sequence[Msg], key: KeyExtractor) -> pa.RecordBatch:
    """Rows for ``msgs`` (direct-get replies of one partition, in order)."""
    sequences = []
    subjects = []
    keys = []
    data = []
    headers = []
    stamps = []
    for msg in msgs:
        h = msg.headers or {}
        sequences.append(int(h[SEQUENCE]))
        _, subject = strip_partition(h[SUBJECT])
        subjects.append(subject)
        keys.append(key(subject))
        data.append(msg.data)
        headers.append([(k, v) for k, v in h.items() if k not in REPLY_HEADERS])
        stamps.append(h.get(TIMESTAMP))
    times = pa.array(stamps, pa.string()).cast(pa.timestamp("ns", tz="UTC"))
    return pa.RecordBatch.from_arrays(
        [
            pa.array([partition] * len(msgs), pa.int32()),
            pa.array(sequences, pa.int64()),
            pa.array(subjects, pa.string()),
            pa.array(keys, pa.string()),
            pa.array(data, pa.binary()),
            pa.array(headers, HEADERS_TYPE),
            times.cast(pa.timestamp("us", tz="UTC"), safe=False),
        ],
        schema=ARROW_SCHEMA,
    )
