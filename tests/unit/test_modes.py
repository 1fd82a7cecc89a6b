"""The shape issue 26 gave the member runtime, checked so it cannot drift back: one object
per exclusivity mode, chosen once; every job a collaborator (``Member`` has one base
class, ``MemberCore`` no stubs naming calls between mixins); outside the mode modules the
runtime never asks which mode it is in. Parsed where it is about the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cgroupd.core.settings import Exclusivity, MemberSettings
from cgroupd.member import Member
from cgroupd.member.core import MemberCore
from cgroupd.member.modes import MODES, PinnedMode, SyncMode

RUNTIME = Path(__file__).resolve().parents[2] / "cgroupd" / "member"
#: The modules that belong to one mode (or pick it): they may ask which mode this is.
MODE_MODULES = {"modes.py", "election_sync.py", "rebalance.py", "selfcheck.py",
                "election_pinned.py", "rebalance_pinned.py", "pinned_reset.py",
                "pinned_acks.py"}


async def _handler(msg: object) -> None:
    return None


def test_member_has_one_base_class_and_the_core_no_stubs() -> None:
    """Before issue 26: eight mixins, and 28 ``NotImplementedError`` stubs in core.py."""
    assert Member.__bases__ == (MemberCore,)
    stubs = [f"{path.name}:{node.lineno}" for path in sorted(RUNTIME.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Raise) and node.exc is not None
             and "NotImplementedError" in ast.unparse(node.exc)]
    assert stubs == []


def _mode_reads(path: Path) -> list[int]:
    """Lines that read ``.exclusivity`` or ``Exclusivity.<X>`` (code, not prose)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (
                node.attr == "exclusivity"
                or (isinstance(node.value, ast.Name) and node.value.id == "Exclusivity")):
            lines.add(node.lineno)
    return sorted(lines)


def test_outside_the_mode_modules_only_the_core_picks_the_mode() -> None:
    """core.py picks the mode once (a static group is pinned; ``MODES[...]``); no other
    runtime module asks (31 code lines in 9 files before issue 26)."""
    found = {path.name: _mode_reads(path) for path in sorted(RUNTIME.glob("*.py"))
             if path.name not in MODE_MODULES}
    found = {name: lines for name, lines in found.items() if lines}
    assert set(found) == {"core.py"}, found
    assert len(found["core.py"]) <= 3, found  # static -> pinned (2 lines), MODES[...]


def test_only_the_mode_modules_end_a_generation() -> None:
    """``gen.end(...)`` only in a mode's modules; the rest (stop, group deleted, a change
    that cannot be moved to, a crashed task) asks ``mode.step_down`` (before: 23 calls in
    8 files)."""
    ends = [f"{path.name}:{node.lineno}" for path in sorted(RUNTIME.glob("*.py"))
            if path.name not in MODE_MODULES
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "end"]
    assert ends == []


@pytest.mark.parametrize(("exclusivity", "static", "mode"), [
    (Exclusivity.SYNC, False, SyncMode), (Exclusivity.PINNED, False, PinnedMode),
    (Exclusivity.SYNC, True, PinnedMode)])
async def test_each_member_gets_its_modes_object(exclusivity: Exclusivity, static: bool,
                                                 mode: type) -> None:
    """Chosen once, from the settings; a static group is always pinned."""
    assert set(MODES) == set(Exclusivity)
    m = Member(None, "S", "G", "m1", _handler,  # type: ignore[arg-type]
               MemberSettings().with_exclusivity(exclusivity), static=static)
    assert type(m.mode) is mode and m.mode.m is m
    assert m.mode.shared_consumer is (mode is PinnedMode)
