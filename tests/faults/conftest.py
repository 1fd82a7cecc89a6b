"""Fixtures of the fault suite: servers, a scenario per test, and a leak check.

Every test module here is marked ``faults`` and ``slow`` (``pytest -m faults``;
``-m "not slow"`` leaves them out). After each test, no member process, network namespace
or veth link made by it may be left: the leak check fails the test otherwise. The
per-scenario tables are printed at the end of the session (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.conftest import SUMMARY_TABLE
from tests.faults import injectors, runner
from tests.faults.scenario import REPORTS, Scenario
from tests.support.natsserver import NatsCluster, NatsServer, running_cluster, running_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "faults: fault-injection scenarios (cgroupd join processes, server "
                   "restarts, clusters, network namespaces); select with -m faults")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Like tests/conftest.py does for nats_cluster: `-m "not cluster"` stays reliable.
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here and "cluster" in getattr(
                item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


_FIRST_TABLE = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[None]:
    """Hand the scenario tables this test made to its teardown report, which tests/
    conftest.py prints at the end (on several workers only the reports reach the
    controller)."""
    if call.when == "setup":
        item.stash[_FIRST_TABLE] = len(REPORTS)
    outcome = yield
    if call.when == "teardown":
        report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
        first = item.stash.get(_FIRST_TABLE, len(REPORTS))
        report.user_properties.extend((SUMMARY_TABLE, table) for table in REPORTS[first:])


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Fail a test that leaves member processes, namespaces or veth links behind."""
    yield
    left = [repr(p) for p in runner.LIVE if p.poll() is None]
    for proc in list(runner.LIVE):  # reap anyway, so one leak does not spread
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        runner.LIVE.discard(proc)
    net = injectors.leftovers()
    assert not left and not net, f"left behind: processes {left}, namespaces/links {net}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    """A single JetStream node on loopback (process backend: it is killed and restarted)."""
    with running_server(backend="process", workdir=tmp_path / "nats") as srv:
        assert isinstance(srv, NatsServer)
        yield srv


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A 3-node JetStream cluster on loopback."""
    with running_cluster(workdir=tmp_path / "nats-cluster") as cl:
        yield cl


@pytest_asyncio.fixture
async def single(request: pytest.FixtureRequest, server: NatsServer,
                 tmp_path: Path) -> AsyncIterator[Scenario]:
    """A scenario named after the test, on ``server``."""
    async with Scenario(request.node.name.removeprefix("test_"), [server.url],
                        tmp_path / "scenario") as sc:
        yield sc
