"""The one transition table of a member instance (:data:`cgroupd.member.state.TRANSITIONS`):
what it allows, that docs/architecture.md and the supervisor's docstring show it as the
code has it, and that ``_transition`` enforces it (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

import cgroupd.member.supervisor
from cgroupd.member import Member
from cgroupd.member.state import (
    ALLOWED,
    FIRST_PHASE,
    TRANSITIONS,
    MemberState,
    Phase,
    allowed,
    render_moves,
    render_transitions,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
J, SB, A, SD, X = (MemberState.JOINING, MemberState.STANDBY, MemberState.ACTIVE,
                   MemberState.STEPPING_DOWN, MemberState.STOPPED)


def test_the_architecture_doc_shows_the_table_from_the_code() -> None:
    """Edit state.TRANSITIONS, then paste render_transitions() between the markers."""
    text = DOC.read_text()
    begin = text.index("-->\n", text.index("<!-- transitions:begin")) + len("-->\n")
    end = text.index("<!-- transitions:end -->")
    assert text[begin:end] == render_transitions()


def test_the_supervisor_docstring_draws_the_moves_of_the_table() -> None:
    """The diagram in the supervisor's docstring is render_moves()'s (it once drew
    ACTIVE -> STOPPED, which was never allowed)."""
    doc = cgroupd.member.supervisor.__doc__ or ""
    assert render_moves() in doc
    assert "ACTIVE (taking-over, running, moving) ──► STEPPING-DOWN\n" in render_moves()


def test_state_moves_are_those_public_state_always_allowed() -> None:
    """Phases add moves within a state, never between states (the public ALLOWED is
    what it was before the phases); an active instance never stops without stepping
    down."""
    before = {J: {SB, X}, SB: {SB, A, X}, A: {SD}, SD: {SB, X}, X: set()}
    assert before == ALLOWED
    assert not allowed((A, Phase.RUNNING), (X, None))


def test_hidden_sub_states_are_real_steps() -> None:
    """Claiming comes between standby and active; a pinned instance takes over before
    it runs; a move returns to running; stop() during a release ends in stopped."""
    assert allowed((SB, Phase.WAITING), (SB, Phase.CLAIMING))
    assert not allowed((SB, Phase.WAITING), (A, Phase.RUNNING))
    assert allowed((SB, Phase.CLAIMING), (A, Phase.TAKING_OVER))
    assert not allowed((A, Phase.TAKING_OVER), (A, Phase.MOVING))
    assert allowed((A, Phase.MOVING), (A, Phase.RUNNING))
    assert allowed((SD, Phase.RELEASING), (SD, Phase.STOPPING))
    assert not allowed((SD, Phase.STOPPING), (SB, Phase.WAITING))
    assert allowed((SD, Phase.STOPPING), (X, None))


def test_every_phase_is_reachable_and_each_state_begins_in_a_listed_one() -> None:
    reached = {t.dst for t in TRANSITIONS}
    assert {p for _, p in reached} - {None} == set(Phase)
    assert all((s, p) in reached for s, p in FIRST_PHASE.items())


async def test_transition_enforces_the_table_with_phases() -> None:
    """A standby becomes active only from a claim; a pinned instance taking over
    cannot start a move; an illegal move between states keeps its old message."""
    async def handler(msg: object) -> None:
        return None

    member = Member(None, "S", "G", "m1", handler)  # type: ignore[arg-type]
    assert (member.state, member.phase) == (J, None)
    member._transition(SB)
    assert member.phase is Phase.WAITING
    with pytest.raises(RuntimeError, match="standby: waiting -> active: running"):
        member._transition(A)
    member._enter(Phase.CLAIMING)
    member._transition(A, phase=Phase.TAKING_OVER)
    with pytest.raises(RuntimeError, match="active: taking-over -> active: moving"):
        member._enter(Phase.MOVING)
    with pytest.raises(RuntimeError, match="transition active: taking-over -> stopped"):
        member._transition(X)
    member._enter(Phase.RUNNING)
    member._transition(SD)
    assert member.phase is Phase.RELEASING
    member._enter(Phase.STOPPING)
    member._transition(X)
    assert (member.state, member.phase) == (X, None)
