"""Exclusive use of a group's partitions by one Spark query: a lease on its members.

Why: the source reads the group's work-queue stream with direct get and purges what Spark
has committed. A daemon instance consuming the same partitions would ack (and so delete)
messages of a range Spark has not committed yet, and a replay after a failure would no
longer be identical; two queries would each see every message. So while a query reads a
partition nobody else may consume it.

How: exactly what a member instance does to become active (ADR "Implementation design",
:meth:`cgroupd.member.Member._acquire`). For each member owning partitions the query
reads, the driver creates that member's *synchronization consumer*: named after the
member, filters ``sync.<p>.>``, ``action: create``, the query's lease id in its metadata
(``cgroupd_instance``), and a short inactive threshold; then keeps it alive by pulling on
it. While it exists no instance of the member can win the election (create fails with
10148) and no other member can take those partitions (the ``sync.<p>.>`` filters overlap:
10100). Partitions no member owns are claimed the same way under the consumer name
:data:`UNOWNED_CONSUMER`, so adding members later does not let daemons in either.

When the query's driver dies, nobody pulls any more and the server deletes the
consumers after ``inactive_threshold``: the lease ends by itself. A stopped query
releases it at once (``stop()``; see :func:`cgroupd.spark.source._exit_on_sigterm`).

In the group's picture (issue 30): the consumers record the driver's host and when the
lease was taken (:data:`~cgroupd.core.naming.HOST_KEY`, :data:`~cgroupd.core.naming.SINCE_KEY`),
so ``cgroupd status`` shows the query as each member's active instance; the driver
answers the group's discovery requests for its members as an active instance would
(``cgroupd member ls``), with the Spark application id its tasks tell it, and publishes
the ``active`` and ``stepped_down`` events with ``holder: spark``. One implementation
of each: the daemon's discovery answer (:func:`cgroupd.nats.events.instance_info`), its event
publisher, and status's reading of consumers.

A lease is *lost* when one of its consumers disappears or changes hands (an operator's
``cgroupd step-down``, a server restart that dropped it) or when a consumer appears that
consumes one of its partitions (a pinned-mode member after a membership change: pinned
consumers carry the real ``<p>.>`` filters, which do not overlap ``sync.<p>.>``). The next
driver call then fails the query: reading on could lose or duplicate messages silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

import cgroupd
from cgroupd.core import logs
from cgroupd.core.config import GroupConfig, StaticGroupConfig
from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    ConsumerExists,
    LeaseLost,
    LeaseUnavailable,
    WorkQueueOverlap,
)
from cgroupd.core.naming import (
    HOLDER_KEY,
    HOST_KEY,
    INSTANCE_KEY,
    MEMBER_KEY,
    SINCE_KEY,
    consumer_config,
    sync_consumer,
)
from cgroupd.core.partitions import SYNC_PREFIX, owners, sync_filters
from cgroupd.core.settings import PRIORITY_GROUP
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.nats import events, jsapi
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.lease import owner_presence_subject
from cgroupd.nats.pull import Puller, PullOptions

log = logs.get_logger("cgroupd.spark.lease")

#: Consumer name of the claim on partitions that no member owns.
UNOWNED_CONSUMER = "cgroupd-spark-unowned"
#: :data:`~cgroupd.core.naming.HOLDER_KEY`'s value on a synchronization consumer a query holds.
HOLDER_SPARK = "spark"
#: Ack wait recorded in the consumer config (the sync consumer never delivers).
_ACK_WAIT = 30.0


@dataclass(frozen=True)
class LeaseRef:
    """What a Spark task needs to check that its query still holds the lease."""

    stream: str
    lease_id: str
    consumers: tuple[str, ...]
    label: str


async def lease_problem(nc: Any, ref: LeaseRef) -> str | None:
    """Why the query no longer holds its lease, or None while it does.

    Tasks check before and after reading: a task that read while another instance took
    the partitions over may have read messages that instance consumes too.
    """
    for name in ref.consumers:
        info = await jsapi.consumer_info(nc, ref.stream, name)
        meta = ((info or {}).get("config") or {}).get("metadata") or {}
        if info is None or meta.get(INSTANCE_KEY) != ref.lease_id:
            holder = describe_holder(info) if info is not None else "nobody (deleted)"
            return (f"the query's lease {ref.lease_id} on group {ref.label} is gone: "
                    f"consumer {name!r} is held by {holder}")
    return None


def application_subject(lease_id: str) -> str:
    """Where a query's tasks tell its driver the Spark application id (the driver's
    Python process is not told it; every task is)."""
    return f"{events.PREFIX}.spark.{lease_id}.application"


def new_lease_id() -> str:
    """A lease id: shown as the member's instance id by ``cgroupd status``."""
    return f"spark-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class Claim:
    """One synchronization consumer of the lease: a member and all its partitions."""

    consumer: str
    member: str | None
    partitions: tuple[int, ...]


