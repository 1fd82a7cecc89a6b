"""tests/support/virtualclock.py: virtual time that jumps to the next timer when every
task waits, without overtaking real I/O or a running thread."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from tests.support.virtualclock import START, VirtualClockLoop

pytestmark = pytest.mark.virtual_clock


async def test_the_marker_runs_the_test_on_the_virtual_loop() -> None:
    """A ``virtual_clock`` test runs on :class:`VirtualClockLoop`."""
    assert isinstance(asyncio.get_running_loop(), VirtualClockLoop)


async def test_an_hour_of_sleep_takes_milliseconds() -> None:
    """``asyncio.sleep(3600)`` moves the loop's time by an hour and no wall time."""
    loop = asyncio.get_running_loop()
    began, wall = loop.time(), time.monotonic()
    await asyncio.sleep(3600)
    assert loop.time() - began == pytest.approx(3600)
    assert time.monotonic() - wall < 0.5


async def test_timers_fire_in_order_at_their_times() -> None:
    """Timers and sleeps of many tasks run in the order of their deadlines, each at its
    own virtual time."""
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        seen.append((name, loop.time() - START))

    loop.call_later(2.5, lambda: seen.append(("timer", loop.time() - START)))
    await asyncio.gather(sleeper("c", 3.0), sleeper("a", 1.0), sleeper("b", 2.0))
    assert [name for name, _ in seen] == ["a", "b", "timer", "c"]
    assert [round(at, 6) for _, at in seen] == [1.0, 2.0, 2.5, 3.0]


async def test_a_timeout_fires_virtually() -> None:
    """``asyncio.timeout`` around a wait that never ends expires at its virtual time."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(30):
            await asyncio.Event().wait()
    assert loop.time() - began == pytest.approx(30)


async def test_ready_io_is_served_before_a_jump() -> None:
    """Data arriving on a socket wakes its reader at once: time does not jump past it
    to a far timer that another task waits on."""
    loop = asyncio.get_running_loop()
    left, right = socket.socketpair()
    left.setblocking(False)
    right.setblocking(False)
    try:
        far = asyncio.ensure_future(asyncio.sleep(1000))
        began = loop.time()
        right.send(b"x")
        assert await loop.sock_recv(left, 1) == b"x"
        assert loop.time() - began < 1
        far.cancel()
    finally:
        left.close()
        right.close()


async def test_a_running_thread_is_waited_for_not_overtaken() -> None:
    """While a thread runs, the loop waits for it for real (its time follows the wall
    clock): a 0.2 s thread ends before a 10 s virtual timeout."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with asyncio.timeout(10):
        await asyncio.to_thread(time.sleep, 0.2)
    assert 0.2 <= loop.time() - began < 10


async def test_a_pipe_written_by_a_thread_wakes_the_loop() -> None:
    """A reader on a pipe that a thread writes after a real delay gets the data (the
    loop waits on the thread's end for real rather than jumping)."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    os.set_blocking(r, False)
    got: asyncio.Future[bytes] = loop.create_future()
    loop.add_reader(r, lambda: got.done() or got.set_result(os.read(r, 1)))
    try:
        def write_later() -> None:
            time.sleep(0.05)
            os.write(w, b"y")
        thread = asyncio.ensure_future(asyncio.to_thread(write_later))
        assert await got == b"y"
        await thread
    finally:
        loop.remove_reader(r)
        os.close(r)
        os.close(w)
