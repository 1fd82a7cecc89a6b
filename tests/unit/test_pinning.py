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


def test_a_pin_gone_with_its_leader_keeps_the_lease_until_pinned_again() -> None:
    """nats-server keeps the pin in the consumer leader's memory only: consumer info that
    shows nobody pinned under a *new* leader extends the lease from when it was asked, and
    the next pin id we are given continues it; nobody pinned under the same leader (an
    unpin, or the TTL ran out) ends it."""
    clock = Clock()
    lease = PinLease(2.0, clock)
    lease.renewed("pin-a", 100.0)
    lease.leader = "n0"
    clock.now = 101.0
    assert lease.vanished("n1", checked_at=101.0)
    assert lease.until == 101.0 + 2.0 - lease.margin and lease.repinning
    clock.now = 101.5
    lease.renewed("pin-b", 101.4)
    assert lease.pin_id == "pin-b" and not lease.repinning and lease.valid
    lease.renewed("pin-c", 101.6)  # once pinned again, another id is not ours
    assert lease.pin_id == "pin-b"
    assert not lease.vanished("n0", checked_at=101.7) and lease.lost


def test_a_pin_waited_for_through_a_second_leader_change_back_to_the_first() -> None:
    """Leadership moved n0, n1, n0 before any message pinned us again (a rolling restart
    with the group stream's sourcing stalled): n0 is a new leader too, the wait goes on
    (the holder stepped down, CI-like run at 09:10 on 2026-11-27: a 32 s gap)."""
    clock = Clock()
    lease = PinLease(2.0, clock)
    lease.renewed("pin-a", 100.0)
    lease.leader = "n0"
    assert lease.vanished("n1", checked_at=100.5)
    clock.now = 101.0
    assert lease.vanished("n1", checked_at=101.0)  # still waiting under n1
    clock.now = 101.5
    assert lease.vanished("n0", checked_at=101.5), "back to n0 while waiting"
    assert lease.repinning and not lease.lost and lease.until == 101.5 + 2.0 - lease.margin
    lease.renewed("pin-b", 101.6)
    assert lease.pin_id == "pin-b" and not lease.repinning
    lease.leader = "n0"
    assert not lease.vanished("n0", checked_at=101.7) and lease.lost, \
        "pinned again, then nobody under the leader that confirmed it: an unpin"


def test_a_pin_gone_under_the_same_leader_or_unclustered_ends_the_lease() -> None:
    for leader, now in (("n0", "n0"), (None, None), ("n0", None)):
        clock = Clock()
        lease = PinLease(2.0, clock)
        lease.renewed("pin-a", 100.0)
        lease.leader = leader
        assert not lease.vanished(now, checked_at=100.1)
        assert lease.lost and not lease.valid


def test_pinned_again_only_while_the_lease_runs() -> None:
    """A new pin id after the lease ran out is not ours to continue."""
    clock = Clock()
    lease = PinLease(2.0, clock)
    lease.renewed("pin-a", 100.0)
    lease.leader = "n0"
    assert lease.vanished("n1", checked_at=100.5)
    clock.now = lease.until + 0.01
    lease.renewed("pin-b", clock.now)
    assert lease.pin_id == "pin-a" and not lease.valid


def test_pinned_again_while_the_lease_ran_continues_it_however_late_the_proof() -> None:
    """What counts is when the delivery with the new pin id reached us: a new leader busy
    after a restart may answer the consumer info proving it only after the lease ran
    out (the holder stepped down then, and the member stood still 30 s)."""
    clock = Clock()
    lease = PinLease(2.0, clock)
    lease.renewed("pin-a", 100.0)
    lease.leader = "n0"
    assert lease.vanished("n1", checked_at=100.5)
    pinned_at = lease.until - 0.1
    clock.now = lease.until + 0.5  # the answer comes late
    lease.renewed("pin-b", pulled_at=pinned_at + 0.01, pinned_at=pinned_at)
    assert lease.pin_id == "pin-b" and not lease.repinning
    assert lease.until == pinned_at + 0.01 + 2.0 - lease.margin
    clock.now = 100.5
    late = PinLease(2.0, clock)
    late.renewed("pin-a", 100.0)
    late.leader = "n0"
    assert late.vanished("n1", checked_at=100.5)
    late.renewed("pin-c", pulled_at=late.until + 0.2, pinned_at=late.until + 0.1)
    assert late.pin_id == "pin-a", "pinned only after the lease ran out: not ours"