def claims_for(config: GroupConfig, partitions: Iterable[int],
               group: str | None = None) -> list[Claim]:
    """The claims that cover ``partitions``: one per owning member, with *all* of that
    member's partitions (its election consumer always names all of them, under the name
    :func:`cgroupd.core.naming.sync_consumer` gives it), and one for the partitions no member
    owns. ``group``: needed for a static group, whose consumer names carry it."""
    static = isinstance(config, StaticGroupConfig)
    if static and group is None:
        raise ValueError("a static group's claims need its name")
    wanted = set(partitions)
    owner = owners(config)
    by_member: dict[str, list[int]] = {}
    for p, member in sorted(owner.items()):
        by_member.setdefault(member, []).append(p)
    claims = [Claim(sync_consumer(group or "", m, static), m, tuple(ps))
              for m, ps in sorted(by_member.items()) if wanted & set(ps)]
    unowned = tuple(sorted(p for p in wanted if p not in owner))
    if unowned:
        claims.append(Claim(UNOWNED_CONSUMER, None, unowned))
    return claims


def _filters(info: dict[str, Any]) -> list[str]:
    config = info.get("config") or {}
    return list(config.get("filter_subjects") or (
        [config["filter_subject"]] if config.get("filter_subject") else []))


def _consumes(info: dict[str, Any], partitions: set[int]) -> list[int]:
    """Partitions among ``partitions`` whose messages consumer ``info`` can receive."""
    hit = set()
    for f in _filters(info):
        head = f.split(".", 1)[0]
        if head in (">", "*"):
            return sorted(partitions)
        if head.isascii() and head.isdigit() and int(head) in partitions:
            hit.add(int(head))
    return sorted(hit)


def describe_holder(info: dict[str, Any] | None) -> str:
    """Who holds a consumer, for an error message."""
    if info is None:
        return "an instance that has just let go"
    config = info.get("config") or {}
    meta = config.get("metadata") or {}
    instance = meta.get(INSTANCE_KEY)
    name = info.get("name", "?")
    if meta.get(HOLDER_KEY) == HOLDER_SPARK:
        return f"another Spark query (lease {instance}, consumer {name!r})"
    if PRIORITY_GROUP in (config.get("priority_groups") or []):
        pinned = next((g.get("pinned_client_id") for g in info.get("priority_groups") or []
                       if g.get("group") == PRIORITY_GROUP), None)
        return (f"pinned-mode member instances (consumer {name!r}, pinned client "
                f"{pinned or 'none yet'})")
    if instance:
        return f"daemon instance {instance} (consumer {name!r})"
    return f"consumer {name!r}"


