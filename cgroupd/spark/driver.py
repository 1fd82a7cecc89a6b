"""The source's driver side: one connection, the group, the lease, offset arithmetic.

Spark calls the reader's driver methods (``initialOffset``, ``latestOffset``,
``partitions``, ``commit``) synchronously, one at a time, in a Python process the JVM
starts for the query and keeps until the query ends. The lease must be pulled on
continuously, between those calls too, so everything here runs on an event loop in a
daemon thread of that process (:class:`LoopThread`); the reader submits coroutines to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import structlog

from cgroupd.admin import get_group
from cgroupd.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.errors import ConfigError
from cgroupd.jetstream import JetStream
from cgroupd.partitions import member_partitions
from cgroupd.spark.directget import DirectGet, nth_sequence
from cgroupd.spark.lease import Lease, claims_for
from cgroupd.spark.offsets import LATEST, Offsets, allocate, parse_starting_offsets
from cgroupd.spark.options import SourceOptions

log = structlog.get_logger("cgroupd.spark")

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


class DriverSession:
    """Connection, group config, lease and offset queries of one streaming query."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.js: JetStream | None = None
        self.lease: Lease | None = None
        self.stream = ""
        self.partitions: tuple[int, ...] = ()
        self.filters: tuple[PartitioningFilter, ...] = ()
        self._dg: DirectGet | None = None

    @property
    def label(self) -> str:
        return f"{self.options.stream}/{self.options.group}"

    async def open(self) -> None:
        """Connect, read the group, take the lease; on any failure leave nothing behind."""
        o = self.options
        nc = await o.connection.connect(reconnect=True)
        try:
            self.js = JetStream(nc)
            stored = await get_group(self.js, o.stream, o.group)
            config = stored.config
            if not isinstance(config, ElasticGroupConfig):
                raise ConfigError(
                    f"group {self.label} is a static group; the Spark source reads elastic "
                    "groups, whose work-queue stream it can purge as Spark commits")
            self.stream = stored.consume_stream
            self.filters = config.partitioning_filters
            if o.member is not None:
                self.partitions = member_partitions(config, o.member)
                if not self.partitions:
                    raise ConfigError(f"member {o.member!r} owns no partitions of group "
                                      f"{self.label} (members: {list(config.member_names)})")
            else:
                self.partitions = tuple(range(config.max_members))
            self._dg = DirectGet(nc, self.stream)
            self.lease = Lease(self.js, self.stream, claims_for(config, self.partitions),
                               label=self.label,
                               inactive_threshold=o.lease_inactive_threshold,
                               wait=o.lease_wait)
            await self.lease.acquire()
        except BaseException:
            await self.close()
            raise
        log.info("source started", group=self.label, partitions=list(self.partitions),
                 lease=self.lease.lease_id)

    async def close(self) -> None:
        if self.lease is not None:
            await self.lease.release()
        if self._dg is not None:
            await self._dg.close()
        if self.js is not None:
            try:
                await self.js.nc.close()
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

    def own(self, offsets: Mapping[int, int]) -> Offsets:
        """``offsets`` for exactly this query's partitions (new partitions start at 0)."""
        return {p: int(offsets.get(p, 0)) for p in self.partitions}

    async def latest(self, start: Mapping[int, int] | None = None) -> Offsets:
        """Per partition, the last sequence in the stream (never behind ``start``)."""
        start = start or {}
        out: Offsets = {}
        for p in self.partitions:
            last = await self.direct.last_sequence(f"{p}.>")
            out[p] = max(last or 0, start.get(p, 0))
        return out

    async def initial(self) -> Offsets:
        starting = parse_starting_offsets(self.options.starting_offsets, self.partitions)
        if isinstance(starting, dict):
            return starting
        if starting == LATEST:
            return await self.latest()
        return {p: 0 for p in self.partitions}

    async def count(self, p: int, after: int, upto: int) -> int:
        """Messages of partition ``p`` with sequence in ``(after, upto]``."""
        if upto <= after:
            return 0
        subject = f"{p}.>"
        first = await self.direct.probe(after + 1, subject)
        if first is None or first.sequence > upto:
            return 0
        beyond = await self.direct.probe(upto + 1, subject)
        return first.pending_after + 1 - (beyond.pending_after + 1 if beyond else 0)

    async def cap(self, start: Offsets, latest: Offsets, limit: int) -> Offsets:
        """``latest``, cut so that at most ``limit`` messages lie in ``(start, end]``.

        Shares follow :func:`~cgroupd.spark.offsets.allocate`; each partition's cut is
        the sequence of its n-th message after ``start``. Messages that arrive during the
        computation may push a cut a little later (see
        :func:`~cgroupd.spark.directget.nth_sequence`).
        """
        available = {p: await self.count(p, start[p], latest[p]) for p in self.partitions}
        shares = allocate(available, limit)
        end = dict(latest)
        for p, share in shares.items():
            if share >= available[p]:
                continue
            end[p] = start[p] if share == 0 else await nth_sequence(
                self.direct, f"{p}.>", start[p], share, latest[p])
        return end

    async def commit(self, end: Mapping[int, int]) -> None:
        """Purge each partition below ``end[p] + 1``: Spark will never ask for it again."""
        assert self.js is not None
        for p in self.partitions:
            if end.get(p, 0) > 0:
                await self.js.purge(self.stream, f"{p}.>", end[p] + 1)
