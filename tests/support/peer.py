"""The reference implementation as a peer: natsio-pcgroups in a venv of its own.

natsio-pcgroups (the Python port of orbit.go ``pcgroups``, byte-compatible with its
records) needs Python >= 3.12; cgroupd runs on 3.11. :func:`peer_python` finds a Python
>= 3.12 (``$CGROUPD_PEER_PYTHON``, this interpreter, ``python3.1x`` on PATH, pyenv's
versions), creates a venv with the pinned peer version once and caches it across runs
(``$CGROUPD_PEER_CACHE``, default ``~/.cache/cgroupd/peer``, keyed by peer version and
Python version; a lock makes concurrent test runs share one install).
:class:`PeerProcess` runs :mod:`tests.support.peer_driver` with that Python: one process per
peer instance, commanded with JSON lines (kill it to crash the instance).

Used by the interop tests and by benchmarks that run the peer side by side::

    python = peer_python()            # None when no Python >= 3.12 exists (see why())
    async with PeerProcess(python, url) as peer:
        await peer.call("create_elastic", stream="S", group="g", max_members=4,
                        filters=[["orders.*", [1]]])
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tests.support.polling import within

PEER_PACKAGE = "natsio-pcgroups"
#: The peer version the interop tests are written against (its records, names, timers).
PEER_VERSION = "0.1.1"
MIN_PYTHON = (3, 12)
DRIVER = Path(__file__).with_name("peer_driver.py")

_why_not = ""


def why() -> str:
    """Why :func:`peer_python` found no Python, for a skip message."""
    return _why_not


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys, venv; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        major, minor = out.split()
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _candidates() -> list[str]:
    found: list[str] = []
    if os.environ.get("CGROUPD_PEER_PYTHON"):
        found.append(os.environ["CGROUPD_PEER_PYTHON"])
    found.append(sys.executable)
    for name in ("python3.14", "python3.13", "python3.12", "python3"):
        path = shutil.which(name)
        if path:
            found.append(path)
    roots = []
    if shutil.which("pyenv"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            roots.append(subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                                        timeout=30, check=True).stdout.strip())
    roots += [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    for root in filter(None, roots):
        found += sorted(glob.glob(f"{root}/versions/*/bin/python3.1[2-9]"), reverse=True)
    return list(dict.fromkeys(found))


def find_python() -> tuple[str, tuple[int, int]] | None:
    """A Python >= 3.12 with ``venv``, and its version; None when there is none."""
    global _why_not
    tried = []
    for python in _candidates():
        version = _version_of(python)
        tried.append(f"{python} ({'.'.join(map(str, version)) if version else 'unusable'})")
        if version is not None and version >= MIN_PYTHON:
            return python, version
    _why_not = (f"{PEER_PACKAGE} needs Python >= 3.12 and none was found (set "
                f"CGROUPD_PEER_PYTHON; tried: {', '.join(tried) or 'nothing'})")
    return None


def cache_root() -> Path:
    return Path(os.environ.get("CGROUPD_PEER_CACHE")
                or Path.home() / ".cache" / "cgroupd" / "peer")


def peer_python() -> str | None:
    """The Python of a venv holding the peer (created once, then cached); None when no
    Python >= 3.12 exists. Raises RuntimeError when the install itself fails."""
    found = find_python()
    if found is None:
        return None
    base, version = found
    venv = cache_root() / f"{PEER_PACKAGE}-{PEER_VERSION}-py{version[0]}.{version[1]}"
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists() and python.exists():
        return str(python)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and python.exists():
            return str(python)
        shutil.rmtree(venv, ignore_errors=True)
        steps = [[base, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  f"{PEER_PACKAGE}=={PEER_VERSION}"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"setting up the peer failed: {' '.join(step)}:\n"
                                   f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        marker.write_text(f"{PEER_PACKAGE}=={PEER_VERSION}\n")
    return str(python)


class PeerError(Exception):
    """The peer refused a command; the message is its exception, ``Type: text``."""


class PeerProcess:
    """One :mod:`tests.support.peer_driver` process connected to ``url``."""

    def __init__(self, python: str, url: str, log: Path | None = None) -> None:
        self.python = python
        self.url = url
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> Self:
        stderr = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, str(DRIVER), self.url, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
        finally:
            if self.log:
                stderr.close()  # type: ignore[union-attr]
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def call(self, op: str, timeout: float = 30.0, **args: Any) -> Any:
        """Run one command; its result, or PeerError with the peer's exception."""
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        async with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await within(self.proc.stdout.readline(), timeout, f"the peer's answer to {op}")
        if not line:
            raise PeerError(f"the peer process exited (code {self.proc.returncode})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise PeerError(answer["error"])
        return answer["result"]

    def kill(self) -> None:
        """SIGKILL: the instance dies without a word to the server."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        """End the process (closing stdin stops it cleanly), kill it if it lingers."""
        if self.proc is None:
            return
        if self.proc.returncode is None and self.proc.stdin:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                await within(self.proc.wait(), 10, "the peer process to exit")
            except TimeoutError:
                self.kill()
        self.kill()
        await self.proc.wait()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None
                        ) -> None:
        await self.close()
