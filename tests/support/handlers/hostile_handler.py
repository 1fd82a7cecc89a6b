"""Handler for ``cgroupd join`` in the hostile-input tests: records every start and end.

Each message of those tests carries its publish index ``n`` in the header ``Hostile-N``,
or, when it has no headers at all, as its payload ``n:<n>``; its key is the second
subject token. Each start and end is one JSON line in ``CGROUPD_TEST_RECORD`` (the
:class:`tests.support.groups.Record` format) with digests of what arrived, so the test can check
that payload, headers and subject came through intact without writing megabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping

from cgroupd.nats.message import Message

#: Headers the server adds on the way (sourcing into the work-queue stream, pinning).
SERVER_ADDED = frozenset({"Nats-Stream-Source", "Nats-Pin-Id"})
N_HEADER = "Hostile-N"


def headers_digest(headers: Mapping[str, str]) -> str:
    """Digest of the publisher's headers (what the server adds left out)."""
    items = sorted((k, v) for k, v in headers.items() if k not in SERVER_ADDED)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def index_of(message: Message) -> int:
    if N_HEADER in message.headers:
        return int(message.headers[N_HEADER])
    return int(message.data.decode().removeprefix("n:"))


def _record(event: str, message: Message) -> None:
    line = json.dumps({
        "event": event, "instance": str(os.getpid()), "t": time.time(),
        "n": index_of(message), "subject": message.subject.split(".")[1],
        "seq": message.stream_sequence, "partition": message.partition,
        "deliveries": message.delivery_count, "size": len(message.data),
        "data": digest(message.data), "headers": headers_digest(message.headers),
        "full_subject": digest(message.subject.encode()),
    })
    with open(os.environ["CGROUPD_TEST_RECORD"], "a", encoding="utf-8") as out:
        out.write(line + "\n")


async def handle(message: Message) -> None:
    """Record the start, return (ack), record the end."""
    _record("start", message)
    _record("end", message)
