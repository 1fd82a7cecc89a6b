"""Keyed traffic with a known sequence per key, at a set rate, that survives server faults.

Message ``n`` (0-based, global) goes to ``<prefix>.k<n % keys>`` with payload
``{"key": ..., "i": <index within its key>, "n": n}`` (plus ``hold`` / ``block`` seconds for
the messages a test marks: see :mod:`tests.faults.recorder`). Publishes are sequential and each
waits for its PubAck, so the stream holds every key's messages in publish order. A
publish that fails (server restarting, cluster electing a leader) is retried with the same
``Nats-Msg-Id``, so one whose PubAck was lost is dropped by the stream's duplicate window
instead of being stored twice. ``sent`` lists only acknowledged messages.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Mapping

import nats.errors
import nats.js.errors
from nats.aio.client import Client

from tests.support.polling import within


class PublishFailed(AssertionError):
    """A message could not be stored within the retry deadline."""


def fnv1a32(data: bytes) -> int:
    """The hash nats-server's ``partition()`` transform uses (FNV-1a, 32 bit)."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def partition_of(token: str, partitions: int) -> int:
    """Partition of a subject whose partitioning wildcard is ``token``."""
    return fnv1a32(token.encode()) % partitions


class KeyedPublisher:
    """Publishes ``count`` messages over ``keys`` keys at ``rate`` per second."""

    def __init__(self, nc: Client, *, count: int, keys: int = 32, rate: float = 200.0,
                 prefix: str = "orders", holds: Mapping[int, float] | None = None,
                 blocks: Mapping[int, float] | None = None,
                 retry_for: float = 60.0, publish_timeout: float = 2.0,
                 window: int = 1) -> None:
        self.js = nc.jetstream(timeout=publish_timeout)
        self.count = count
        self.keys = keys
        self.rate = rate
        self.prefix = prefix
        self.holds = dict(holds or {})
        #: Messages whose first handler blocks its event loop this long (``time.sleep``).
        self.blocks = dict(blocks or {})
        self.retry_for = retry_for
        #: PubAcks awaited at once. Above 1 (high rates; one connection keeps the stream in
        #: publish order) a failed publish fails the run instead of being retried, which
        #: could put it behind later messages of its key: for scenarios without server
        #: faults only.
        self.window = window
        self.sent: list[tuple[str, int]] = []
        self.retries = 0
        self.longest_publish = 0.0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._task: asyncio.Task[list[tuple[str, int]]] | None = None
        #: Message index before which publishing waits for :meth:`resume` (see
        #: :meth:`pause_before`).
        self.paused_at: int | None = None
        self._resumed = asyncio.Event()

    def pause_before(self, n: int) -> None:
        """Publish messages ``0 .. n-1``, then wait for :meth:`resume`: a scenario that
        needs messages after an event (a pinned standby is pinned, so active, only once a
        message comes) gets them however slowly the machine reached that event (CI with a
        CPU hog on 0f041f0: all 1,200 messages were done before the kill, and the standby
        of test_least_privilege's pinned failover never became active)."""
        if self.window > 1:
            raise ValueError("pause_before needs window=1")
        self.paused_at = n

    def resume(self) -> None:
        """Let a publisher paused by :meth:`pause_before` go on."""
        self._resumed.set()

    def subject(self, n: int) -> str:
        return f"{self.prefix}.k{n % self.keys}"

    def first_of_key(self, token: str, after: int = 0) -> int:
        """The first message index ``>= after`` sent on key ``token`` (e.g. ``"k3"``)."""
        k = int(token.removeprefix("k"))
        return after + (k - after) % self.keys

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="faults-publisher")

    async def wait(self, timeout: float) -> list[tuple[str, int]]:
        """Wait for the publisher started with :meth:`start` to finish."""
        assert self._task is not None
        return await within(asyncio.shield(self._task), timeout, "the publisher to finish")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._task = None

    @property
    def published(self) -> int:
        return len(self.sent)

    def _payload(self, n: int, per_key: dict[str, int]) -> tuple[str, bytes]:
        """Message ``n``'s subject and body (its index within its key counted in
        ``per_key``), with the hold or event-loop block the scenario asked for."""
        subject = self.subject(n)
        i = per_key.get(subject, 0)
        per_key[subject] = i + 1
        body: dict[str, object] = {"key": subject, "i": i, "n": n}
        if n in self.holds:
            body["hold"] = self.holds[n]
        if n in self.blocks:
            body["block"] = self.blocks[n]
        return subject, json.dumps(body).encode()

    async def run(self) -> list[tuple[str, int]]:
        if self.window > 1:
            return await self._run_windowed()
        self.started_at = time.time()
        per_key: dict[str, int] = {}
        next_at = time.monotonic()
        for n in range(self.count):
            if n == self.paused_at:
                await self._resumed.wait()
                next_at = time.monotonic()
            subject, payload = self._payload(n, per_key)
            await self._publish(subject, payload, f"faults-{n}")
            self.sent.append((subject, n))
            # Pacing, not synchronisation: keep the configured rate.
            next_at += 1 / self.rate
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_at = time.monotonic()  # fell behind (a fault): do not burst
        self.finished_at = time.time()
        return self.sent

    async def _run_windowed(self) -> list[tuple[str, int]]:
        """:meth:`run` with up to ``window`` PubAcks outstanding."""
        self.started_at = time.time()
        per_key: dict[str, int] = {}
        next_at = time.monotonic()
        waiting: deque[tuple[str, int, asyncio.Future[object]]] = deque()

        async def settle_first() -> None:
            subject, n, ack = waiting.popleft()
            try:
                await within(ack, self.retry_for, f"the PubAck of faults-{n}")
            except Exception as exc:
                raise PublishFailed(f"publish of faults-{n} to {subject} failed: "
                                    f"{exc!r}") from exc
            self.sent.append((subject, n))

        for n in range(self.count):
            subject, payload = self._payload(n, per_key)
            ack = await self.js.publish_async(subject, payload,
                                              headers={"Nats-Msg-Id": f"faults-{n}"})
            waiting.append((subject, n, ack))
            while waiting and (len(waiting) >= self.window or waiting[0][2].done()):
                await settle_first()
            next_at += 1 / self.rate
            delay = next_at - time.monotonic()
            if delay > 0.005:  # pace in steps of a few ms: a sleep per message is too slow
                await asyncio.sleep(delay)
            elif delay < -0.05:
                next_at = time.monotonic()  # fell behind: do not burst
        while waiting:
            await settle_first()
        self.finished_at = time.time()
        return self.sent

    async def _publish(self, subject: str, data: bytes, msg_id: str) -> None:
        began = time.monotonic()
        deadline = began + self.retry_for
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                await self.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
                self.longest_publish = max(self.longest_publish, time.monotonic() - began)
                return
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                last = exc
                self.retries += 1
            # Back off a little while the server recovers (retry pacing).
            await asyncio.sleep(0.1)
        raise PublishFailed(f"could not publish {msg_id} to {subject} within "
                            f"{self.retry_for:g}s: {last!r}")
