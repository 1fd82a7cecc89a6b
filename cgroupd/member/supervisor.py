"""The member runtime: one instance of one member of a consumer group.

Implements the ADR's "Implementation design" and "Transitioning" sections. One supervisor
task runs the states below; each time this instance wins the election (its mode's
``acquire``, see :mod:`cgroupd.member.modes`) it starts a :class:`Generation` (its
partitions, its pullers, its dispatcher), lets the mode ``run`` it and waits for whatever
ends it: a config change, the loss of a consumer, a failed self-check, the group's
deletion, or stop().

The states (their phases in brackets) and where each may go, rendered from the one
transition table :data:`cgroupd.member.state.TRANSITIONS` (every move, phases included,
is in docs/architecture.md; ``tests/unit/test_state_table.py`` fails when either drifts;
an active instance always steps down before it stops):

    JOINING ──► STANDBY, STOPPED
    STANDBY (waiting, claiming) ──► ACTIVE, STOPPED
    ACTIVE (taking-over, running, moving) ──► STEPPING-DOWN
    STEPPING-DOWN (releasing, stopping) ──► STANDBY, STOPPED
    STOPPED
"""

from __future__ import annotations

import asyncio
import contextlib

from cgroupd.core.errors import GroupNotFound, InstanceIdInUse
from cgroupd.core.partitions import member_partitions
from cgroupd.member.core import MemberCore
from cgroupd.member.generation import Generation
from cgroupd.member.state import MemberState, Phase, StepDown
from cgroupd.nats.lease import Presence, presence_subject

__all__ = ["Member"]


class Member(MemberCore):
    """One running instance of ``member`` in ``group`` on ``stream``.

    ``handler`` gets each :class:`Message`; returning acks it (unless it settled it
    itself), raising retries it with backoff (in place for the ordered modes, see
    :mod:`cgroupd.member.dispatch`). Sync handlers run in a thread so they never stall the pulls
    that keep this instance's consumers alive.
    """

    async def start(self) -> None:
        """Read the group config and begin competing; raises if the group is unusable, and
        :class:`InstanceIdInUse` if a running process already answers for this instance id."""
        await self._refuse_duplicate_id()
        self._watcher = asyncio.create_task(self._config_watch.watch(), name="cgroupd-watch")
        done, _ = await asyncio.wait({self._first_config, self._watcher},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._first_config not in done:
            self._watcher.result()  # re-raises why the watch failed
            raise GroupNotFound(f"group {self.stream}/{self.group} could not be read")
        self._first_config.result()
        self._watcher.add_done_callback(self._config_watch.watch_ended)
        self._connection_off = self.js.on_connection(self._connection_lost,
                                                     self._connection_back)
        with contextlib.suppress(Exception):
            self._advisories = await self.js.watch_deletion(
                self._consume_stream, self.sync_consumer, self._config_watch.on_claim_deleted)
        self._presence_sub = await self.js.answer(
            presence_subject(self._key, self.member, self.instance_id), self._presence_text)
        await self.mode.open()
        self._transition(MemberState.STANDBY)
        self._supervisor = asyncio.create_task(self._supervise(), name="cgroupd-member")

    async def stop(self) -> None:
        """Stop: finish in-flight handlers (bounded), delete own consumers, return."""
        self._stopping = True
        self.stop_reason = self.stop_reason or "stopped"
        if self.phase is Phase.RELEASING:
            self._enter(Phase.STOPPING)
        self.mode.step_down(StepDown.STOPPING)
        self._wake.set()
        if self._supervisor is not None:
            # Waiting, not awaiting: a cancelled caller must not cancel the supervisor
            # half-way through releasing our consumers.
            await asyncio.wait({self._supervisor})
        await self._config_watch.close()
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

    async def wait_stopped(self) -> str:
        """Wait until the instance stopped by itself (group deleted) or by stop()."""
        if self._supervisor is not None:
            await asyncio.wait({self._supervisor})
            if not self._supervisor.cancelled() and self._supervisor.exception() is not None:
                raise self._supervisor.exception()  # type: ignore[misc]
        return self.stop_reason or "stopped"

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
                    await self.mode.stand_by(0.1 if soon else self.settings.retry_interval)
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

    async def _acquire(self, partitions: tuple[int, ...]) -> Generation | None:
        """Try once to become the active instance; None means stay standby."""
        return await self.mode.acquire(partitions)

    async def _run_active(self, gen: Generation) -> StepDown:
        self._gen = gen
        self.partitions = gen.partitions
        # Pinned mode (a lease on the pin): nothing starts until the takeover is done.
        self._transition(MemberState.ACTIVE, phase=self.mode.first_phase,
                         partitions=list(gen.partitions))
        self._log.info("became active", partitions=list(gen.partitions))
        await self._assigned(gen, gen.partitions)
        if self.on_active is not None:
            await self._callback(self.on_active, gen.partitions)
        self.mode.run(gen)
        if self._stopping or self._deleted:
            self.mode.step_down(
                StepDown.STOPPING if self._stopping else StepDown.GROUP_DELETED, gen=gen)
        why, detail = await gen.ended
        if why in (StepDown.DATA_LOST, StepDown.SYNC_LOST, StepDown.PIN_LOST) \
                and await self._config_watch.deleted_meanwhile():
            why = gen.reported = StepDown.GROUP_DELETED
        self._transition(MemberState.STEPPING_DOWN, phase=Phase.STOPPING if self._stopping
                         or self._deleted else Phase.RELEASING, reason=why.value,
                         detail=detail)
        self.stats["step_downs"] += why is not StepDown.STOPPING
        self._stepping_since = self._clock()
        try:
            await self._releaser.release(gen)
        finally:
            self._stepping_since = None
        self._gen = None
        self.partitions = ()
        if (self._stopping or self._deleted) and self.phase is Phase.RELEASING:
            self._enter(Phase.STOPPING)  # the group was deleted during the release
        self._transition(MemberState.STOPPED if self._stopping or self._deleted
                         else MemberState.STANDBY, reason=why.value)
        self._log.info("stepped down", reason=why.value, detail=detail)
        if self.on_standby is not None:
            await self._callback(self.on_standby, why.value)
        return why

    async def _refuse_duplicate_id(self) -> None:
        """Two processes with one instance id would both pass for the active instance (their
        consumers' configs would be identical): ask whether someone answers for it."""
        answer = await self.js.probe(
            presence_subject(self._key, self.member, self.instance_id), self._probe_timeout)
        if answer.presence is Presence.ALIVE:
            raise InstanceIdInUse(
                f"instance id {self.instance_id!r} is already used by a running instance of "
                f"group {self.stream}/{self.group} (state {answer.state or 'unknown'}); give "
                "each process its own id, or none (a random one is chosen)")

    def _connection_lost(self) -> None:
        """Checks sent before a disconnection prove nothing: start nothing until a new one
        (sync exclusivity; a standby may take over meanwhile). The mode says what else
        (pinned: a delivery on its way may be lost)."""
        gen = self._gen
        if gen is not None:
            gen.lease.revoke()
            self.mode.connection_lost(gen)

    def _connection_back(self) -> None:
        gen = self._gen
        if gen is not None and gen.dispatcher is not None:
            gen.dispatcher.connection_back()
        if gen is not None:
            self.mode.connection_back(gen)
