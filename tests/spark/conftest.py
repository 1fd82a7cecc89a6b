"""Spark tests: no query driver outlives its test."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.support.spark_support import ManualQuery

#: The thread a reader's driver side runs its loop, connection and lease on.
DRIVER_THREAD = "cgroupd-spark-driver"


@pytest.fixture(autouse=True)
def no_driver_left_running() -> Iterator[None]:
    """A driver left open reconnects for ever: it logged into a later unit test's captured
    stderr (CI on 90d8111), and would join any server that later listens on its port.
    Close what the test left open, then fail it, naming what it left."""
    before = set(threading.enumerate())
    yield
    left = [q.options.stream for q in ManualQuery.open]
    for query in list(ManualQuery.open):
        query.close()
    running = [t for t in threading.enumerate() if t not in before and t.name == DRIVER_THREAD]
    assert not left, f"the test left ManualQuery of {left} open (close it, or use `with`)"
    assert not running, f"the test left {len(running)} reader driver thread(s) running"
