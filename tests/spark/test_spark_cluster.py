"""The source and the sink on a Spark standalone cluster (issue 30): a master and two
1-core workers on this machine, a worker killed in the middle of a query, and every
message once in the output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from nats.js import api

from cgroupd.nats.jetstream import JetStream
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.spark_cluster import ROOT, StandaloneCluster, descendants
from tests.support.spark_support import make_group, wait_sourced

pytestmark = pytest.mark.slow

MESSAGES = 20_000
PER_BATCH = 5_000
#: The worker is killed while the sink has published this many to this many messages
#: of a batch after the first: tasks of the batch are running on both executors.
KILL_WINDOW = (500, PER_BATCH - 500)


def _end(proc: subprocess.Popen[str]) -> None:
    """End the driver process and its JVM by pid."""
    if proc.poll() is None:
        for pid in reversed(descendants(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(600)  # JVMs start slowly on a busy 2-core machine
async def test_a_worker_killed_mid_query_loses_and_duplicates_nothing(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path) -> None:
    """20,000 keyed messages read from a group by the source and published by the sink
    (``out.<key>``) on a standalone cluster, 5,000 a batch; while a batch after the
    first is being published (the output stream holds 500 to 4,500 of its messages),
    one worker is SIGKILLed with its executor and Python workers. The query finishes on
    the other worker (the lost tasks run again, replaying their reads and publishes)
    and the output stream holds every message exactly once; the sink's commits count
    every row once, as published or as a duplicate the server dropped."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    await jetstream.add_stream(api.StreamConfig(name="OUT", subjects=["out.>"],
                                                duplicate_window=300.0))
    await publish_keyed(jetstream, MESSAGES, keys=16)
    await wait_sourced(jetstream, "ORDERS-g", MESSAGES)
    with StandaloneCluster(tmp_path / "cluster") as cluster, \
            open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "tests.support.spark_cluster", "--master", cluster.url,
             "--servers", nats_server.url, "--per-batch", str(PER_BATCH),
             "--tmp", str(tmp_path / "driver")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            follow = asyncio.ensure_future(asyncio.to_thread(_follow, driver))
            killed = await _kill_mid_batch(jetstream, cluster, follow)
            lines = await follow
        finally:
            _end(driver)
        # The sink's commits on the driver: a batch replayed after the kill reports the
        # rows the server dropped as duplicates (shown on failure).
        published = [line for line in (tmp_path / "driver.log").read_text(
            errors="replace").splitlines() if "batch published" in line]
        done = lines[-1]
        assert killed, f"no worker was killed: {lines}"
        assert done.get("done") and done["error"] is None, (lines, published)
        counts = [(int(re.search(r"published=(\d+)", x)[1]),  # type: ignore[index]
                   int(re.search(r"duplicates=(\d+)", x)[1]))  # type: ignore[index]
                  for x in published]
        assert sum(p + d for p, d in counts) == MESSAGES, published
        assert done["rows"] == MESSAGES, "Spark's progress counts each batch once"
        assert cluster.alive_workers() == 1
    info = await jetstream.stream_info("OUT")
    assert info is not None
    seen: dict[int, int] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await jetstream.js.get_msg("OUT", seq)
        n = json.loads(msg.data)["n"]
        seen[n] = seen.get(n, 0) + 1
    assert sorted(seen) == list(range(MESSAGES)), "a message is missing"
    assert max(seen.values()) == 1, "a message was published twice"


async def _kill_mid_batch(js: JetStream, cluster: StandaloneCluster,
                          follow: asyncio.Future[list[dict[str, Any]]]) -> list[int]:
    """SIGKILL worker 0 once the output is inside :data:`KILL_WINDOW` of a batch after
    the first (polled every 10 ms; a batch publishes for a few hundred ms at least)."""
    while not follow.done():
        info = await js.stream_info("OUT")
        count = info.state.messages if info is not None else 0
        if PER_BATCH <= count < MESSAGES - PER_BATCH + KILL_WINDOW[1] \
                and KILL_WINDOW[0] <= count % PER_BATCH <= KILL_WINDOW[1]:
            return await asyncio.to_thread(cluster.kill_worker, 0)
        await asyncio.sleep(0.01)
    return []


def _follow(driver: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """The driver's JSON lines, to the last."""
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + 500
    assert driver.stdout is not None
    for raw in driver.stdout:
        line = json.loads(raw)
        lines.append(line)
        if line.get("done") or time.monotonic() > deadline:
            break
    return lines
