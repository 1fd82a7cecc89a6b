"""Following the group's KV record: membership changes start a rebalance (in place when
possible, ADR "Transitioning" otherwise); the group's deletion stops the member."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from cgroupd.core.config import (
    ElasticGroupConfig,
    GroupConfig,
)
from cgroupd.core.errors import (
    CgroupdError,
    ConfigError,
    GroupNotFound,
)
from cgroupd.core.partitions import member_partitions
from cgroupd.core.retrying import retry_delay
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.member.state import MemberState, StepDown
from cgroupd.nats.jetstream import Record

if TYPE_CHECKING:
    from cgroupd.member.core import MemberCore


class ConfigWatch:
    """A job of every member (see the module docstring); a collaborator holding the
    member, not a mixin of it."""

    def __init__(self, member: MemberCore) -> None:
        self.m = member

    async def watch(self) -> None:
        """Follow the group record; never dies on a bad record (ADR: keep watching).

        A transient failure (the server did not answer in time, a 503) is retried with a
        jittered, growing pause, also before the first record: under a mass start the
        first read times out and used to end the process (issue 27). Only a failure that
        retrying cannot mend (no permission, no bucket) ends :meth:`Member.start`."""
        decode = self.m._decode
        failures = 0
        while not self.m._stopping:
            try:
                async for record in self.m.js.watch_record(self.m._bucket, self.m._key):
                    failures = 0
                    self.m.waiting_for = None
                    self._apply_record(record, decode)
            except asyncio.CancelledError:
                raise
            except CgroupdError as exc:
                if not self.m._first_config.done() and not exc.retriable:
                    self.m._first_config.set_exception(exc)
                    return
                self.m.stats["watch_failures"] += 1
                if not self.m._first_config.done():
                    self.m.waiting_for = f"reading the group record: {exc}"
                self.m._log.warning("config watch failed; retrying", error=str(exc),
                                    attempt=failures + 1)
            except Exception as exc:  # noqa: BLE001 - a bug or an untranslated error
                # Never die silently: a member that stops following its group would miss
                # membership changes and the group's deletion.
                self.m.stats["watch_failures"] += 1
                self.m._log.error("config watch failed unexpectedly; retrying", error=repr(exc))
                if not self.m._first_config.done():
                    self.m._first_config.set_exception(exc)
                    return
            # Jittered: after a server restart every instance's watch fails at once.
            await self.m._sleep(retry_delay(failures, self.m.settings.retry_interval))
            failures += 1

    def watch_ended(self, task: asyncio.Task[None]) -> None:
        """The config watch must run as long as the member does: restart it if it ended."""
        if self.m._stopping or self.m._deleted or task.cancelled() or self.m._watcher is not task:
            return
        self.m.stats["watch_failures"] += 1
        self.m._log.error("config watch ended unexpectedly; restarting",
                          error=repr(task.exception()))
        self.m._watcher = asyncio.create_task(self.watch(), name="cgroupd-watch")
        self.m._watcher.add_done_callback(self.watch_ended)

    def _group_deleted(self) -> None:
        if self.m._deleted:
            return
        self.m._log.info("group deleted")
        self.m._deleted = True
        self.m.stop_reason = "group deleted"
        self.m.mode.step_down(StepDown.GROUP_DELETED)
        self.m._wake.set()

    async def deleted_meanwhile(self) -> bool:
        """Was the group deleted? Asked when a consumer vanished: deleting a group removes
        its record first, then its consumers or work-queue stream, yet a puller may hear of
        the consumer's end before the watch delivers the record's deletion."""
        if self.m._deleted:
            return True
        try:
            record = await self.m.js.get_record(self.m._bucket, self.m._key)
        except CgroupdError:
            return False  # cannot tell: keep the reason we have
        if record is None or record.value is None:
            self._group_deleted()
        return self.m._deleted

    def _apply_record(self, record: Record, decode: Callable[[bytes], GroupConfig]) -> None:
        if record.value is None:
            if not self.m._first_config.done():
                self.m._first_config.set_exception(GroupNotFound(
                    f"no consumer group {self.m.group!r} on stream {self.m.stream!r}"))
                return
            self._group_deleted()
            return
        try:
            config = decode(record.value)
        except ConfigError as exc:
            self.m._log.error("invalid group record ignored", revision=record.revision,
                              problems=exc.problems)
            self.m.stats["invalid_group_records"] = self.m.stats.get("invalid_group_records", 0) + 1
            if self.m.config is None and not self.m._first_config.done():
                self.m._first_config.set_exception(exc)
            return
        if (self.m.config is not None and isinstance(config, ElasticGroupConfig)
            and isinstance(self.m.config, ElasticGroupConfig)
            and not config.same_shape(self.m.config)):
            # Only membership may change after creation; anything else means the group was
            # replaced under us. Keep the last good config and say so loudly.
            self.m._log.error("group record changed more than membership; ignored",
                              revision=record.revision)
            self.m.stats["replaced_group_records"] = self.m.stats.get("replaced_group_records",
                                                                      0) + 1
            return
        first = self.m.config is None
        self.m.config = config
        if not self.m._first_config.done():
            self.m._first_config.set_result(None)
        new = member_partitions(config, self.m.member)
        gen = self.m._gen
        current = gen.target if gen is not None else self.m._last_partitions
        if not first and new != current and gen is not None and self.m.active \
                and self.m.mode.incremental(new):
            # Move only what changes; the partitions we keep never stop (issue 9).
            self.m.mode.move_to(new)
        elif not first and new != current:
            # ADR Transitioning: everyone drops its consumers, then waits before competing
            # again; the active instance a fixed delay, standbys a little longer (so the
            # active one tends to win again). A member that had no partitions has nobody
            # to defer to: it competes at once.
            s = self.m.settings
            if current:
                delay = s.transition_delay
                if not self.m.active:
                    delay += random.uniform(0, s.transition_jitter)
                self.m._not_before = self.m._clock() + delay
            if gen is not None:
                self.m.mode.step_down(StepDown.CONFIG_CHANGED,
                                      f"partitions {gen.partitions} -> {new}", gen=gen)
        if new != current:
            self.m._changed_at = self.m._clock()
        self.m._last_partitions = new
        self.m._wake.set()

    async def close(self) -> None:
        if self.m._watcher is not None:
            await cancel_and_wait(self.m._watcher)  # a KV watch's request may swallow one
        self.m._watcher = None
        for sub in (self.m._advisories, self.m._presence_sub, self.m._step_down_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self.m._advisories = self.m._presence_sub = self.m._step_down_sub = None

    async def on_claim_deleted(self, name: str) -> None:
        """Our member's claim went away: a standby may win right now. Only this deletion
        is heard (see :meth:`JetStream.watch_deletion`): others concern other members
        (issue 15: each one woke every standby), and after a membership change, when
        previous owners let go of our partitions, a standby looks again every 0.1 s
        anyway (:meth:`Member._supervise`)."""
        if self.m.state is MemberState.STANDBY and name == self.m.sync_consumer:
            self.m._wake.set()
