"""The member runtime: one instance of one member of a consumer group.

Implements the ADR's "Implementation design" and "Transitioning" sections. One supervisor
task runs the states below; each time this instance wins the election it starts a
:class:`Generation` (its partitions, its pullers, its dispatcher) and waits, with
``asyncio.wait(FIRST_COMPLETED)``, for whatever ends it: a config change, the loss of a
consumer, a failed self-check, the group's deletion, or stop().

    JOINING ──► STANDBY ◄──────────────┐
                  │ won both consumers │
                  ▼                    │
                ACTIVE ──► STEPPING_DOWN
                  │ stop() / group deleted
                  ▼
               STOPPED
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from cgroupd import jsapi, logs
from cgroupd.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    ElasticGroupConfig,
    GroupConfig,
    elastic_from_json,
    group_key,
    static_from_json,
    validate_name,
    work_queue_stream,
)
from cgroupd.consumerinfo import ConsumerInfo
from cgroupd.dispatch import Completed, Dispatcher, Handler
from cgroupd.errors import (
    AckNotConfirmed,
    AckOutcomeUnknown,
    ApiError,
    CgroupdError,
    ConfigError,
    ConsumerExists,
    ConsumerNotFound,
    GroupNotFound,
    InstanceIdInUse,
    JetStreamNotEnabled,
    WorkQueueOverlap,
)
from cgroupd.jetstream import JetStream, Record
from cgroupd.lease import (
    Lease,
    OwnerWatch,
    Presence,
    Prober,
    may_reclaim,
    presence_subject,
    probe,
)
from cgroupd.naming import (
    HOLDER_KEY,
    INSTANCE_KEY,
    MEMBER_KEY,
    RELEASED_KEY,
    RESET_KEY,
    SKIP_KEY,
    TOKEN_KEY,
    consumer_config,
    data_consumer,
    sync_consumer,
)
from cgroupd.partitions import (
    group_subjects,
    hold_filters,
    idle_filter,
    key_function,
    member_consumer_filters,
    member_filters,
    member_partitions,
    partition_filters,
    reference_filters,
    sync_filters,
)
from cgroupd.pinning import PinLease, SkipRules
from cgroupd.pull import PullEnd, Puller, PullOptions
from cgroupd.settings import PRIORITY_GROUP, Exclusivity, MemberSettings

__all__ = [
    "HOLDER_KEY",
    "INSTANCE_KEY",
    "MEMBER_KEY",
    "RELEASED_KEY",
    "RESET_KEY",
    "SKIP_KEY",
    "TOKEN_KEY",
    "Generation",
    "Member",
    "MemberState",
    "StepDown",
    "new_instance_id",
]

log = logs.get_logger("cgroupd.member")

ActiveCallback = Callable[[tuple[int, ...]], Awaitable[None] | None]
StandbyCallback = Callable[[str], Awaitable[None] | None]
#: Called with (partitions now owned, seconds the move took) after an in-place rebalance.
RebalanceCallback = Callable[[tuple[tuple[int, ...], float]], Awaitable[None] | None]

class MemberState(Enum):
    JOINING = "joining"  # reading the group config for the first time
    STANDBY = "standby"  # not consuming: competing, waiting to compete, or not a member
    ACTIVE = "active"  # owns this member's consumers and delivers messages
    STEPPING_DOWN = "stepping-down"  # finishing in-flight handlers, releasing consumers
    STOPPED = "stopped"  # done for good


_ALLOWED = {
    MemberState.JOINING: {MemberState.STANDBY, MemberState.STOPPED},
    MemberState.STANDBY: {MemberState.ACTIVE, MemberState.STOPPED, MemberState.STANDBY},
    MemberState.ACTIVE: {MemberState.STEPPING_DOWN},
    MemberState.STEPPING_DOWN: {MemberState.STANDBY, MemberState.STOPPED},
    MemberState.STOPPED: set(),
}


class StepDown(Enum):
    """Why an active instance stopped being active (metric label, callback argument)."""

    CONFIG_CHANGED = "config-changed"
    SYNC_LOST = "sync-consumer-lost"
    DATA_LOST = "data-consumer-lost"
    PIN_LOST = "pin-lost"
    STALLED = "stalled"
    GROUP_DELETED = "group-deleted"
    STOPPING = "stopping"
    ERROR = "error"


def new_instance_id() -> str:
    """A short random id, unique per running instance."""
    return secrets.token_hex(6)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Wake(asyncio.Event):
    """An event that can be waited on with a timeout cheaply (a future and a timer, not
    ``wait_for``'s extra task): a standby waits on it several times a second."""

    def __init__(self) -> None:
        super().__init__()
        self._naps: set[asyncio.Future[None]] = set()

    def set(self) -> None:
        super().set()
        for fut in list(self._naps):
            _resolve(fut)

    async def nap(self, timeout: float) -> None:
        """Return when set, or after ``timeout`` seconds (yielding to the loop either way)."""
        if self.is_set():
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._naps.add(fut)
        timer = loop.call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._naps.discard(fut)


async def _maybe_await(value: Awaitable[None] | None) -> None:
    if inspect.isawaitable(value):
        await value


@dataclass
class Generation:
    """One period of activity: its partitions, this instance's consumers, its tasks. It
    ends once (``ended``); an incremental rebalance changes its partitions in place."""

    partitions: tuple[int, ...]
    #: This instance's data consumers and the partitions each serves. One at first; an
    #: incremental rebalance adds one for the partitions it gains (a consumer never
    #: rewinds when filters are added to it, so gained partitions need a fresh one).
    data: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pullers: list[Puller] = field(default_factory=list)
    dispatcher: Dispatcher | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    #: The data consumers' info at the last self-check, and deliveries received so far.
    data_info: dict[str, Any] | None = None
    received: int = 0
    #: Partitions the latest config gives us; differs from ``partitions`` while an
    #: incremental rebalance moves some of them.
    target: tuple[int, ...] = ()
    retarget: asyncio.Event = field(default_factory=asyncio.Event)
    rebalances: int = 0
    #: Pinned mode: this instance's lease on the pin (see :mod:`cgroupd.pinning`), when the
    #: first pinned delivery came, and the renewal in progress (one at a time).
    pin_lease: PinLease | None = None
    pinned_at: float = 0.0
    renewal: asyncio.Future[bool] | None = None
    #: Static groups: per partition, the stream sequence up to which it is processed
    #: (what a release records), and the messages redelivered that were processed.
    processed: dict[int, int] = field(default_factory=dict)
    skip: SkipRules = field(default_factory=SkipRules)
    #: The member consumer must be brought to the config again (see RESET_KEY).
    reconcile: bool = False
    #: Sync exclusivity: the right to start handlers (see :mod:`cgroupd.lease`), when the
    #: synchronization consumer became ours, and the one self-check in flight.
    lease: Lease = field(default_factory=lambda: Lease(0.0))
    claimed_at: float = 0.0
    verifying: asyncio.Future[bool | None] | None = None

    ended: asyncio.Future[tuple[StepDown, str]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        self.target = self.partitions

    def end(self, why: StepDown, detail: str = "") -> None:
        if not self.ended.done():
            self.ended.set_result((why, detail))


class _PinnedAcks:
    """Acks on a consumer shared by several instances count only while this instance
    provably holds the pin: the server applies and confirms them from anyone."""

    def __init__(self, member: Member, gen: Generation) -> None:
        self._member = member
        self._gen = gen

    async def _ours(self) -> bool:
        lease = self._gen.pin_lease
        return lease is not None and (lease.valid or await self._member._renew(self._gen))

    async def before_ack(self) -> None:
        if not await self._ours():
            raise AckNotConfirmed("this instance no longer holds the pin: the ack was not "
                                  "sent, the message goes to the instance holding it now")

    async def after_confirm(self) -> None:
        if not await self._ours():
            raise AckOutcomeUnknown(
                "the ack was confirmed only after this instance lost the pin: it may also "
                "be delivered to the new holder")


class Member:
    """One running instance of ``member`` in ``group`` on ``stream``.

    ``handler`` gets each :class:`Message`; returning acks it (unless it settled it
    itself), raising retries it with backoff (in place for the ordered modes, see
    :mod:`cgroupd.dispatch`). Sync handlers run in a thread so they never stall the pulls
    that keep this instance's consumers alive.
    """

    def __init__(
        self,
        js: JetStream,
        stream: str,
        group: str,
        member: str,
        handler: Handler,
        settings: MemberSettings | None = None,
        *,
        static: bool = False,
        instance_id: str | None = None,
        on_active: ActiveCallback | None = None,
        on_standby: StandbyCallback | None = None,
        on_rebalance: RebalanceCallback | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.js = js
        self.stream = validate_name("stream", stream)
        self.group = validate_name("group", group)
        self.member = validate_name("member", member)
        self.handler = handler
        self.settings = settings or MemberSettings()
        self.static = static
        if static and self.settings.exclusivity is not Exclusivity.PINNED:
            self.settings = replace(self.settings, exclusivity=Exclusivity.PINNED)
        self.instance_id = instance_id or new_instance_id()
        self.on_active = on_active
        self.on_standby = on_standby
        self.on_rebalance = on_rebalance
        self._sleep = sleep
        self._clock = clock
        self.state = MemberState.JOINING
        self.config: GroupConfig | None = None
        self.partitions: tuple[int, ...] = ()
        self.stop_reason: str | None = None
        self._bucket = STATIC_BUCKET if static else ELASTIC_BUCKET
        self._key = group_key(stream, group)
        self._consume_stream = stream if static else work_queue_stream(stream, group)
        self._wake = Wake()  # config change, advisory, stop: re-evaluate now
        self._stopping = False
        self._deleted = False
        self._supervisor: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._advisories: Any = None
        self._presence_sub: Any = None
        self._gen: Generation | None = None
        self._first_config = asyncio.get_running_loop().create_future()
        #: Sync exclusivity: this process's token (see TOKEN_KEY), a standby's watch over
        #: the active instance, and the sequences this instance completed (a redelivery
        #: of one of them is settled again, not run again).
        self._token = secrets.token_hex(8)
        self._watch: OwnerWatch | None = None
        self._prober: Prober | None = None
        self._completed: Completed = Completed()
        self._connection_off: Callable[[], None] | None = None
        self._stepping_since: float | None = None
        #: Partitions under the latest config, and when competing may resume after a change.
        self._last_partitions: tuple[int, ...] = ()
        self._not_before = 0.0
        self._changed_at = -1e9
        self.stats = {"delivered": 0, "acked": 0, "naked": 0, "termed": 0, "retries": 0,
                      "duplicates": 0, "step_downs": 0, "rebalances": 0, "resettled": 0,
                      "swallowed": 0, "ack_fences": 0, "lease_checks": 0, "takeovers": 0,
                      "watch_failures": 0}
        self._log = log.bind(stream=stream, group=group, member=member,
                             instance=self.instance_id)

    # -- public ---------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.state is MemberState.ACTIVE

    @property
    def sync_consumer(self) -> str:
        """Name of the member's election consumer (pinned mode: its only consumer)."""
        return sync_consumer(self.group, self.member, self.static)

    @property
    def data_consumer(self) -> str:
        return data_consumer(self.member, self.instance_id)

    async def start(self) -> None:
        """Read the group config and begin competing; raises if the group is unusable, and
        :class:`InstanceIdInUse` if a running process already answers for this instance id."""
        await self._refuse_duplicate_id()
        self._watcher = asyncio.create_task(self._watch_config(), name="cgroupd-watch")
        done, _ = await asyncio.wait({self._first_config, self._watcher},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._first_config not in done:
            self._watcher.result()  # re-raises why the watch failed
            raise GroupNotFound(f"group {self.stream}/{self.group} could not be read")
        self._first_config.result()
        self._watcher.add_done_callback(self._watch_ended)
        self._connection_off = self.js.on_connection(self._connection_lost,
                                                     self._connection_back)
        with contextlib.suppress(Exception):
            self._advisories = await self.js.nc.subscribe(
                f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{self._consume_stream}.*",
                cb=self._on_consumer_deleted)
        self._presence_sub = await self.js.nc.subscribe(
            presence_subject(self._key, self.instance_id), cb=self._answer_presence)
        self._transition(MemberState.STANDBY)
        self._supervisor = asyncio.create_task(self._supervise(), name="cgroupd-member")

    async def stop(self) -> None:
        """Stop: finish in-flight handlers (bounded), delete own consumers, return."""
        self._stopping = True
        self.stop_reason = self.stop_reason or "stopped"
        if self._gen is not None:
            self._gen.end(StepDown.STOPPING)
        self._wake.set()
        if self._supervisor is not None:
            # Waiting, not awaiting: a cancelled caller must not cancel the supervisor
            # half-way through releasing our consumers.
            await asyncio.wait({self._supervisor})
        await self._close_watch()
        await self._close_prober()
        if self._connection_off is not None:
            self._connection_off()
            self._connection_off = None
        if self.state is not MemberState.STOPPED:
            self._transition(MemberState.STOPPED)

    def health(self) -> list[str]:
        """What keeps this instance from doing its job (empty when healthy): a runtime that
        stopped by itself, a dead config watch, a release stuck on a handler that does not
        return."""
        problems = []
        sup = self._supervisor
        if sup is not None and sup.done() and not (self._stopping or self._deleted):
            problems.append(f"member runtime stopped: {self.stop_reason or 'unknown'}")
        if self._supervisor is not None and not self._stopping and (
                self._watcher is None or self._watcher.done()):
            problems.append("group config watch is not running")
        since = self._stepping_since
        limit = self.settings.drain_timeout + 2 * self.settings.retry_interval
        if since is not None and self._clock() - since > limit:
            gen = self._gen
            threads = (gen.dispatcher.running_threads
                       if gen is not None and gen.dispatcher is not None else 0)
            problems.append(f"release stuck for {self._clock() - since:.0f}s: "
                            f"{threads} sync handler(s) have not returned")
        return problems

    async def _refuse_duplicate_id(self) -> None:
        """Two processes with one instance id would both pass for the active instance (their
        consumers' configs would be identical): ask whether someone answers for it."""
        answer = await probe(self.js.nc, presence_subject(self._key, self.instance_id),
                             self._probe_timeout)
        if answer.presence is Presence.ALIVE:
            raise InstanceIdInUse(
                f"instance id {self.instance_id!r} is already used by a running instance of "
                f"group {self.stream}/{self.group} (state {answer.state or 'unknown'}); give "
                "each process its own id, or none (a random one is chosen)")

    @property
    def _probe_timeout(self) -> float:
        return max(0.25, 4 * self.settings.presence_interval)

    async def wait_stopped(self) -> str:
        """Wait until the instance stopped by itself (group deleted) or by stop()."""
        if self._supervisor is not None:
            await asyncio.wait({self._supervisor})
            if not self._supervisor.cancelled() and self._supervisor.exception() is not None:
                raise self._supervisor.exception()  # type: ignore[misc]
        return self.stop_reason or "stopped"

    # -- state ----------------------------------------------------------------------
    def _transition(self, to: MemberState, **info: Any) -> None:
        if to not in _ALLOWED[self.state]:
            raise RuntimeError(f"illegal member transition {self.state.value} -> {to.value}")
        if to is not self.state:
            self._log.info("state", old=self.state.value, new=to.value, **info)
        self.state = to

    # -- config watch ---------------------------------------------------------------
    async def _watch_config(self) -> None:
        """Follow the group record; never dies on a bad record (ADR: keep watching)."""
        decode = static_from_json if self.static else elastic_from_json
        while not self._stopping:
            try:
                async for record in self.js.watch_record(self._bucket, self._key):
                    self._apply_record(record, decode)
            except asyncio.CancelledError:
                raise
            except CgroupdError as exc:
                if not self._first_config.done():
                    self._first_config.set_exception(exc)
                    return
                self._log.warning("config watch failed; retrying", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug or an untranslated error
                # Never die silently: a member that stops following its group would miss
                # membership changes and the group's deletion.
                self.stats["watch_failures"] += 1
                self._log.error("config watch failed unexpectedly; retrying", error=repr(exc))
                if not self._first_config.done():
                    self._first_config.set_exception(exc)
                    return
            await self._sleep(self.settings.retry_interval)

    def _watch_ended(self, task: asyncio.Task[None]) -> None:
        """The config watch must run as long as the member does: restart it if it ended."""
        if self._stopping or self._deleted or task.cancelled() or self._watcher is not task:
            return
        self.stats["watch_failures"] += 1
        self._log.error("config watch ended unexpectedly; restarting",
                        error=repr(task.exception()))
        self._watcher = asyncio.create_task(self._watch_config(), name="cgroupd-watch")
        self._watcher.add_done_callback(self._watch_ended)

    def _apply_record(self, record: Record, decode: Callable[[bytes], GroupConfig]) -> None:
        if record.value is None:
            if not self._first_config.done():
                self._first_config.set_exception(GroupNotFound(
                    f"no consumer group {self.group!r} on stream {self.stream!r}"))
                return
            self._log.info("group deleted")
            self._deleted = True
            self.stop_reason = "group deleted"
            if self._gen is not None:
                self._gen.end(StepDown.GROUP_DELETED)
            self._wake.set()
            return
        try:
            config = decode(record.value)
        except ConfigError as exc:
            self._log.error("invalid group record ignored", revision=record.revision,
                            problems=exc.problems)
            if self.config is None and not self._first_config.done():
                self._first_config.set_exception(exc)
            return
        if (self.config is not None and isinstance(config, ElasticGroupConfig)
                and isinstance(self.config, ElasticGroupConfig)
                and not config.same_shape(self.config)):
            # Only membership may change after creation; anything else means the group was
            # replaced under us. Keep the last good config and say so loudly.
            self._log.error("group record changed more than membership; ignored",
                            revision=record.revision)
            return
        first = self.config is None
        self.config = config
        if not self._first_config.done():
            self._first_config.set_result(None)
        new = member_partitions(config, self.member)
        gen = self._gen
        current = gen.target if gen is not None else self._last_partitions
        if not first and new != current and gen is not None and self.active \
                and self._incremental(gen, new):
            # Move only what changes; the partitions we keep never stop (issue 9).
            gen.target = new
            gen.retarget.set()
        elif not first and new != current:
            # ADR Transitioning: everyone drops its consumers, then waits before competing
            # again; the active instance a fixed delay, standbys a little longer (so the
            # active one tends to win again). A member that had no partitions has nobody
            # to defer to: it competes at once.
            s = self.settings
            if current:
                delay = s.transition_delay
                if not self.active:
                    delay += random.uniform(0, s.transition_jitter)
                self._not_before = self._clock() + delay
            if gen is not None:
                gen.end(StepDown.CONFIG_CHANGED, f"partitions {gen.partitions} -> {new}")
        if new != current:
            self._changed_at = self._clock()
        self._last_partitions = new
        self._wake.set()

    async def _close_watch(self) -> None:
        for task in (self._watcher,):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watcher = None
        for sub in (self._advisories, self._presence_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._advisories = self._presence_sub = None

    async def _on_consumer_deleted(self, msg: Msg) -> None:
        """A consumer of our stream went away: a standby may win right now."""
        if self.state is MemberState.STANDBY:
            self._wake.set()

    # -- supervisor -----------------------------------------------------------------
    async def _supervise(self) -> None:
        delay = 0.0
        try:
            while not self._stopping and not self._deleted:
                if delay > 0:
                    await self._wait_wake(delay, interruptible=False)
                hold = self._not_before - self._clock()
                if hold > 0:
                    await self._sleep(hold)
                    continue
                delay = self.settings.retry_interval
                assert self.config is not None
                partitions = member_partitions(self.config, self.member)
                if not partitions:
                    self._wake.clear()  # just evaluated: wait for the next change
                    await self._wait_wake(self.settings.retry_interval * 5)
                    delay = 0.0
                    continue
                self._wake.clear()
                gen = await self._acquire(partitions)
                if gen is None:
                    # Right after a membership change the partitions we want are being
                    # released by their previous owners: look again soon.
                    soon = self._clock() < self._changed_at + 5.0
                    await self._stand_by(0.1 if soon else self.settings.retry_interval)
                    delay = 0.0
                    continue
                why = await self._run_active(gen)
                delay = self._delay_after(why)
        except Exception as exc:  # a bug, not a fault: say so, release, stop
            self._log.exception("member runtime failed", error=repr(exc))
            self.stop_reason = f"error: {exc!r}"
            raise
        finally:
            if self.state is MemberState.STANDBY:
                self._transition(MemberState.STOPPED)

    def _delay_after(self, why: StepDown) -> float:
        if why in (StepDown.CONFIG_CHANGED, StepDown.STALLED):
            return 0.0  # the transition hold applies / nobody else needs a chance
        return self.settings.rejoin_delay

    async def _wait_wake(self, timeout: float, interruptible: bool = True) -> None:
        """Sleep up to ``timeout``; a config change or advisory (since the last attempt
        began, so none is lost while an attempt runs) ends it early."""
        if not interruptible:
            await self._sleep(timeout)
            return
        await self._wake.nap(timeout)

    # -- election -------------------------------------------------------------------
    def _consumer_config(self, filters: list[str], **extra: Any) -> dict[str, Any]:
        s = self.settings
        fields: dict[str, Any] = {"max_ack_pending": s.max_in_flight,
                                  "metadata": {MEMBER_KEY: self.member}, **extra}
        return consumer_config(filters, ack_wait=s.ack_wait, **fields)

    async def _acquire(self, partitions: tuple[int, ...]) -> Generation | None:
        """Try once to become the active instance; None means stay standby."""
        if self.settings.exclusivity is Exclusivity.PINNED:
            return await self._acquire_pinned(partitions)
        s = self.settings
        watch = self._watch
        if (watch is not None and watch.replaceable(self._clock(), s.lease, s.takeover_margin)
                and not await self._unseat(watch)):
            return None
        inactive = int(s.inactive_threshold * 1e9)
        instance_meta = {MEMBER_KEY: self.member, INSTANCE_KEY: self.instance_id,
                         TOKEN_KEY: self._token}
        sync_cfg = self._consumer_config(sync_filters(partitions), inactive_threshold=inactive,
                                         metadata=instance_meta, max_ack_pending=1)
        sent = self._clock()
        try:
            await self.js.create_consumer(self._consume_stream, self.sync_consumer, sync_cfg)
        except ConsumerExists:
            if self._watch is None:
                await self._learn_owner()
            return None
        except WorkQueueOverlap:
            return None
        except CgroupdError as exc:
            self._log.warning("sync consumer create failed", error=str(exc))
            return None
        self._watch = None
        await self._close_prober()
        gen = self._gen = self._generation(partitions)
        # Any ownership check the previous holder sent after this point fails: its lease
        # has run out a lease from now (see _reclaim_abandoned).
        gen.claimed_at = self._clock()
        gen.lease.renew(sent)
        # We hold the election from here on: keep the sync consumer alive while waiting
        # for the previous owner's data consumer to go (10100). A live previous owner
        # (draining after a step-down) is never robbed; an abandoned one is reclaimed.
        gen.pullers.append(await self._start_puller(gen, self.sync_consumer, 1, StepDown.SYNC_LOST))
        try:
            await self._add_data_consumer(gen, self.data_consumer, partitions)
        except CgroupdError as exc:
            self._log.warning("data consumer create failed", error=str(exc))
            await self._release(gen)
            self._gen = None
            return None
        return gen

    # -- standing by (sync exclusivity) ---------------------------------------------
    async def _learn_owner(self) -> None:
        """Read who holds the member's synchronization consumer, to watch it."""
        try:
            info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        except CgroupdError as exc:
            self._log.info("could not read the sync consumer's holder", error=str(exc))
            return
        meta = ConsumerInfo.of(info).metadata
        owner = meta.get(INSTANCE_KEY)
        if info is None or not owner or meta.get(HOLDER_KEY):
            # Gone already, or not a member instance (a Spark query's lease, which answers
            # no probe): nothing to watch; it ends by itself.
            self._watch = None
            return
        if owner == self.instance_id:
            if meta.get(TOKEN_KEY) != self._token:
                raise InstanceIdInUse(
                    f"another process holds member {self.member} of {self.stream}/"
                    f"{self.group} under this instance id ({self.instance_id!r}); give each "
                    "process its own id")
            # Ours, from an earlier period that could not delete it: drop it and compete.
            with contextlib.suppress(CgroupdError):
                await self.js.delete_consumer(self._consume_stream, self.sync_consumer)
            self._watch = None
            return
        if self._watch is None or self._watch.instance != owner:
            self._watch = OwnerWatch(owner, heard=self._clock())

    async def _stand_by(self, timeout: float) -> None:
        """Wait up to ``timeout`` (a wake ends it early) while watching the active
        instance: return at once when it is gone, idle, or silent for ``lease +
        takeover_margin``, so that the next attempt replaces it."""
        watch, s = self._watch, self.settings
        if watch is None or s.exclusivity is not Exclusivity.SYNC:
            await self._close_prober()
            await self._wait_wake(timeout)
            return
        prober = self._prober
        if prober is None or prober.watch is not watch:
            await self._close_prober()
            prober = self._prober = Prober(self.js.nc, presence_subject(
                self._key, watch.instance), watch, self._clock, self._wake.set)
        deadline = self._clock() + timeout
        while not self._wake.is_set():
            await prober.send()
            # A "no responders" answer, an advisory or a config change wakes us at once.
            await self._wait_wake(s.presence_interval)
            now = self._clock()
            if self._watch is not watch or watch.replaceable(now, s.lease, s.takeover_margin):
                return
            if now >= deadline:
                return

    async def _close_prober(self) -> None:
        if self._prober is not None:
            await self._prober.close()
            self._prober = None

    async def _unseat(self, watch: OwnerWatch) -> bool:
        """Delete the synchronization consumer of an active instance that is gone, idle, or
        silent for too long (if it still holds it); True: competing may go on."""
        s = self.settings
        if not watch.gone:
            # One last question before taking over from a silent or idle instance.
            answer = await probe(self.js.nc, presence_subject(self._key, watch.instance),
                                 self._probe_timeout)
            watch.update(answer, self._clock())
            if not watch.replaceable(self._clock(), s.lease, s.takeover_margin):
                return False
            # Other standbys decided at about the same time: spread them out, so that one
            # is first and the others see it below (no such wait after a crash: speed).
            await self._sleep(random.uniform(0, 2 * s.presence_interval))
        # Read the holder right before deleting (another standby may have been quicker).
        try:
            info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        except CgroupdError as exc:
            self._log.info("could not read the sync consumer's holder", error=str(exc))
            return False
        if info is None or ConsumerInfo(info).meta(INSTANCE_KEY) != watch.instance:
            self._watch = None  # released meanwhile, or someone else holds it now
            return True
        why = "gone" if watch.gone else "idle" if watch.idle else "silent"
        silent = self._clock() - watch.heard
        self._log.warning("taking over from the active instance", active=watch.instance,
                          why=why, silent_for=round(silent, 3))
        self.stats["takeovers"] += 1
        try:
            await self.js.delete_consumer(self._consume_stream, self.sync_consumer)
            if watch.gone:
                # Dead: its data consumer can go now too (saves the successor a round of
                # "overlapping consumer" and presence checks; extra ones are reclaimed).
                await self.js.delete_consumer(self._consume_stream,
                                              data_consumer(self.member, watch.instance))
        except CgroupdError as exc:
            self._log.warning("could not delete the old owner's consumers", error=str(exc))
            return False
        self._watch = None
        return True

    async def _add_data_consumer(self, gen: Generation, name: str,
                                 partitions: tuple[int, ...]) -> None:
        """Create a data consumer for ``partitions`` and pull from it.

        Creation fails with 10100 while the previous owner's data consumer still holds
        some of them: retry until it lets go (reclaiming it if abandoned), up to a bound.
        """
        s = self.settings
        config = self._consumer_config(
            partition_filters(partitions), inactive_threshold=int(s.inactive_threshold * 1e9),
            metadata={MEMBER_KEY: self.member, INSTANCE_KEY: self.instance_id,
                      TOKEN_KEY: self._token})
        # Long enough for the previous owner to drain, or its lease to run out.
        deadline = self._clock() + max(s.drain_timeout, s.lease) + 2 * s.retry_interval
        while True:
            try:
                await self.js.create_consumer(self._consume_stream, name, config)
                break
            except WorkQueueOverlap:
                if s.reclaim_abandoned and await self._reclaim_abandoned(gen):
                    continue
                if self._clock() > deadline or gen.ended.done() or self._stopping:
                    raise
            await self._sleep(min(0.05, s.retry_interval))
        gen.data[name] = partitions
        gen.pullers.append(await self._start_puller(gen, name, s.max_in_flight,
                                                    StepDown.DATA_LOST, deliver=True))

    def _incremental(self, gen: Generation, new: tuple[int, ...]) -> bool:
        """Can this change be applied by moving only the partitions that change?"""
        if self.settings.exclusivity is Exclusivity.PINNED:
            # The member consumer is shared and never deleted (issue 13 item 3): the
            # pinned instance moves partitions in place, even to none.
            return True
        return (self.settings.incremental_rebalance
                and bool(new) and bool(set(new) & set(gen.partitions)))

    async def _rebalance_loop(self, gen: Generation) -> None:
        """Apply membership changes in place: release lost partitions once their messages
        are settled, then claim gained ones as soon as their previous owner let go."""
        pinned = self.settings.exclusivity is Exclusivity.PINNED
        retry_until: float | None = None
        while not gen.ended.done():
            await gen.retarget.wait()
            gen.retarget.clear()
            target = gen.target
            if target == gen.partitions and not gen.reconcile:
                retry_until = None
                continue
            gen.reconcile = False
            started = self._clock()
            move = self._move_pinned if pinned else self._move_partitions
            try:
                done = await move(gen, target)
            except CgroupdError as exc:
                self._log.warning("rebalance step failed", error=str(exc))
                done = False
            if not done:
                if gen.target != target:
                    continue  # superseded: the loop goes again
                if pinned:
                    # Every attempt starts from the member consumer as it is: one that
                    # met a passing conflict (another member mid-move) is tried again.
                    if retry_until is None:
                        retry_until = started + self.settings.drain_timeout
                    if self._clock() < retry_until:
                        gen.reconcile = True
                        gen.retarget.set()
                        await self._sleep(0.1)
                        continue
                gen.end(StepDown.CONFIG_CHANGED, "incremental rebalance not possible")
                continue
            retry_until = None
            self.partitions = gen.partitions
            self.stats["rebalances"] += 1
            if not gen.partitions:
                gen.end(StepDown.CONFIG_CHANGED, "this member owns no partition any more")
                continue
            elapsed = self._clock() - started
            self._log.info("rebalanced", partitions=list(gen.partitions),
                           seconds=round(elapsed, 3))
            if self.on_rebalance is not None:
                await self._callback(self.on_rebalance, (gen.partitions, elapsed))

    async def _move_partitions(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """One incremental rebalance; False means fall back to a full rejoin.

        Losing: the data consumer's filters drop the lost partitions; every delivery made
        before (numbered at most what the update answers) is taken in and finished, our
        acks are confirmed applied, and only then does the sync consumer let them go, so
        the next owner never gets a message we still hold or finished. Late deliveries of
        them are never run (issue 13 item 11). Gaining: once the sync consumer holds them,
        the member's data consumer is replaced, at a quiet point, by one fresh consumer
        for all its partitions, so the member keeps one consumer and its in-flight limit
        (max in flight 1 keeps the member in stream order)."""
        s = self.settings
        assert gen.dispatcher is not None
        kept = tuple(p for p in gen.partitions if p in target)
        lost = set(gen.partitions) - set(target)
        if not kept:
            return False
        if lost:
            for name, parts in list(gen.data.items()):
                left = tuple(p for p in parts if p not in lost)
                if left == parts:
                    continue
                if not left:
                    return False  # a consumer of lost partitions only: rejoin instead
                reply = await self._update_filters(name, partition_filters(left))
                delivered = ConsumerInfo(reply).delivered_consumer_seq
                puller = next((p for p in gen.pullers if p.consumer == name), None)
                if puller is None or not await puller.received_through(
                        delivered, s.drain_timeout):
                    return False
                gen.data[name] = left
            if not await gen.dispatcher.settle(lost, s.drain_timeout):
                return False
            if not await self._acks_confirmed(gen):
                return False
            gen.dispatcher.accept = set(kept)
            await self._update_filters(self.sync_consumer, sync_filters(kept))
            gen.partitions = kept
        gained = tuple(p for p in target if p not in gen.partitions)
        if gained:
            deadline = self._clock() + s.drain_timeout + 2 * s.retry_interval
            while True:
                if gen.ended.done() or gen.target != target:
                    return gen.target != target  # superseded: the loop goes again
                try:
                    await self._update_filters(self.sync_consumer, sync_filters(target))
                    break
                except WorkQueueOverlap:
                    if self._clock() > deadline:
                        raise
                # Still claimed: by a previous owner finishing (wait), or by a dead one
                # whose claim nobody will release (reclaimed at once).
                await self._reclaim_released(gen, set(gained))
                await self._sleep(0.05)
            # Claimed: the previous owners are done with them, but an abandoned data
            # consumer may still hold them; only then pause for the swap.
            while not await self._reclaim_released(gen, set(gained)):
                if gen.ended.done() or gen.target != target:
                    return gen.target != target
                if self._clock() > deadline:
                    return False
                await self._sleep(0.05)
            if not await self._replace_data_consumer(gen, target):
                return False
            gen.partitions = target
        return True

    async def _replace_data_consumer(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """At a quiet point (nothing running, our acks applied), swap the data consumer(s)
        for one fresh consumer of ``target``: it delivers what is left of every partition
        in stream order. What we held but had not started goes back with the old one."""
        s = self.settings
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        dispatcher.pause()
        try:
            old = list(gen.data)
            for puller in [p for p in gen.pullers if p.consumer in old]:
                await puller.stop()  # nothing of the old consumer arrives any more
            gen.pullers = [p for p in gen.pullers if p.consumer not in old]
            if not await dispatcher.idle(s.drain_timeout):
                return False
            dispatcher.discard_unstarted()
            if not await self._acks_confirmed(gen):
                return False
            for name in old:
                del gen.data[name]  # first: a self-check must not miss it as "lost"
                await self.js.delete_consumer(self._consume_stream, name)
            dispatcher.last_settled = None
            dispatcher.accept = set(target)
            gen.rebalances += 1
            await self._add_data_consumer(
                gen, data_consumer(self.member, self.instance_id, gen.rebalances), target)
            return True
        finally:
            dispatcher.resume()

    async def _reclaim_released(self, gen: Generation, partitions: set[int]) -> bool:
        """Consumers of *other* members that still hold partitions we now own, whose
        instance is gone (issue 13 item 12): a member killed and then dropped leaves its
        synchronization consumer (until the server's inactive threshold) and its data
        consumer (kept for its unacknowledged messages' ack wait). One whose instance the
        server says is gone is deleted; any other (a live previous owner still finishing,
        a Spark query's lease) is waited for. True when none is left."""
        wanted = set(partition_filters(sorted(partitions))) | set(
            sync_filters(sorted(partitions)))
        free = True
        try:
            for info in map(ConsumerInfo, await self.js.list_consumers(self._consume_stream)):
                meta = info.metadata
                owner, name = meta.get(INSTANCE_KEY), info.name
                filters = set(info.filters)
                if name in gen.data or name == self.sync_consumer or not filters & wanted:
                    continue
                if meta.get(HOLDER_KEY):
                    free = False  # a lease held by something other than a member: it ends
                    continue
                # Only an instance the server says is gone (no responders): one slow to
                # answer under load may be alive and finishing.
                answer = await probe(self.js.nc, presence_subject(self._key, owner),
                                     self._probe_timeout) if owner else None
                gone = answer is not None and answer.presence is Presence.GONE
                if gone and not gen.ended.done():
                    self._log.warning("reclaiming a released member's abandoned data "
                                      "consumer", consumer=name, instance=owner)
                    await self.js.delete_consumer(self._consume_stream, name)
                else:
                    free = False
        except CgroupdError as exc:
            self._log.warning("could not inspect a previous owner's consumer", error=str(exc))
            return False
        return free

    # -- pinned mode: moving partitions on the shared member consumer ------------------
    async def _move_pinned(self, gen: Generation, target: tuple[int, ...]) -> bool:
        """Bring the member consumer to ``target`` in place (issue 13 items 3 and 4); False
        means fall back to a rejoin. Only the pinned instance changes the consumer.

        Losing: the lost partitions are *held* (a filter that claims them but delivers
        nothing), what was delivered of them is finished, our acks confirmed, and only then
        are they let go (a static group records how far they were processed). Gaining:
        claim them (held) once their previous owner let go, then, at a quiet point (nothing
        running, nothing of ours in flight), take them and reset the consumer so it
        delivers their messages from where the previous owner left off (a work queue holds
        exactly what is left; a static group skips what was processed, see SkipRules).
        """
        info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        if info is None or gen.dispatcher is None:
            return False
        view = ConsumerInfo(info)
        real, held = member_consumer_filters(view.filters)
        if view.meta(RESET_KEY) \
                and not await self._quiet_reset(gen, real):
            return False
        want = set(target)
        lost, gained = real - want, want - real
        if not lost and not gained and not held:
            gen.partitions = tuple(sorted(want))
            gen.dispatcher.accept = want
            return True
        if (lost or held - gained) and not await self._release_partitions(
                gen, real & want, lost, held & gained):
            return False
        if gained and not await self._take_partitions(gen, real & want, gained):
            return False
        gen.partitions = tuple(sorted(want))
        gen.dispatcher.accept = want
        return True

    def _member_filters(self, real: set[int], held: set[int]) -> list[str]:
        """The member consumer's filters: the reference's for the partitions it delivers
        (it shares this consumer and rewrites one whose filters differ from its own), and
        hold filters for those it claims without delivering."""
        assert self.config is not None
        if real == set(member_partitions(self.config, self.member)):
            delivered = member_filters(self.config, self.member)
        else:
            delivered = reference_filters(self.config, sorted(real))
        subjects = group_subjects(self.config)
        filters = delivered + hold_filters(sorted(held - real), subjects)
        return filters or [idle_filter(self.member)]

    async def _release_partitions(self, gen: Generation, kept: set[int], lost: set[int],
                                  claiming: set[int]) -> bool:
        """Stop delivering ``lost``, finish what we hold of them, then let them go."""
        s = self.settings
        assert gen.dispatcher is not None
        puller = next(p for p in gen.pullers if p.delivers)
        reply = await self._update_config(self.sync_consumer, self._member_filters(
            kept, lost | claiming))
        delivered = ConsumerInfo(reply).delivered_consumer_seq
        # Every delivery of a lost partition is numbered at most `delivered`: take them all
        # in before settling, or one arriving late would run beside its next owner.
        if not await puller.received_through(delivered, s.drain_timeout):
            return False
        if not await gen.dispatcher.settle(lost, s.drain_timeout):
            return False
        if not await self._acks_confirmed(gen):
            return False
        meta: dict[str, str] = {}
        if self.static:
            released = ConsumerInfo(reply).json_map(RELEASED_KEY)
            for p in lost:
                done = max(gen.processed.get(p, 0), gen.dispatcher.highest.get(p, 0))
                released[str(p)] = max(done, int(released.get(str(p), 0)))
            meta[RELEASED_KEY] = json.dumps(released, separators=(",", ":"), sort_keys=True)
        gen.dispatcher.accept = set(kept)
        await self._update_config(self.sync_consumer, self._member_filters(kept, claiming),
                                  meta)
        return True

    async def _take_partitions(self, gen: Generation, kept: set[int], gained: set[int]) -> bool:
        """Claim ``gained`` once free, then take them at a quiet point (see _move_pinned)."""
        starts = await self._claim_partitions(gen, kept, gained)
        if starts is None:
            return False
        return await self._quiet_reset(gen, kept, starts)

    async def _quiet_reset(self, gen: Generation, kept: set[int],
                           starts: dict[int, int] | None = None) -> bool:
        """At a quiet point (nothing running, our acks applied, no pull of ours open) set
        the filters to ``kept`` plus the partitions in ``starts`` (how far each was
        processed) and reset the consumer so it delivers what is left of them, in order.
        A work queue holds exactly what is left; a static group's consumer goes back to
        the lowest sequence still needed and skips what was processed (SkipRules)."""
        s = self.settings
        assert gen.dispatcher is not None
        dispatcher = gen.dispatcher
        starts = starts or {}
        partitions = kept | set(starts)
        puller = next(p for p in gen.pullers if p.delivers)
        was_open = not dispatcher.paused
        puller.hush()
        dispatcher.pause()
        try:
            if not await dispatcher.idle(s.drain_timeout):
                return False
            pending = dispatcher.discard_unstarted()
            if not await self._acks_confirmed(gen):
                return False
            deadline = self._clock() + s.pull_expires + 1.0
            while puller.outstanding > 0 and self._clock() < deadline:
                await self._sleep(0.01)
            if puller.outstanding > 0:
                return False
            pending += dispatcher.discard_unstarted()
            meta: dict[str, str] = {RESET_KEY: ""}
            seq = 1  # a work queue holds exactly what is left to do
            if self.static:
                info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
                upto = ConsumerInfo.of(info).delivered_stream_seq
                for p in kept:
                    gen.skip.processed_through(
                        p, upto, (m.stream_sequence for m in pending if m.partition == p))
                for p, done in starts.items():
                    gen.skip.processed_through(p, done)
                    gen.processed[p] = done
                meta[SKIP_KEY] = gen.skip.to_json()
                seq = gen.skip.lowest_needed(partitions)
            await self._update_config(self.sync_consumer,
                                      self._member_filters(partitions, set()), meta)
            dispatcher.accept = partitions
            await self._reset_pinned(gen, seq)
            return True
        finally:
            puller.hush(False)
            if was_open:
                dispatcher.resume()

    async def _claim_partitions(self, gen: Generation, kept: set[int],
                                gained: set[int]) -> dict[int, int] | None:
        """Hold ``gained`` as soon as no other consumer has them; for a static group, also
        how far each was processed (the previous owners' release records). None if they
        are not free in time."""
        s = self.settings
        deadline = self._clock() + s.drain_timeout + 2 * s.retry_interval
        while not gen.ended.done() and gained <= set(gen.target):
            starts, busy = await self._previous_owners(gained)
            if not busy:
                try:
                    await self._update_config(self.sync_consumer,
                                              self._member_filters(kept, gained))
                    return starts
                except WorkQueueOverlap:
                    pass
            if self._clock() > deadline:
                self._log.info("partitions not released in time", partitions=sorted(gained),
                               held_by=sorted(busy))
                return None
            await self._sleep(0.05)
        return None

    async def _previous_owners(self, gained: set[int]) -> tuple[dict[int, int], set[str]]:
        """How far each of ``gained`` was processed (static release records), and the
        other consumers that still deliver or hold any of them (reclaimed if nobody has
        pulled on them for a while: their member is gone)."""
        starts = {p: 0 for p in gained}
        busy: set[str] = set()
        for raw in await self.js.list_consumers(self._consume_stream):
            info = ConsumerInfo(raw)
            name = info.name
            owner = info.meta(MEMBER_KEY)
            # A static stream may carry other groups' consumers: ours are named after
            # their member (as admin reads them; the Go reference's carry no metadata).
            ours = name == f"{self.group}-{owner}" or (
                owner is None and name.startswith(f"{self.group}-"))
            if name == self.sync_consumer or (self.static and not ours):
                continue
            if self.static:
                for key, done in info.json_map(RELEASED_KEY).items():
                    if key.isdigit() and int(key) in starts:
                        starts[int(key)] = max(starts[int(key)], int(done))
            real, held = member_consumer_filters(info.filters)
            if (real | held) & gained:
                if await self._reclaim_member_consumer(info):
                    for p in (real | held) & gained:
                        floor = info.ack_floor_stream_seq
                        starts[p] = max(starts[p], floor)
                    continue
                busy.add(name)
        return starts, busy

    async def _reclaim_member_consumer(self, info: ConsumerInfo) -> bool:
        """Another member's consumer that holds partitions now ours, and nobody pulls on
        it: all its instances are gone (issue 13 item 12). On a work queue it is deleted
        (its unacknowledged messages stay in the stream for us); on a static stream it is
        left alone (partitions do not conflict there) and we start after its ack floor."""
        name = info.name

        def abandoned(view: ConsumerInfo) -> bool:
            # No pull waiting (a standby or the holder would have one), and no holder: a
            # live holder may pause its pulls for a moment, but keeps its pin.
            return view.num_waiting == 0 and not view.anyone_pinned

        if not abandoned(info):
            return False
        await self._sleep(self.settings.pull_expires)  # a live instance pulls by then
        again = await self.js.consumer_info(self._consume_stream, name)
        if again is None:
            return True
        if not abandoned(ConsumerInfo(again)):
            return False
        self._log.warning("taking partitions from a member consumer nobody pulls on",
                          consumer=name)
        if not self.static:
            await self.js.delete_consumer(self._consume_stream, name)
        return True

    async def _acks_confirmed(self, gen: Generation) -> bool:
        """Every ack we sent on the member consumer is applied: the server applies one
        consumer's acks in order, so a confirmed repeat of the last one proves it."""
        last = gen.dispatcher.last_settled if gen.dispatcher is not None else None
        if last is None:
            return True
        try:
            reply = await self.js.nc.request(last.reply, b"+ACK",
                                             timeout=self.settings.drain_timeout)
        except (nats.errors.Error, TimeoutError) as exc:
            self._log.info("acks not confirmed", error=repr(exc))
            return False
        status = jsapi.server_status(reply)
        return status is None or status.code == "200"

    async def _update_config(self, name: str, filters: list[str],
                             metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """Change one of our consumers in place: its filters, and metadata entries."""
        info = await self.js.consumer_info(self._consume_stream, name)
        if info is None:
            raise ConsumerNotFound(404, jsapi.ERR_CONSUMER_NOT_FOUND,
                                   f"consumer {name} disappeared")
        config = dict(info["config"])
        config["filter_subjects"] = filters
        config.pop("filter_subject", None)
        if metadata:
            config["metadata"] = {**(config.get("metadata") or {}), **metadata}
        try:
            return await self.js.create_consumer(self._consume_stream, name, config,
                                                 action="update")
        except ApiError as exc:
            self._log.info("consumer update refused", consumer=name, filters=filters,
                           error=str(exc))
            raise

    async def _update_filters(self, name: str, filters: list[str]) -> dict[str, Any]:
        """Change the filters of one of our consumers in place (consumer update); the
        consumer info it answers with."""
        return await self._update_config(name, filters)

    async def _reclaim_abandoned(self, gen: Generation) -> bool:
        """Delete data consumers of this member whose instance cannot be using them.

        The server keeps a consumer holding unacknowledged messages until their ack wait
        runs out, so a crashed owner would block its successor for ``ack_wait``. Every
        instance answers on its presence subject, with its state; the server itself says
        "no responders" when the instance's connection is gone. Reclaimed (see
        :func:`cgroupd.lease.may_reclaim`): a gone instance's consumer at once; a silent
        one's once we have held the sync consumer for a whole lease (its lease has run out
        by then); one that answers it is no longer active. A live owner still draining
        answers, and is left alone: it deletes its consumer itself.
        """
        mine = set(gen.data) | {self.sync_consumer}
        reclaimed = False
        try:
            for info in map(ConsumerInfo, await self.js.list_consumers(self._consume_stream)):
                meta = info.metadata
                name, owner = info.name, meta.get(INSTANCE_KEY)
                if name in mine or meta.get(MEMBER_KEY) != self.member or not owner \
                        or name == self.sync_consumer:
                    continue
                answer = await probe(self.js.nc, presence_subject(self._key, owner),
                                     self._probe_timeout)
                held = self._clock() - gen.claimed_at
                if may_reclaim(answer, held, self.settings.lease) and not gen.ended.done():
                    self._log.warning("reclaiming abandoned data consumer", consumer=name,
                                      instance=owner, presence=answer.presence.value,
                                      state=answer.state or None)
                    reclaimed |= await self.js.delete_consumer(self._consume_stream, name)
        except CgroupdError as exc:
            self._log.warning("could not inspect previous owner's consumer", error=str(exc))
        return reclaimed

    async def _answer_presence(self, msg: Msg) -> None:
        if msg.reply:
            state = self.state.value
            if self.state is MemberState.STANDBY and self._gen is not None:
                state = "claiming"  # holds the claim, creating its data consumer
            with contextlib.suppress(Exception):
                await self.js.nc.publish(msg.reply, f"{self.instance_id} {state}".encode())

    def _connection_lost(self) -> None:
        """Checks sent before a disconnection prove nothing: start nothing until a new one
        (sync exclusivity; a standby may take over meanwhile)."""
        gen = self._gen
        if gen is not None:
            gen.lease.revoke()

    def _connection_back(self) -> None:
        gen = self._gen
        if gen is not None and gen.dispatcher is not None:
            gen.dispatcher.connection_back()

    async def _acquire_pinned(self, partitions: tuple[int, ...]) -> Generation | None:
        """Pinned mode: ensure the shared member consumer exists, pull until pinned.

        Only the pinned instance changes the consumer (:meth:`_move_pinned` brings its
        filters to the config); a standby that finds it with other filters leaves it be.
        Nothing starts before :meth:`_take_over` opens the dispatcher."""
        s = self.settings
        name = self.sync_consumer
        extra: dict[str, Any] = {
            "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "pinned_client",
            "priority_timeout": int(s.pinned_ttl * 1e9),
        }
        if self.static:
            extra["durable_name"] = name
        else:
            extra["inactive_threshold"] = int(max(s.ack_wait, s.inactive_threshold) * 1e9)
        cfg = self._consumer_config(self._member_filters(set(partitions), set()), **extra)
        if self.static:
            # A new durable starts each partition where its previous owners left it
            # (issue 13 item 4), and not before they let it go (no conflict tells us).
            try:
                starts, busy = await self._previous_owners(set(partitions))
            except CgroupdError as exc:
                self._log.warning("could not read previous owners", error=str(exc))
                return None
            if busy:
                return None
            cfg["metadata"][SKIP_KEY] = SkipRules(
                {p: (done, frozenset()) for p, done in starts.items() if done}).to_json()
        try:
            await self.js.create_consumer(self._consume_stream, name, cfg)
        except WorkQueueOverlap:
            with contextlib.suppress(CgroupdError):
                await self._previous_owners(set(partitions))  # reclaims abandoned ones
            return None
        except ConsumerExists:
            # It exists (made by another instance, maybe the reference's): share it.
            info = await self.js.consumer_info(self._consume_stream, name)
            if PRIORITY_GROUP not in ConsumerInfo.of(info).priority_groups:
                self._log.warning("member consumer exists without priority group",
                                  consumer=name)
                return None
            if not await self._retarget_unpinned(info or {}, partitions):
                return None
        except CgroupdError as exc:
            self._log.warning("member consumer create failed", error=str(exc))
            return None
        gen = self._gen = self._generation(partitions)
        if self._stopping or self._deleted:  # stop() came while we were creating it
            gen.end(StepDown.STOPPING)
        gen.pin_lease = PinLease(s.pinned_ttl, self._clock)
        assert gen.dispatcher is not None
        gen.dispatcher.pause()
        pinned = asyncio.get_running_loop().create_future()
        gen.pullers.append(await self._start_puller(
            gen, name, s.max_in_flight, StepDown.PIN_LOST, deliver=True, pinned=pinned))
        # Standby until the server pins us: the first message carries our pin id.
        done, _ = await asyncio.wait({pinned, gen.ended}, return_when=asyncio.FIRST_COMPLETED)
        if pinned in done and not gen.ended.done():
            return gen
        await self._release(gen)
        self._gen = None
        return None

    def _generation(self, partitions: tuple[int, ...]) -> Generation:
        s = self.settings
        gen = Generation(partitions, lease=Lease(s.lease, self._clock))
        pinned = s.exclusivity is Exclusivity.PINNED
        gen.dispatcher = Dispatcher(
            self.js.nc, self.handler, ordering=s.ordering, max_in_flight=s.max_in_flight,
            ack_wait=s.ack_wait, backoff=s.backoff,
            key_of=key_function(s.key, self.config), before_start=lambda: self._fence(gen),
            on_settled=lambda: self._refill(gen), log=self._log, stats=self.stats,
            guard=_PinnedAcks(self, gen) if pinned else None,
            hand_back_on_close=pinned, completed=self._completed)
        gen.dispatcher.accept = set(partitions)
        if pinned and self.static:
            gen.dispatcher.ack_not_owned = True
            gen.dispatcher.skip = lambda m: gen.skip.covers(m.partition, m.stream_sequence)
        gen.dispatcher.start()
        return gen

    async def _start_puller(self, gen: Generation, consumer: str, batch: int,
                            lost: StepDown, deliver: bool = False,
                            pinned: asyncio.Future[None] | None = None) -> Puller:
        s = self.settings
        group = PRIORITY_GROUP if pinned is not None else None

        def on_message(msg: Msg) -> None:
            if pinned is not None and not pinned.done():
                gen.pinned_at = self._clock()
                pinned.set_result(None)
            if deliver and gen.dispatcher is not None:
                gen.received += 1
                gen.dispatcher.submit(msg)

        dispatcher = gen.dispatcher
        capacity = None
        if deliver and dispatcher is not None:
            def capacity() -> int:
                return s.max_in_flight - dispatcher.holding

        puller = await self.js.puller(
            self._consume_stream, consumer,
            PullOptions(batch=batch, expires=s.pull_expires, heartbeat=s.heartbeat,
                        group=group, check_gaps=deliver and pinned is None),
            on_message, capacity)

        def ended(fut: asyncio.Future[tuple[PullEnd, str]]) -> None:
            why, detail = fut.result()
            if why is PullEnd.DELIVERY_LOST:
                gen.end(StepDown.STALLED, f"{consumer}: {detail}")
            elif why is not PullEnd.STOPPED:
                gen.end(lost, f"{consumer}: {detail}")

        puller.ended.add_done_callback(ended)
        return puller

    # -- activity -------------------------------------------------------------------
    async def _run_active(self, gen: Generation) -> StepDown:
        self._gen = gen
        self.partitions = gen.partitions
        self._transition(MemberState.ACTIVE, partitions=list(gen.partitions))
        self._log.info("became active", partitions=list(gen.partitions))
        if self.on_active is not None:
            await self._callback(self.on_active, gen.partitions)
        if self.settings.exclusivity is Exclusivity.SYNC:
            for work in (self._rebalance_loop, self._verify_loop):
                self._spawn(gen, work(gen), work.__name__)
        else:
            self._spawn(gen, self._hold_pin(gen), "_hold_pin")
        if self._stopping or self._deleted:
            gen.end(StepDown.STOPPING if self._stopping else StepDown.GROUP_DELETED)
        why, detail = await gen.ended
        self._transition(MemberState.STEPPING_DOWN, reason=why.value, detail=detail)
        self.stats["step_downs"] += why is not StepDown.STOPPING
        self._stepping_since = self._clock()
        try:
            await self._release(gen)
        finally:
            self._stepping_since = None
        self._gen = None
        self.partitions = ()
        self._transition(MemberState.STOPPED if self._stopping or self._deleted
                         else MemberState.STANDBY, reason=why.value)
        self._log.info("stepped down", reason=why.value, detail=detail)
        if self.on_standby is not None:
            await self._callback(self.on_standby, why.value)
        return why

    def _spawn(self, gen: Generation, coro: Awaitable[None], name: str) -> None:
        """A generation's background task; if it dies of a bug, the generation ends."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"cgroupd{name}")
        gen.tasks.add(task)

        def done(t: asyncio.Future[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self._log.error("background task failed", task=name, error=repr(t.exception()))
                gen.end(StepDown.ERROR, f"{name} failed: {t.exception()!r}")

        task.add_done_callback(done)

    async def _release(self, gen: Generation) -> None:
        """Stop taking messages, let running handlers finish (bounded), drop consumers."""
        gen.end(StepDown.STOPPING)
        if gen.verifying is not None:
            gen.verifying.cancel()
        for task in gen.tasks:
            task.cancel()
        for task in gen.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.settings.exclusivity is Exclusivity.PINNED:
            await self._release_pinned(gen)
            return
        # Our own data consumers: ask for nothing more while handlers finish (what still
        # arrives stays unacknowledged, for the next owner).
        for puller in gen.pullers:
            if puller.delivers:
                await puller.pause()
        if gen.dispatcher is not None:
            await gen.dispatcher.drain(self.settings.drain_timeout)
        await self._release_sync(gen)

    async def _release_sync(self, gen: Generation) -> None:
        """Sync exclusivity, once no handler runs any more: confirm our settlements, drop
        our data consumers (never skipped silently), then our claim if it is still ours."""
        # Settlements first: once the server confirmed them, deleting a data consumer
        # cannot hand a message we finished to the next owner.
        if gen.dispatcher is not None and gen.dispatcher.unconfirmed:
            deadline = self._clock() + 2 * jsapi.API_TIMEOUT
            while not await gen.dispatcher.confirm():
                if self._clock() > deadline:
                    self._log.warning("settlements not confirmed before release; the next "
                                      "owner may run those messages again",
                                      count=gen.dispatcher.unconfirmed)
                    break
                await self._sleep(0.05)
        claims = [p for p in gen.pullers if not p.delivers]
        for puller in gen.pullers:
            if puller.delivers:
                await puller.stop()
        # Data consumers first: their unacked messages become available to the next owner,
        # who can only create its data consumer once ours are gone.
        for name in list(gen.data):
            await self._delete_own(name)
        # The claim: only if nothing says it went to someone else. Our sync puller would
        # have been told of its deletion, and the info must still name this process.
        intact = (gen.ended.result()[0] is not StepDown.SYNC_LOST
                  and not any(p.ended.done() for p in claims))
        if intact and await self._sync_is_ours() and not any(p.ended.done() for p in claims):
            with contextlib.suppress(CgroupdError):
                await self.js.delete_consumer(self._consume_stream, self.sync_consumer)
        for puller in claims:
            await puller.stop()

    async def _delete_own(self, name: str, attempts: int = 3) -> None:
        """Delete one of our consumers, retrying; say so loudly if it cannot be done (the
        next owner then reclaims it: we answer that we are no longer active)."""
        for attempt in range(attempts):
            try:
                await self.js.delete_consumer(self._consume_stream, name)
                return
            except CgroupdError as exc:
                if attempt + 1 == attempts:
                    self._log.error("could not delete our data consumer", consumer=name,
                                    error=str(exc))
                    return
            await self._sleep(0.1 * (attempt + 1))

    async def _release_pinned(self, gen: Generation) -> None:
        """Pinned mode: the member consumer is shared by every instance and outlives us.

        Running handlers finish while we keep pulling (so the pin stays ours); what
        arrives meanwhile is kept, not started. Then we give up the pin and hand back
        every message not started, in stream order: the next holder gets them before
        anything later of their keys (issue 13 item 2). Handing back is safe only within
        one pinned TTL of the unpin: the next holder takes back what we still hold by a
        consumer reset no earlier than that (see :meth:`_take_over`).
        """
        s = self.settings
        if gen.dispatcher is not None:
            await gen.dispatcher.drain(s.drain_timeout, hold_late=True)
        asked = self._clock()
        unpinned = await self._unpin(gen)
        lease = gen.pin_lease
        safe_until = asked + s.pinned_ttl - (lease.margin if lease is not None else 0.0)
        if unpinned and gen.dispatcher is not None and self._clock() < safe_until:
            back = await gen.dispatcher.hand_back()
            if back:
                self._log.info("handed back messages not started", count=back)
        for puller in gen.pullers:
            if unpinned and puller.delivers:
                # Deliveries already on their way are nak'ed as they come.
                await puller.retire(min(0.2, max(0.0, safe_until - self._clock())))
            await puller.stop()

    async def _unpin(self, gen: Generation) -> bool:
        """Give up the pin at once so the server picks a standby without waiting for the
        pinned TTL; only while the pin is provably ours: unpinning after losing it would
        unpin the new holder (issue 13)."""
        lease = gen.pin_lease
        if lease is None or lease.lost or not gen.ended.done() \
                or gen.ended.result()[0] is StepDown.PIN_LOST:
            return False
        if lease.remaining() < 2 * lease.margin and not await self._renew(gen):
            return False
        try:
            await self.js.unpin(self._consume_stream, self.sync_consumer, PRIORITY_GROUP)
        except CgroupdError as exc:
            self._log.info("could not unpin", error=str(exc))
            return False
        lease.lose()
        return True

    # -- pinned mode: the lease and the takeover ---------------------------------------
    async def _hold_pin(self, gen: Generation) -> None:
        """Pinned mode, while active: take over, then renew the lease every quarter of
        the pinned TTL (so handlers never wait for it) and apply membership changes."""
        if not await self._take_over(gen):
            return
        self._spawn(gen, self._rebalance_loop(gen), "_rebalance_loop")
        period = self.settings.pinned_ttl / 4
        while not gen.ended.done():
            await self._sleep(period)
            if not await self._renew(gen):
                gen.end(StepDown.PIN_LOST, "the pin could not be proven ours any more")

    async def _renew(self, gen: Generation) -> bool:
        """Prove the pin is still ours and extend the lease; one renewal at a time."""
        if gen.renewal is None or gen.renewal.done():
            gen.renewal = asyncio.ensure_future(self._renew_once(gen))
        return await asyncio.shield(gen.renewal)

    async def _renew_once(self, gen: Generation) -> bool:
        """A pull carrying our pin id, a round trip proving the server read it, then the
        consumer info showing our pin id still (see :mod:`cgroupd.pinning`)."""
        lease = gen.pin_lease
        puller = next((p for p in gen.pullers if p.delivers), None)
        if lease is None or lease.lost or puller is None:
            return False
        pin = puller.pin_id
        if pin is None or puller.ended.done():
            lease.lose()
            return False
        await puller.pull_one()
        sent = puller.pin_pulled_at
        try:
            await self.js.nc.flush(timeout=max(1, int(self.settings.pull_expires)))
            info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        except (CgroupdError, nats.errors.Error, TimeoutError) as exc:
            self._log.info("pin lease not renewed: no answer", error=repr(exc))
            return lease.valid
        holder = ConsumerInfo.of(info).pinned_client(PRIORITY_GROUP)
        if info is None or holder != pin:
            lease.lose()
            return False
        lease.renewed(pin, sent)
        if ConsumerInfo(info).meta(RESET_KEY):
            gen.reconcile = True  # a standby retargeted it before we held the pin
            gen.retarget.set()
        return lease.valid

    async def _take_over(self, gen: Generation) -> bool:
        """A newly pinned instance starts nothing while the member consumer holds messages
        delivered to someone else: a previous holder's, unfinished or being handed back.
        Handed back, they come to us and wait in stream order among their keys. If they do
        not come, then one pinned TTL after we were pinned, when no previous holder can
        trust an ack any more, we reset the consumer to its ack floor: everything not
        acknowledged is delivered again, in stream order (issue 13 item 1)."""
        s = self.settings
        assert gen.dispatcher is not None
        if not await self._renew(gen):
            gen.end(StepDown.PIN_LOST, "pinned, but could not prove it")
            return False
        puller = next(p for p in gen.pullers if p.delivers)
        deadline = gen.pinned_at + s.pinned_ttl
        # Before a reset no pull of ours may be open, or a delivery made before it could
        # arrive after it and run ahead of (and twice with) its redelivery. So requests
        # stop one pull expiry before the reset; the pin stays ours a TTL past the last.
        hush_at = max(gen.pinned_at, deadline - s.pull_expires - 0.25)
        can_reset = True
        try:
            while not gen.ended.done():
                try:
                    info = await self.js.consumer_info(self._consume_stream,
                                                       self.sync_consumer)
                    if info is None:
                        gen.end(StepDown.PIN_LOST, "member consumer deleted")
                        return False
                    if self.static:
                        self._load_static_state(gen, info)
                    foreign = int(info.get("num_ack_pending", 0)) - gen.dispatcher.holding
                    if foreign <= 0:
                        break
                    now = self._clock()
                    if now >= hush_at and can_reset:
                        puller.hush()
                    if now >= deadline and puller.outstanding == 0 and can_reset:
                        self._log.info("taking back messages a previous holder left "
                                       "unfinished", count=foreign)
                        try:
                            await self._reset_pinned(gen)
                        except (ApiError, JetStreamNotEnabled) as exc:
                            # No consumer reset (nats-server < 2.14): they come back once
                            # their ack wait runs out; nothing starts before.
                            self._log.error("consumer reset unavailable; waiting for the "
                                            "previous holder's messages to time out",
                                            error=str(exc), count=foreign)
                            can_reset = False
                            puller.hush(False)
                            continue
                        break
                except CgroupdError as exc:
                    self._log.info("takeover check failed; retrying", error=str(exc))
                await self._sleep(0.02)
        finally:
            puller.hush(False)
        if gen.ended.done():
            return False
        # The consumer may have the filters of another config, or have been retargeted by
        # a standby (RESET_KEY): bring it to ours before anything starts.
        try:
            moved = await self._move_pinned(gen, gen.target)
        except CgroupdError as exc:
            self._log.warning("could not bring the member consumer to this config",
                              error=str(exc))
            moved = False
        if not moved:
            gen.end(StepDown.CONFIG_CHANGED, "member consumer not brought to the config")
            return False
        self.partitions = gen.partitions
        gen.dispatcher.resume()
        return True

    async def _retarget_unpinned(self, info: dict[str, Any],
                                 partitions: tuple[int, ...]) -> bool:
        """A standby found the member consumer with other filters than its config gives.
        While an instance holds the pin, that one moves them (:meth:`_move_pinned`). While
        nobody does, no message may pin anyone (pinning takes a delivery), so the standby
        sets them, marking the consumer so the next holder resets it at a quiet point
        before running anything. False: not now, try again later."""
        view = ConsumerInfo(info)
        real, held = member_consumer_filters(view.filters)
        if real == set(partitions) and not held:
            return True
        holder = view.pinned_client(PRIORITY_GROUP)
        if holder:
            return True  # the holder applies the config; we wait for the pin
        meta = {RESET_KEY: "1"}
        if self.static:
            starts, busy = await self._previous_owners(set(partitions) - real)
            if busy:
                return False
            skip = SkipRules.from_json(view.meta(SKIP_KEY))
            for p, done in starts.items():
                if done:
                    skip.processed_through(p, done)
            floor = view.ack_floor_stream_seq
            released = view.json_map(RELEASED_KEY)
            for p in real - set(partitions):
                released[str(p)] = max(floor, int(released.get(str(p), 0)))
            meta[SKIP_KEY] = skip.to_json()
            meta[RELEASED_KEY] = json.dumps(released, separators=(",", ":"), sort_keys=True)
        try:
            await self._update_config(self.sync_consumer,
                                      self._member_filters(set(partitions), set()), meta)
        except ApiError as exc:
            if isinstance(exc, WorkQueueOverlap):
                await self._previous_owners(set(partitions) - real)  # reclaims abandoned
            self._log.info("member consumer not retargeted yet", error=str(exc))
            return False
        return True

    def _load_static_state(self, gen: Generation, info: dict[str, Any]) -> None:
        """Static group, on taking over: what the consumer says was processed."""
        view = ConsumerInfo(info)
        floor = view.ack_floor_stream_seq
        for p in gen.partitions:
            gen.processed[p] = max(gen.processed.get(p, 0), floor)
        text = view.meta(SKIP_KEY)
        gen.skip.rules = SkipRules.from_json(text).rules

    async def _reset_pinned(self, gen: Generation, seq: int = 0) -> None:
        """Reset the member consumer to ``seq`` (0: past its ack floor) and forget what we
        hold: all of it is delivered again, in stream order. Call with no pull of ours
        open (nothing delivered before the reset may still be on its way)."""
        assert gen.dispatcher is not None
        info = await self.js.reset_consumer(self._consume_stream, self.sync_consumer, seq)
        gen.dispatcher.last_settled = None  # acks before a reset need no proof after it
        dropped = gen.dispatcher.discard_unstarted()
        self._log.info("member consumer reset", seq=info.get("reset_seq"),
                       dropped=len(dropped))

    async def _sync_is_ours(self) -> bool:
        try:
            info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        except CgroupdError:
            return False
        meta = ConsumerInfo.of(info).metadata
        return bool(meta.get(INSTANCE_KEY) == self.instance_id
                    and meta.get(TOKEN_KEY) == self._token)

    async def _verify_loop(self, gen: Generation) -> None:
        """ADR: the active instance checks its consumers still exist and name it; each
        confirmed check renews its lease.

        It also notices a data consumer that starves us, at three checks in a row: the
        server holds messages for it, none is unacknowledged and we hold none (a
        nats-server killed with SIGKILL can come back with consumer state that no longer
        matches its stream), or the server counts more unacknowledged deliveries than we
        hold or nak'ed with a delay still to run out (a delivery lost in a reconnect). A new
        data consumer starts cleanly from what the work-queue stream still holds.
        """
        starved = received = 0
        while not gen.ended.done():
            await self._sleep(self.settings.retry_interval)
            gen.data_info = None
            if await self._check(gen) is not True or gen.data_info is None:
                continue
            info = gen.data_info
            dispatcher = gen.dispatcher
            holding = dispatcher.holding if dispatcher is not None else 0
            # A message nak'ed with a delay stays unacknowledged on the server until it is
            # redelivered, while we hold nothing of it: not a lost delivery (item 10).
            delayed = dispatcher.delayed() if dispatcher is not None else 0
            unacked = int(info.get("num_ack_pending", 0))
            waiting = int(info.get("num_pending", 0)) > 0
            quiet = gen.received == received and holding == 0
            # Starved: messages wait for us and nothing is unacknowledged, yet nothing
            # comes; or, with nothing arriving and nothing held, the server still counts
            # deliveries unacknowledged (lost in a reconnect): they would sit out their
            # ack wait.
            if (waiting and unacked == 0 and holding == 0) or (quiet and unacked > delayed):
                starved += 1
            else:
                starved = 0
            received = gen.received
            if starved >= 3:
                gen.end(StepDown.STALLED, "data consumer stopped delivering pending messages")

    async def _check(self, gen: Generation) -> bool | None:
        """One self-check at a time per generation, shared by everyone who asks (a
        generation whose lease ran out has every handler slot waiting for it)."""
        task = gen.verifying
        if task is None or task.done():
            task = gen.verifying = asyncio.ensure_future(self._verify(gen))
        return await asyncio.shield(task)

    async def _verify(self, gen: Generation) -> bool | None:
        """Do we still own the member? True (and the lease renewed from when the check was
        sent), False (the generation ends), None (no answer: the lease runs out meanwhile)."""
        sent = self._clock()
        names = list(gen.data)
        try:
            sync = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
            data = [await self.js.consumer_info(self._consume_stream, name)
                    for name in names]
        except CgroupdError as exc:
            self._log.warning("self-check could not reach the server", error=str(exc))
            return None
        meta = ConsumerInfo.of(sync).metadata
        if sync is None or meta.get(INSTANCE_KEY) != self.instance_id \
                or meta.get(TOKEN_KEY) != self._token:
            gen.end(StepDown.SYNC_LOST, "sync consumer missing or owned by another instance")
            return False
        # A consumer a rebalance replaced meanwhile is not missing.
        if any(info is None and name in gen.data for name, info in zip(names, data,
                                                                        strict=True)):
            gen.end(StepDown.DATA_LOST, "data consumer missing")
            return False
        data = [info for name, info in zip(names, data, strict=True) if name in gen.data]
        gen.data_info = {
            key: sum(int((info or {}).get(key, 0)) for info in data)
            for key in ("num_pending", "num_ack_pending")}
        gen.lease.renew(sent)
        return True

    async def _refill(self, gen: Generation) -> None:
        """A handler slot freed up: let the data pullers ask for more."""
        for puller in gen.pullers:
            if puller.delivers:
                await puller.refill()

    async def _fence(self, gen: Generation) -> bool:
        """Before a handler starts (or a failed one is retried): may this instance still
        touch its messages? Sync mode: only under a running lease. Pinned mode: only
        within the lease on the pin (renewed here if it ran out)."""
        if self.settings.exclusivity is Exclusivity.PINNED:
            lease = gen.pin_lease
            if lease is None or (not lease.valid and not await self._renew(gen)):
                gen.end(StepDown.PIN_LOST, "cannot prove the pin is still ours")
                return False
            return not gen.ended.done()
        if self.settings.exclusivity is Exclusivity.SYNC:
            return await self._hold_lease(gen)
        return not gen.ended.done()

    async def _hold_lease(self, gen: Generation) -> bool:
        """Sync exclusivity: start only under a running lease. Once it has run out (cut
        off, stalled, disconnected), wait until a self-check confirms we still own the
        member (True) or shows we do not (False: the generation has ended)."""
        while not gen.ended.done():
            if gen.lease.valid and self.js.connected:
                return True
            self.stats["lease_checks"] += 1
            if await self._check(gen) is None:
                await self._sleep(min(0.1, self.settings.retry_interval))
        return False

    async def _callback(self, cb: Callable[..., Awaitable[None] | None], arg: Any) -> None:
        try:
            await _maybe_await(cb(arg))
        except Exception as exc:  # noqa: BLE001
            self._log.warning("callback failed", error=repr(exc))

