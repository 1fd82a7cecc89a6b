"""What a ``cgroupd join`` instance tells operators while it runs (:mod:`cgroupd.nats.events`).

The member runtime's callbacks become advisories (became active, stepped down and why,
partitions moved) and metrics; every ``--status-interval`` the group status refreshes the
unowned-partitions gauge (and the active instance of the lowest consumed partition
publishes the "unowned" advisory while any is), and an active instance reads the lag of
its own partitions (the one of partition 0 also how an elastic group's stream hears from
its source); the instance answers discovery requests. Nothing here is fatal: a
failed read is logged and counted, and the member goes on consuming.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import cgroupd
from cgroupd import admin
from cgroupd.admin.lag import SourceSilence, read_lag, read_source_lag
from cgroupd.join.metrics import Metrics
from cgroupd.join.options import JoinOptions
from cgroupd.member import Member
from cgroupd.nats import events
from cgroupd.nats.jetstream import JetStream

#: The partition whose active instance reports the group stream's source (one per group).
SOURCE_REPORTER = 0


class Operations:
    """One instance's advisories, discovery answers, and status and lag loops.

    The daemon hands :meth:`on_active`, :meth:`on_standby`, :meth:`on_handover` and
    :meth:`on_rebalance` to the :class:`~cgroupd.member.Member`, sets :attr:`member` once it
    exists, answers discovery with :meth:`instance_info` and runs :meth:`status_loop` and
    :meth:`lag_loop` once joined.
    """

    def __init__(self, options: JoinOptions, metrics: Metrics, log: Any,
                 publisher: events.Publisher | None) -> None:
        self.options = options
        self.metrics = metrics
        self.member: Member | None = None
        self._log = log
        self._publisher = publisher
        #: Partitions held while active and since when this instance is in its state.
        self._held: tuple[int, ...] = ()
        self._since = time.time()
        self._publishing: set[asyncio.Task[None]] = set()
        #: The group stream's source, while this instance reports it (:meth:`report_source`).
        self._silence = SourceSilence()
        self._source_error: str | None = None

    # -- the runtime's callbacks -----------------------------------------------------
    def on_active(self, partitions: tuple[int, ...]) -> None:
        took = self.metrics.became_active(partitions)
        if took is not None:
            self._log.info("rebalance", phase="done", seconds=round(took, 3),
                           partitions=list(partitions))
        self._held, self._since = tuple(partitions), time.time()
        self.event("active", partitions=list(partitions))

    def on_standby(self, reason: str) -> None:
        # A full rejoin (pinned mode, or a change incremental rebalance cannot apply):
        # measured from this step-down to the next activation.
        if self.metrics.stepped_down(reason):
            self._log.info("rebalance", phase="started")
        self.metrics.clear_lag()
        self._stop_source_report()
        if self._held:  # released without a hand-over (the release failed)
            self.event("stepped_down", reason=reason, partitions=list(self._held))
        self._held, self._since = (), time.time()

    async def on_handover(self, reason: str) -> None:
        # Published before the consumers (or the pin) go: a successor's "active" cannot
        # overtake it (one connection keeps our order, the server the rest).
        released, self._held = self._held, ()
        if self._publisher is not None:
            await self._publisher.publish("stepped_down", **self._who(), reason=reason,
                                          partitions=list(released))
            self.metrics.event_published("stepped_down")

    def on_rebalance(self, moved: tuple[tuple[int, ...], float]) -> None:
        # In place, without a step-down; the runtime logs "rebalanced" itself.
        partitions, seconds = moved
        self.metrics.rebalanced(partitions, seconds)
        before, self._held = set(self._held), tuple(partitions)
        self.event("rebalanced", partitions=list(partitions), seconds=round(seconds, 4),
                   gained=sorted(set(partitions) - before),
                   lost=sorted(before - set(partitions)))

    # -- advisories and discovery ----------------------------------------------------
    def _who(self) -> dict[str, Any]:
        m = self.member
        return {"member": self.options.member,
                "instance": m.instance_id if m is not None else None,
                "host": events.hostname(), "pid": os.getpid()}

    def event(self, kind: str, **fields: Any) -> None:
        """Publish an advisory without holding up the runtime's callback."""
        publisher = self._publisher
        if publisher is None:
            return

        async def publish() -> None:
            await publisher.publish(kind, **self._who(), **fields)
            self.metrics.event_published(kind)

        task = asyncio.create_task(publish(), name=f"cgroupd-event-{kind}")
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def flush(self) -> None:
        """Let advisories already raised (a step-down while stopping) go out."""
        if self._publishing:
            await asyncio.wait(set(self._publishing), timeout=1.0)

    def instance_info(self) -> str | None:
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

    # -- status and lag loops --------------------------------------------------------
    async def lag_loop(self, js: JetStream) -> None:
        """While active, export the lag of this instance's partitions: one direct get
        per partition per interval (a static member's consumer info besides); and, on
        the instance that reports it, how an elastic group's stream hears from its
        source (:meth:`report_source`)."""
        o = self.options
        member = self.member
        assert member is not None
        while True:
            await asyncio.sleep(o.status_interval)
            partitions = member.partitions if member.active else ()
            if not partitions:
                self.metrics.clear_lag()
                self._stop_source_report()
                continue
            started = time.monotonic()
            stored: admin.StoredGroup | None = None
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
            else:
                if member.active and member.partitions == partitions:
                    now = time.time()
                    self.metrics.set_lag({p: (x.messages, x.seconds(now))
                                          for p, x in lags.items()},
                                         time.monotonic() - started)
            if stored is not None:  # a failed partition read does not skip the source's
                await self.report_source(js, stored, partitions)

    async def report_source(self, js: JetStream, stored: admin.StoredGroup,
                            partitions: tuple[int, ...]) -> None:
        """Export how an elastic group's work-queue stream hears from its origin, which
        the partition lag cannot show (a stalled source leaves the partitions empty:
        issue 29). One instance per group reports it, so the fleet makes one stream info
        per interval: the active instance whose partitions include partition 0 (every
        group has a partition 0 and at most one active instance consumes it; chosen
        from what the instance knows itself, with no request to agree). The others do
        nothing for it. While partition 0 has no active instance nobody reports it
        (CgroupdUnownedPartitions says so). A failed read is counted as a lag read
        error and keeps the last values."""
        origin = self.options.stream
        member = self.member
        if stored.static or stored.consume_stream == origin or SOURCE_REPORTER not in partitions:
            self._stop_source_report()
            return
        try:
            lag = await read_source_lag(js, stored.consume_stream, origin)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.metrics.lag_failed()
            self._log.warning("group stream source read failed", error=str(exc) or repr(exc))
            return
        if member is None or not member.active or SOURCE_REPORTER not in member.partitions:
            self._stop_source_report()
            return
        if lag is None:  # not sourcing the origin now (a replay re-sources it)
            self._stop_source_report()
            return
        if lag.error != self._source_error:
            if lag.error:
                self._log.warning("group stream source error", stream=stored.consume_stream,
                                  source=origin, error=lag.error)
            self._source_error = lag.error
        self.metrics.set_source(self._silence.seconds(lag), lag.messages)

    def _stop_source_report(self) -> None:
        self._silence.reset()
        self._source_error = None
        self.metrics.clear_source()

    async def status_loop(self, js: JetStream) -> None:
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
                self.unowned_advisory(status)
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

    def unowned_advisory(self, status: admin.GroupStatus) -> None:
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
        self.event("unowned", unowned_partitions=sorted(unowned),
                   members_without_instance=status.members_without_instance,
                   idle=not owned,
                   pending=sum(r.pending for r in status.partitions
                               if r.partition in unowned))
