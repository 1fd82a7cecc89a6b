"""The source's driver side: one connection, the layout, the lease, offset arithmetic.

Spark calls the reader's driver methods (``initialOffset``, ``latestOffset``,
``partitions``, ``commit``) synchronously, one at a time, in a Python process the JVM
starts for the query and keeps until the query ends. The lease (``mode=workqueue``) must
be pulled on continuously, between those calls too, so everything here runs on an event
loop in a daemon thread of that process (:class:`LoopThread`).

When Spark asks for the latest offset with ``start``, every batch up to ``start`` is in
its commit log (the sink committed it; a restarted query replays an uncommitted batch
first, from its logged offsets, without asking). So ``latest(start)`` is where the
work-queue mode purges what Spark is done with: at the first trigger after a batch,
rather than when the *next* batch is planned (Spark's ``commit`` comes one batch late,
and never for the last batch before a stop).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from cgroupd.admin import StoredGroup, get_group
from cgroupd.core import logs
from cgroupd.core.config import group_key
from cgroupd.core.errors import ConfigError, DataLoss, StreamNotFound
from cgroupd.nats import jsapi
from cgroupd.nats.jetstream import JetStream
from cgroupd.spark import worker_logging
from cgroupd.spark.directget import DirectGet, nth_sequence
from cgroupd.spark.layout import Layout, resolve
from cgroupd.spark.lease import Lease, claims_for
from cgroupd.spark.offsets import (
    READ_SUBJECT,
    Offset,
    ReadRange,
    Requested,
    parse_requested,
    plan_slices,
    resolve_start,
)
from cgroupd.spark.options import SourceOptions, connect_reader
from cgroupd.spark.wire import ReaderClient

log = logs.get_logger("cgroupd.spark")

T = TypeVar("T")

#: Bound on one driver call (a lease acquisition waits up to ``leaseWaitTimeout`` more).
CALL_TIMEOUT = 60.0


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self, name: str = "cgroupd-spark-driver") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = CALL_TIMEOUT) -> T:
        """Run ``coro`` on the loop and wait for its result (or exception)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def lost_ranges(start: Offset, partitions: tuple[int, ...],
                first_seq: int) -> dict[int, tuple[int, int]]:
    """Per partition whose unread messages may have been removed, the removed sequences
    ``(first, last)``: everything below the stream's ``first_seq`` is gone, and a
    partition has read up to its own offset (or the offset's ``position``, below which
    every message was read or is not the query's)."""
    out = {}
    for p in partitions:
        done = max(start.partitions.get(p, 0), start.position)
        if first_seq > done + 1:
            out[p] = (done + 1, first_seq - 1)
    return out


