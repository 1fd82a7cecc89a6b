"""The hung-test report names the coroutine a loop's task waits in, even for a loop that
another thread runs (as the Spark driver's does)."""

from __future__ import annotations

import asyncio
import threading

from tests.support import hangdump


async def waiting_for_the_release_that_never_comes(started: threading.Event) -> None:
    started.set()
    await asyncio.Event().wait()


async def releasing(started: threading.Event) -> None:
    await waiting_for_the_release_that_never_comes(started)


def test_the_report_names_where_a_task_of_another_threads_loop_waits() -> None:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    task = loop.create_task(releasing(started))
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        assert started.wait(5)
        report = hangdump.describe_tasks()
        assert "waiting_for_the_release_that_never_comes" in report
        assert "await asyncio.Event().wait()" in report  # the innermost coroutine too
    finally:
        loop.call_soon_threadsafe(task.cancel)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_arm_fires_before_the_timeout_and_disarm_stops_it() -> None:
    fired = threading.Event()
    disarm = hangdump.arm(0.2, lambda text: fired.set())
    assert fired.wait(5)
    disarm()
    quiet = threading.Event()
    hangdump.arm(60, lambda text: quiet.set())()
    assert not quiet.wait(0.3)
