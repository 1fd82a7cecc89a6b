"""A guard over the fake-adapter state-machine tests: they run on virtual time and watch
the runtime through its public surface (``state``, ``health()``, ``generation``,
``stats``, callbacks, logs), never its private attributes (issue 26). A test that reads
``member._gen`` breaks with every refactor of the runtime and tests the code as written,
not the behaviour; this check fails on the first such read.

Parsed, not run: every ``x._name`` attribute (not ``self``'s, ``cls``'s or ``super()``'s,
not a dunder) in a test module that uses the fake adapter is a finding, unless listed in
``STILL_PRIVATE`` with the reason. That list may only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent

#: Private steps a test still drives directly, by module. Empty since issue 26: the last
#: ones (a claim race, a stale holder) became scenarios driven through the mode's public
#: ``move_to``/``acquire``/``release``, ``stop()`` and the callbacks. Never add to it.
STILL_PRIVATE: dict[str, set[str]] = {}

def _uses_fakes(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in (
                "tests.support.fakes", "tests.support.fakes_pinned"):
            return True
    return False


def _marked_virtual(tree: ast.Module) -> bool:
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                and "virtual_clock" in ast.unparse(node.value)):
            return True
    return False


def _private_reads(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                and owner.func.id == "super"):
            continue
        found.append((node.lineno, name))
    return found


FAKE_TESTS = sorted(p for p in UNIT.glob("test_*.py") if _uses_fakes(ast.parse(p.read_text())))


def test_the_fake_adapter_tests_are_found() -> None:
    """The guard sees the state-machine tests (a rename would otherwise empty it)."""
    assert len(FAKE_TESTS) >= 13, FAKE_TESTS


@pytest.mark.parametrize("path", FAKE_TESTS, ids=lambda p: p.name)
def test_runs_on_virtual_time(path: Path) -> None:
    """A fake-adapter test module is marked ``virtual_clock``: its leases, TTLs and
    backoffs take virtual time, not seconds of the wall clock."""
    assert _marked_virtual(ast.parse(path.read_text())), (
        f"{path.name}: add `pytestmark = pytest.mark.virtual_clock`")


@pytest.mark.parametrize("path", FAKE_TESTS, ids=lambda p: p.name)
def test_reads_no_private_runtime_attribute(path: Path) -> None:
    """Only the public surface, apart from the steps listed."""
    allowed = STILL_PRIVATE.get(path.name, set())
    bad = [f"{path.name}:{line}: .{name}"
           for line, name in _private_reads(ast.parse(path.read_text()))
           if name not in allowed]
    assert not bad, "read through the public surface instead:\n" + "\n".join(bad)


def test_the_list_of_exceptions_only_shrinks() -> None:
    """Every listed exception is still used (a fixed one leaves the list)."""
    unused = []
    for name, attrs in STILL_PRIVATE.items():
        used = {n for _, n in _private_reads(ast.parse((UNIT / name).read_text()))}
        unused += [f"{name}: {a}" for a in sorted(attrs - used)]
    assert not unused, f"no longer read, drop from STILL_PRIVATE: {unused}"
