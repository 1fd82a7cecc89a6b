"""``cgroupd join`` as a long-running process: one member instance, its handler, its probes.

Lifecycle (one supervisor coroutine, :meth:`Daemon.run`)::

    connect ─► check group ─► HTTP probes ─► member.start() ─► "joined"
       │            │               │               │
       └── fails: one-line error, exit 1 ───────────┘
    joined ─► wait for: SIGTERM/SIGINT │ the member stopping by itself
      signal        → member.stop(): no new messages, in-flight ones finish within the
                      drain timeout and are acked, own consumers deleted so a standby takes
                      over at once → exit 0 (a second signal exits at once, code 1)
      group deleted → log, exit 0
      runtime error → log, exit 1

HTTP (``--metrics-port``, 0 = off): ``/metrics`` (Prometheus text), ``/healthz`` (200 while
NATS is connected, the member runtime and its config watch run, no release is stuck on a
handler that does not return, and the event loop was not blocked for longer than
``JoinOptions.max_loop_lag`` in the last ``LAG_WINDOW`` seconds; 503 with the problems
otherwise), ``/readyz`` (200 once joined: standby or active).

Operations (:mod:`cgroupd.events`): the runtime's callbacks become advisories (became
active, stepped down and why, partitions moved); every ``--status-interval`` the group
status refreshes the unowned-partitions gauge (and the active instance of the lowest
consumed partition publishes the "unowned" advisory while any is), and an active
instance reads the lag of its own partitions; the instance answers discovery requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

import cgroupd
from cgroupd import admin, events, logs
from cgroupd.config import STATIC_BUCKET, group_key, name_problems
from cgroupd.connect import Connection, ConnectionOptions, connect
from cgroupd.errors import (
    BucketNotFound,
    ConfigError,
    GroupNotFound,
    StartupError,
)
from cgroupd.handlers import HandlerOptions, Publish, build_handler
from cgroupd.jetstream import JetStream
from cgroupd.lag import read_lag
from cgroupd.loopmonitor import MAX_LOOP_LAG, LoopMonitor
from cgroupd.member import Member, MemberState
from cgroupd.metrics import Metrics
from cgroupd.partitions import member_partitions
from cgroupd.settings import MemberSettings
from cgroupd.tasks import cancel_and_wait

if TYPE_CHECKING:  # aiohttp is imported only when a webhook or the HTTP server is used
    import aiohttp

    from cgroupd.probes import ProbeServer

log = logs.get_logger("cgroupd.daemon")

#: How often the unowned-partitions gauge is refreshed from the group status.
STATUS_INTERVAL = 10.0
#: Bound on reading the group config for the first time.
START_TIMEOUT = 10.0
#: Bound on a dead-letter publish (waiting for the stream's PubAck).
DEAD_LETTER_TIMEOUT = 5.0

_READY_STATES = (MemberState.STANDBY, MemberState.ACTIVE)


@dataclass(frozen=True)
class JoinOptions:
    """Who this instance is and what it exposes."""

    stream: str
    group: str
    member: str
    #: Require a static group; otherwise the group's kind is read from its record.
    static: bool = False
    #: Instance id (default: random); names the data consumer ``<member>-<id>``.
    instance_id: str | None = None
    #: Port of the /metrics, /healthz, /readyz server; 0 disables it.
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    status_interval: float = STATUS_INTERVAL
    start_timeout: float = START_TIMEOUT
    #: /healthz fails after the event loop was blocked this long (see LAG_WINDOW).
    max_loop_lag: float = MAX_LOOP_LAG

    def __post_init__(self) -> None:
        problems = (name_problems("stream", self.stream) + name_problems("group", self.group)
                    + name_problems("member", self.member))
        if self.instance_id is not None:
            problems += name_problems("instance", self.instance_id)
        if not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics port {self.metrics_port} is outside 0..65535")
        if not all(math.isfinite(x) and x > 0
                   for x in (self.status_interval, self.start_timeout)):
            problems.append("status interval and start timeout must be positive")
        if problems:
            raise ConfigError(problems)


def drain_problems(settings: MemberSettings, handler: HandlerOptions) -> list[str]:
    """Settings that would let the next owner run a key while this instance's handler may
    still be running it: a webhook cancelled at the drain timeout may go on on the far
    side for up to its own timeout (issue 13 item 7)."""
    hook = handler.webhook
    if hook is not None and settings.drain_timeout < hook.timeout:
        return [f"--drain-timeout ({settings.drain_timeout:g}s) must be at least "
                f"--webhook-timeout ({hook.timeout:g}s): a webhook still running when a "
                "stopping instance gives up waiting may go on at the far side while the "
                "next owner already runs the same key"]
    return []


def jetstream_publisher(js: JetStream, timeout: float = DEAD_LETTER_TIMEOUT) -> Publish:
    """A confirmed (PubAck) publish, for dead letters; raises when not stored."""

    async def publish(subject: str, data: bytes, headers: dict[str, str]) -> None:
        await js.publish(subject, data, headers=headers, timeout=timeout)

    return publish


class Daemon:
    """One ``cgroupd join`` process."""

    def __init__(self, connection: ConnectionOptions, options: JoinOptions,
                 settings: MemberSettings, handler: HandlerOptions) -> None:
        self.connection = connection
        self.options = options
        problems = drain_problems(settings, handler)
        if problems:
            raise ConfigError(problems)
        self.settings = settings
        self.handler_options = handler
        self.metrics = Metrics(options.stream, options.group, options.member)
        self.metrics.exported = bool(options.metrics_port)
        self.metrics.count_ignored_input(lambda: self.member.stats if self.member else {})
        self.loop_monitor = LoopMonitor()
        self.nc: Connection | None = None
        self.member: Member | None = None
        self._stop = asyncio.Event()
        #: A second signal: give up draining. (Member.stop() swallows a CancelledError of
        #: its caller, so cancelling the main task cannot do this.)
        self._force = asyncio.Event()
        self._signals = 0
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probes: ProbeServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log = log.bind(stream=options.stream, group=options.group,
                             member=options.member)
        self._events: events.Publisher | None = None
        #: Partitions held while active and since when this instance is in its state.
        self._held: tuple[int, ...] = ()
        self._since = time.time()
        self._info_sub: Any = None
        self._publishing: set[asyncio.Task[None]] = set()

    # -- signals --------------------------------------------------------------------
    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            self._log.info("stopping", signal=sig.name)
            self._stop.set()
        else:
            self._log.warning("second signal; exiting without draining", signal=sig.name)
            self._force.set()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    # -- run ------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until a signal or the group's deletion; the process exit code."""
        self._install_signals()
        try:
            return await self._run()
        finally:
            await self._shutdown()
            self._remove_signals()

    async def _run(self) -> int:
        o = self.options
        self.nc = await connect(self.connection, disconnected_cb=self._disconnected,
                                reconnected_cb=self._reconnected)
        self.metrics.set_connected(True)
        js = JetStream(self.nc)
        static = await self._group_kind(js)
        if self.handler_options.webhook is not None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max(10, 2 * self.settings.max_in_flight)))
        publish = (jetstream_publisher(js)
                   if self.handler_options.dead_letter.subject is not None else None)
        handler = build_handler(self.handler_options, session=self._session,
                                publish=publish, metrics=self.metrics,
                                context={"stream": o.stream, "group": o.group,
                                         "member": o.member})
        self._events = events.Publisher(self.nc, o.stream, o.group)
        member = self.member = Member(
            js, o.stream, o.group, o.member, handler.handle, self.settings, static=static,
            instance_id=o.instance_id, on_active=self._on_active,
            on_standby=self._on_standby, on_rebalance=self._on_rebalance,
            on_handover=self._on_handover)
        structlog.contextvars.bind_contextvars(instance=member.instance_id)
        self._info_sub = await js.answer(events.info_subject(o.stream, o.group),
                                         self._instance_info)
        self._spawn(self.loop_monitor.run(), "cgroupd-loop-monitor")
        if o.metrics_port:
            await self._start_http()
        if not await self._start_member(member):
            return 0
        config = member.config
        partitions = list(member_partitions(config, o.member)) if config else []
        self._log.info("joined", instance=member.instance_id, static=static,
                       exclusivity=member.settings.exclusivity.value, partitions=partitions,
                       handler=self.handler_options.reference or "webhook")
        if not partitions:
            self._log.warning("this member owns no partitions (not listed in the group?); "
                              "standing by until the membership changes")
        self._spawn(self._status_loop(js), "cgroupd-status")
        if self.metrics.exported:  # the lag gauges are all it feeds
            self._spawn(self._lag_loop(js), "cgroupd-lag")
        # Never cancel this future: wait_stopped() awaits the runtime's supervisor task,
        # and cancelling a task that awaits another task cancels that one too.
        stopped = asyncio.ensure_future(member.wait_stopped())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({stopped, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if stopped.done():
            return self._stopped_by_itself(stopped)
        stopping = asyncio.ensure_future(member.stop())
        force = asyncio.ensure_future(self._force.wait())
        try:
            await asyncio.wait({stopping, force}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            force.cancel()
        if not stopping.done():
            # Left to asyncio.run()'s final cancellation; the server drops our consumers
            # after the inactive threshold and redelivers what was in flight.
            return 1
        with contextlib.suppress(BaseException):
            await stopped
        if stopping.exception() is not None:
            self._log.error("member stop failed", error=repr(stopping.exception()))
            return 1
        self._log.info("stopped", reason=member.stop_reason)
        return 0

    def _stopped_by_itself(self, stopped: asyncio.Future[str]) -> int:
        exc = stopped.exception()
        if exc is not None:
            self._log.error("member runtime failed", error=repr(exc))
            return 1
        reason = stopped.result()
        if reason == "group deleted":
            self._log.info("group deleted; exiting")
            return 0
        self._log.error("member runtime stopped", reason=reason)
        return 1

    async def _group_kind(self, js: JetStream) -> bool:
        """True for a static group; GroupNotFound (one clear line) when there is none."""
        o = self.options
        if o.static:
            try:
                record = await js.get_record(STATIC_BUCKET, group_key(o.stream, o.group))
            except BucketNotFound:
                record = None
            if record is None or record.value is None:
                raise GroupNotFound(f"no static consumer group {o.group!r} on stream "
                                    f"{o.stream!r}")
            return True
        # The record says which kind of group this is (Member.start() itself raises
        # GroupNotFound for a missing one; this read only decides elastic or static).
        return (await admin.get_group(js, o.stream, o.group)).static

    async def _start_member(self, member: Member) -> bool:
        """Start competing; False if a signal came first. Raises if the group is unusable."""
        starting = asyncio.ensure_future(member.start())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({starting, stop}, timeout=self.options.start_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if starting in done:
            starting.result()  # re-raises GroupNotFound, ConfigError, ...
            return True
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await member.stop()
        if self._stop.is_set():
            return False
        raise StartupError(f"group {self.options.stream}/{self.options.group} could not be "
                           f"read within {self.options.start_timeout:g}s")

    async def _shutdown(self) -> None:
        await self._flush_events()
        for task in list(self._tasks):
            # A swallowed cancellation was seen here after SIGCONT + SIGTERM.
            await cancel_and_wait(task)
        self._tasks.clear()
        if self.member is not None and self._signals < 2:
            with contextlib.suppress(Exception):  # idempotent; also closes the config watch
                await self.member.stop()
            await self._flush_events()
        if self._probes is not None:
            await self._probes.stop()
            self._probes = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._closing = True
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        structlog.contextvars.unbind_contextvars("instance")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- callbacks ------------------------------------------------------------------
    def _on_active(self, partitions: tuple[int, ...]) -> None:
        took = self.metrics.became_active(partitions)
        if took is not None:
            self._log.info("rebalance", phase="done", seconds=round(took, 3),
                           partitions=list(partitions))
        self._held, self._since = tuple(partitions), time.time()
        self._event("active", partitions=list(partitions))

    def _on_standby(self, reason: str) -> None:
        # A full rejoin (pinned mode, or a change incremental rebalance cannot apply):
        # measured from this step-down to the next activation.
        if self.metrics.stepped_down(reason):
            self._log.info("rebalance", phase="started")
        self.metrics.clear_lag()
        if self._held:  # released without a hand-over (the release failed)
            self._event("stepped_down", reason=reason, partitions=list(self._held))
        self._held, self._since = (), time.time()

    async def _on_handover(self, reason: str) -> None:
        # Published before the consumers (or the pin) go: a successor's "active" cannot
        # overtake it (one connection keeps our order, the server the rest).
        released, self._held = self._held, ()
        if self._events is not None:
            await self._events.publish("stepped_down", **self._who(), reason=reason,
                                       partitions=list(released))
            self.metrics.event_published("stepped_down")

    def _on_rebalance(self, moved: tuple[tuple[int, ...], float]) -> None:
        # In place, without a step-down; the runtime logs "rebalanced" itself.
        partitions, seconds = moved
        self.metrics.rebalanced(partitions, seconds)
        before, self._held = set(self._held), tuple(partitions)
        self._event("rebalanced", partitions=list(partitions), seconds=round(seconds, 4),
                    gained=sorted(set(partitions) - before),
                    lost=sorted(before - set(partitions)))

    # -- events and discovery ------------------------------------------------------
    def _who(self) -> dict[str, Any]:
        m = self.member
        return {"member": self.options.member,
                "instance": m.instance_id if m is not None else None,
                "host": events.hostname(), "pid": os.getpid()}

    def _event(self, kind: str, **fields: Any) -> None:
        """Publish an advisory without holding up the runtime's callback."""
        publisher = self._events
        if publisher is None:
            return

        async def publish() -> None:
            await publisher.publish(kind, **self._who(), **fields)
            self.metrics.event_published(kind)

        task = asyncio.create_task(publish(), name=f"cgroupd-event-{kind}")
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _flush_events(self) -> None:
        """Let advisories already raised (a step-down while stopping) go out."""
        if self._publishing:
            await asyncio.wait(set(self._publishing), timeout=1.0)

    def _instance_info(self) -> str | None:
        """This instance's answer to a discovery request (None before the member exists)."""
        if self.member is None:
            return None
        m = self.member
        info = events.instance_info(
            stream=self.options.stream, group=self.options.group, member=self.options.member,
            instance=m.instance_id, state=m.state.value, since=events.iso(self._since),
            partitions=list(m.partitions), exclusivity=m.settings.exclusivity.value,
            in_flight=self.metrics.in_flight(), version=cgroupd.__version__)
        return json.dumps(info)

    async def _lag_loop(self, js: JetStream) -> None:
        """While active, export the lag of this instance's partitions: one direct get
        per partition per interval (a static member's consumer info besides)."""
        o = self.options
        member = self.member
        assert member is not None
        while True:
            await asyncio.sleep(o.status_interval)
            partitions = member.partitions if member.active else ()
            if not partitions:
                self.metrics.clear_lag()
                continue
            started = time.monotonic()
            try:
                stored = await admin.get_group(js, o.stream, o.group)
                floors: dict[int, int] = {}
                if stored.static:
                    info = await js.consumer_info(stored.consume_stream, member.sync_consumer)
                    floor = int(((info or {}).get("ack_floor") or {}).get("stream_seq", 0))
                    floors = dict.fromkeys(partitions, floor)
                lags = await read_lag(js, stored.consume_stream, stored.config, partitions,
                                      floors)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.metrics.lag_failed()
                self._log.warning("lag read failed", error=str(exc) or repr(exc))
                continue
            if member.active and member.partitions == partitions:
                now = time.time()
                self.metrics.set_lag({p: (x.messages, x.seconds(now)) for p, x in lags.items()},
                                     time.monotonic() - started)

    async def _disconnected(self) -> None:
        self.metrics.set_connected(False)
        # nats-py also calls this for failed first attempts: only a lost connection counts.
        if self.nc is not None and not self._closing:
            self._log.warning("nats disconnected; reconnecting")

    async def _reconnected(self) -> None:
        self.metrics.set_connected(True)
        url = self.nc.connected_url if self.nc is not None else None
        self._log.info("nats reconnected", server=url.geturl() if url else None)

    async def _status_loop(self, js: JetStream) -> None:
        """Refresh the unowned-partitions gauge; failures are counted, never fatal."""
        o = self.options
        # Not at once: right after joining, partitions are about to be taken.
        await asyncio.sleep(min(o.status_interval, 2.0))
        while True:
            if not self.metrics.exported and self.member is not None \
                    and self.member.owner_answers:
                # A status read costs the server a request per partition, and with no
                # gauge to feed, the advisory below is not ours to publish (the member
                # has an active instance, not this one): skip it (issue 15 §3).
                await asyncio.sleep(o.status_interval)
                continue
            try:
                if not self.metrics.exported and await self._all_owned(js):
                    # Nothing unowned: no gauge and no advisory need the per-partition
                    # lag read of a full status (a request per partition).
                    await asyncio.sleep(o.status_interval)
                    continue
                status = await admin.group_status(js, o.stream, o.group)
                self.metrics.set_unowned_partitions(len(status.unowned_partitions))
                self._unowned_advisory(status)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.metrics.status_failed()
                self._log.warning("group status read failed", error=str(exc) or repr(exc))
            await asyncio.sleep(o.status_interval)

    async def _all_owned(self, js: JetStream) -> bool:
        config = self.member.config if self.member is not None else None
        if config is None:
            return False
        owned = admin.owned_partitions(await admin.group_consumers(js, self.options.stream,
                                                                    self.options.group))
        return owned >= set(range(config.max_members))

    def _unowned_advisory(self, status: admin.GroupStatus) -> None:
        """The ADR's timed "nobody consumes these partitions" advisory: published by the
        active instance of the lowest partition that has one, or, when none has (the group
        is idle), by every instance."""
        if not status.unowned_partitions:
            return
        owned = [r for r in status.partitions if r.instance is not None]
        # By member and state, not instance id: pinned consumers name the pin instead.
        mine = (self.member is not None and self.member.active
                and bool(owned) and owned[0].member == self.options.member)
        if owned and not mine:
            return
        unowned = set(status.unowned_partitions)
        self._event("unowned", unowned_partitions=sorted(unowned),
                    members_without_instance=status.members_without_instance,
                    idle=not owned,
                    pending=sum(r.pending for r in status.partitions
                                if r.partition in unowned))

    # -- HTTP -----------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        """Why this process cannot do its job right now (empty: healthy)."""
        out = []
        if self.nc is None or not self.nc.is_connected:
            out.append("not connected to NATS")
        if self.member is not None:
            out += self.member.health()
        lag = self.loop_monitor.worst()
        if lag > self.options.max_loop_lag:
            out.append(f"event loop blocked for {lag:.1f}s within the last "
                       f"{self.loop_monitor.window:g}s (a handler blocking it, or no CPU)")
        return out

    @property
    def ready(self) -> bool:
        return self.member is not None and self.member.state in _READY_STATES

    async def _start_http(self) -> None:
        from cgroupd.probes import ProbeServer

        o = self.options
        probes = ProbeServer(self.metrics, problems=self.problems, ready=lambda: self.ready,
                             state=self._state)
        await probes.start(o.metrics_host, o.metrics_port)
        self._probes = probes
        self._log.info("http listening", host=o.metrics_host, port=o.metrics_port)

    def _state(self) -> dict[str, Any]:
        m = self.member
        return {
            "nats": "connected" if self.nc is not None and self.nc.is_connected
            else "disconnected",
            "state": m.state.value if m is not None else "starting",
            "instance": m.instance_id if m is not None else None,
            "partitions": list(m.partitions) if m is not None else [],
        }


async def run_join(connection: ConnectionOptions, options: JoinOptions,
                   settings: MemberSettings, handler: HandlerOptions) -> int:
    """Run one member instance until stopped; returns the exit code.

    Startup failures raise :class:`~cgroupd.errors.CgroupdError` (the CLI prints one line
    and exits 1).
    """
    return await Daemon(connection, options, settings, handler).run()
