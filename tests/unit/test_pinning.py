"""The pin lease and the skip rules of pinned mode, with a fake clock (no server)."""

from __future__ import annotations

import math

from cgroupd.core.pinning import PinLease, SkipRules


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_runs_one_ttl_from_the_pull_that_proved_it_minus_a_margin() -> None:
    """Not established at first; after a renewal it runs from the pull's sending (not
    the renewal's end: a stall in between only shortens it)."""
    clock = Clock()
    lease = PinLease(2.0, clock)
    assert not lease.valid and lease.remaining() == -math.inf
    lease.renewed("pin-a", pulled_at=99.0)
    assert lease.pin_id == "pin-a"
    assert lease.until == 99.0 + 2.0 - lease.margin
    assert lease.valid
    clock.now = lease.until + 0.001
    assert not lease.valid


def test_a_renewal_never_shortens_a_lease_nor_takes_another_pin() -> None:
    clock = Clock()
    lease = PinLease(2.0, clock)
    lease.renewed("pin-a", 100.0)
    until = lease.until
    lease.renewed("pin-a", 99.5)  # an older pull proves less
    assert lease.until == until
    lease.renewed("pin-b", 101.0)  # a pin id is never reused: not ours
    assert lease.until == until and lease.pin_id == "pin-a"


def test_a_lost_lease_stays_lost() -> None:
    clock = Clock()
    lease = PinLease(2.0, clock)
    lease.renewed("pin-a", 100.0)
    lease.lose()
    assert not lease.valid and lease.lost
    lease.renewed("pin-a", 101.0)
    assert not lease.valid


def test_the_margin_stays_below_the_ttl() -> None:
    assert PinLease(0.4).margin == 0.1
    assert PinLease(120.0).margin == 0.25


def test_skip_rules_cover_what_was_processed_except_what_was_handed_back() -> None:
    rules = SkipRules()
    rules.processed_through(0, 50, pending=[45, 48])
    rules.processed_through(1, 20)
    assert rules.covers(0, 1) and rules.covers(0, 50)
    assert not rules.covers(0, 45) and not rules.covers(0, 48)
    assert not rules.covers(0, 51) and not rules.covers(2, 1) and not rules.covers(None, 1)
    assert rules.lowest_needed({0, 1}) == 21
    assert rules.lowest_needed({0}) == 45
    assert rules.lowest_needed({3}) == 1


def test_skip_rules_merge_never_forget_work_done_nor_invent_it() -> None:
    """A later quiet point below an earlier bound keeps the earlier bound and its
    exceptions above the new one; exceptions below it were delivered since (done, or
    pending again and listed anew)."""
    rules = SkipRules()
    rules.processed_through(0, 100, pending=[90, 95])
    rules.processed_through(0, 92, pending=[91])
    assert rules.rules[0] == (100, frozenset({91, 95}))
    assert not rules.covers(0, 91) and not rules.covers(0, 95)
    assert rules.covers(0, 90) and rules.covers(0, 99)


def test_skip_rules_round_trip_and_survive_garbage() -> None:
    rules = SkipRules({0: (10, frozenset({7})), 3: (5, frozenset())})
    again = SkipRules.from_json(rules.to_json())
    assert again.rules == rules.rules
    for junk in (None, "", "not json", "[1, 2]", '{"x": [1, []]}', '{"1": "no"}'):
        assert SkipRules.from_json(junk).rules == {}
