"""Running the handler for one period of activity: in order per key, concurrent across keys.

Ordering modes (``MemberSettings.ordering``):

- ``partition`` and ``key``: messages with the same key (the partition number, or the key
  function's value) run one after another in stream order; different keys run at once, up
  to ``max_in_flight``. A failing message is retried *in place* with backoff, so no later
  message of its key can overtake it; its ``delivery_count`` grows with each attempt, so a
  dead-letter wrapper sees the attempts. Everything held is kept from timing out with
  ``in_progress``. A server redelivery of a message still held (same stream sequence) is
  recognised and not run twice.
- ``none``: every message runs as soon as a slot is free; a failure is nak'ed with backoff.

A handler that returns acks its message (unless it settled it itself); one that raises is
retried. Messages not started when the period ends stay unacknowledged, and the server
gives them to the next owner in stream order.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd.message import Message, Outcome

Handler = Callable[[Message], Awaitable[None] | None]
KeyOf = Callable[[str, Mapping[str, str], int | None], str]


def is_async(handler: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__)


class HandlerRaised(Exception):
    """A sync handler raised something that is not an ``Exception`` (SystemExit,
    KeyboardInterrupt, GeneratorExit, another BaseException) in its thread."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"the handler raised {original!r}")
        self.original = original


def call_in_thread(handler: Callable[[Message], Any], message: Message) -> Any:
    """Run a sync handler (in a worker thread). Whatever it raises crosses back into the
    event loop as an ``Exception``: a ``GeneratorExit`` or ``SystemExit`` surfacing
    through an awaited future would escape the coroutine that catches it."""
    try:
        return handler(message)
    except Exception:
        raise
    except BaseException as exc:
        raise HandlerRaised(exc) from exc


class HandlerReturnedGenerator(TypeError):
    """The handler returned a generator: its body (with a ``yield`` by mistake) never ran."""


def handler_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised while running a handler, is the handler's failure.

    Anything the handler raises is: ``SystemExit``, ``KeyboardInterrupt`` (signals reach
    the daemon through its own handlers, never as exceptions inside a handler),
    ``GeneratorExit``, other ``BaseException`` subclasses, and a ``CancelledError`` of
    the handler's own making. Only the cancellation of the task running it (a drain
    timeout, a stop) is not: that must propagate.
    """
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() == 0
    return True


async def settle_result(result: Any) -> None:
    """Await what a handler returned if it is awaitable; refuse a generator, which means
    the handler's body never ran (returning would ack a message nobody handled)."""
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        raise HandlerReturnedGenerator(
            f"the handler returned {type(result).__name__} instead of running: remove the "
            "'yield' from it (handlers are plain or async functions)")
    if inspect.isawaitable(result):
        await result


class Ordering(Enum):
    """What order messages are processed in within one member."""

    PARTITION = "partition"  # per partition (max in flight 1: the whole member in order)
    KEY = "key"  # per key: same key in stream order, different keys concurrently
    NONE = "none"  # no order: maximum concurrency


