"""The streams and KV bucket behind a group, as nats-py configs: the consumer-group
bucket, an elastic group's work-queue stream (built, or checked before it is reused),
and re-sourcing that stream from a sequence (replay). The admin API and replay use these,
so they never touch nats-py's config types themselves.
"""

from __future__ import annotations

import re

from nats.js import api

from cgroupd.core.config import ElasticGroupConfig
from cgroupd.core.errors import GroupExists
from cgroupd.core.naming import DATA_SLOTS
from cgroupd.core.partitions import transform_destination
from cgroupd.nats.jetstream import JetStream

#: A stream's info as the adapter returns it (``config``, ``state``).
StreamInfo = api.StreamInfo


async def ensure_bucket(js: JetStream, bucket: str, origin: StreamInfo) -> None:
    """The consumer-group KV bucket, created (replicated like the origin) if absent."""
    await js.bucket(bucket, create_with=api.KeyValueConfig(
        bucket=bucket, history=1, replicas=origin.config.num_replicas or 1,
        storage=api.StorageType.FILE))


#: The first nats-server whose ``partition(N)`` takes no wildcard argument (hashing the
#: whole subject): what a group without a partitioning filter needs.
WHOLE_SUBJECT_SERVER = (2, 12)


def transforms(config: ElasticGroupConfig) -> list[api.SubjectTransform]:
    """The subject transforms that put each message's partition first: one per filter,
    or ``>`` into ``{{Partition(N)}}.>`` for a whole-subject group (as the reference)."""
    return [api.SubjectTransform(src=pf.filter,
                                 dest=transform_destination(pf, config.max_members))
            for pf in config.effective_filters]


def whole_subject_problem(config: ElasticGroupConfig,
                          server: tuple[int, int, int] | None) -> str | None:
    """Why this server cannot hold a whole-subject group (None when it can, or when the
    group has partitioning filters, or the version is unknown)."""
    if not config.whole_subject or server is None or server[:2] >= WHOLE_SUBJECT_SERVER:
        return None
    return (f"a group without --filter partitions on the whole subject, which needs "
            f"nats-server >= {'.'.join(map(str, WHOLE_SUBJECT_SERVER))} (its partition(N) "
            f"transform); this server is {'.'.join(map(str, server))}: give --filter "
            "SUBJECT (e.g. --filter 'orders.*' --wildcards 1) or upgrade the server")


#: Consumers nats-server 2.15 lets a stream have when its ``max_consumers`` is unset (-1):
#: a larger group fails with err_code 10026 (tests/integration/test_group_stream_limits.py).
SERVER_DEFAULT_MAX_CONSUMERS = 1000
#: Consumers beyond the members' own that a group's stream should take: Spark leases,
#: ``cgroupd`` tools, a reference member or two during an upgrade.
SPARE_CONSUMERS = 64


def work_queue_consumer_limit(config: ElasticGroupConfig) -> int | None:
    """The ``max_consumers`` a group's work-queue stream needs, or None when the server's
    default is enough (the stream then looks as the reference makes it). Each member has
    one synchronization consumer and its data consumers' names (:data:`DATA_SLOTS`): 500
    members with two instances each came to 1,000 consumers and stalled (issue 27)."""
    needed = config.max_members * (1 + DATA_SLOTS) + SPARE_CONSUMERS
    return needed if needed > SERVER_DEFAULT_MAX_CONSUMERS else None


async def ensure_work_queue_stream(js: JetStream, name: str, stream: str, origin: StreamInfo,
                                   config: ElasticGroupConfig) -> None:
    """Create an elastic group's work-queue stream sourcing ``stream`` (whose info is
    ``origin``), or check that an existing stream of that name is this group's
    (GroupExists otherwise)."""
    wanted = transforms(config)
    limit = work_queue_consumer_limit(config)
    existing = await js.stream_info(name)
    if existing is not None:
        _check_work_queue_stream(existing, stream, wanted)
        have = existing.config.max_consumers or -1
        if limit is not None and (have < 0 or have < limit):
            # Made by the reference or an earlier cgroupd: room for every member.
            existing.config.max_consumers = limit
            await js.update_stream(existing.config)
        return
    await js.add_stream(api.StreamConfig(
        name=name,
        max_consumers=limit or -1,
        retention=api.RetentionPolicy.WORK_QUEUE,
        discard=api.DiscardPolicy.NEW,
        max_msgs=config.max_buffered_msgs or -1,
        max_bytes=config.max_buffered_bytes or -1,
        num_replicas=origin.config.num_replicas or 1,
        storage=origin.config.storage,
        allow_direct=True,
        sources=[api.StreamSource(name=stream, subject_transforms=wanted)],
    ))


def _check_work_queue_stream(info: StreamInfo, origin: str,
                             wanted: list[api.SubjectTransform]) -> None:
    """An existing ``<stream>-<group>`` is reused only if it is this group's stream: a
    work queue sourcing the origin with the group's partitioning transforms."""
    cfg = info.config
    sources = cfg.sources or []
    want = sorted((t.src, _transform_key(t.dest)) for t in wanted)
    have = sorted((t.src, _transform_key(t.dest)) for t in (sources[0].subject_transforms
                                                            if sources else None) or [])
    ok = (is_work_queue(info) and len(sources) == 1
          and sources[0].name == origin and have == want)
    if not ok:
        raise GroupExists(
            f"stream {cfg.name!r} exists but is not this group's work-queue stream (it must "
            f"be a work queue sourcing {origin!r} with the group's partitioning); delete "
            "it or choose another group name")


def _transform_key(dest: str | None) -> str:
    """A transform destination as the server reads it: function names in any case and
    spaces inside ``{{ }}`` (the reference writes ``{{Partition(4,1)}}``) do not matter."""
    return re.sub(r"\{\{[^}]*\}\}", lambda m: m.group(0).replace(" ", "").lower(), dest or "")


def is_work_queue(info: StreamInfo) -> bool:
    """Whether the stream has work-queue retention (acked messages are removed)."""
    return info.config.retention == api.RetentionPolicy.WORK_QUEUE


async def resource(js: JetStream, wq: str, info: StreamInfo, origin: str,
                   config: ElasticGroupConfig, sequence: int, placeholder: str) -> None:
    """Source the work-queue stream ``wq`` again from ``sequence`` of ``origin``: remove
    its source (capturing only ``placeholder`` meanwhile), purge it, and put the source
    back starting at ``sequence``. Without a source (an interrupted replay), the group's
    source is rebuilt from ``config``."""
    cfg = info.config
    if cfg.sources:
        source = cfg.sources[0]
        paused = api.StreamConfig.from_response(cfg.as_dict())
        paused.sources = []
        paused.subjects = [placeholder]
        await js.update_stream(paused)
    else:  # finishing an interrupted replay: rebuild the group's source
        source = api.StreamSource(name=origin, subject_transforms=transforms(config))
    await js.purge(wq)
    source.opt_start_seq = sequence
    source.opt_start_time = None
    restored = api.StreamConfig.from_response(cfg.as_dict())
    restored.sources = [source]
    restored.subjects = []
    await js.update_stream(restored)
