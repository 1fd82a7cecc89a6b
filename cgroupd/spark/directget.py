"""Reading a stream by sequence with JetStream direct get, to the end of every range.

The Spark source never consumes through a JetStream consumer: it reads with direct get
(the stream has ``allow_direct``), which leaves messages in place, so any uncommitted
range reads back identically. The request forms (:mod:`cgroupd.nats.jsapi`, checked against
nats-server 2.15.1):

* Last message on a subject (wildcards allowed): ``{"last_by_subj": "<p>.>"}``. One
  reply: the message, or status 404. Not ``multi_last`` with a batch of one: that is the
  last message of the alphabetically first *subject* under the filter.
* A run from sequence ``s``: ``{"seq": s, "next_by_subj": "<filter>", "batch": n,
  "max_bytes": m}``. Messages with sequence >= ``s`` in order, each with
  ``Nats-Num-Pending`` (messages of the filter after it), then ``204 EOB`` whose
  ``Nats-Num-Pending`` says whether more follow; status 404 when there is none.
  ``up_to_seq`` is ignored here, so readers stop at their end sequence themselves.

**Every replica answers direct gets, lagging followers included.** A follower that is
behind answers "nothing more" (EOB with nothing pending, or 404) for messages the leader
already has. :func:`read_range` therefore never takes a short answer for the end of a
range: it reads until it has seen a message at or beyond the range's end, and when a
replica says there is nothing more before that, it asks the stream *leader* (the
message-get API, which only the leader answers) whether a message of the range exists
after the last one read. If the leader has one, a replica is behind: retry (backing off)
and fail with :class:`~cgroupd.core.errors.ReplicaBehind` after ``stale_timeout``. If the
leader has none, the range is complete.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from nats.aio.subscription import Subscription

from cgroupd.core import logs
from cgroupd.core.errors import (
    ApiError,
    ReplicaBehind,
    ServerUnreachable,
    StreamNotFound,
)
from cgroupd.core.retrying import retry_delay
from cgroupd.nats import jsapi
from cgroupd.spark.wire import ReaderClient

log = logs.get_logger("cgroupd.spark")

#: Bytes one direct-get request asks for at most: well under the server's per-client
#: pending limit (64 MiB by default), which a burst of 1 MB messages would exceed.
MAX_BYTES = 8 << 20
#: How long a range may keep ending early at replicas while the leader has more.
STALE_TIMEOUT = 10.0
#: How long direct gets may go unanswered ("no responders") before the stream is taken
#: for missing or closed to direct get: a replicated stream's leader election fits in it.
UNAVAILABLE_TIMEOUT = 10.0

#: The server's trailer on a message of a direct-get *batch*, matched where the last
#: ``\r\nNats-Stream: `` starts: one match instead of splitting and checking six lines
#: (0.96 against 1.76 µs a message here). Only the server writes these lines and none of
#: their values holds a CR; anything else falls back to :func:`cgroupd.nats.jsapi.direct_message`,
#: so a match gives exactly what it would.
_BATCH_TRAILER = re.compile(
    rb"\r\nNats-Stream: ([^\r]*)\r\nNats-Subject: ([^\r]*)\r\nNats-Sequence: ([0-9]+)"
    rb"\r\nNats-Time-Stamp: ([^\r]*)\r\nNats-Num-Pending: [0-9]+\r\n"
    rb"Nats-Last-Sequence: [^\r]*\r\n\r\n\Z")

#: One message of a direct-get batch: ``(sequence, subject, time stamp, raw header block,
#: where the server's trailer starts in it, payload)``.
Item = tuple[int, bytes, bytes, bytes, int, bytes]


@dataclass
class _Call:
    """One request in flight: what came back so far, and how it ended."""

    batch: bool
    items: list[Item] = field(default_factory=list)
    #: ``(code, description, headers)`` of the status that ended it (None: a message).
    status: tuple[str, str, dict[str, str]] | None = None
    #: Nats-Num-Pending of the EOB (messages of the filter after the last one sent).
    pending: int = 0
    received: int = 0
    done: asyncio.Future[None] | None = None


def _unavailable(call: _Call) -> bool:
    """The server answered "no responders": no replica listens for direct gets."""
    return call.status is not None and call.status[0] == "503"


@dataclass(frozen=True)
class Batch:
    """What one batched request returned."""

    items: list[Item]
    #: The answering replica has more messages of the filter after the last item.
    more: bool


class DirectGet:
    """Direct-get requests on one stream over one :class:`ReaderClient`; requests may run
    concurrently (each has its own reply subject)."""

    def __init__(self, nc: ReaderClient, stream: str,
                 timeout: float = jsapi.API_TIMEOUT) -> None:
        self.nc = nc
        self.stream = stream
        self._stream_b = stream.encode()
        self._subject = jsapi.direct_get_subject(stream, jsapi.api(nc))
        self.timeout = timeout
        self._prefix = b""
        self._sub: Subscription | None = None
        self._calls: dict[bytes, _Call] = {}
        self._serial = 0
        self._opening: asyncio.Lock | None = None

    async def close(self) -> None:
        if self._sub is not None:
            await self.nc.raw_unsubscribe(self._sub)
            self._sub = None

    def _receive(self, subject: bytes, hdr: bytes | None, payload: bytes) -> None:
        call = self._calls.get(subject[len(self._prefix):])
        if call is None or call.done is None or call.done.done():
            return  # a late answer to a request that gave up
        call.received += 1
        if call.batch and hdr is not None:
            end = hdr.rfind(b"\r\nNats-Stream: ")
            m = _BATCH_TRAILER.match(hdr, end) if end >= 0 else None
            if m is not None and m.group(1) == self._stream_b:
                call.items.append((int(m.group(3)), m.group(2), m.group(4), hdr, end, payload))
                return
        found = jsapi.direct_message(hdr, self._stream_b, call.batch)
        if found is not None and hdr is not None:
            end, subj, seq, stamp, _ = found
            call.items.append((seq, subj, stamp, hdr, end, payload))
            if not call.batch:
                call.done.set_result(None)
            return
        call.status = jsapi.direct_status(hdr)
        pending = call.status[2].get("Nats-Num-Pending", "0")
        call.pending = int(pending) if pending.isdigit() else 0
        call.done.set_result(None)

    async def _call(self, body: bytes, batch: bool) -> _Call:
        if self._sub is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._sub is None:
                    inbox = self.nc.new_inbox()
                    self._prefix = f"{inbox}.".encode()
                    self._sub = await self.nc.raw_subscribe(f"{inbox}.*", self._receive)
        self._serial += 1
        token = str(self._serial).encode()
        call = _Call(batch, done=asyncio.get_running_loop().create_future())
        self._calls[token] = call
        try:
            try:
                await self.nc.publish(self._subject, body,
                                      reply=(self._prefix + token).decode())
            except Exception as exc:
                raise ServerUnreachable(f"direct get on {self.stream}: not connected to "
                                        f"NATS ({exc or type(exc).__name__})") from exc
            seen = -1
            assert call.done is not None
            while True:
                # The deadline is for progress, not for the whole batch.
                await asyncio.wait({call.done}, timeout=self.timeout)
                if call.done.done():
                    return call
                if call.received == seen:
                    raise ServerUnreachable(
                        f"direct get on {self.stream}: no answer within {self.timeout:.1f}s")
                seen = call.received
        finally:
            self._calls.pop(token, None)
            if call.done is not None and not call.done.done():
                call.done.cancel()

    async def _answered(self, body: bytes, batch: bool) -> _Call:
        """:meth:`_call`, asked again while nobody answers direct gets on the stream.

        "No responders" (503) is also what a stream that exists and allows direct get
        says for a moment when no replica is subscribed: while its leader changes, or a
        follower catches up under load (CI on 5e3894c, an R3 stream read through a
        follower). Only when it persists for :data:`UNAVAILABLE_TIMEOUT` is it an error.
        """
        deadline = time.monotonic() + UNAVAILABLE_TIMEOUT
        attempt = 0
        while True:
            call = await self._call(body, batch)
            if not _unavailable(call) or time.monotonic() >= deadline:
                self._check(call)
                return call
            if attempt == 0:
                log.info("no replica answers direct gets yet, asking again",
                         stream=self.stream)
            await asyncio.sleep(min(retry_delay(attempt, 0.05, cap=1.0),
                                    max(deadline - time.monotonic(), 0.0)))
            attempt += 1

    def _check(self, call: _Call) -> None:
        """Raise for a status other than a normal end (204 EOB, or 404: nothing there)."""
        if call.status is None:
            return
        code, description, _ = call.status
        if code in ("204", "404"):
            return
        if _unavailable(call):
            raise StreamNotFound(
                f"stream {self.stream!r} does not answer direct get: it does not exist, "
                "does not allow direct get (enable it with `nats stream edit "
                f"{self.stream} --allow-direct`), or no replica is available")
        raise ApiError(int(code) if code.isdigit() else 500, 0,
                       f"direct get on {self.stream}: {description or code or 'bad reply'}")

    async def last(self, subject: str) -> int | None:
        """Sequence of the last message on ``subject`` (wildcards allowed), None if none."""
        call = await self._answered(jsapi.direct_get_body(last_by_subj=subject), batch=False)
        return call.items[0][0] if call.items else None

    async def first(self, seq: int, subject: str) -> tuple[int, int] | None:
        """``(sequence, messages on subject after it)`` of the first message on
        ``subject`` at or after ``seq``; None if there is none."""
        call = await self._answered(jsapi.direct_get_body(
            seq=max(seq, 1), next_by_subj=subject, batch=1), batch=True)
        if not call.items:
            return None
        item = call.items[0]
        found = jsapi.direct_message(item[3], self._stream_b, True)
        return item[0], (found[4] if found else 0)

    async def first_after_time(self, when: str) -> int | None:
        """Sequence of the first message stored at or after ``when`` (RFC 3339)."""
        call = await self._answered(jsapi.direct_get_body(start_time=when, batch=1), batch=True)
        return call.items[0][0] if call.items else None

    async def batch(self, seq: int, subject: str, n: int,
                    max_bytes: int = MAX_BYTES) -> Batch:
        """Up to ``n`` messages on ``subject`` with sequence >= ``seq``, in order."""
        call = await self._answered(jsapi.direct_get_body(
            seq=max(seq, 1), next_by_subj=subject, batch=n, max_bytes=max_bytes), batch=True)
        more = call.status is not None and call.status[0] == "204" and call.pending > 0
        return Batch(call.items, more)


async def leader_has(nc: ReaderClient, stream: str, seq: int, subject: str,
                     timeout: float = jsapi.API_TIMEOUT) -> int | None:
    """Sequence of the first message on ``subject`` at or after ``seq`` according to the
    stream leader, None if it has none."""
    try:
        msg = await jsapi.get_message(nc, stream, seq, subject, timeout)
    except ServerUnreachable:
        raise
    return msg.seq if msg is not None else None


async def read_range(
    dg: DirectGet,
    subject: str,
    start: int,
    end: int,
    *,
    fetch: int,
    stale_timeout: float = STALE_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[list[Item], None]:
    """Every message on ``subject`` with sequence in ``(start, end]``, in chunks, in order.

    See the module docstring for why a short answer is not the end.
    """
    seq = start + 1
    began = clock()
    delay = 0.02
    while seq <= end:
        got = await dg.batch(seq, subject, min(fetch, end - seq + 1))
        items = got.items
        if items:
            last = items[-1][0]
            keep = items if last <= end else [i for i in items if i[0] <= end]
            if keep:
                yield keep
            if last >= end:
                return
            seq = last + 1
            if got.more:
                continue
        # The replica that answered has nothing more on the subject: ask the leader.
        nxt = await leader_has(dg.nc, dg.stream, seq, subject)
        if nxt is None or nxt > end:
            return
        if clock() - began > stale_timeout:
            raise ReplicaBehind(
                f"direct get on {dg.stream}: the replicas that answer kept ending before "
                f"sequence {nxt} of {subject} for {stale_timeout:g}s although the stream "
                "leader has it (a replica is behind; is the cluster healthy?)")
        log.info("replica behind, retrying", stream=dg.stream, subject=subject, seq=seq,
                 leader_has=nxt)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


async def nth_sequence(dg: DirectGet, subject: str, after: int, n: int,
                       upper: int) -> int:
    """Sequence of the ``n``-th message on ``subject`` after sequence ``after``.

    Binary search over sequences in ``(after, upper]``, counting with the
    ``Nats-Num-Pending`` of one-message probes (a few dozen tiny requests instead of
    transferring ``n`` messages to the driver). Exact while no message arrives on
    ``subject`` during the search; arrivals make it pick a later sequence, by at most the
    messages that arrived. Returns ``upper`` when fewer than ``n`` messages exist.
    """
    first = await dg.first(after + 1, subject)
    if first is None or first[0] > upper:
        return after
    base = first[1] + 1  # messages at or after first

    async def rank(seq: int) -> tuple[int, int]:
        """(messages in (after, m], m) for m the first message at or after seq."""
        p = await dg.first(seq, subject)
        if p is None:
            return base, upper + 1
        return base - p[1], p[0]

    lo, hi = first[0], upper  # answer in [lo, hi]
    if n <= 1:
        return lo
    found = upper
    while lo <= hi:
        mid = (lo + hi) // 2
        r, seq = await rank(mid)
        if seq > upper:
            hi = mid - 1
            continue
        if r == n:
            return seq
        if r > n:
            found = min(found, seq)
            hi = mid - 1
        else:
            lo = seq + 1
    return found
