"""The guard of tests/unit/conftest.py: the fast run stays server-free."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.natsserver import running_server


def test_starting_nats_server_fails_the_test(tmp_path: Path) -> None:
    """Through the harness or a bare subprocess, by path or by name: refused, naming where
    such a test belongs, before any process starts."""
    with pytest.raises(pytest.fail.Exception, match=r"started nats-server.*tests/integration"):
        with running_server(workdir=tmp_path / "nats"):
            pass
    for argv in (["nats-server", "-v"], ["/opt/bin/nats-server", "-v"]):
        with pytest.raises(pytest.fail.Exception, match="started nats-server"):
            subprocess.run(argv, check=False)
    assert subprocess.run(["true"], check=False).returncode == 0  # other children run
