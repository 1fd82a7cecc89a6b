"""What the console reads, shared by every browser that watches: one status read per
group per refresh interval however many pages poll (:class:`Shared`, a single-flight
cache), and each group's timeline, followed once (its advisories and the server's pin
changes) and kept in a bounded ring."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from cgroupd import views
from cgroupd.cli.observe import problem, status_and_instances
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.nats import events
from cgroupd.nats.jetstream import JetStream

T = TypeVar("T")

#: Timeline entries kept per group (the newest; older ones fall off).
TIMELINE_SIZE = 500


class Shared(Generic[T]):
    """The last result of ``read``, fresh for ``ttl`` seconds after the read began; a
    caller arriving while a read runs waits for that one (no second read). A failure is
    returned to the callers of that read only: the next caller after ``ttl`` reads again.
    """

    def __init__(self, read: Callable[[], Awaitable[T]], ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self.ttl = ttl
        self._clock = clock
        self._began = -float("inf")
        #: The last good result (empty until the first read succeeds).
        self._value: list[T] = []
        self._running: asyncio.Future[T] | None = None
        #: Reads made (each one the expensive call).
        self.reads = 0

    def expire(self) -> None:
        """The next caller reads again (after a change made through the console)."""
        self._began = -float("inf")

    async def get(self) -> T:
        if self._running is None:
            if self._value and self._clock() - self._began < self.ttl:
                return self._value[0]
            self._began = self._clock()
            self.reads += 1
            self._running = asyncio.ensure_future(self._read())
            self._running.add_done_callback(self._finished)
        # A caller going away (a closed tab) must not cancel the read the others wait on.
        return await asyncio.shield(self._running)

    def _finished(self, future: asyncio.Future[T]) -> None:
        self._running = None
        if not future.cancelled() and future.exception() is None:
            self._value = [future.result()]


class Timeline:
    """A group's events, numbered in arrival order so a page asks only for the new ones."""

    def __init__(self, size: int = TIMELINE_SIZE) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=size)
        self._seq = itertools.count(1)

    def add(self, kind: str, text: str, when: str | None = None, **fields: Any) -> None:
        self._entries.append({"seq": next(self._seq), "kind": kind,
                              "time": when or events.iso(time.time()), "text": text,
                              **fields})

    def after(self, seq: int) -> list[dict[str, Any]]:
        return [e for e in self._entries if e["seq"] > seq]


def _advisory_entry(event: dict[str, Any]) -> dict[str, Any]:
    """An advisory as a timeline entry: its line as ``cgroupd events`` prints it, and the
    few fields a page marks it by (strings only: anyone may publish there)."""
    def text(key: str) -> str | None:
        value = event.get(key)
        return value[:200] if isinstance(value, str) else None

    return {"kind": events.kind_of(event)[:40], "text": views.event_line(event),
            "when": text("timestamp"), "member": text("member"),
            "instance": text("instance")}


class GroupWatch:
    """One group as every page sees it: its shared status read and its timeline."""

    def __init__(self, js: JetStream, stream: str, group: str, interval: float,
                 discovery_wait: float) -> None:
        self.js = js
        self.stream = stream
        self.group = group
        self.discovery_wait = discovery_wait
        self.timeline = Timeline()
        self.status: Shared[dict[str, Any]] = Shared(self._read, interval)
        self._last_good: dict[str, Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pins_for: str | None = None

    async def start(self) -> None:
        """Follow the group's advisories; returns once subscribed (nothing later is
        missed)."""
        await self._follow(lambda ready: events.follow(self.js.nc, self.stream, self.group,
                                                       ready), self._on_advisory)

    async def _follow(self, make: Callable[[Callable[[], None]],
                                           AsyncIterator[dict[str, Any]]],
                      on_event: Callable[[dict[str, Any]], None]) -> None:
        """Run ``make(ready)``'s events into ``on_event`` in a task kept until close;
        returns once the source called ``ready`` (or failed to subscribe: raised)."""
        subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ready() -> None:
            if not subscribed.done():
                subscribed.set_result(None)

        async def run() -> None:
            async for event in make(ready):
                on_event(event)

        task = asyncio.create_task(run())
        self._tasks.append(task)
        done, _ = await asyncio.wait({task, subscribed},
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()

    def _on_advisory(self, event: dict[str, Any]) -> None:
        entry = _advisory_entry(event)
        self.timeline.add(entry.pop("kind"), entry.pop("text"), entry.pop("when"), **entry)

    def _on_pin(self, event: dict[str, Any]) -> None:
        consumer = str(event.get("consumer"))
        static = self._pins_for == self.stream
        if static and not consumer.startswith(f"{self.group}-"):
            return  # another static group's member consumer on the same stream
        member = consumer[len(self.group) + 1:] if static else consumer
        self.timeline.add(str(event.get("type")),
                          views.pin_line(event, self.stream, self.group, member),
                          event.get("timestamp"), member=member, instance=None)

    async def _watch_pins(self, consume_stream: str) -> None:
        """Follow the server's pin advisories on the group's consumers, once its stream
        is known (the first status read)."""
        if self._pins_for is not None:
            return
        self._pins_for = consume_stream
        try:
            await self._follow(
                lambda ready: events.follow_pins(self.js.nc, consume_stream, ready),
                self._on_pin)
        except Exception:  # noqa: BLE001 - the status still shows; tried again next read
            self._pins_for = None

    async def _read(self) -> dict[str, Any]:
        """One status read as ``cgroupd status`` makes it (record, consumers, lag,
        discovery), shaped by the same views; a failure keeps the last good data and says
        what went wrong."""
        try:
            st, instances = await status_and_instances(self.js, self.stream, self.group,
                                                       self.discovery_wait)
        except Exception as exc:  # noqa: BLE001 - shown in the page, read again next time
            if self._last_good is None:
                return {"stream": self.stream, "group": self.group, "error": problem(exc),
                        "read_at": events.iso(time.time())}
            return {**self._last_good, "error": problem(exc), "stale": True}
        await self._watch_pins(st.group.consume_stream)
        data = {
            "stream": self.stream, "group": self.group,
            "read_at": events.iso(time.time()),
            "status": views.status_data(st, instances),
            "members": views.members_data(st, instances),
            "record": views.group_data(self.stream, self.group, st.group.config,
                                       st.group.revision),
            "error": None, "stale": False,
        }
        self._last_good = data
        return data

    async def close(self) -> None:
        # Cancelled until each ends (see cgroupd.core.tasks), then their outcomes read.
        await asyncio.gather(*(cancel_and_wait(task) for task in self._tasks))
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
