"""``cgroupd join`` as a long-running process: one member instance, its handler, its probes.

Lifecycle (one supervisor coroutine, :meth:`Daemon.run`)::

    HTTP probes ─► connect ─► check group ─► member.start() ─► "joined"
       │              │            │               │
       └── fails: one-line error, exit 1 ──────────┘
    (a transient failure of connect, check group or start, e.g. a server too busy to
    answer in time, is retried with a jittered, growing pause; /readyz says which)
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
otherwise), ``/readyz`` (200 once joined: standby or active, while an elastic group's
work-queue stream exists; 503 otherwise, its body's ``problem`` saying why).

Operations (advisories, discovery answers, the status and lag loops):
:mod:`cgroupd.join.operations`. Who the instance is and what it exposes: :mod:`cgroupd.join.options`
(:class:`JoinOptions`, re-exported here with :func:`drain_problems`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from cgroupd import admin
from cgroupd.core import logs
from cgroupd.core.config import (
    MAX_MEMBER_PARTITIONS,
    STATIC_BUCKET,
    GroupConfig,
    group_key,
    work_queue_stream,
)
from cgroupd.core.errors import (
    BucketNotFound,
    CgroupdError,
    ConfigError,
    DeadLetterFailed,
    GroupNotFound,
    ServerBusy,
    StartupError,
)
from cgroupd.core.partitions import assignment_ranges, member_partitions
from cgroupd.core.records import static_from_json
from cgroupd.core.redact import redact_url
from cgroupd.core.retrying import retry_delay
from cgroupd.core.settings import MemberSettings
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.join.handlers import (
    HandlerOptions,
    HandlerWrapper,
    Publish,
    build_handler,
    listener_hooks,
)
from cgroupd.join.healthwatch import AckWatch, Denials
from cgroupd.join.loopmonitor import LoopMonitor
from cgroupd.join.metrics import Metrics
from cgroupd.join.operations import Operations
from cgroupd.join.options import JoinOptions as JoinOptions
from cgroupd.join.options import drain_problems as drain_problems
from cgroupd.member import Member, MemberState
from cgroupd.nats import events
from cgroupd.nats.connect import Connection, ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream

if TYPE_CHECKING:  # aiohttp is imported only when a webhook or the HTTP server is used
    import aiohttp

    from cgroupd.join.probes import ProbeServer

log = logs.get_logger("cgroupd.daemon")

#: Seconds between two looks for a missing work-queue stream.
WORK_QUEUE_RECHECK = 2.0
#: Bound on a dead-letter publish (waiting for the stream's PubAck).
DEAD_LETTER_TIMEOUT = 5.0

_READY_STATES = (MemberState.STANDBY, MemberState.ACTIVE)

T = TypeVar("T")


def jetstream_publisher(js: JetStream, timeout: float = DEAD_LETTER_TIMEOUT,
                        on_decoy: Callable[[], None] | None = None) -> Publish:
    """A confirmed (PubAck) publish, for dead letters; raises when not stored.

    A PubAck that says ``duplicate`` means the stream holds *some* message with our
    ``Nats-Msg-Id``: ours from an earlier attempt whose ack was lost, or a decoy someone
    else published under it. The stored message is read back and compared; anything but
    ours (or one that cannot be read) is published again under a fresh random id, so a
    dead letter is never dropped as a duplicate of something else (issue 25 row 5).
    """

    async def publish(subject: str, data: bytes, headers: dict[str, str]) -> None:
        msg_id = headers.get("Nats-Msg-Id", "")
        stream, seq, duplicate = await js.publish_stored(subject, data, headers, timeout)
        if not duplicate or await _is_ours(js, stream, seq, data, headers):
            return
        if on_decoy is not None:
            on_decoy()
        log.warning("a dead letter's id was taken by another message; publishing it under "
                    "a new id (is the dead-letter subject write-protected?)",
                    dead_letter_subject=subject, stream=stream, stored_seq=seq)
        for _ in range(3):
            fresh = {**headers, "Nats-Msg-Id": f"{msg_id}-{secrets.token_hex(16)}"}
            stream, seq, duplicate = await js.publish_stored(subject, data, fresh, timeout)
            if not duplicate:
                return
        raise DeadLetterFailed(f"dead letter to {subject} not stored: every id was taken")

    return publish


async def _is_ours(js: JetStream, stream: str, seq: int, data: bytes,
                   headers: dict[str, str]) -> bool:
    """Whether ``stream``'s message ``seq`` is this dead letter (False when unreadable)."""
    try:
        stored = await js.get_message(stream, seq)
    except CgroupdError as exc:
        log.warning("cannot read back a duplicate dead letter; publishing it again",
                    stream=stream, seq=seq, error=str(exc))
        return False
    return (stored is not None and stored.data == data
            and all((stored.headers.get(k) or "").strip() == v.strip()
                    for k, v in headers.items()))


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
        #: What the server refused this instance (for /healthz; issue 25 row 10).
        self.denials = Denials(dead_letter_subject=handler.dead_letter.subject,
                               inbox_prefix=connection.inbox_prefix)
        self.acks = AckWatch()
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
        self._handler: HandlerWrapper | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log = log.bind(stream=options.stream, group=options.group,
                             member=options.member)
        #: Advisories, discovery answers, status and lag loops (once connected).
        self.operations: Operations | None = None
        self._info_sub: Any = None
        #: Why the group cannot be consumed though this instance runs (its work-queue
        #: stream does not exist): /readyz answers 503 with it, the status loop says it.
        self.group_problem: str | None = None
        #: The transient failure a start-up step keeps retrying (shown by /readyz).
        self._waiting_for: str | None = None

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
        if o.metrics_port:
            # Only /healthz reads the loop monitor: without it, its four wakeups a second
            # would be an idle instance's largest cost after presence (issue 15 §3).
            self._spawn(self.loop_monitor.run(), "cgroupd-loop-monitor")
            # Before connecting: while a start-up step retries, /readyz says which.
            await self._start_http()
        nc = await self._until_stopped(
            "connect", lambda: connect(self.connection, disconnected_cb=self._disconnected,
                                       reconnected_cb=self._reconnected),
            transient=lambda exc: isinstance(exc, ServerBusy))
        if nc is None:
            return 0
        self.nc = nc
        self._watch_denials(self.nc)
        self.metrics.set_connected(True)
        js = JetStream(self.nc)
        self.metrics.follow_answer_timeout(lambda: js.answers.seconds)
        static = await self._until_stopped("read group", lambda: self._group_kind(js))
        if static is None:
            return 0
        if not static:
            await self._check_work_queue(js)
        if self.handler_options.webhook is not None:
            import aiohttp

            ssl_context = self.handler_options.webhook.ssl_context()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max(10, 2 * self.settings.max_in_flight),
                                               ssl=ssl_context if ssl_context else True))
        publish = (jetstream_publisher(js, on_decoy=self.metrics.dead_letter_id_taken)
                   if self.handler_options.dead_letter.subject is not None else None)
        handler = self._handler = build_handler(
            self.handler_options, session=self._session, publish=publish,
            metrics=self.metrics, context={"stream": o.stream, "group": o.group,
                                           "member": o.member})
        ops = self.operations = Operations(o, self.metrics, self._log,
                                           events.Publisher(self.nc, o.stream, o.group))
        context = {"stream": o.stream, "group": o.group, "member": o.member}
        hooks = listener_hooks(self.handler_options, self._session, context)
        member = self.member = ops.member = Member(
            js, o.stream, o.group, o.member, handler.handle, self.settings, static=static,
            instance_id=o.instance_id, on_active=ops.on_active,
            on_standby=ops.on_standby, on_rebalance=ops.on_rebalance,
            on_handover=ops.on_handover,
            on_partitions_assigned=hooks.get("on_partitions_assigned"),
            on_partitions_revoked=hooks.get("on_partitions_revoked"),
            on_partitions_lost=hooks.get("on_partitions_lost"))
        context["instance"] = member.instance_id
        structlog.contextvars.bind_contextvars(instance=member.instance_id)
        self._info_sub = await js.answer(events.info_subject(o.stream, o.group),
                                         ops.instance_info)
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
        if self.group_problem is not None:
            self._spawn(self._watch_work_queue(js), "cgroupd-work-queue-check")
        self._spawn(ops.status_loop(js), "cgroupd-status")
        if self.metrics.exported:  # the lag gauges are all it feeds
            self._spawn(ops.lag_loop(js), "cgroupd-lag")
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
            self._check_size(static_from_json(record.value))
            return True
        # The record says which kind of group this is (Member.start() itself raises
        # GroupNotFound for a missing one; this read only decides elastic or static).
        stored = await admin.get_group(js, o.stream, o.group)
        self._check_size(stored.config)
        return stored.static

    def _check_size(self, config: GroupConfig) -> None:
        """Refuse, clearly, to consume more partitions than one consumer can filter: a
        reference group may have up to 2**31-1, but each partition a member owns is one
        filter of its consumer (and one entry in memory)."""
        o = self.options
        owned = sum(last - first + 1
                    for first, last in assignment_ranges(config).get(o.member, ()))
        if owned > MAX_MEMBER_PARTITIONS:
            raise StartupError(
                f"member {o.member} would own {owned} partitions of {o.stream}/{o.group} "
                f"({config.max_members} in all); cgroupd consumes at most "
                f"{MAX_MEMBER_PARTITIONS} per member (one consumer filter each: nats-server "
                "takes seconds to create a consumer with thousands): add members")

    async def _check_work_queue(self, js: JetStream) -> None:
        """Whether the elastic group's work-queue stream exists: a record whose stream
        the server refused (overlapping filters; a whole-subject group on a server older
        than 2.12) leaves members with nothing to consume, which must not look ready."""
        o = self.options
        wq = work_queue_stream(o.stream, o.group)
        try:
            missing = await js.stream_info(wq) is None
        except CgroupdError as exc:  # transient: judged again by the watch
            self._log.warning("cannot check the work-queue stream", error=str(exc))
            return
        was = self.group_problem
        self.group_problem = (
            f"the group's work-queue stream {wq} does not exist (the server refused it "
            "when the group was created, or it was deleted): nothing can be consumed; "
            f"delete the group and create it again ('cgroupd group create {o.stream} "
            f"{o.group} ...' says why the server refuses it)") if missing else None
        if self.group_problem is not None and was is None:
            self._log.error("group cannot be consumed", problem=self.group_problem)
        elif self.group_problem is None and was is not None:
            self._log.info("work-queue stream exists now", stream=wq)

    async def _watch_work_queue(self, js: JetStream) -> None:
        """Look again every few seconds until the stream exists (then stop: one API call
        per interval only while something is wrong)."""
        while self.group_problem is not None:
            await asyncio.sleep(WORK_QUEUE_RECHECK)
            await self._check_work_queue(js)

    async def _start_member(self, member: Member) -> bool:
        """Start competing; False if a signal came first. Raises if the group is unusable.

        While the member retries a transient failure (``member.waiting_for``: a server too
        busy to answer, as in a mass start) the start goes on past ``start_timeout``,
        said in a warning each time; only a start that hangs for no known reason fails."""
        starting = asyncio.ensure_future(member.start())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            while True:
                done, _ = await asyncio.wait({starting, stop},
                                             timeout=self.options.start_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if done or member.waiting_for is None:
                    break
                self.metrics.startup_retried("join")
                self._log.warning("still joining; retrying", waiting_for=member.waiting_for)
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

    async def _until_stopped(self, step: str, attempt: Callable[[], Awaitable[T]],
                             transient: Callable[[CgroupdError], bool] = lambda exc:
                             exc.retriable) -> T | None:
        """``attempt()``, tried again after each ``transient`` failure (a timeout, a 503) with
        a jittered, growing pause until it succeeds; None if a signal came first. A
        failure that retrying cannot mend is raised: the process exits on it (issue 27:
        under a mass start the first reads time out, which used to end the process)."""
        failures = 0
        while not self._stop.is_set():
            try:
                result = await attempt()
            except CgroupdError as exc:
                if not transient(exc):
                    raise
                self.metrics.startup_retried(step)
                self._waiting_for = f"{step}: {exc}"
                self._log.warning("transient failure; retrying", step=step, error=str(exc),
                                  attempt=failures + 1)
            else:
                self._waiting_for = None
                return result
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry_delay(failures, self.settings.retry_interval)):
                    await self._stop.wait()
            failures += 1
        return None

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

    async def _flush_events(self) -> None:
        if self.operations is not None:
            await self.operations.flush()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- connection ---------------------------------------------------------------
    def _watch_denials(self, nc: Connection) -> None:
        """Chain nats-py's error callback (set by connect()): permission violations
        (a denied publish gets no reply, only this) go to /healthz and the metrics."""
        chained = nc._error_cb

        async def on_error(exc: Exception) -> None:
            seen = self.denials.record(str(exc))
            if seen is None:
                if chained is not None:
                    await chained(exc)
                return
            # Not chained (connect()'s callback logs every error): one warning per
            # denied operation a minute, not one per message.
            self.metrics.permission_violation(*seen)
            fields = self.denials.to_log()
            if fields is not None:
                self._log.warning("NATS permission denied", **fields)

        nc._error_cb = on_error

    async def _disconnected(self) -> None:
        self.metrics.set_connected(False)
        # nats-py also calls this for failed first attempts: only a lost connection counts.
        if self.nc is not None and not self._closing:
            self._log.warning("nats disconnected; reconnecting")

    async def _reconnected(self) -> None:
        self.metrics.set_connected(True)
        self.denials.reconnected()
        url = self.nc.connected_url if self.nc is not None else None
        self._log.info("nats reconnected", server=redact_url(url.geturl()) if url else None)

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
        out += self.denials.problems()
        if self._handler is not None and self.member is not None:
            lost = self.acks.problem(self._handler.acked, self.member.stats["resettled"])
            if lost is not None:
                out.append(lost)
        lag = self.loop_monitor.worst()
        if lag > self.options.max_loop_lag:
            out.append(f"event loop blocked for {lag:.1f}s within the last "
                       f"{self.loop_monitor.window:g}s (a handler blocking it, or no CPU)")
        return out

    @property
    def ready(self) -> bool:
        return (self.member is not None and self.member.state in _READY_STATES
                and self.group_problem is None)

    async def _start_http(self) -> None:
        from cgroupd.join.probes import ProbeServer

        o = self.options
        probes = ProbeServer(self.metrics, problems=self.problems, ready=lambda: self.ready,
                             state=self._state, read_timeout=o.http_read_timeout,
                             max_connections=o.http_max_connections)
        await probes.start(o.metrics_host, o.metrics_port)
        self._probes = probes
        self._log.info("http listening", host=o.metrics_host, port=o.metrics_port,
                       read_timeout=o.http_read_timeout,
                       max_connections=probes.max_connections)

    def _state(self) -> dict[str, Any]:
        m = self.member
        return {
            "nats": "connected" if self.nc is not None and self.nc.is_connected
            else "disconnected",
            "state": m.state.value if m is not None else "starting",
            "instance": m.instance_id if m is not None else None,
            "partitions": list(m.partitions) if m is not None else [],
            **({"problem": self.group_problem} if self.group_problem else {}),
            "waiting_for": self._waiting_for or (m.waiting_for if m is not None else None),
        }


async def run_join(connection: ConnectionOptions, options: JoinOptions,
                   settings: MemberSettings, handler: HandlerOptions) -> int:
    """Run one member instance until stopped; returns the exit code.

    Startup failures raise :class:`~cgroupd.core.errors.CgroupdError` (the CLI prints one line
    and exits 1).
    """
    return await Daemon(connection, options, settings, handler).run()
