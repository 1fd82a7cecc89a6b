"""Calling a handler, sync or async: the one place that knows how.

An ``async def`` handler (or an object whose ``__call__`` is one) is awaited; a sync one
runs in a worker thread, so pulls and heartbeats keep flowing while it works. The
dispatcher and the daemon's handler wrapper both call handlers through
:func:`call_handler`; each says which thread runner to use (the dispatcher's own keeps
track of threads a drain must wait for).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from cgroupd.errors import HandlerRaised, HandlerReturnedGenerator
from cgroupd.message import Message

#: Runs ``fn(*args)`` in a worker thread and returns its result.
InThread = Callable[..., Awaitable[Any]]


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
