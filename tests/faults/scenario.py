"""One fault scenario end to end: group, member processes, traffic, fault, verdict.

A test builds a :class:`Scenario`, creates its group, starts ``cgroupd join`` processes,
starts a :class:`~tests.faults.traffic.KeyedPublisher`, injects its fault while traffic
flows, then calls :meth:`Scenario.finish`: wait until every published message was
processed (committed, for the exactly-once variant) and the group's work-queue stream is
empty, stop the processes with SIGTERM, read every instance's database and judge it
(:func:`tests.faults.checks.judge`). The verdict's table is printed and also collected for
the end-of-session summary (``tests/faults/conftest.py``).

Every wait polls with a deadline; :meth:`Scenario.close` kills whatever is left.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import api

from cgroupd import admin
from cgroupd.core.config import StaticGroupConfig
from cgroupd.nats.jetstream import JetStream
from tests.faults.checks import FaultVerdict, Row, committed, judge, load_rows, processed
from tests.faults.runner import JoinProc
from tests.faults.traffic import KeyedPublisher, partition_of
from tests.support.groups import make_group
from tests.support.natsserver import client_options
from tests.support.polling import eventually

#: Tables of every scenario judged in this session, printed at the end.
REPORTS: list[str] = []


class Scenario:
    """Member processes of one group, their traffic, and what they recorded."""

    def __init__(self, name: str, urls: Sequence[str], workdir: Path, *,
                 variant: str = "exactly_once", stream: str = "ORDERS",
                 group: str = "g") -> None:
        self.name = name
        self.urls = list(urls)
        self.workdir = workdir
        self.variant = variant
        self.stream = stream
        self.group = group
        self.procs: list[JoinProc] = []
        self.nc: Client | None = None
        self.js: JetStream | None = None
        self.publisher: KeyedPublisher | None = None
        self.partitions = 0
        self.notes: list[str] = []
        #: Set by a test that crashes a server (SIGKILL): acks it had not synced are lost.
        self.crash = False
        #: Set by a test that cuts a member off the network: the acks it sent meanwhile are
        #: lost, so its successor redoes that work (like after a crash).
        self.lost_acks = False
        #: Set by a test whose full rejoins may give a member back to an instance that
        #: had it before (see :func:`tests.faults.checks.start_violations`).
        self.returns = False
        #: Set by make_static_group: the group consumes a limits stream.
        self.static = False
        self.began = time.monotonic()
        self._excluded: set[int] = set()
        self._settled_at = 0.0
        (workdir / "db").mkdir(parents=True, exist_ok=True)

    # -- setup ----------------------------------------------------------------------
    async def __aenter__(self) -> Scenario:
        self.nc = await nats.connect(servers=self.urls, **client_options(
            name=f"faults-{self.name}"))
        self.js = JetStream(self.nc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill every process still running and disconnect (always runs)."""
        if self.publisher is not None:
            await self.publisher.stop()
        for p in self.procs:
            p.close()
        if self.nc is not None:
            await self.nc.close()
            self.nc = None

    async def make_group(self, partitions: int, members: Iterable[str],
                         replicas: int = 1) -> None:
        assert self.js is not None
        self.partitions = partitions
        deadline = time.monotonic() + 30
        while True:
            try:
                await make_group(self.js, self.stream, self.group, partitions,
                                 tuple(members), replicas=replicas)
                return
            except Exception as exc:
                # In a fresh cluster the KV bucket's stream can be created before the
                # interest in its subjects reached the node we talk to: the first record
                # write gets "no responders" (nats-py: NoStreamResponseError).
                if time.monotonic() > deadline:
                    raise
                self.note(f"group creation failed, retrying: {exc!r}")
            await asyncio.sleep(0.2)  # retry pacing

    async def make_static_group(self, partitions: int, members: Iterable[str]) -> None:
        """A limits stream whose stored subjects start with the partition (a subject
        transform on the stream: ``orders.k3`` is stored as ``<p>.orders.k3``, the same
        partition an elastic group would give it) and a static group on it."""
        assert self.js is not None
        prefix = self.stream.lower()
        await self.js.add_stream(api.StreamConfig(
            name=self.stream, subjects=[f"{prefix}.*"],
            subject_transform=api.SubjectTransform(
                src=f"{prefix}.*", dest=f"{{{{partition({partitions},1)}}}}.{prefix}.$1")))
        await admin.create_static_group(self.js, self.stream, self.group, StaticGroupConfig(
            max_members=partitions, members=tuple(members)))
        self.partitions = partitions
        self.static = True

    async def add_stream(self, name: str, subjects: list[str], replicas: int = 1) -> None:
        assert self.js is not None
        await self.js.add_stream(api.StreamConfig(name=name, subjects=subjects,
                                                  num_replicas=replicas))

    def start(self, member: str, *, args: Sequence[str] = (), env: dict[str, str] | None = None,
              netns: str | None = None, urls: Sequence[str] | None = None) -> JoinProc:
        proc = JoinProc(urls or self.urls, self.workdir, stream=self.stream, group=self.group,
                        member=member, variant=self.variant, args=args, env=env, netns=netns)
        self.procs.append(proc)
        return proc

    def traffic(self, count: int, *, keys: int = 32, rate: float = 200.0,
                holds: dict[int, float] | None = None, window: int = 1,
                blocks: dict[int, float] | None = None) -> KeyedPublisher:
        assert self.nc is not None
        self.publisher = KeyedPublisher(self.nc, count=count, keys=keys, rate=rate,
                                        prefix=self.stream.lower(), holds=holds,
                                        window=window, blocks=blocks)
        return self.publisher

    def keys_of(self, partitions: Iterable[int], keys: int = 32) -> list[str]:
        """Key tokens (``k<i>``) whose messages land in ``partitions``."""
        wanted = set(partitions)
        return [f"k{k}" for k in range(keys) if partition_of(f"k{k}", self.partitions) in wanted]

    def note(self, text: str) -> None:
        elapsed = time.monotonic() - self.began
        self.notes.append(f"[{elapsed:5.1f}s] {text}")

    # -- observation ----------------------------------------------------------------
    def rows(self) -> list[Row]:
        return load_rows(self.workdir / "db")

    def instances(self, member: str) -> list[JoinProc]:
        return [p for p in self.procs if p.member == member]

    async def wait_for(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        """:func:`eventually`, failing with the scenario's name and its processes' log
        tails."""
        return await eventually(check, timeout, 0.1, f"{what} ({self.name})",
                                diagnostics=self.diagnostics)

    async def wait_active(self, member: str, timeout: float = 30.0,
                          exclude: Iterable[JoinProc] = ()) -> JoinProc:
        """The one live instance of ``member`` that says it is active."""
        skip = set(map(id, exclude))

        def find() -> JoinProc | None:
            live = [p for p in self.instances(member)
                    if p.active and id(p) not in skip and not p.suspended]
            return live[0] if len(live) == 1 else None

        proc: JoinProc = await self.wait_for(find, timeout, f"an active instance of {member}")
        return proc

    async def wait_joined(self, procs: Iterable[JoinProc], timeout: float = 30.0) -> None:
        for p in procs:
            await self.wait_for(_joined(p), timeout, f"{p.instance} to join")

    async def wait_started(self, n: int, timeout: float = 30.0) -> Row:
        """The first recorded start of message ``n``."""
        def find() -> Row | None:
            return next((r for r in self.rows() if r.n == n), None)
        row: Row = await self.wait_for(find, timeout, f"message #{n} to be started")
        return row

    def finished(self) -> set[int]:
        rows = self.rows()
        spans = committed(rows)[0] if self.variant == "exactly_once" else processed(rows)
        return {s.row.n for s in spans}

    async def wait_progress(self, count: int, timeout: float = 30.0,
                            by: JoinProc | None = None) -> None:
        """Until ``count`` messages are finished (by one instance, if given)."""
        def enough() -> bool:
            rows = self.rows()
            spans = (committed(rows)[0] if self.variant == "exactly_once"
                     else processed(rows))
            return sum(by is None or s.row.instance == by.instance for s in spans) >= count
        await self.wait_for(enough, timeout, f"{count} messages finished"
                            + (f" by {by.instance}" if by else ""))

    def diagnostics(self) -> str:
        lines = []
        for p in self.procs:
            lines.append(f"--- {p!r} state={p.state()} log tail:\n{p.tail(1500)}")
        return "\n".join(lines)

    # -- the end --------------------------------------------------------------------
    async def finish(self, *, exclude: Iterable[int] = (), timeout: float = 90.0,
                     expect_exit_zero: bool = True) -> FaultVerdict:
        """:meth:`settle`, then :meth:`verdict`."""
        await self.settle(exclude=exclude, timeout=timeout, expect_exit_zero=expect_exit_zero)
        return self.verdict()

    async def settle(self, *, exclude: Iterable[int] = (), timeout: float = 90.0,
                     expect_exit_zero: bool = True) -> None:
        """Wait for all traffic to be handled and drained, then stop every process.

        ``exclude``: messages not expected to finish (dead-lettered ones).
        """
        assert self.publisher is not None and self.js is not None
        sent = await self.publisher.wait(timeout)
        self._excluded = set(exclude)
        want = {n for _, n in sent} - self._excluded
        await self.wait_for(lambda: want <= self.finished(), timeout,
                            f"all {len(want)} messages to be finished")
        self._settled_at = time.time()
        js = self.js

        async def drained() -> bool:
            try:
                if self.static:  # a limits stream keeps its messages: ask the consumers
                    views = await admin.group_consumers(js, self.stream, self.group)
                    return all(v.num_pending + v.num_ack_pending == 0 for v in views
                               if v.partitions)
                counts = await admin.partition_pending(js, self.stream, self.group)
            except Exception:  # noqa: BLE001 - server still recovering: look again
                return False
            return sum(counts.values()) == 0

        await self.wait_for(drained, 30, "the group's work-queue stream to be empty")
        await self.stop_all()
        if expect_exit_zero:
            bad = [(p.instance, p.returncode) for p in self.procs
                   if p.returncode not in (0, -signal.SIGKILL)]
            if bad:
                self.note(f"unexpected exit codes {bad}")

    @property
    def settled_at(self) -> float:
        """When :meth:`settle` saw every message finished (epoch seconds; 0 before)."""
        return self._settled_at

    def verdict(self, rows: Sequence[Row] | None = None) -> FaultVerdict:
        """Judge what was recorded (after :meth:`settle`), or ``rows`` read from it and
        adjusted by the test; print and collect the table."""
        assert self.publisher is not None
        pub = self.publisher
        sent = [(s, n) for s, n in pub.sent if n not in self._excluded]
        # Stalls count from the first publish until the last message was finished.
        window = (pub.started_at or 0.0, self._settled_at)
        rewinds = self.crash or self.lost_acks or any(p.killed for p in self.procs)
        verdict = judge(self.name, self.variant, self.rows() if rows is None else rows,
                        sent, window=window, rewinds=rewinds, returns=self.returns)
        self.note(f"publisher: {pub.retries} publish retries, longest publish "
                  f"{pub.longest_publish:.2f}s")
        if self._excluded:
            self.note(f"{len(self._excluded)} message(s) excluded from the checks: "
                      f"{sorted(self._excluded)}")
        verdict.notes = self.notes + verdict.notes
        REPORTS.append(verdict.table())
        print("\n" + verdict.table())
        return verdict

    async def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every live process (resuming stopped ones) and wait for them to exit."""
        for p in self.procs:
            if p.alive:
                if p.suspended:
                    p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
        await self.wait_for(lambda: not any(p.alive for p in self.procs), timeout,
                            "every member process to exit after SIGTERM")


def _joined(proc: JoinProc) -> Callable[[], bool]:
    return lambda: proc.state() is not None
