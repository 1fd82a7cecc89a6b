"""What every part of the member runtime shares: the instance's identity, settings and
state, and the helpers they all use (consumer config, pullers, generations, config
updates). The jobs live in their own modules as collaborators that hold the member:
its exclusivity mode's (:mod:`cgroupd.member.modes`), the config watch and the release."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from cgroupd.core import logs
from cgroupd.core.answers import judge_answer
from cgroupd.core.clock import LOOP_CLOCK, Clock
from cgroupd.core.config import (
    ELASTIC_BUCKET,
    STATIC_BUCKET,
    GroupConfig,
    group_key,
    validate_name,
    work_queue_stream,
)
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    ConsumerNotFound,
)
from cgroupd.core.naming import (
    DATA_SLOTS,
    INSTANCE_KEY,
    MEMBER_KEY,
    TOKEN_KEY,
    consumer_config,
    data_consumer,
    sync_consumer,
)
from cgroupd.core.partitions import key_function
from cgroupd.core.records import elastic_from_json, static_from_json
from cgroupd.core.settings import PRIORITY_GROUP, Exclusivity, MemberSettings
from cgroupd.member.config_watch import ConfigWatch
from cgroupd.member.dispatch import Completed, Dispatcher, Handler
from cgroupd.member.generation import Generation, GenerationInfo
from cgroupd.member.listener import ASSIGNED, LOST, REVOKED, PartitionListener, PartitionsCallback
from cgroupd.member.modes import MODES, ExclusivityMode
from cgroupd.member.release import Release
from cgroupd.member.state import (
    FIRST_PHASE,
    ActiveCallback,
    MemberState,
    Phase,
    RebalanceCallback,
    StandbyCallback,
    StepDown,
    Wake,
    allowed,
    maybe_await,
    new_instance_id,
    where_name,
)
from cgroupd.nats import jsapi
from cgroupd.nats.adapter import JetStreamPort
from cgroupd.nats.lease import (
    Lease,
    OwnerWatch,
    Prober,
)
from cgroupd.nats.message import Deliveries
from cgroupd.nats.pull import PullEnd, Puller, PullOptions

log = logs.get_logger("cgroupd.member")


class MemberCore:
    """State shared by the jobs of one member instance (see :class:`cgroupd.member.Member`)."""

    def __init__(
        self,
        js: JetStreamPort,
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
        on_handover: StandbyCallback | None = None,
        on_partitions_assigned: PartitionsCallback | None = None,
        on_partitions_revoked: PartitionsCallback | None = None,
        on_partitions_lost: PartitionsCallback | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        self.js = js
        self.stream = validate_name("stream", stream)
        self.group = validate_name("group", group)
        self.member = validate_name("member", member)
        self.handler = handler
        self.settings = settings or MemberSettings()
        self.static = static
        if static and self.settings.exclusivity is not Exclusivity.PINNED:
            self.settings = self.settings.with_exclusivity(Exclusivity.PINNED)
        self.instance_id = instance_id or new_instance_id()
        self.on_active = on_active
        self.on_standby = on_standby
        self.on_rebalance = on_rebalance
        #: Called with the step-down reason once this instance starts nothing more and
        #: its settlements are confirmed, just before its consumers (or the pin) go to a
        #: successor: what it says then reaches the server before any successor can act.
        #: Must return quickly (in pinned mode the unpin waits for it).
        self.on_handover = on_handover
        #: Kafka's rebalance listener: see :mod:`cgroupd.member.listener`.
        self.listener = PartitionListener(on_partitions_assigned, on_partitions_revoked,
                                          on_partitions_lost, self.settings.listener_timeout)
        #: Where every part of this member reads the time and sleeps (see
        #: :mod:`cgroupd.core.clock`): its generations' leases, the dispatcher, the prober.
        self.clock = clock
        self._sleep = clock.sleep
        self._clock = clock.now
        self.state = MemberState.JOINING
        #: What the instance does within ``state`` (see :class:`cgroupd.member.state.Phase`).
        self.phase: Phase | None = None
        self.config: GroupConfig | None = None
        self.partitions: tuple[int, ...] = ()
        self.stop_reason: str | None = None
        #: While joining: the transient failure :meth:`Member.start` keeps retrying.
        self.waiting_for: str | None = None
        self._bucket = STATIC_BUCKET if static else ELASTIC_BUCKET
        #: How the group record reads (a static group's record differs).
        self._decode: Callable[[bytes], GroupConfig] = (static_from_json if static
                                                        else elastic_from_json)
        self._key = group_key(stream, group)
        self._consume_stream = stream if static else work_queue_stream(stream, group)
        self._wake = Wake()  # config change, advisory, stop: re-evaluate now
        self._stopping = False
        self._deleted = False
        self._supervisor: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._advisories: Any = None
        self._presence_sub: Any = None
        #: Pinned mode: where an operator's step-down request reaches the pin holder.
        self._step_down_sub: Any = None
        self._gen: Generation | None = None
        self._generations = 0  # how many this instance began (GenerationInfo.number)
        self._first_config = asyncio.get_running_loop().create_future()
        #: Sync exclusivity: this process's token (see TOKEN_KEY), a standby's watch over
        #: the active instance, and the sequences this instance completed (a redelivery
        #: of one of them is settled again, not run again).
        self._token = secrets.token_hex(8)
        self._watch: OwnerWatch | None = None
        #: Sync exclusivity: the slot of the next data consumer's name (a random start,
        #: so that a successor rarely meets its predecessor's name).
        self._data_slot = secrets.randbelow(DATA_SLOTS)
        #: Names of this member's consumers this instance deleted (a predecessor's) since
        #: it last created a data consumer: not reused at once, while the server may still
        #: be removing their files.
        self._just_deleted: set[str] = set()
        self._prober: Prober | None = None
        self._completed: Completed = Completed()
        self._connection_off: Callable[[], None] | None = None
        self._stepping_since: float | None = None
        #: Partitions under the latest config, and when competing may resume after a change.
        self._last_partitions: tuple[int, ...] = ()
        self._not_before = 0.0
        self._changed_at = -1e9
        #: What differs between the exclusivity modes, chosen once (see
        #: :mod:`cgroupd.member.modes`), and the jobs every member has.
        self.mode: ExclusivityMode = MODES[self.settings.exclusivity](self)
        self._config_watch = ConfigWatch(self)
        self._releaser = Release(self)
        self.stats = {"delivered": 0, "acked": 0, "naked": 0, "termed": 0, "retries": 0,
                      "duplicates": 0, "step_downs": 0, "rebalances": 0, "resettled": 0,
                      "swallowed": 0, "ack_fences": 0, "lease_checks": 0, "takeovers": 0,
                      "takeovers_declined": 0, "watch_failures": 0,
                      "stale_checks": 0, "pulls_restarted": 0,
                      "data_consumers_renewed": 0}
        self._log = log.bind(stream=stream, group=group, member=member,
                             instance=self.instance_id)

    @property
    def active(self) -> bool:
        return self.state is MemberState.ACTIVE

    @property
    def owner_answers(self) -> bool:
        """A standby whose member's active instance answered its presence probes within
        a lease (so the member has an active instance, and it is not this one)."""
        watch = self._watch
        return (self.state is MemberState.STANDBY and watch is not None and not watch.gone
                and not watch.idle and watch.silent_for(self._clock()) < self.settings.lease)

    @property
    def generation(self) -> GenerationInfo | None:
        """The current generation (claiming, active, moving or stepping down), as a
        read-only snapshot; None while this instance has none (standby, joining)."""
        gen = self._gen
        return gen.info() if gen is not None else None

    @property
    def sync_consumer(self) -> str:
        """Name of the member's election consumer (pinned mode: its only consumer)."""
        return sync_consumer(self.group, self.member, self.static)

    @property
    def data_consumer(self) -> str:
        """The name of this instance's (first) data consumer while it has one, else the
        one it tries next (see :func:`cgroupd.core.naming.data_consumer`)."""
        if self._gen is not None and self._gen.data:
            return next(iter(self._gen.data))
        return data_consumer(self.member, self._data_slot)

    def _next_data_slot(self) -> None:
        """Sync exclusivity: name the next data consumer after the next slot."""
        self._data_slot = (self._data_slot + 1) % DATA_SLOTS

    @property
    def _probe_timeout(self) -> float:
        return max(0.25, 4 * self.settings.presence_interval)

    def _transition(self, to: MemberState, *, phase: Phase | None = None,
                    **info: Any) -> None:
        """Move to ``to`` (in ``phase``, by default the state's first) as the one
        transition table (:data:`cgroupd.member.state.TRANSITIONS`) allows."""
        phase = phase or FIRST_PHASE.get(to)
        if not allowed((self.state, self.phase), (to, phase)):
            raise RuntimeError("illegal member transition "
                               f"{where_name((self.state, self.phase))} -> "
                               f"{where_name((to, phase))}")
        if to is not self.state:
            self._log.info("state", old=self.state.value, new=to.value, **info)
        elif phase is not self.phase:
            self._log.debug("phase", state=to.value, old=self.phase and self.phase.value,
                            new=phase and phase.value)
        self.state = to
        self.phase = phase

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase`` within the current state (see :meth:`_transition`)."""
        self._transition(self.state, phase=phase)

    async def _wait_wake(self, timeout: float, interruptible: bool = True) -> None:
        """Sleep up to ``timeout``; a config change or advisory (since the last attempt
        began, so none is lost while an attempt runs) ends it early."""
        if not interruptible:
            await self._sleep(timeout)
            return
        await self._wake.nap(timeout)

    def _consumer_config(self, filters: list[str], **extra: Any) -> dict[str, Any]:
        s = self.settings
        fields: dict[str, Any] = {"max_ack_pending": s.max_in_flight,
                                  "metadata": {MEMBER_KEY: self.member}, **extra}
        return consumer_config(filters, ack_wait=s.ack_wait, **fields)

    def _generation(self, partitions: tuple[int, ...]) -> Generation:
        s = self.settings
        self._generations += 1
        gen = Generation(partitions, number=self._generations,
                         lease=Lease(s.lease, self._clock))
        mode = self.mode
        deliveries = Deliveries(self.js.nc, mode.acks(gen))
        gen.dispatcher = Dispatcher(
            deliveries, self.handler, ordering=s.ordering, max_in_flight=s.max_in_flight,
            ack_wait=s.ack_wait, backoff=s.backoff,
            key_of=key_function(s.key, self.config), before_start=lambda: mode.fence(gen),
            on_settled=lambda: self._refill(gen), log=self._log, stats=self.stats,
            hand_back_on_close=mode.hand_back_on_close, completed=self._completed,
            clock=self.clock)
        gen.dispatcher.accept = set(partitions)
        # Opened once the listener heard of the partitions (Member._run_active; pinned
        # mode: the takeover): nothing starts before on_partitions_assigned returned.
        gen.dispatcher.pause()
        mode.prepare(gen)
        gen.dispatcher.start()
        return gen

    async def _start_puller(self, gen: Generation, consumer: str, batch: int,
                            lost: StepDown, deliver: bool = False,
                            pinned: asyncio.Future[None] | None = None) -> Puller:
        s = self.settings
        group = PRIORITY_GROUP if pinned is not None else None

        def on_message(msg: Any) -> None:
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
                        group=group, check_gaps=deliver and pinned is None,
                        overlap=self.mode.pulls_overlap(consumer)),
            on_message, capacity)

        def ended(fut: asyncio.Future[tuple[PullEnd, str]]) -> None:
            why, detail = fut.result()
            self.mode.pull_ended(gen, puller, why, f"{consumer}: {detail}", lost)

        puller.ended.add_done_callback(ended)
        return puller

    def _spawn(self, gen: Generation, coro: Awaitable[None], name: str) -> None:
        """A generation's background task; if it dies of a bug, the generation ends."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"cgroupd{name}")
        gen.tasks.add(task)

        def done(t: asyncio.Future[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self._log.error("background task failed", task=name, error=repr(t.exception()))
                self.mode.step_down(StepDown.ERROR, f"{name} failed: {t.exception()!r}",
                                    gen=gen)

        task.add_done_callback(done)

    async def _assigned(self, gen: Generation, partitions: Iterable[int]) -> None:
        """The listener hears that ``partitions`` are ours, before their first message."""
        new = set(partitions) - gen.announced
        gen.announced |= new
        await self.listener.call(ASSIGNED, new, self._log)

    async def _gone(self, gen: Generation, partitions: Iterable[int], lost: bool = False
                    ) -> None:
        """The listener hears that ``partitions`` (of those it was told are ours) go:
        revoked (after their last message settled, before anyone else can get them), or
        lost (no clean hand-over)."""
        gone = set(partitions) & gen.announced
        gen.announced -= gone
        await self.listener.call(LOST if lost else REVOKED, gone, self._log)

    async def _callback(self, cb: Callable[..., Awaitable[None] | None], arg: Any) -> None:
        try:
            await maybe_await(cb(arg))
        except Exception as exc:  # noqa: BLE001
            self._log.warning("callback failed", error=repr(exc))

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

    async def _acks_confirmed(self, gen: Generation) -> bool:
        """Every ack we sent on the member consumer is applied: the server applies one
        consumer's acks in order, so a confirmed repeat of the last one proves it."""
        last = gen.dispatcher.last_settled if gen.dispatcher is not None else None
        if last is None:
            return True
        try:
            return await self.js.confirm_ack(last.reply, self.settings.drain_timeout)
        except CgroupdError as exc:
            self._log.info("acks not confirmed", error=repr(exc))
            return False

    async def _sync_is_ours(self) -> bool:
        """Whether the sync consumer names this process, as a server in touch with its
        cluster says (a stale answer may name us after another instance took over: then
        deleting the consumer by name would delete the new owner's)."""
        try:
            info = await self.js.consumer_info(self._consume_stream, self.sync_consumer)
        except CgroupdError:
            return False
        if judge_answer([info], sent=self._clock(), lease=self.settings.lease).stale:
            return False
        meta = ConsumerInfo.of(info).metadata
        return bool(meta.get(INSTANCE_KEY) == self.instance_id
                    and meta.get(TOKEN_KEY) == self._token)

    async def _refill(self, gen: Generation) -> None:
        """A handler slot freed up: let the data pullers ask for more."""
        for puller in gen.pullers:
            if puller.delivers and puller.room:
                await puller.refill()

    def _presence_text(self) -> str | None:
        """What this instance answers on its presence subject: its id and state."""
        state = self.state.value
        if self.phase is Phase.CLAIMING:  # (STANDBY) creating or checking the claim,
            state = Phase.CLAIMING.value  # or creating its data consumer: not idle
        return f"{self.instance_id} {state}"

    async def _close_prober(self) -> None:
        if self._prober is not None:
            await self._prober.close()
            self._prober = None