class Dispatcher:
    """Holds the messages of one generation and runs the handler on them."""

    def __init__(
        self,
        nc: Client,
        handler: Handler,
        *,
        ordering: Ordering,
        max_in_flight: int,
        ack_wait: float,
        backoff: Callable[[int], float],
        key_of: KeyOf,
        before_start: Callable[[], Awaitable[bool]],
        on_settled: Callable[[], Awaitable[None]],
        log: Any,
        stats: dict[str, int],
    ) -> None:
        self._nc = nc
        self._handler = handler
        self._handler_is_async = is_async(handler)
        self._ordering = ordering
        self._key_of = key_of
        self._backoff = backoff
        self._before_start = before_start
        self._on_settled = on_settled
        self._log = log
        self._stats = stats
        self._ack_wait = ack_wait
        self._slots = asyncio.Semaphore(max_in_flight)
        self._held: dict[int, Message] = {}
        self._keys: dict[str, deque[Message]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        self._keepalive: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin keeping held messages alive; paired with :meth:`drain`."""
        self._keepalive = asyncio.create_task(self._keep_alive(), name="cgroupd-keepalive")

    @property
    def holding(self) -> int:
        """Messages delivered to us and not yet settled."""
        return len(self._held)

    async def settle(self, partitions: set[int], timeout: float) -> bool:
        """Wait until no message of ``partitions`` is held; False if that takes too long."""
        deadline = asyncio.get_running_loop().time() + timeout
        while any(m.partition in partitions for m in self._held.values()):
            if asyncio.get_running_loop().time() > deadline or self._closing.is_set():
                return False
            await asyncio.sleep(0.005)
        return True

    def submit(self, raw: Msg) -> None:
        """Take a delivery from the data consumer (called from the puller's callback)."""
        if self._closing.is_set():
            # Not ours to start any more: hand it back now rather than after the ack wait.
            if raw.reply:
                self._spawn(self._settle(self._nc.publish(raw.reply, b"-NAK")))
            return
        try:
            message = Message.from_msg(self._nc, raw)
        except Exception as exc:  # noqa: BLE001 - not a JetStream delivery: nothing to ack
            self._log.warning("ignored a message that is not a JetStream delivery",
                              subject=raw.subject, error=repr(exc))
            return
        seq = message.stream_sequence
        if seq in self._held:
            # The server redelivered a message we still hold (ack wait passed while it ran
            # or waited): the held copy settles it, running it twice would break order.
            self._stats["duplicates"] += 1
            return
        self._held[seq] = message
        self._stats["delivered"] += 1
        if self._ordering is Ordering.NONE:
            self._spawn(self._run_unordered(message))
            return
        key = self._key_of(message.subject, message.headers, message.partition)
        queue = self._keys.get(key)
        if queue is not None:
            queue.append(message)
            return
        self._keys[key] = deque([message])
        self._spawn(self._run_key(key))

    async def drain(self, timeout: float) -> None:
        """Start nothing new; let running handlers finish for up to ``timeout``."""
        self._closing.set()
        if self._keepalive is not None:
            self._keepalive.cancel()
        tasks = set(self._workers)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                self._log.warning("handlers still running after the drain timeout were "
                                  "cancelled; their messages will be redelivered",
                                  count=len(late))
                await asyncio.wait(late)
        if self._keepalive is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._workers.add(task)
        task.add_done_callback(self._workers.discard)

    async def _run_key(self, key: str) -> None:
        """Run one key's messages in order, each until it is settled."""
        queue = self._keys[key]
        try:
            while queue and not self._closing.is_set():
                message = queue[0]
                while not await self._invoke(message):
                    if self._closing.is_set():
                        return
                    delay = self._backoff(message.delivery_count)
                    self._stats["retries"] += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._closing.wait(), delay)
                    if self._closing.is_set():
                        return
                    message.delivery_count += 1
                queue.popleft()
                self._held.pop(message.stream_sequence, None)
                await self._on_settled()
        finally:
            if self._keys.get(key) is queue:
                del self._keys[key]

    async def _run_unordered(self, message: Message) -> None:
        if not await self._invoke(message) and not self._closing.is_set():
            await self._settle(message.nak(self._backoff(message.delivery_count)))
            self._count(message.outcome)
        self._held.pop(message.stream_sequence, None)
        await self._on_settled()

    async def _invoke(self, message: Message) -> bool:
        """Run the handler once. True when the message is settled (acked, termed, nak'ed)."""
        async with self._slots:
            if self._closing.is_set() or not await self._before_start():
                self._closing.set()
                return False
            try:
                if self._handler_is_async:
                    result = await self._handler(message)  # type: ignore[misc]
                else:
                    result = await asyncio.to_thread(call_in_thread, self._handler, message)
                await settle_result(result)
            except BaseException as exc:  # a handler failure never kills us
                if not handler_failure(exc):
                    raise
                self._log.warning("handler failed; retrying", subject=message.subject,
                                  seq=message.stream_sequence,
                                  deliveries=message.delivery_count, error=repr(exc))
                if message.outcome is None:
                    return False
            else:
                if message.outcome is None:
                    await self._settle(message.ack())
        self._count(message.outcome)
        return True

    def _count(self, outcome: Outcome | None) -> None:
        if outcome is not None:
            self._stats[{Outcome.ACK: "acked", Outcome.NAK: "naked",
                         Outcome.TERM: "termed"}[outcome]] += 1

    async def _settle(self, op: Awaitable[None]) -> None:
        try:
            await op
        except Exception as exc:  # noqa: BLE001 - an ack lost here is a redelivery later
            self._log.warning("ack could not be sent", error=repr(exc))

    async def _keep_alive(self) -> None:
        """Every held message, running or waiting its turn, is kept from redelivery."""
        while True:
            await asyncio.sleep(self._ack_wait / 3)
            for message in list(self._held.values()):
                if message.outcome is None:
                    await self._settle(message.in_progress())
