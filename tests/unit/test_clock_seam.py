"""The member runtime reads time and sleeps only through its clock (cgroupd/core/clock.py), so
one clock, real or virtual, drives all of it (issue 26). Parsed, not run: the modules
below call no ``time.monotonic``/``time.time``/``time.perf_counter``, no ``loop.time()``
and no ``asyncio.sleep`` of a non-zero delay (``asyncio.sleep(0)`` only yields)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cgroupd"

#: The runtime and the parts it drives: member, generations, dispatcher, settlements,
#: pullers, leases, key queues.
MODULES = sorted([*(PACKAGE / "member").glob("*.py"),
                  *(PACKAGE / name for name in ("nats/pull.py", "nats/lease.py",
                                                "core/pinning.py"))])

WALL = {"monotonic", "time", "perf_counter", "monotonic_ns", "time_ns"}


def _findings(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "time" for a in node.names):
            found.append(f"{node.lineno}: import time")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func, owner = node.func, node.func.value
        if isinstance(owner, ast.Name) and owner.id == "time" and func.attr in WALL:
            found.append(f"{node.lineno}: time.{func.attr}()")
        elif func.attr == "time" and not node.args and not (
                isinstance(owner, ast.Name) and owner.id == "time"):
            found.append(f"{node.lineno}: {ast.unparse(node)} (the loop's time: use the clock)")
        elif (isinstance(owner, ast.Name) and owner.id == "asyncio" and func.attr == "sleep"
              and not (node.args and isinstance(node.args[0], ast.Constant)
                       and node.args[0].value == 0)):
            found.append(f"{node.lineno}: {ast.unparse(node)} (use the clock's sleep)")
    return found


def test_the_modules_exist() -> None:
    assert all(p.exists() for p in MODULES) and len(MODULES) > 12, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_time_comes_from_the_clock(path: Path) -> None:
    """No wall clock, no loop time read directly, no sleep around the clock."""
    assert _findings(path) == []
