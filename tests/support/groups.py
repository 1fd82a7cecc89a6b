"""Helpers shared by member tests: keyed traffic, member processes, and the checkers.

The checkers state the promises: nothing published is missing, per key every completion
follows publish order (see :func:`check`), and two instances of one member never hold messages at
the same time (their processing intervals do not overlap).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import api

from cgroupd import admin
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.settings import MemberSettings
from cgroupd.member import Member
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.message import Message
from tests.support.natsserver import client_options
from tests.support.polling import eventually, within

ROOT = Path(__file__).resolve().parents[2]


async def make_group(js: JetStream, stream: str = "ORDERS", group: str = "g",
                     partitions: int = 6, members: Iterable[str] = ("m1", "m2", "m3"),
                     replicas: int = 1) -> ElasticGroupConfig:
    """An origin stream ``orders.<key>`` and an elastic group keyed on ``<key>``."""
    await js.add_stream(api.StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"],
                                         num_replicas=replicas))
    config = ElasticGroupConfig(
        max_members=partitions,
        partitioning_filters=(PartitioningFilter(f"{stream.lower()}.*", (1,)),),
        members=tuple(members))
    return await admin.create_elastic_group(js, stream, group, config)


async def publish_keyed(js: JetStream, count: int, keys: int = 64, stream: str = "ORDERS",
                        start: int = 0, rate: float | None = None) -> list[tuple[str, int]]:
    """Publish ``count`` messages round-robin over ``keys`` keys; payload = per-key index.

    Returns ``(subject, index)`` in publish order.
    """
    sent = []
    per_key: dict[str, int] = {}
    for i in range(start, start + count):
        subject = f"{stream.lower()}.k{i % keys}"
        n = per_key.get(subject, start // keys + (1 if i % keys < start % keys else 0))
        per_key[subject] = n + 1
        await js.js.publish(subject, json.dumps({"key": subject, "n": i}).encode())
        sent.append((subject, i))
        if rate:
            await asyncio.sleep(1 / rate)
    return sent


@dataclass
class Record:
    """What one test observed: message events and state changes, from any instance."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, event: str, instance: str, **fields: Any) -> None:
        self.events.append({"event": event, "instance": instance, "t": time.time(), **fields})

    @classmethod
    def load(cls, paths: Iterable[Path]) -> Record:
        rec = cls()
        for path in paths:
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.strip():
                        try:
                            rec.events.append(json.loads(line))
                        except ValueError:
                            pass  # a line cut short by SIGKILL
        rec.events.sort(key=lambda e: e["t"])
        return rec

    def ends(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "end"]


@dataclass
class Verdict:
    messages: int
    lost: list[int]
    order_violations: list[str]
    overlaps: list[str]
    duplicates: int

    def assert_ok(self) -> None:
        assert not self.lost, f"lost {len(self.lost)} messages, e.g. {self.lost[:5]}"
        assert not self.order_violations, self.order_violations[:5]
        assert not self.overlaps, self.overlaps[:5]


def check(record: Record, sent: list[tuple[str, int]],
          member_of: Callable[[dict[str, Any]], str] | None = None, *,
          rewinds: bool = False) -> Verdict:
    """Lost messages, per-key order of every completion, overlaps of same-member instances.

    Order: per key, completions follow publish order. A message's first completion never
    comes after a later message's, and, unless ``rewinds`` is set, no completion at all
    (a rerun included) comes after a later message of its key was completed: nothing runs
    again behind work already done. ``rewinds`` is for scenarios where a crash loses
    acknowledgements (SIGKILL of an owner loses its unflushed acks, SIGKILL of a server
    its unsynced ack state): the tail of the work is then redone, which is at-least-once.
    ``member_of`` maps an event to its member name; overlaps are checked only when given.
    """
    first_done: dict[int, dict[str, Any]] = {}
    completions = 0
    violations = []
    #: Per key: the highest message completed so far, and who completed it.
    high: dict[str, tuple[int, str]] = {}
    for e in sorted(record.ends(), key=lambda e: e["t"]):
        n, key, inst = e["n"], e["subject"], e["instance"]
        completions += 1
        first = n not in first_done
        first_done.setdefault(n, e)
        top = high.get(key)
        if top is not None and top[0] > n:
            if first:
                violations.append(f"{key}: #{n} completed after #{top[0]}")
            elif not rewinds:
                violations.append(f"{key}: {inst} completed #{n} again after {top[1]} "
                                  f"completed #{top[0]}")
        if top is None or n > top[0]:
            high[key] = (n, inst)
    lost = sorted(n for _, n in sent if n not in first_done)
    overlaps: list[str] = []
    if member_of is not None:
        overlaps = _overlaps(record, member_of)
    return Verdict(len(sent), lost, violations, overlaps, completions - len(first_done))