class StreamState:
    """A stream's identity and extent, as its leader reports them."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        state = info.get("state") or {}
        config = info.get("config") or {}
        self.name = str(config.get("name", ""))
        self.created = str(info.get("created", ""))
        self.first_seq = int(state.get("first_seq", 0))
        self.last_seq = int(state.get("last_seq", 0))
        self.allow_direct = bool(config.get("allow_direct", False))


class DriverSession:
    """Connection, layout, lease and offset queries of one query (streaming or batch)."""

    def __init__(self, options: SourceOptions) -> None:
        worker_logging()
        self.options = options
        self.nc: ReaderClient | None = None
        self.js: JetStream | None = None
        self.lease: Lease | None = None
        self.layout: Layout | None = None
        self.created = ""
        self._dg: DirectGet | None = None
        #: Work-queue mode: per partition, the sequence below which it is purged.
        self._purged: dict[int, int] = {}
        self._last_empty_poll = 0.0
        #: When the last batch was planned (minOffsetsPerTrigger's maxTriggerDelay).
        self._last_batch = time.monotonic()
        self.latest_seen: Offset | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self, *, take_lease: bool = True) -> None:
        """Connect, resolve the layout, take the lease; on failure leave nothing behind."""
        o = self.options
        self.nc = await connect_reader(o.connection, reconnect=True)
        try:
            self.js = JetStream(self.nc)
            stored: StoredGroup | None = None
            if o.group is not None:
                stored = await get_group(self.js, o.stream, o.group)
            self.layout = resolve(o.stream, stored, o.mode, o.member, o.subject)
            state = await self.state()
            if not state.allow_direct:
                raise ConfigError(
                    f"stream {self.layout.stream!r} does not allow direct get, which the "
                    "cgroupd source reads with (any replica answers it, nothing is "
                    "consumed); enable it (a config change, the data stays): nats stream "
                    f"edit {self.layout.stream} --allow-direct")
            self.created = state.created
            self._dg = DirectGet(self.nc, self.layout.stream)
            if self.layout.workqueue and take_lease:
                assert stored is not None
                self.lease = Lease(
                    self.js, self.layout.stream, claims_for(stored.config, self.layout.partitions,
                                                            stored.group),
                    label=self.layout.label, presence_key=group_key(o.stream, stored.group),
                    inactive_threshold=o.lease_inactive_threshold, wait=o.lease_wait,
                    group=(o.stream, stored.group), member_option=o.member,
                    group_claims=claims_for(stored.config,
                                            range(stored.config.max_members), stored.group))
                await self.lease.acquire()
        except BaseException:
            await self.close()
            raise
        log.info("source started", source=self.layout.label, stream=self.layout.stream,
                 mode=self.layout.mode.value, partitions=list(self.layout.partitions),
                 lease=self.lease.lease_id if self.lease else None)

    async def close(self) -> None:
        if self.lease is not None:
            await self.lease.release()
        if self._dg is not None:
            await self._dg.close()
        if self.nc is not None:
            try:
                await self.nc.close()
            except Exception:  # noqa: BLE001 - closing anyway
                pass

    def check(self) -> None:
        """LeaseLost if the lease was lost."""
        if self.lease is not None:
            self.lease.check()

    @property
    def direct(self) -> DirectGet:
        assert self._dg is not None, "session not open"
        return self._dg

    @property
    def plan_layout(self) -> Layout:
        assert self.layout is not None, "session not open"
        return self.layout

    async def state(self) -> StreamState:
        assert self.nc is not None and self.layout is not None
        try:
            info = await jsapi.stream_state(self.nc, self.layout.stream)
        except StreamNotFound as exc:
            raise StreamNotFound(f"stream {self.layout.stream!r} does not exist") from exc
        return StreamState(info)

    # -- offsets ----------------------------------------------------------------------------
    def _offset(self, position: int, partitions: Mapping[int, int]) -> Offset:
        return Offset(self.plan_layout.stream, self.created, position, dict(partitions))

    def _requested_start(self) -> Requested:
        return parse_requested("startingOffsets", self.options.starting_offsets,
                               self.plan_layout.stream, self.plan_layout.partitions)

    async def initial(self) -> Offset:
        """Where the query starts (``startingTimestamp`` wins over ``startingOffsets``,
        as in Kafka's source)."""
        layout = self.plan_layout
        state = await self.state()
        ts = self.options.starting_timestamp
        if ts is not None:
            when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts // 1000))
            first = await self.direct.first_after_time(f"{when}.{ts % 1000:03d}Z")
            start = (first - 1) if first is not None else state.last_seq
            parts = {p: start for p in layout.partitions}
        else:
            parts = resolve_start(self._requested_start(), layout.partitions,
                                  state.first_seq, state.last_seq)
        position = min(parts.values()) if parts else state.last_seq
        return Offset(layout.stream, state.created, position, parts, initial=True)

    def checked_start(self, start: Offset, state: StreamState) -> Offset:
        """``start``, or (``failOnDataLoss=false``) where to go on when it cannot be."""
        layout = self.plan_layout
        fail = self.options.fail_on_data_loss
        if start.stream != layout.stream or start.created != state.created:
            what = (f"the checkpoint's offsets are for stream {start.stream!r} created "
                    f"{start.created or '?'}, but the query reads {layout.stream!r} created "
                    f"{state.created}")
            detail = ("the stream was deleted and created again since (its sequences "
                      "started over), so messages the query had not read are gone"
                      if start.stream == layout.stream else
                      "this checkpoint belongs to another query's source")
            if fail:
                log.error("data loss: failing the query (failOnDataLoss=true)", detail=what)
                raise DataLoss(f"{what}: {detail}. Use a new checkpoint, or set "
                               "failOnDataLoss=false to read the current stream from its "
                               "start.")
            log.warning("data loss: starting over on the current stream", detail=what)
            earliest = max(state.first_seq - 1, 0)
            return self._offset(earliest, {p: earliest for p in layout.partitions})
        whole = not layout.workqueue or len(layout.partitions) == layout.count
        lost = lost_ranges(start, layout.partitions, state.first_seq) if whole else {}
        if lost:
            # Whatever fell below a partition's offset unread is lost. (In a work queue only
            # when the query holds every partition: otherwise daemons legitimately consume
            # the other members' partitions, and the lease keeps them off the query's.)
            # Which partitions held the removed messages the server no longer knows: the
            # partitions named are those whose unread range the removal reached.
            read = ", ".join(f"partition {p} had read to {lo - 1}"
                             for p, (lo, _) in sorted(lost.items()))
            what = (f"messages of stream {layout.stream!r} from sequence "
                    f"{min(lo for lo, _ in lost.values())} to {state.first_seq - 1} were "
                    f"removed (limits, age, a purge) before the query read them: {read}")
            if fail:
                log.error("data loss: failing the query (failOnDataLoss=true)", detail=what,
                          partitions=sorted(lost))
                raise DataLoss(f"{what}. Set failOnDataLoss=false to go on from sequence "
                               f"{state.first_seq}.")
            log.warning("data loss: going on (failOnDataLoss=false)", detail=what,
                        partitions=sorted(lost))
        return start

    async def latest(self, start: Offset) -> Offset:
        """The newest offset, never behind ``start`` (see the module docstring for the
        purge in work-queue mode)."""
        wait = self.options.idle_wait - (time.monotonic() - self._last_empty_poll)
        if self._last_empty_poll and wait > 0:
            await asyncio.sleep(wait)  # Spark polls every 10 ms while nothing arrives
        state = await self.state()
        if state.created != self.created and start.created == self.created:
            raise DataLoss(f"stream {self.plan_layout.stream!r} was deleted and created "
                           "again while the query ran: messages it had not read are gone")
        base = self.checked_start(start, state)
        if self.plan_layout.workqueue and base is start:
            await self.purge_below(start)
        end = await self._ends(base, state)
        unchanged = end.partitions == dict(base.partitions)
        self._last_empty_poll = time.monotonic() if unchanged else 0.0
        if base is start and unchanged and end.position == start.position:
            return start  # nothing new: the very same offset (Spark compares the text)
        if start.initial:
            end = Offset(end.stream, end.created, end.position, end.partitions,
                         origin=start.plain())
        self.latest_seen = end
        return end

    async def _ends(self, base: Offset, state: StreamState) -> Offset:
        """Every partition read up to the stream's last sequence (never backwards)."""
        if state.last_seq <= base.position:
            return self._offset(base.position, base.partitions)
        return self._offset(state.last_seq, {
            p: max(state.last_seq, base.partitions.get(p, 0))
            for p in self.plan_layout.partitions})

    async def target(self) -> Offset:
        """Trigger.AvailableNow: the offsets to stop at (what is there now)."""
        state = await self.state()
        return await self._ends((await self.initial()).plain(), state)

    async def count(self, subject: str, after: int, upto: int) -> int:
        """Messages on ``subject`` with sequence in ``(after, upto]``."""
        if upto <= after:
            return 0
        first = await self.direct.first(after + 1, subject)
        if first is None or first[0] > upto:
            return 0
        beyond = await self.direct.first(upto + 1, subject)
        return first[1] + 1 - (beyond[1] + 1 if beyond else 0)

    async def available(self, start: Offset, end: Offset) -> int:
        """Messages in the stream run ``(start, end]`` (all of them: which are the
        query's is known only when they are read, so this is an upper bound)."""
        lo = min(start.partitions.get(p, 0) for p in self.plan_layout.partitions)
        return await self.count(READ_SUBJECT, lo, end.position)

    async def cap(self, start: Offset, end: Offset, limit: int) -> Offset:
        """``end``, cut so that at most ``limit`` messages lie in ``(start, end]``: at the
        ``limit``-th message of the stream after the lowest start, so every partition
        takes its messages in the order they arrived (Kafka shares the limit in
        proportion to each partition's backlog; here the oldest go first). Messages
        that arrive during the computation may push the cut a little later (see
        :func:`~cgroupd.spark.directget.nth_sequence`)."""
        available = await self.available(start, end)
        if available <= limit:
            return end
        lo = min(start.partitions.get(p, 0) for p in self.plan_layout.partitions)
        cut = lo if limit == 0 else await nth_sequence(self.direct, READ_SUBJECT, lo, limit,
                                                       end.position)
        ends = {p: max(cut, start.partitions.get(p, 0)) for p in self.plan_layout.partitions}
        return Offset(end.stream, end.created, max(cut, start.position), ends, end.origin)

    def enough(self, available: int) -> bool:
        """minOffsetsPerTrigger: is there enough, or has maxTriggerDelay passed?"""
        least = self.options.min_offsets_per_trigger
        if least is None or available >= least:
            return True
        return time.monotonic() - self._last_batch >= self.options.max_trigger_delay

    def planned(self) -> None:
        self._last_batch = time.monotonic()

    # -- planning ---------------------------------------------------------------------------
    def plan(self, start: Offset, end: Offset) -> list[ReadRange]:
        """The slices of the batch ``(start, end]``, one task each: a pure function of the
        two offsets, so a replayed batch reads the very same ranges."""
        layout = self.plan_layout
        tasks = max(self.options.min_partitions or 0, len(layout.partitions))
        return plan_slices(READ_SUBJECT, start.partitions, end.partitions, tasks=tasks)

    async def purge_below(self, done: Offset) -> None:
        """Work-queue mode: remove what Spark has committed (see the module docstring);
        idempotent, and only what moved since the last purge."""
        layout = self.plan_layout
        assert self.js is not None
        todo = {p: s for p, s in done.partitions.items()
                if p in layout.partitions and s > self._purged.get(p, 0)}
        if not todo:
            return
        low = min(done.partitions.get(p, 0) for p in layout.partitions)
        purges = []
        if len(layout.partitions) == layout.count and low > min(
                self._purged.get(p, 0) for p in layout.partitions):
            # Everything below the lowest end is done, whatever its partition: one purge.
            await self.js.purge(layout.stream, None, low + 1)
            purges = [self.js.purge(layout.stream, layout.partition_subject(p), s + 1)
                      for p, s in todo.items() if s > low]
        else:
            purges = [self.js.purge(layout.stream, layout.partition_subject(p), s + 1)
                      for p, s in todo.items()]
        await asyncio.gather(*purges)
        self._purged.update(todo)
        log.info("purged what Spark committed", stream=layout.stream,
                 below={p: s + 1 for p, s in sorted(todo.items())})
