"""The source and the sink on a Spark standalone cluster (issue 30): a master and two
1-core workers on this machine, a worker killed in the middle of a query, and every
message once in the output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
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

from cgroupd.jetstream import JetStream
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.spark_cluster import ROOT, StandaloneCluster, descendants
from tests.support.spark_support import make_group, wait_sourced

pytestmark = pytest.mark.slow

MESSAGES = 20_000
PER_BATCH = 2_500


def _end(proc: subprocess.Popen[str]) -> None:
    """End the driver process and its JVM by pid."""
    if proc.poll() is None:
        for pid in reversed(descendants(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.timeout(600)  # JVMs start slowly on a busy 2-core machine
async def test_a_worker_killed_mid_query_loses_and_duplicates_nothing(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path) -> None:
    """20,000 keyed messages read from a group by the source and published by the sink
    (``out.<key>``) on a standalone cluster, 2,500 a batch; once the first batch is
    done, one worker is SIGKILLed with its executor and Python workers. The query
    finishes on the other worker (the lost tasks run again, replaying their reads and
    publishes) and the output stream holds every message exactly once."""
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
            lines = await asyncio.to_thread(_follow, driver, cluster)
        finally:
            _end(driver)
        # The sink's commits on the driver: a batch replayed after the kill reports the
        # rows the server dropped as duplicates (shown on failure).
        published = [line for line in (tmp_path / "driver.log").read_text(
            errors="replace").splitlines() if "batch published" in line]
        killed = [line for line in lines if line.get("killed")]
        done = lines[-1]
        assert killed, f"no worker was killed: {lines}"
        assert done.get("done") and done["error"] is None, (lines, published)
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


def _follow(driver: subprocess.Popen[str], cluster: StandaloneCluster) -> list[dict[str, Any]]:
    """The driver's JSON lines; the worker is killed after the first finished batch."""
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + 500
    assert driver.stdout is not None
    for raw in driver.stdout:
        line = json.loads(raw)
        lines.append(line)
        if line.get("batch") == 0 and not any(x.get("killed") for x in lines):
            lines.append({"killed": cluster.kill_worker(0)})
        if line.get("done") or time.monotonic() > deadline:
            break
    return lines
