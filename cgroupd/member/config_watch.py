"""Following the group's KV record: membership changes start a rebalance (in place when
possible, ADR "Transitioning" otherwise); the group's deletion stops the member."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

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
from cgroupd.core.records import elastic_from_json, static_from_json
from cgroupd.core.retrying import retry_delay
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.member.core import MemberCore
from cgroupd.member.state import MemberState, StepDown
from cgroupd.nats.jetstream import Record


class ConfigWatch(MemberCore):
    """One job of :class:`cgroupd.member.Member` (see the module docstring)."""

    async def _watch_config(self) -> None:
        """Follow the group record; never dies on a bad record (ADR: keep watching).

        A transient failure (the server did not answer in time, a 503) is retried with a
        jittered, growing pause, also before the first record: under a mass start the
        first read times out and used to end the process (issue 27). Only a failure that
        retrying cannot mend (no permission, no bucket) ends :meth:`Member.start`."""
        decode = static_from_json if self.static else elastic_from_json
        failures = 0
        while not self._stopping:
            try:
                async for record in self.js.watch_record(self._bucket, self._key):
                    failures = 0
                    self.waiting_for = None
                    self._apply_record(record, decode)
            except asyncio.CancelledError:
                raise
            except CgroupdError as exc:
                if not self._first_config.done() and not exc.retriable:
                    self._first_config.set_exception(exc)
                    return
                self.stats["watch_failures"] += 1
                if not self._first_config.done():
                    self.waiting_for = f"reading the group record: {exc}"
                self._log.warning("config watch failed; retrying", error=str(exc),
                                  attempt=failures + 1)
            except Exception as exc:  # noqa: BLE001 - a bug or an untranslated error
                # Never die silently: a member that stops following its group would miss
                # membership changes and the group's deletion.
                self.stats["watch_failures"] += 1
                self._log.error("config watch failed unexpectedly; retrying", error=repr(exc))
                if not self._first_config.done():
                    self._first_config.set_exception(exc)
                    return
            # Jittered: after a server restart every instance's watch fails at once.
            await self._sleep(retry_delay(failures, self.settings.retry_interval))
            failures += 1

    def _watch_ended(self, task: asyncio.Task[None]) -> None:
        """The config watch must run as long as the member does: restart it if it ended."""
        if self._stopping or self._deleted or task.cancelled() or self._watcher is not task:
            return
        self.stats["watch_failures"] += 1
        self._log.error("config watch ended unexpectedly; restarting",
                        error=repr(task.exception()))
        self._watcher = asyncio.create_task(self._watch_config(), name="cgroupd-watch")
        self._watcher.add_done_callback(self._watch_ended)

    def _group_deleted(self) -> None:
        if self._deleted:
            return
        self._log.info("group deleted")
        self._deleted = True
        self.stop_reason = "group deleted"
        if self._gen is not None:
            self._gen.end(StepDown.GROUP_DELETED)
        self._wake.set()

    async def _deleted_meanwhile(self) -> bool:
        """Was the group deleted? Asked when a consumer vanished: deleting a group removes
        its record first, then its consumers or work-queue stream, yet a puller may hear of
        the consumer's end before the watch delivers the record's deletion."""
        if self._deleted:
            return True
        try:
            record = await self.js.get_record(self._bucket, self._key)
        except CgroupdError:
            return False  # cannot tell: keep the reason we have
        if record is None or record.value is None:
            self._group_deleted()
        return self._deleted

    def _apply_record(self, record: Record, decode: Callable[[bytes], GroupConfig]) -> None:
        if record.value is None:
            if not self._first_config.done():
                self._first_config.set_exception(GroupNotFound(
                    f"no consumer group {self.group!r} on stream {self.stream!r}"))
                return
            self._group_deleted()
            return
        try:
            config = decode(record.value)
        except ConfigError as exc:
            self._log.error("invalid group record ignored", revision=record.revision,
                            problems=exc.problems)
            self.stats["invalid_group_records"] = self.stats.get("invalid_group_records", 0) + 1
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
            self.stats["replaced_group_records"] = self.stats.get("replaced_group_records",
                                                                  0) + 1
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
        if self._watcher is not None:
            await cancel_and_wait(self._watcher)  # a KV watch's request may swallow one
        self._watcher = None
        for sub in (self._advisories, self._presence_sub, self._step_down_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._advisories = self._presence_sub = self._step_down_sub = None

    async def _on_consumer_deleted(self, name: str) -> None:
        """A consumer of our stream went away: a standby may win right now if it was our
        member's claim, or, for a while after a membership change, anyone's (previous
        owners of our partitions let go). Other deletions concern other members: with
        many members each one woke every standby (issue 15). A standby watching a live
        active instance waits for our claim's deletion only: its member's partitions move
        in place, and a create would be refused (the claim exists); with 16 members each
        deletion of a move woke 16 standbys into a refused create."""
        if self.state is not MemberState.STANDBY:
            return
        if name == self.sync_consumer or (self._clock() < self._changed_at + 5.0
                                          and self._watch is None):
            self._wake.set()
