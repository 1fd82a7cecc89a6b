"""Issue 30 rows 2 and 6: a Spark query that holds members is in the group's picture
(``status``, ``member ls``, events) and says what it does in its log lines."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from nats.aio.msg import Msg
from pyspark.sql import SparkSession

from cgroupd import admin, views
from cgroupd.nats import events
from cgroupd.nats.jetstream import JetStream
from cgroupd.spark.source import close_executor_connections
from tests.support.groups import publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually, eventually_blocking
from tests.support.spark_support import (
    make_group,
    shared_spark,
    source,
    to_parquet,
    wait_sourced,
)

pytestmark = pytest.mark.slow

WQ = "ORDERS-g"


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return shared_spark()


@pytest.fixture(autouse=True)
def _executor_connections() -> Iterator[None]:
    yield
    close_executor_connections()


async def test_status_member_ls_and_events_show_a_workqueue_query(
        spark: SparkSession, nats_server: NatsServer, jetstream: JetStream,
        tmp_path: Path) -> None:
    """A running mode=workqueue query on member m1 is m1's active instance for
    ``status`` (instance = the lease id, its host, 'held by Spark' with the application
    id and since when), for ``member ls`` (an instance that answered discovery: active,
    Spark, the application id) and for events (``active`` when it took m1,
    ``stepped_down`` when it stopped); m2, which nobody holds, is still reported as
    without an active instance. Before this, status said m1 had none."""
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    await publish_keyed(jetstream, 200, keys=16)
    await wait_sourced(jetstream, WQ, 200)
    seen: list[dict[str, Any]] = []

    async def on_event(msg: Msg) -> None:
        seen.append(json.loads(msg.data))

    sub = await jetstream.nc.subscribe(events.events_filter("ORDERS", "g"), cb=on_event)
    await jetstream.nc.flush()
    # Started on this thread: Spark looks the format up in the session active on it.
    query = to_parquet(source(spark, nats_server.url, mode="workqueue", member="m1"),
                       tmp_path / "out", available_now=False)
    try:
        await asyncio.to_thread(
            eventually_blocking,
            lambda: sum(p["numInputRows"] for p in query.recentProgress) > 0, 90,
            what="a first batch")
        app = spark.sparkContext.applicationId
        found: list[dict[str, Any]] = []

        async def told() -> bool:
            found[:] = await events.discover(jetstream.nc, "ORDERS", "g", 0.3)
            return any(i.get("application") == app for i in found)

        await eventually(told, timeout=30, what="the driver to know the application id")
        st = await admin.group_status(jetstream, "ORDERS", "g", in_flight=True)
        data = views.status_data(st, found)
        mine = [r for r in data["partitions"] if r["member"] == "m1"]
        lease = mine[0]["instance"]
        assert lease.startswith("spark-")
        assert all(r["instance"] == lease and r["host"] == events.hostname()
                   and r["holder"]["kind"] == "spark" and r["holder"]["application"] == app
                   and r["holder"]["since"] for r in mine), mine
        assert st.members_without_instance == ["m2"]
        text = views.status_text(data, st)
        assert f"m1: lease {lease} on {events.hostname()}, application {app}" in text
        members = {r["member"]: r for r in views.members_data(st, found)}
        assert members["m1"]["active_instance"] == lease
        (answer,) = members["m1"]["instances"]
        assert answer["state"] == "active" and answer["holder"] == "spark"
        assert answer["partitions"] == [0, 1] and answer["since"]
        assert f"active (Spark {app})" in views.members_text("ORDERS", "g",
                                                             list(members.values()))
        active = [e for e in seen if events.kind_of(e) == "active"]
        assert [(e["member"], e["instance"], e["holder"]) for e in active] == [
            ("m1", lease, "spark")]
    finally:
        query.stop()
    await eventually(lambda: any(events.kind_of(e) == "stepped_down" for e in seen),
                     what="the stepped_down event")
    down = [e for e in seen if events.kind_of(e) == "stepped_down"]
    assert [(e["member"], e["instance"], e["reason"]) for e in down] == [
        ("m1", lease, "query stopped")]
    await sub.unsubscribe()
    st = await admin.group_status(jetstream, "ORDERS", "g")
    assert st.members_without_instance == ["m1", "m2"]


def test_worker_logging_shows_info_lines_on_stderr() -> None:
    """Spark's Python workers configure no logging: worker_logging() makes the source's
    INFO lines (lease taken, purges) visible on the process's stderr; a process that
    configured logging keeps its own."""
    script = ("from cgroupd.spark import worker_logging; worker_logging(); "
              "from cgroupd.core import logs; "
              "logs.get_logger('cgroupd.spark.lease').info('lease taken', group='S/g')")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "INFO cgroupd.spark.lease: lease taken group=S/g" in run.stderr
    configured = subprocess.run(
        [sys.executable, "-c", "import logging; logging.basicConfig(level='ERROR'); "
         + script], capture_output=True, text=True, timeout=60, check=True)
    assert "lease taken" not in configured.stderr

