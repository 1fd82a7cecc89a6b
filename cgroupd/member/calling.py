"""Calling a handler, sync or async: the one place that knows how, and the threads a
drain must wait for (issue 13 item 7).

An ``async def`` handler (or an object whose ``__call__`` is one) is awaited; a sync one
runs in a worker thread, so pulls and heartbeats keep flowing while it works. A thread
cannot be cancelled: a stopping member must wait for it (and settle its message) before
its partitions go to the next owner. :class:`Threads` counts the threads of one
dispatcher; :func:`run_in_thread` finds the one of the handler running in the current
task, so handler wrappers that call sync user code use it instead of ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from cgroupd.core.errors import HandlerRaised, HandlerReturnedGenerator
from cgroupd.nats.message import Message

#: Runs ``fn(*args)`` in a worker thread and returns its result.
InThread = Callable[..., Awaitable[Any]]

#: The threads of the dispatcher calling the handler of the current task.
_calling: contextvars.ContextVar[Threads | None] = contextvars.ContextVar(
    "cgroupd_threads", default=None)


class Threads:
    """The threads running sync handlers for one dispatcher, counted until each returns
    (cancelling the task that awaits one does not stop it)."""

    def __init__(self) -> None:
        self.count = 0
        #: Tasks awaiting a thread: a drain waits for them instead of cancelling them.
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Set while no thread runs.
        self.done = asyncio.Event()
        self.done.set()

    def enter(self) -> None:
        """The current task calls handlers for these threads' dispatcher (see
        :func:`run_in_thread`)."""
        _calling.set(self)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        self.count += 1
        self.done.clear()

        def finished() -> None:
            self.count -= 1
            if not self.count:
                self.done.set()

        def run() -> Any:
            try:
                return fn(*args)
            finally:
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:  # loop closed: nobody waits
                    pass

        ctx = contextvars.copy_context()
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        try:
            return await loop.run_in_executor(None, functools.partial(ctx.run, run))
        finally:
            if task is not None:
                self.tasks.discard(task)


async def run_in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking function for the handler being called, in a thread its dispatcher
    keeps track of (outside a dispatcher: ``asyncio.to_thread``)."""
    threads = _calling.get()
    if threads is None:
        return await asyncio.to_thread(fn, *args)
    return await threads.run(fn, *args)


def is_async(handler: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__)


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
    if result is None:  # the common case, per message: skip the inspection
        return
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        raise HandlerReturnedGenerator(
            f"the handler returned {type(result).__name__} instead of running: remove the "
            "'yield' from it (handlers are plain or async functions)")
    if inspect.isawaitable(result):
        await result


async def call_handler(handler: Callable[[Message], Any], message: Message,
                       asynchronous: bool | None = None,
                       in_thread: InThread = asyncio.to_thread) -> None:
    """Run ``handler`` on ``message`` to completion: awaited when ``asynchronous`` (by
    default :func:`is_async`), otherwise in a thread through ``in_thread``; what it
    returns is awaited if awaitable, and a generator is refused (:func:`settle_result`)."""
    if asynchronous is None:
        asynchronous = is_async(handler)
    if asynchronous:
        result = await handler(message)
    else:
        result = await in_thread(call_in_thread, handler, message)
    await settle_result(result)
