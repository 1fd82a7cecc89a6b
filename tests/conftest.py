"""Shared fixtures: real NATS servers (see tests/support/natsserver.py for the how and why)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from cgroupd.nats.jetstream import JetStream
from tests.support import hangdump, peer
from tests.support.cli import (
    restore_logging,  # noqa: F401 - autouse for every test: the CLI configures logging globally
)
from tests.support.groups import Fleet
from tests.support.natsserver import (
    DockerNatsServer,
    NatsCluster,
    NatsServer,
    client_options,
    running_cluster,
    running_server,
)


def pytest_configure(config: pytest.Config) -> None:
    _without_the_developers_nats_context()
    config.addinivalue_line("markers", "cluster: uses a 3-node nats-server cluster (nats_cluster)")
    config.addinivalue_line(
        "markers", "alone: fault injection or a 3-node cluster; scripts/test.sh runs these "
                   "after the rest, with nothing beside them (set at collection)"
    )
    config.addinivalue_line(
        "markers", "slow: takes seconds (failover, timeouts); deselect with -m 'not slow'"
    )
    config.addinivalue_line(
        "markers", "prometheus: needs promtool / the Prometheus server (Debian's prometheus "
                   "package, installed by scripts/test.sh)"
    )
    config.addinivalue_line(
        "markers", "interop: runs the reference implementation (natsio-pcgroups, in a "
                   "cached venv of a Python >= 3.12) next to cgroupd; see tests/support/peer.py"
    )


#: Tests that must not overlap one another when the suite runs on several workers
#: (``pytest -n 2 --dist loadgroup``, scripts/test.sh): each group runs in order on one
#: worker while the other worker takes the rest. Spark starts a JVM per session; the
#: console drives one headless Chromium; the interop tests share the reference's venv.
#: Fault injection and 3-node clusters are marked ``alone``: they measure takeover times,
#: so scripts/test.sh runs them after the rest, with no CPU-bound test beside them (on
#: two workers beside the rest, a pinned stall test and a pinned toggle test failed in CI
#: runs that passed alone), two at a time: they mostly wait on timers and servers.
SERIAL_GROUPS = {"spark": "spark", "console": "browser"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # Any test using the cluster fixture gets the marker, so `-m "not cluster"` is reliable.
        cluster = "nats_cluster" in getattr(item, "fixturenames", ())
        if cluster:
            item.add_marker(pytest.mark.cluster)
        folder = item.path.parent.name
        group = SERIAL_GROUPS.get(folder)
        if group is None and item.get_closest_marker("interop"):
            group = "peer"  # one reference venv, one peer at a time
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if folder == "faults" or cluster:  # a 3-node cluster in any folder (Spark's too)
            item.add_marker(pytest.mark.alone)


#: Tables a test hands to the session's summary (``report.user_properties`` entries named
#: :data:`SUMMARY_TABLE`, set by tests/faults/conftest.py): collected here, where xdist's
#: controller sees every worker's reports, and printed at the end.
SUMMARY_TABLE = "fault_scenario"
_TABLES: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _TABLES.extend(str(value) for name, value in report.user_properties
                   if name == SUMMARY_TABLE)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _TABLES:
        terminalreporter.section("fault scenarios")
        for table in _TABLES:
            terminalreporter.write_line(table)
            terminalreporter.write_line("")


_HANGDUMP_DISARM = pytest.StashKey[Any]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Arm :mod:`tests.support.hangdump` beside pytest-timeout's own timer (returns None,
    so pytest-timeout still sets its timer)."""
    if settings.timeout and settings.timeout > 0:
        terminal = item.config.get_terminal_writer()

        def write(text: str) -> None:
            terminal.write(text)
            terminal.flush()

        item.stash[_HANGDUMP_DISARM] = hangdump.arm(settings.timeout, write)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    disarm = item.stash.get(_HANGDUMP_DISARM, None)
    if disarm is not None:
        disarm()


@pytest.fixture(scope="session")
def peer_python() -> str:
    """Python of the peer's venv (tests/support/peer.py); skips only where no Python >= 3.12
    exists (a failed install fails the test)."""
    python = peer.peer_python()
    if python is None:
        pytest.skip(peer.why())
    return python


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer | DockerNatsServer]:
    """A fresh single JetStream node (process, or docker if CGROUPD_TEST_NATS=docker)."""
    with running_server(workdir=tmp_path / "nats") as server:
        yield server


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A fresh 3-node JetStream cluster with a meta leader (process backend only)."""
    with running_cluster(workdir=tmp_path / "nats-cluster") as cluster:
        yield cluster


@pytest_asyncio.fixture
async def nc(nats_server: NatsServer | DockerNatsServer) -> AsyncIterator[Client]:
    """A client connected to ``nats_server`` that reconnects across restarts."""
    client = await nats.connect(servers=[nats_server.url], **client_options())
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    """JetStream context of ``nc``."""
    return nc.jetstream()


@pytest.fixture
def jetstream(nc: Client) -> JetStream:
    """cgroupd's JetStream adapter over ``nc``."""
    return JetStream(nc)


@pytest_asyncio.fixture
async def fleet(nats_server: NatsServer) -> AsyncIterator[Fleet]:
    """In-process member instances on ``nats_server``, all stopped afterwards."""
    f = Fleet(nats_server.url)
    try:
        yield f
    finally:
        await f.close()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Append anything with ``close()`` (child processes, followers): all closed after the
    test, whatever happened."""
    things: list[Any] = []
    try:
        yield things
    finally:
        for thing in things:
            thing.close()


def _without_the_developers_nats_context() -> None:
    """cgroupd starts from the ``nats`` CLI's selected context (``context.txt``) or
    ``NATS_CONTEXT``, as ``nats`` does: on a machine that has one, tests would connect
    with its servers, credentials and TLS. Point them at an empty config directory then
    (only then: other tools read ``XDG_CONFIG_HOME`` too)."""
    from cgroupd.cli.natscontext import CONTEXT_ENV, config_dir

    os.environ.pop(CONTEXT_ENV, None)
    if (config_dir(os.environ) / "context.txt").exists():
        os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="cgroupd-tests-xdg-")