def _overlaps(record: Record, member_of: Callable[[dict[str, Any]], str]) -> list[str]:
    """Message processing intervals of different instances of one member that intersect."""
    begun: dict[tuple[str, int], float] = {}
    intervals: dict[str, list[tuple[float, float, str]]] = {}
    for e in record.events:
        key = (e["instance"], e.get("seq", -1))
        if e["event"] == "start":
            begun[key] = e["t"]
        elif e["event"] == "end" and key in begun:
            intervals.setdefault(member_of(e), []).append((begun.pop(key), e["t"], key[0]))
    out = []
    for member, spans in intervals.items():
        spans.sort()
        latest_end, latest_instance = float("-inf"), ""
        for start, end, instance in spans:
            if instance != latest_instance and start < latest_end:
                out.append(f"{member}: {latest_instance} busy until {latest_end:.3f} "
                           f"while {instance} started at {start:.3f}")
            if end > latest_end:
                latest_end, latest_instance = end, instance
    return out


class MemberProcess:
    """``tests.support.member_process`` in a child process; signal it, read what it recorded."""

    def __init__(self, url: str, record: Path, stream: str, group: str, member: str,
                 *extra: str) -> None:
        self.record = record
        self.member = member
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self._log = open(f"{record}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.member_process", "--url", url, "--stream", stream,
             "--group", group, "--member", member, "--record", str(record), *extra],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def events(self) -> list[dict[str, Any]]:
        return Record.load([self.record]).events

    def last_state(self) -> str | None:
        states = [e["event"] for e in self.events() if e["event"] in ("active", "standby")]
        return states[-1] if states else None

    @property
    def active(self) -> bool:
        return self.last_state() == "active"

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        """Never leave the process behind, even if it was stopped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


async def wait_started(procs: Iterable[MemberProcess], timeout: float = 20.0) -> None:
    for p in procs:
        await eventually(lambda p=p: any(e["event"] == "started" for e in p.events()),
                         timeout, what=f"{p.member} process to start")


class Fleet:
    """In-process member instances, each on its own connection, all recording to one log."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.record = Record()
        self.members: list[Member] = []
        self._conns: list[Client] = []
        self.member_of: dict[str, str] = {}
        self.handler_delay = 0.0
        self.fail_once: set[int] = set()

    async def add(self, member: str, settings: MemberSettings | None = None,
                  **kw: Any) -> Member:
        nc = await nats.connect(servers=[self.url], **client_options())
        self._conns.append(nc)
        holder: dict[str, Member] = {}

        async def handler(msg: Message) -> None:
            inst = holder["m"].instance_id
            n = json.loads(msg.data)["n"]
            self.record.add("start", inst, subject=msg.subject, n=n, seq=msg.stream_sequence,
                            partition=msg.partition)
            if self.handler_delay:
                await asyncio.sleep(self.handler_delay)
            if n in self.fail_once:
                self.fail_once.discard(n)
                self.record.add("fail", inst, subject=msg.subject, n=n, seq=msg.stream_sequence)
                raise RuntimeError(f"injected failure on #{n}")
            self.record.add("end", inst, subject=msg.subject, n=n, seq=msg.stream_sequence,
                            partition=msg.partition)

        m = Member(JetStream(nc), "ORDERS", "g", member, handler, settings, **kw)
        holder["m"] = m
        self.member_of[m.instance_id] = member
        await m.start()
        self.members.append(m)
        return m

    def active(self, member: str | None = None) -> list[Member]:
        return [m for m in self.members if m.active and (member is None or m.member == member)]

    def by_member(self, e: dict[str, Any]) -> str:
        return self.member_of[e["instance"]]

    async def close(self, timeout: float = 60.0) -> None:
        """Stop every member; a stop that hangs fails the test with every task's stack
        (a hang is a bug to see, not a suite that never ends)."""
        stops = asyncio.gather(*(m.stop() for m in self.members), return_exceptions=True)
        try:
            await within(asyncio.shield(stops), timeout, "every member to stop")
        except TimeoutError:
            stuck = [f"{m.member}/{m.instance_id} {m.state.value}" for m in self.members
                     if m.state.value != "stopped"]
            stacks = io.StringIO()
            for task in asyncio.all_tasks():
                task.print_stack(file=stacks)
            raise AssertionError(f"members did not stop within {timeout:g}s: {stuck}\n"
                                 f"{stacks.getvalue()}") from None
        finally:
            for nc in self._conns:
                await nc.close()


async def all_done(fleet: Fleet, sent: list[tuple[str, int]], timeout: float = 30.0) -> None:
    want = {n for _, n in sent}
    await eventually(lambda: want <= {e["n"] for e in fleet.record.ends()}, timeout,
                     what=f"{len(want)} messages processed")
