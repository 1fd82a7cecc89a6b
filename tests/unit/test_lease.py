"""The lease and the standby's watch (cgroupd.nats.lease), with a fake clock: no server."""

from __future__ import annotations

import pytest

from cgroupd.core.naming import INSTANCE_KEY, MEMBER_KEY, PRESENCE_BY_MEMBER, PRESENCE_KEY
from cgroupd.nats.lease import (
    Answer,
    Lease,
    OwnerWatch,
    Presence,
    confirm_gone,
    legacy_presence_subject,
    may_reclaim,
    owner_presence_subject,
    presence_subject,
    pulled_since_silent,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_runs_from_the_sending_of_the_confirmed_check() -> None:
    """Renewed with the time the check was *sent*: a reply read late (a stall between
    sending and reading) buys no extra time."""
    clock = Clock()
    lease = Lease(3.0, clock)
    assert not lease.valid, "no check confirmed yet"
    lease.renew(clock.now)
    clock.now += 2.9
    assert lease.valid
    clock.now += 0.2
    assert not lease.valid
    sent = clock.now - 2.5  # a check sent 2.5 s ago, its reply read only now
    lease.renew(sent)
    assert lease.valid and lease.remaining == pytest.approx(0.5)
    lease.renew(sent - 1)  # an older check never moves it back
    assert lease.remaining == pytest.approx(0.5)


def test_a_revoked_lease_ignores_checks_sent_before_the_revocation() -> None:
    """A disconnection revokes the lease; a check sent before it and answered after it
    proves nothing about now."""
    clock = Clock()
    lease = Lease(3.0, clock)
    before = clock.now
    clock.now += 0.1
    lease.revoke()
    lease.renew(before)
    assert not lease.valid
    clock.now += 0.1
    lease.renew(clock.now)
    assert lease.valid


def test_a_watched_owner_is_replaceable_when_gone_idle_or_silent_long_enough() -> None:
    """Gone: at once. Idle (it says it is not active): at once. Silent: only after
    lease + margin without an answer, counted from the last answer (or the watch's start)."""
    watch = OwnerWatch("a", heard=0.0)
    assert not watch.replaceable(3.9, 3.0, 1.0)
    assert watch.replaceable(4.0, 3.0, 1.0)
    watch.update(Answer(Presence.SILENT), 4.0)
    assert watch.replaceable(4.0, 3.0, 1.0)
    watch.update(Answer(Presence.ALIVE, "active"), 4.0)
    assert not watch.replaceable(7.9, 3.0, 1.0)
    watch.update(Answer(Presence.ALIVE, "stepping-down"), 5.0)
    assert not watch.replaceable(5.0, 3.0, 1.0)
    watch.update(Answer(Presence.ALIVE, "claiming"), 5.0)
    assert not watch.replaceable(5.0, 3.0, 1.0), "a standby creating its data consumer"
    watch.update(Answer(Presence.ALIVE, "standby"), 5.0)
    assert watch.idle and watch.replaceable(5.0, 3.0, 1.0)
    watch.update(Answer(Presence.GONE), 5.1)
    assert watch.gone and watch.replaceable(5.1, 3.0, 1.0)


@pytest.mark.parametrize(("answer", "held", "allowed"), [
    (Answer(Presence.GONE), 0.0, True),
    (Answer(Presence.ALIVE, "active"), 100.0, False),
    (Answer(Presence.ALIVE, "stepping-down"), 100.0, False),
    (Answer(Presence.ALIVE, "claiming"), 100.0, False),
    (Answer(Presence.ALIVE, "standby"), 0.0, True),
    (Answer(Presence.ALIVE, "stopped"), 0.0, True),
    (Answer(Presence.SILENT), 2.9, False),
    (Answer(Presence.SILENT), 3.0, True),
])
def test_who_may_have_its_data_consumer_reclaimed(answer: Answer, held: float,
                                                  allowed: bool) -> None:
    """A dead or idle instance's data consumer at once; a live active or draining one's
    never (it releases it itself); a silent one's once the new owner has held the
    synchronization consumer for a whole lease."""
    assert may_reclaim(answer, held, 3.0) is allowed


def test_no_responders_is_death_only_when_the_leader_holds_no_pull_of_the_instance() -> None:
    """Issue 29: our server's "no responders" while the consumer's leader holds a pull
    request of the instance is silence (a cut between servers), never death; other
    answers pass unchanged."""
    assert confirm_gone(Answer(Presence.GONE), 0).presence is Presence.GONE
    assert confirm_gone(Answer(Presence.GONE), 2).presence is Presence.SILENT
    alive = Answer(Presence.ALIVE, "active")
    assert confirm_gone(alive, 0) is alive and confirm_gone(alive, 1) is alive
    assert not may_reclaim(confirm_gone(Answer(Presence.GONE), 1), 0.0, 3.0)


def test_a_vouched_owner_is_not_replaceable_while_our_server_cannot_see_it() -> None:
    """Our server says "no responders", the consumer's leader vouched for the instance at
    10.0 (checks 1 s apart): not gone, heard from at 10.0, not replaceable until 11.0;
    "no responders" at 11.0 is believed (the next check decides). Silence (a probe our
    server delivered, unanswered) is never vouched for: a stall is the lease's case."""
    watch = OwnerWatch("a", heard=0.0)
    watch.update(Answer(Presence.GONE), 10.0)
    assert watch.gone and watch.unseen
    watch.vouch(10.0, 1.0)
    assert not watch.gone and watch.silent_for(10.0) == 0.0
    watch.update(Answer(Presence.GONE), 10.9)
    assert not watch.gone and not watch.replaceable(10.9, 3.0, 1.0)
    watch.update(Answer(Presence.GONE), 11.0)
    assert watch.gone and watch.replaceable(11.0, 3.0, 1.0)
    silent = OwnerWatch("b", heard=0.0)
    silent.update(Answer(Presence.GONE), 1.0)
    silent.vouch(1.0, 1.0)
    silent.update(Answer(Presence.SILENT), 1.5)
    assert not silent.unseen and not silent.vouched(1.5)
    assert silent.replaceable(5.0, 3.0, 1.0)  # silent since the vouch, lease + margin


def test_a_held_pull_proves_life_only_once_it_is_younger_than_the_silence() -> None:
    """Pulls live 5 s, probes every 0.25 s: a request still held 4 s into a silence may be
    a stalled instance's last one; 5.75 s in, it was sent after the silence began. A silent
    watch deferred to then is not replaceable before it, whatever the lease says."""
    assert not pulled_since_silent(4.0, 5.0, 0.25)
    assert not pulled_since_silent(5.7, 5.0, 0.25)
    assert pulled_since_silent(5.75, 5.0, 0.25)
    watch = OwnerWatch("a", heard=0.0)
    assert watch.replaceable(4.0, 3.0, 1.0)
    watch.defer(5.75)
    assert not watch.replaceable(5.7, 3.0, 1.0) and watch.replaceable(5.75, 3.0, 1.0)
    watch.update(Answer(Presence.GONE), 5.0)
    assert watch.replaceable(5.0, 3.0, 1.0), "a death is not deferred"


def test_where_an_owner_answers_presence() -> None:
    """Issue 25 rows 6 and 7: instances answer on a subject with their member's own token
    (a permission can keep other members off it); consumers of earlier versions (no
    cgroupd_presence) are probed where those instances answer; no instance, no subject."""
    meta = {MEMBER_KEY: "m1", INSTANCE_KEY: "i1", PRESENCE_KEY: PRESENCE_BY_MEMBER}
    assert owner_presence_subject("S.g", meta) == "_CGROUPD.presence.S.g.m1.i1"
    assert owner_presence_subject("S.g", meta) == presence_subject("S.g", "m1", "i1")
    old = {MEMBER_KEY: "m1", INSTANCE_KEY: "i1"}
    assert owner_presence_subject("S.g", old) == "_CGROUPD.presence.S.g.i1"
    assert owner_presence_subject("S.g", old) == legacy_presence_subject("S.g", "i1")
    assert owner_presence_subject("S.g", {MEMBER_KEY: "m1"}) is None
