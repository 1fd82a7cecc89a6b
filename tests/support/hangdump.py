"""Where a hung test's coroutines wait, printed just before pytest-timeout ends it.

pytest-timeout dumps every thread's stack, but a thread running an event loop shows only
the loop waiting in ``select``: the await chains of its tasks, which say what the test is
stuck on, are not on any thread's stack (CI on e92d1b3: a Spark lease release that waited
for ever said nothing about where). A few seconds before the timeout fires, this prints
each running loop's tasks with their await chains.
"""

from __future__ import annotations

import asyncio
import io
import linecache
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

LEAD = 5.0
"""Seconds before pytest-timeout's own timeout that the tasks are printed."""


def running_loops() -> list[asyncio.AbstractEventLoop]:
    """Event loops that some thread is running now, found on the threads' stacks (a loop
    belongs to the thread that runs it; there is no registry to ask)."""
    loops: dict[int, asyncio.AbstractEventLoop] = {}
    for frame in sys._current_frames().values():
        walk: FrameType | None = frame
        while walk is not None:
            owner = walk.f_locals.get("self")
            if isinstance(owner, asyncio.AbstractEventLoop) and owner.is_running():
                loops[id(owner)] = owner
                break
            walk = walk.f_back
    return list(loops.values())


def await_chain(task: asyncio.Task[Any]) -> list[str]:
    """The task's coroutine and every coroutine it awaits, outermost first, down to what
    it waits on (``Task.print_stack`` shows only the outermost frame of a suspended one)."""
    lines: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None and len(lines) < 60:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            lines.append(f"  waits on {awaited!r}")
            break
        code = frame.f_code
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}: {source}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return lines


def describe_tasks() -> str:
    """Every running loop's tasks with their await chains (read from another thread: a
    best-effort snapshot of a loop that is hung anyway)."""
    out = io.StringIO()
    for loop in running_loops():
        tasks = asyncio.all_tasks(loop)
        out.write(f"--- event loop {loop!r}: {len(tasks)} tasks\n")
        for task in tasks:
            out.write(f"{task!r}\n")
            out.writelines(line + "\n" for line in await_chain(task))
    return out.getvalue()


def arm(timeout: float, write: Callable[[str], None]) -> Callable[[], None]:
    """Print the tasks ``LEAD`` seconds before ``timeout``; returns the disarm call."""
    def fire() -> None:
        write("\n+++ hung test: asyncio tasks before pytest-timeout ends it +++\n")
        write(describe_tasks() or "(no event loop is running)\n")

    timer = threading.Timer(max(timeout - LEAD, timeout / 2), fire)
    timer.name = "hangdump"
    timer.daemon = True
    timer.start()
    return timer.cancel
