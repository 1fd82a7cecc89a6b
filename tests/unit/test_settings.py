"""Settings validation, backoff, and the member state machine's allowed transitions."""

from __future__ import annotations

from typing import Any

import pytest

from cgroupd.core.errors import CgroupdError, ConfigError
from cgroupd.core.settings import Exclusivity, MemberSettings
from cgroupd.join.handlers import DEFAULT_WEBHOOK_TIMEOUT
from cgroupd.member import Member, MemberState
from cgroupd.member.dispatch import Ordering
from cgroupd.member.state import Phase


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_in_flight": -1}, "max_in_flight must be at least 1"),
    ({"ack_wait": 0}, "ack_wait must be positive"),
    ({"inactive_threshold": -1}, "inactive_threshold must be positive"),
    ({"drain_timeout": -1}, "drain_timeout must not be negative"),
    ({"heartbeat": 0.6, "pull_expires": 1.0}, "heartbeat must be at most half"),
    ({"lease": 1.0, "retry_interval": 1.0}, r"lease \(1s\) must be longer than retry_interval"),
    ({"presence_interval": 0}, "presence_interval must be positive"),
    ({"takeover_margin": -1}, "takeover_margin must not be negative"),
    ({"inactive_threshold": 0.5},
     r"inactive_threshold \(0.5s\) must be at least lease \+ takeover_margin \+ pull_expires"),
])
def test_invalid_settings_say_which_rule(changes: dict[str, Any], message: str) -> None:
    """Each broken rule is named in the error: a ConfigError, like every other bad
    configuration (a CgroupdError, no longer a ValueError: no documented API promised it)."""
    with pytest.raises(ConfigError, match=message) as raised:
        MemberSettings(**changes)
    assert isinstance(raised.value, CgroupdError) and not isinstance(raised.value, ValueError)


def test_backoff_doubles_and_caps() -> None:
    """Retry delays grow exponentially with the attempt and stop at the cap."""
    s = MemberSettings(retry_backoff=0.1, retry_backoff_max=1.0)
    assert [s.backoff(n) for n in (1, 2, 3, 4, 5, 10)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_defaults_give_strict_order_fast_failover_and_stall_tolerance() -> None:
    """The defaults are strict per-partition order, crash detection in a fraction of a
    second (presence probes), stalls of 2 s survived without a takeover, and a drain that
    outlasts the default webhook timeout."""
    s = MemberSettings()
    assert s.ordering is Ordering.PARTITION and s.max_in_flight == 256
    assert s.presence_interval <= 0.25 and s.retry_interval <= 1.0
    assert s.lease + s.takeover_margin > 3.0
    assert s.inactive_threshold >= s.lease + s.takeover_margin + s.pull_expires
    assert s.drain_timeout >= DEFAULT_WEBHOOK_TIMEOUT


def test_pinned_mode_keeps_its_own_inactive_threshold_rule() -> None:
    """The inactive-threshold floor protects the sync election; pinned mode may differ."""
    MemberSettings(exclusivity=Exclusivity.PINNED, inactive_threshold=0.5)


def test_pinned_ttl_must_outlast_the_quiet_before_a_reset() -> None:
    """A new holder stops pulling for pull_expires + 0.25 s before resetting the member
    consumer; a pin TTL not longer than that loses the pin on every takeover (found by
    tests/unit/test_election_pinned_reset_unit.py)."""
    with pytest.raises(ConfigError, match=r"pinned_ttl .* must be longer than pull_expires"):
        MemberSettings(exclusivity=Exclusivity.PINNED, pinned_ttl=1.0, pull_expires=1.0)
    s = MemberSettings(exclusivity=Exclusivity.PINNED)
    assert s.pinned_ttl > s.pull_expires + 0.25
    MemberSettings(pinned_ttl=1.0, pull_expires=1.0)  # sync mode pulls without a pin


async def test_member_rejects_illegal_state_transitions() -> None:
    """The state machine only moves along the documented edges."""
    async def handler(msg: object) -> None:
        return None

    member = Member(None, "S", "G", "m1", handler)  # type: ignore[arg-type]
    assert member.state is MemberState.JOINING
    with pytest.raises(RuntimeError, match="illegal member transition joining -> active"):
        member._transition(MemberState.ACTIVE)
    member._transition(MemberState.STANDBY)
    with pytest.raises(RuntimeError, match="standby: waiting -> active"):
        member._transition(MemberState.ACTIVE)  # only from a claim
    member._enter(Phase.CLAIMING)
    member._transition(MemberState.ACTIVE)
    with pytest.raises(RuntimeError, match="active: running -> standby: waiting"):
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

    with pytest.raises(ConfigError):
        Member(None, "S", "G", name, handler)  # type: ignore[arg-type]
