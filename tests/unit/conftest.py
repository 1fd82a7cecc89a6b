"""The unit tests are the fast run (`bash scripts/test.sh tests/unit`): no nats-server, no
server fixture. This guard keeps it so: a unit test that asks for a server fixture, or
that starts nats-server (through the harness, the demo or a bare subprocess), fails
saying where such a test belongs."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.virtualclock import new_virtual_loop

#: Fixtures of tests/conftest.py that start a server (or need one started).
SERVER_FIXTURES = frozenset({"nats_server", "nats_cluster", "nc", "js", "jetstream", "fleet",
                             "peer_python"})

WHERE = ("unit tests run without a server; a test that needs one belongs in "
         "tests/integration/ (or tests/faults/, tests/spark/, tests/k8s/)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture is set up: refuse the server fixtures."""
    asked = sorted(SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))
    if asked:
        pytest.fail(f"{item.nodeid} asks for {', '.join(asked)}: {WHERE}", pytrace=False)


def _is_nats_server(args: Any) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    if not argv:
        return False
    program = os.path.basename(os.fsdecode(argv[0]))
    return program.startswith("nats-server")


class _NoServerPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` that refuses to start nats-server."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _is_nats_server(args):
            pytest.fail(f"a unit test started nats-server ({args!r}): {WHERE}", pytrace=False)
        super().__init__(args, *rest, **kwargs)


@pytest.fixture(autouse=True)
def no_nats_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any nats-server process started during a unit test fails it (``pytest.fail`` is a
    BaseException: a broad ``except Exception`` in the code under test cannot hide it)."""
    monkeypatch.setattr(subprocess, "Popen", _NoServerPopen)
    yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "virtual_clock: run the test (and its async fixtures) on "
        "tests.support.virtualclock's autojumping virtual time")


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> dict[str, Any]:
    """The fake-adapter state-machine tests (marked ``virtual_clock``) run on virtual
    time; every other unit test on a plain loop."""
    if item.get_closest_marker("virtual_clock") is not None:
        return {"virtual": new_virtual_loop}
    return {"real": asyncio.new_event_loop}