class Lease:
    """The synchronization consumers of a set of claims, held by one query.

    Asynchronous; the Spark source runs it on the event loop of a driver thread.
    """

    def __init__(
        self,
        js: JetStream,
        stream: str,
        claims: list[Claim],
        *,
        lease_id: str | None = None,
        presence_key: str,
        label: str = "",
        presence_timeout: float = 0.5,
        inactive_threshold: float = 2.0,
        wait: float = 10.0,
        check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        group: tuple[str, str] | None = None,
        member_option: str | None = None,
        group_claims: Iterable[Claim] = (),
    ) -> None:
        if inactive_threshold <= 0 or wait < 0 or check_interval <= 0:
            raise ValueError("lease timings must be positive")
        self.js = js
        self.stream = stream
        self.claims = list(claims)
        self.lease_id = lease_id or new_lease_id()
        self.label = label or stream
        #: ``<origin>.<group>``: where the group's daemon instances answer presence.
        self.presence_key = presence_key
        self.presence_timeout = presence_timeout
        self.inactive_threshold = inactive_threshold
        self.wait = wait
        self.check_interval = check_interval
        self._clock = clock
        self._sleep = sleep
        self._held: list[Claim] = []
        self._pullers: dict[str, Puller] = {}
        self._watch: asyncio.Task[None] | None = None
        self._lost: str | None = None
        self._log = log.bind(stream=stream, lease=self.lease_id)
        #: ``(origin stream, group)``: where the lease shows itself as the active
        #: instance of its members (discovery answers and events, as a daemon does).
        self.group = group
        #: The source's ``member`` option, and every member's claim: the refusal names
        #: the members a query could read instead.
        self.member_option = member_option
        self.group_claims = tuple(group_claims) or tuple(self.claims)
        #: When the lease was taken (wall clock, for status) and the Spark application
        #: id, once a task has told it (:func:`application_subject`).
        self.since: float | None = None
        self.application: str | None = None
        self._subs: list[Subscription] = []

    @property
    def ref(self) -> LeaseRef:
        return LeaseRef(self.stream, self.lease_id, tuple(c.consumer for c in self.claims),
                        self.label)

    @property
    def partitions(self) -> set[int]:
        return {p for c in self.claims for p in c.partitions}

    @property
    def held(self) -> bool:
        return bool(self._held) and len(self._held) == len(self.claims) and self._lost is None

    def _config(self, claim: Claim) -> dict[str, Any]:
        # The same shape as Member._acquire's sync consumer, so the daemon and `cgroupd
        # status` read it as the member's election consumer held by instance lease_id.
        meta = {INSTANCE_KEY: self.lease_id, HOLDER_KEY: HOLDER_SPARK,
                HOST_KEY: events.hostname(), SINCE_KEY: events.iso(self.since) or ""}
        if claim.member is not None:
            meta[MEMBER_KEY] = claim.member
        return consumer_config(sync_filters(claim.partitions), ack_wait=_ACK_WAIT,
                               max_ack_pending=1, metadata=meta,
                               inactive_threshold=int(self.inactive_threshold * 1e9))

    # -- acquiring ------------------------------------------------------------------
    async def acquire(self) -> None:
        """Take every claim, or none: LeaseUnavailable names who is in the way."""
        deadline = self._clock() + self.wait
        self.since = time.time()
        try:
            for claim in self.claims:
                await self._take(claim, deadline)
            await self._await_foreign_consumers(deadline)
            await self._show()
        except BaseException:
            await self.release()
            raise
        self._watch = asyncio.create_task(self._watch_loop(), name="cgroupd-spark-lease")
        self._log.info("lease taken", group=self.label,
                       members=[c.member for c in self.claims if c.member is not None],
                       partitions=sorted(self.partitions),
                       consumers=[c.consumer for c in self.claims])

    # -- in the group's picture -----------------------------------------------------
    def _info(self, claim: Claim) -> dict[str, Any]:
        assert self.group is not None
        return events.instance_info(
            stream=self.group[0], group=self.group[1], member=claim.member,
            instance=self.lease_id, state="active", since=events.iso(self.since),
            partitions=list(claim.partitions), exclusivity="spark", holder=HOLDER_SPARK,
            application=self.application, version=cgroupd.__version__)

    async def _show(self) -> None:
        """Answer the group's discovery requests for every member held, as the active
        instance of it (what ``cgroupd member ls`` lists), learn the application id from
        the tasks, and announce the members taken (the ``active`` event)."""
        if self.group is None:
            return
        nc = self.js.nc
        members = [c for c in self.claims if c.member is not None]

        async def on_info(msg: Msg) -> None:
            if not msg.reply:
                return
            with contextlib.suppress(Exception):  # a lost answer, not a lost lease
                for claim in members:
                    await nc.publish(msg.reply, json.dumps(self._info(claim)).encode())

        async def on_application(msg: Msg) -> None:
            name = msg.data.decode(errors="replace")[:200]
            if name and self.application is None:
                self.application = name
                self._log.info("lease held by Spark application", application=name)

        self._subs = [await nc.subscribe(events.info_subject(*self.group), cb=on_info),
                      await nc.subscribe(application_subject(self.lease_id),
                                         cb=on_application)]
        await self._announce("active", members)

    async def _announce(self, kind: str, claims: list[Claim], **fields: Any) -> None:
        if self.group is None:
            return
        publisher = events.Publisher(self.js.nc, *self.group)
        for claim in claims:
            await publisher.publish(kind, member=claim.member, instance=self.lease_id,
                                    host=events.hostname(), pid=os.getpid(),
                                    partitions=list(claim.partitions), holder=HOLDER_SPARK,
                                    application=self.application, **fields)

    async def _take(self, claim: Claim, deadline: float) -> None:
        config = self._config(claim)
        while True:
            try:
                await self.js.create_consumer(self.stream, claim.consumer, config)
                break
            except (ConsumerExists, WorkQueueOverlap) as exc:
                if self._clock() >= deadline:
                    # The server's 10148/10100 adds nothing to the refusal, which says
                    # who holds the member and what to do.
                    raise LeaseUnavailable(await self._refusal(claim, exc)) from None
            await self._sleep(min(0.1, self.inactive_threshold / 4))
        self._held.append(claim)
        puller = await self.js.puller(self.stream, claim.consumer,
                                      PullOptions(batch=1, expires=1.0, heartbeat=0.25))
        self._pullers[claim.consumer] = puller

    async def _refusal(self, claim: Claim, exc: ApiError) -> str:
        what = (f"member {claim.member!r}" if claim.member is not None
                else f"unowned partitions {list(claim.partitions)}")
        holder = "another holder"
        with contextlib.suppress(CgroupdError):
            if isinstance(exc, ConsumerExists):
                holder = describe_holder(await self.js.consumer_info(self.stream,
                                                                     claim.consumer))
            else:
                wanted = {f"{SYNC_PREFIX}.{p}" for p in claim.partitions}
                for info in await self.js.list_consumers(self.stream):
                    if any(".".join(f.split(".")[:2]) in wanted for f in _filters(info)):
                        holder = describe_holder(info)
                        break
        return (f"cannot read {what} of group {self.label} (partitions "
                f"{list(claim.partitions)}): it is held by {holder}. "
                f"{await self._member_hint(claim)}Or stop that instance or query, then "
                f"retry (waited {self.wait:g}s).")

    async def _member_hint(self, refused: Claim) -> str:
        """What the ``member`` option could pick instead: the members nobody holds."""
        taken: set[str] = set()
        with contextlib.suppress(CgroupdError):
            taken = {str(i.get("name")) for i in await self.js.list_consumers(self.stream)}
        taken -= {c.consumer for c in self._held}  # ours, let go when this refusal is raised
        free = [c for c in self.group_claims if c.member is not None
                and c.member != refused.member and c.consumer not in taken]
        if self.member_option is None:
            start = ("The query reads every member of the group (no 'member' option); "
                     ".option(\"member\", ...) picks the member it reads.")
        else:
            start = (f"The query's .option(\"member\", {self.member_option!r}) picks "
                     "that member.")
        if not free:
            return f"{start} No other member of the group is free now. "
        names = ", ".join(f"{c.member!r} (partitions {list(c.partitions)})" for c in free)
        return (f"{start} Free now (no instance holds them): {names}; e.g. "
                f".option(\"member\", {free[0].member!r}). ")

    async def _foreign(self) -> list[dict[str, Any]]:
        """Consumers, not ours, that can receive messages of our partitions."""
        ours = {c.consumer for c in self.claims}
        mine = self.partitions
        return [info for info in await self.js.list_consumers(self.stream)
                if info.get("name") not in ours and _consumes(info, mine)]

    async def _await_foreign_consumers(self, deadline: float) -> None:
        """Wait for a previous owner's data consumer to go; delete an abandoned one.

        Holding the election consumers means every previous holder stopped pulling on
        them; its data consumer may linger (the server keeps a consumer with unacked
        messages until their ack wait, and a draining instance keeps it until its handlers
        finish). The liveness check is the daemon's own (``_reclaim_abandoned`` in
        :mod:`cgroupd.member.election_sync`): an instance that answers on its
        presence subject is alive and left alone, however idle its consumer looks; one
        the server says is gone (no responders), or that neither answers nor pulls in two
        looks, is abandoned and its consumer deleted.
        """
        silent: set[str] = set()
        while True:
            foreign = await self._foreign()
            if not foreign:
                return
            now_silent = set()
            for info in foreign:
                name = info["name"]
                alive = await self._alive(info)
                if alive is False or (alive is None and int(info.get("num_waiting", 0)) == 0
                                      and name in silent):
                    self._log.warning("deleting abandoned consumer", consumer=name)
                    await self.js.delete_consumer(self.stream, name)
                elif alive is None and int(info.get("num_waiting", 0)) == 0:
                    now_silent.add(name)
            silent = now_silent
            if self._clock() >= deadline:
                info = foreign[0]
                raise LeaseUnavailable(
                    f"cannot read partitions {_consumes(info, self.partitions)} of group "
                    f"{self.label}: they are being consumed by {describe_holder(info)}. "
                    f"Stop it, then retry (waited {self.wait:g}s).")
            await self._sleep(0.25)

    async def _alive(self, info: dict[str, Any]) -> bool | None:
        """True if the instance owning consumer ``info`` answers, False if the server
        knows it is gone, None if it did not answer in time (or names no instance)."""
        meta = (info.get("config") or {}).get("metadata") or {}
        subject = owner_presence_subject(self.presence_key, meta)
        if not subject:
            return None
        try:
            await self.js.nc.request(subject, b"",
                                     timeout=self.presence_timeout)
        except nats.errors.NoRespondersError:
            return False
        except (nats.errors.TimeoutError, nats.errors.Error):
            return None
        return True

    # -- holding --------------------------------------------------------------------
    def check(self) -> None:
        """Raise LeaseLost if any claim was lost since acquiring."""
        for name, puller in self._pullers.items():
            if puller.ended.done() and self._lost is None:
                _, detail = puller.ended.result()
                self._lost = f"synchronization consumer {name!r} ended: {detail}"
        if self._lost is not None:
            raise LeaseLost(f"the query lost its lease on group {self.label}: {self._lost}. "
                            "Another instance may be consuming these partitions; the query "
                            "stops rather than read them concurrently.")

    async def verify(self) -> None:
        """One look at the server: our consumers still ours, nobody else on our partitions."""
        for claim in self.claims:
            info = await self.js.consumer_info(self.stream, claim.consumer)
            meta = ((info or {}).get("config") or {}).get("metadata") or {}
            if info is None or meta.get(INSTANCE_KEY) != self.lease_id:
                self._lost = (f"synchronization consumer {claim.consumer!r} was deleted or "
                              f"taken over ({describe_holder(info) if info else 'gone'})")
                return
        foreign = await self._foreign()
        if foreign:
            info = foreign[0]
            self._lost = (f"{describe_holder(info)} consumes partitions "
                          f"{_consumes(info, self.partitions)}")

    async def _watch_loop(self) -> None:
        while self._lost is None:
            await self._sleep(self.check_interval)
            try:
                await self.verify()
            except CgroupdError as exc:  # unknown for now: the pullers decide
                self._log.warning("lease check could not reach the server", error=str(exc))
        self._log.error("lease lost", reason=self._lost)

    async def release(self) -> None:
        """Stop pulling and delete the consumers that are still ours; idempotent."""
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._watch is not None:
            # Cancelled until it ended: a check's request can swallow one cancellation
            # (nats-py's wait_for on Python 3.11), and the loop would go on while this
            # waited for it for ever (a Spark lease test hung 300 s in CI on e92d1b3).
            watch, self._watch = self._watch, None
            await cancel_and_wait(watch)
            if not watch.cancelled():
                watch.exception()  # retrieved: it ended by an error or by itself
        for puller in self._pullers.values():
            await puller.stop()
        self._pullers.clear()
        held = list(self._held)
        if held and subs:  # it had been taken and shown: say so before a successor can
            with contextlib.suppress(Exception):
                await self._announce("stepped_down", [c for c in held if c.member],
                                     reason=self._lost or "query stopped")
        for claim in held:
            with contextlib.suppress(CgroupdError):
                info = await self.js.consumer_info(self.stream, claim.consumer)
                meta = ((info or {}).get("config") or {}).get("metadata") or {}
                if info is not None and meta.get(INSTANCE_KEY) == self.lease_id:
                    await self.js.delete_consumer(self.stream, claim.consumer)
        self._held.clear()
        if held:
            self._log.info("lease released", group=self.label,
                           members=[c.member for c in held if c.member is not None],
                           reason=self._lost or "query stopped")
