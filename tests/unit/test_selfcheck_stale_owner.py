"""A self-check answered by a server out of touch with its cluster proves nothing, not even
that another instance owns the member (cgroupd/member/selfcheck.py, issue 13).

Seen in the sync cluster-node-cut fault test: right after the heal, the node that had been
cut off still led the previous owner's synchronization consumer (same name, the old
metadata) for about a second, and answered the new owner's self-check first. The new owner
read "owned by another instance", stepped down, and the old instance became active again.
That answer's quorum age (the time since its server last heard the consumer's other
replicas) was the length of the cut: it must be ignored like any stale answer.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from cgroupd.core.naming import INSTANCE_KEY
from cgroupd.member import Member, MemberState
from cgroupd.member.state import StepDown
from tests.support.fakes import FakeJetStream, FakeMsg, FakeServer, data_puller, status
from tests.support.polling import eventually, within
from tests.unit.test_election_unit import SETTINGS, WQ, Group, handler

pytestmark = pytest.mark.virtual_clock  # fake adapter: autojumping virtual time


def _answer(info: dict[str, Any], owner: str, heard_ago: float,
            metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """``info`` as a leader that last heard both other replicas ``heard_ago`` s ago, naming
    ``owner`` in the metadata (all of it ``metadata`` when given: the claim it still has
    from before, another process's token and all)."""
    answer = copy.deepcopy(info)
    config = answer.setdefault("config", {})
    if metadata is not None:
        config["metadata"] = dict(metadata)
    config.setdefault("metadata", {})[INSTANCE_KEY] = owner
    answer["cluster"] = {"leader": "n2", "replicas": [
        {"name": n, "current": True, "active": int(heard_ago * 1e9)} for n in ("n0", "n1")]}
    return answer


class HealingJetStream(FakeJetStream):
    """Answers the sync consumer's info as ``answer_as`` says: (owner, quorum age)."""

    def __init__(self, server: FakeServer, sync: str) -> None:
        super().__init__(server)
        self.sync = sync
        self.answer_as: tuple[str, float] | None = None
        #: The whole metadata such an answer shows (None: the consumer's own).
        self.remembered: dict[str, str] | None = None
        #: How many times the sync consumer's info was answered (each self-check asks).
        self.answered = 0

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        info = await super().consumer_info(stream, name)
        if info is None or name != self.sync or self.answer_as is None:
            return info
        self.answered += 1
        return _answer(info, *self.answer_as, metadata=self.remembered)

    async def checks(self, n: int) -> None:
        """Wait until ``n`` more self-checks got the answer set now."""
        target = self.answered + n
        await eventually(lambda: self.answered >= target, 30, what=f"{n} self-checks")


@pytest.fixture
async def group() -> AsyncIterator[Group]:
    g = Group()
    yield g
    for m in g.members:
        await within(m.stop(), 10, f"{m.member}/{m.instance_id} to stop")


def _same(m: Member, number: int) -> bool:
    """``m`` is in generation ``number`` still, and it has not ended."""
    now = m.generation
    return now is not None and now.number == number and not now.ended


async def _active(group: Group) -> tuple[Member, HealingJetStream]:
    js = HealingJetStream(group.server, "")
    m = Member(js, "ORDERS", "g", "m1", handler, SETTINGS, instance_id="b")
    js.sync = m.sync_consumer
    await m.start()
    group.members.append(m)
    await eventually(lambda: m.state is MemberState.ACTIVE, 3, what="m active")
    assert m.state is MemberState.ACTIVE and m.generation is not None
    return m, js


async def test_a_stale_answer_naming_the_previous_owner_ends_nothing(group: Group) -> None:
    m, js = await _active(group)
    gen = m.generation
    assert gen is not None
    with capture_logs() as logged:
        # The cut-off node, healed a moment ago: it last heard a quorum 15 s ago.
        js.answer_as = ("a", 15.0)
        await js.checks(3)
        assert _same(m, gen.number), m.generation
        assert m.stats["stale_checks"] >= 3
        # The real leader's answer again: still ours.
        js.answer_as = (m.instance_id, 0.05)
        await js.checks(3)
    assert _same(m, gen.number) and m.state is MemberState.ACTIVE
    stale = [e for e in logged if e["event"].startswith("self-check answered by a server out")]
    assert len(stale) == 1 and stale[0]["owner"] == "a", stale


async def test_a_fresh_answer_naming_another_owner_ends_the_generation(group: Group) -> None:
    m, js = await _active(group)
    with capture_logs() as logged:
        js.answer_as = ("a", 0.05)
        await eventually(lambda: m.state is not MemberState.ACTIVE, 5, what="a step-down")
    down = [e for e in logged if e["event"] == "stepped down"]
    assert down and down[0]["reason"] == StepDown.SYNC_LOST.value, logged
    assert "(a)" in down[0]["detail"], down


@pytest.mark.parametrize(("heard_ago", "deleted"), [(15.0, False), (0.05, True)],
                         ids=["stale", "fresh"])
async def test_a_stale_answer_naming_us_deletes_no_sync_consumer_when_releasing(
        group: Group, heard_ago: float, deleted: bool) -> None:
    """The old owner after the heal: the cut-off node still names it the holder (with its
    token). Reading that as "still ours" while releasing (stop()) would delete the sync
    consumer by name: the new owner's. Only a server in touch with its cluster is believed
    (``fresh``: the same answer from one deletes our claim, as every release does)."""
    m, js = await _active(group)
    key = (WQ, m.sync_consumer)
    js.answer_as = (m.instance_id, heard_ago)
    await m.stop()
    assert m.state is MemberState.STOPPED
    assert (key not in group.server.consumers) is deleted, (
        "deleted on a stale answer" if not deleted else "a fresh answer naming us not believed")
    # (Its data consumer went either way: that one is only ever ours.)
    assert not [c for (s, c) in group.server.consumers if s == WQ and c != m.sync_consumer]


@pytest.mark.parametrize(("heard_ago", "deleted"), [(15.0, False), (0.05, True)],
                         ids=["stale", "fresh"])
async def test_a_stale_answer_naming_us_deletes_no_sync_consumer_when_standing_by(
        group: Group, heard_ago: float, deleted: bool) -> None:
    """The old owner after the heal, now a standby: its create is refused (the claim of
    that name is the new owner's), and it reads who holds the claim. The cut-off node
    answers with the claim it had before the cut: ours, with our token. Reading that as
    "ours, left over from an earlier period" would delete the new owner's claim. Only a
    server in touch with its cluster is believed (``fresh``: the same answer from one is
    a claim we really left behind, and it goes)."""
    b, js = await _active(group)  # the old owner, instance b
    remembered = dict(group.server.consumers[(WQ, b.sync_consumer)].config["metadata"])
    a = await group.start("a")  # the new owner
    assert a.state is MemberState.STANDBY

    def healed(reason: str) -> None:
        # From b's step-down on, b hears of the claim only from the node that was cut
        # off, which still has b's claim.
        js.answer_as, js.remembered = (b.instance_id, heard_ago), remembered

    b.on_standby = healed
    # The cut: b's claim goes, a takes it; b's pull on it is told so.
    assert isinstance(a.js, FakeJetStream)
    await a.js.delete_consumer(WQ, b.sync_consumer)
    await _claim_told_deleted(b)
    await eventually(lambda: a.active and b.state is MemberState.STANDBY, 5,
                     what="a active, b standing by")
    with capture_logs() as logged:
        if deleted:
            await eventually(lambda: group.holder() != "a", 5, what="a's claim deleted")
            return
        await js.checks(3)  # b read the holder three times (each attempt, refused)
    assert group.holder() == "a", "deleted on a stale answer"
    assert a.active and a.generation is not None and not a.generation.ended
    ignored = [e for e in logged
               if e["event"].startswith("sync consumer's holder read from a server out")]
    assert ignored and ignored[0]["holder"] == b.instance_id, logged


async def test_release_waits_until_the_stream_removed_what_we_acked(group: Group) -> None:
    """A confirmed ack is the consumer's record, not the work-queue stream's removal
    (nats-server 2.15.1: acks confirmed while the stream had no leader, the consumer then
    deleted, and a new consumer got every message again). Releasing waits, bounded, until
    the stream no longer holds the last message acked before deleting the data consumer."""
    m, js = await _active(group)
    await eventually(lambda: (p := data_puller(m)) is not None and p.inbox, 5, what="pulling")
    puller = data_puller(m)
    assert puller is not None
    data = puller.consumer
    group.server.stored[WQ] = {7}  # #7 is acked below, not yet removed
    await js.nc.deliver(puller.inbox, FakeMsg(subject="0.orders.k", data=b"m", consumer_seq=1,
                                              reply=f"$JS.ACK.{WQ}.{data}.1.7.1.0.0"))
    await eventually(lambda: m.stats["acked"] == 1, 5, what="#7 acked")
    stopping = asyncio.ensure_future(m.stop())
    await asyncio.sleep(0.3)  # a leaderless stream's length, not a synchronisation
    assert not stopping.done(), "went on while the stream still held an acked message"
    assert (WQ, data) in group.server.consumers, "deleted while the stream held #7"
    group.server.stored[WQ].clear()  # a stream leader removed it
    async with asyncio.timeout(1.0):
        await stopping
    assert (WQ, data) not in group.server.consumers


def _claim_inbox(m: Member) -> str:
    """The inbox the active instance's claim (sync consumer) puller listens on."""
    assert isinstance(m.js, FakeJetStream)
    puller = next((p for p in reversed(m.js.pullers)
                   if p.consumer == "m1" and not p.ended.done()), None)
    return "" if puller is None else puller.inbox


async def _claim_told_deleted(m: Member) -> None:
    assert isinstance(m.js, FakeJetStream)
    await m.js.nc.deliver(_claim_inbox(m), status("409", "Consumer Deleted"))


async def test_a_claim_said_deleted_by_a_stale_node_is_kept(group: Group) -> None:
    """After a cluster heal the node that was cut off deletes its stale copy of the claim
    (same name) and answers every pull waiting on it "consumer deleted", the new owner's
    too (CI on 7a87d8d: the new owner stepped down; the old instance took the member
    back). The claim still names us on the servers in touch: we carry on, pulling anew."""
    a = await group.start("a")
    await eventually(lambda: a.active, 5, what="a active")
    gen = a.generation
    assert gen is not None
    old = _claim_inbox(a)
    assert old
    await _claim_told_deleted(a)
    await eventually(lambda: (now := a.generation) is not None and now.number == gen.number
                     and _claim_inbox(a) not in ("", old), 5, what="a new claim puller")
    assert a.active and a.generation is not None and a.generation.number == gen.number
    assert not a.generation.ended


async def test_a_claim_really_deleted_ends_the_generation(group: Group) -> None:
    reasons: list[str] = []
    a = Member(FakeJetStream(group.server), "ORDERS", "g", "m1", handler,  # type: ignore[arg-type]
               SETTINGS, instance_id="a", on_standby=reasons.append)
    await a.start()
    group.members.append(a)
    await eventually(lambda: a.active, 5, what="a active")
    del group.server.consumers[(WQ, "m1")]
    await _claim_told_deleted(a)
    await eventually(lambda: reasons, 5, what="the generation to end")
    assert reasons[0] == StepDown.SYNC_LOST.value
