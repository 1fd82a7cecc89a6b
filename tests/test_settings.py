"""Settings validation, backoff, and the member state machine's allowed transitions."""

from __future__ import annotations

from typing import Any

import pytest

from cgroupd.dispatch import Ordering
from cgroupd.member import Member, MemberState
from cgroupd.settings import MemberSettings


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_in_flight": -1}, "max_in_flight must be at least 1"),
    ({"ack_wait": 0}, "ack_wait must be positive"),
    ({"inactive_threshold": -1}, "inactive_threshold must be positive"),
    ({"drain_timeout": -1}, "drain_timeout must not be negative"),
    ({"heartbeat": 0.6, "pull_expires": 1.0}, "heartbeat must be at most half"),
])
def test_invalid_settings_say_which_rule(changes: dict[str, Any], message: str) -> None:
    """Each broken rule is named in the error."""
    with pytest.raises(ValueError, match=message):
        MemberSettings(**changes)


def test_backoff_doubles_and_caps() -> None:
    """Retry delays grow exponentially with the attempt and stop at the cap."""
    s = MemberSettings(retry_backoff=0.1, retry_backoff_max=1.0)
    assert [s.backoff(n) for n in (1, 2, 3, 4, 5, 10)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_defaults_give_strict_order_and_fast_failover() -> None:
    """The defaults are strict per-partition order and sub-second crash detection."""
    s = MemberSettings()
    assert s.ordering is Ordering.PARTITION and s.max_in_flight == 1
    assert s.inactive_threshold <= 0.5 and s.retry_interval <= 1.0


async def test_member_rejects_illegal_state_transitions() -> None:
    """The state machine only moves along the documented edges."""
    async def handler(msg: object) -> None:
        return None

    member = Member(None, "S", "G", "m1", handler)  # type: ignore[arg-type]
    assert member.state is MemberState.JOINING
    with pytest.raises(RuntimeError, match="illegal member transition joining -> active"):
        member._transition(MemberState.ACTIVE)
    member._transition(MemberState.STANDBY)
    member._transition(MemberState.ACTIVE)
    with pytest.raises(RuntimeError, match="active -> standby"):
        member._transition(MemberState.STANDBY)
    member._transition(MemberState.STEPPING_DOWN)
    member._transition(MemberState.STOPPED)
    with pytest.raises(RuntimeError):
        member._transition(MemberState.STANDBY)


@pytest.mark.parametrize("name", ["", "a.b", "a b", "a*", "x" * 101])
async def test_member_refuses_bad_names(name: str) -> None:
    """Names that cannot be consumer names or KV keys are refused up front."""
    async def handler(msg: object) -> None:
        return None

    with pytest.raises(ValueError):
        Member(None, "S", "G", name, handler)  # type: ignore[arg-type]
