"""What a query reads: the stream, its partitions, and how a message's partition is known.

Pure: no I/O. Three layouts:

* ``prefixed``: every subject starts with the partition number, so partition ``p`` is the
  subject ``<p>.>`` and reads of a partition are server-side filtered. The group's
  work-queue stream ``<stream>-<group>`` (``mode=workqueue``) and a static group's stream
  (whose own transform put the partition first).
* ``hashed``: an elastic group read on its *origin* stream (``mode=read``, the default):
  nothing is consumed or purged, any number of queries can read one stream, and each
  message's partition is computed exactly as the server's ``partition()`` transform does
  for the group's work-queue stream (:func:`cgroupd.core.partitions.partition_of`: FNV-1a of
  the selected tokens, modulo the partition count).
* ``plain``: a stream without a group: one partition, 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from cgroupd.admin import StoredGroup
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter, StaticGroupConfig
from cgroupd.core.errors import ConfigError
from cgroupd.core.partitions import member_partitions


class Mode(StrEnum):
    """How a query reads a group."""

    #: Read the origin stream (or a static group's stream) directly: no lease, no purge.
    READ = "read"
    #: Consume the elastic group's work-queue stream: hold the members' lease, purge what
    #: Spark committed. For handing work between Spark and ``cgroupd join`` daemons.
    WORKQUEUE = "workqueue"


PREFIXED = "prefixed"
HASHED = "hashed"
PLAIN = "plain"


@dataclass(frozen=True)
class Layout:
    """See the module docstring."""

    #: The stream read.
    stream: str
    #: The stream the messages were published to.
    origin: str
    group: str | None
    mode: Mode
    kind: str
    #: The partitions this query reads.
    partitions: tuple[int, ...]
    #: The group's partition count (1 for a plain stream).
    count: int
    #: An elastic group's partitioning filters (keys, and the hash in ``hashed``).
    partitioning: tuple[PartitioningFilter, ...] = ()
    #: A static group's filters (subjects after the partition token; none: all).
    static_filters: tuple[str, ...] = ()
    #: A plain stream's subject filter.
    subject: str = ">"

    @property
    def label(self) -> str:
        return f"{self.origin}/{self.group}" if self.group else self.origin

    @property
    def workqueue(self) -> bool:
        return self.mode is Mode.WORKQUEUE

    def partition_subject(self, p: int) -> str:
        """``prefixed``: the subjects of partition ``p`` (what a purge removes)."""
        return f"{p}.>"

    @property
    def patterns(self) -> tuple[str, ...]:
        """Subjects (partition token stripped) a message must match to be read, when the
        direct-get subject alone does not ensure it."""
        if self.kind == PREFIXED and self.static_filters:
            return self.static_filters
        if self.kind == PLAIN and self.subject != ">":
            return (self.subject,)
        return ()

def resolve(origin: str, stored: StoredGroup | None, mode: Mode, member: str | None,
            subject: str) -> Layout:
    """The layout of a query on ``origin`` (and group ``stored``, if any)."""
    if stored is None:
        if mode is Mode.WORKQUEUE:
            raise ConfigError("mode 'workqueue' reads a group's work-queue stream: give "
                              "the 'group' option")
        if member is not None:
            raise ConfigError("option 'member' needs the 'group' option")
        return Layout(origin, origin, None, mode, PLAIN, (0,), 1, subject=subject)
    config = stored.config
    label = f"{origin}/{stored.group}"
    if member is not None:
        partitions = member_partitions(config, member)
        if not partitions:
            raise ConfigError(f"member {member!r} owns no partitions of group {label} "
                              f"(members: {list(config.member_names)})")
    else:
        partitions = tuple(range(config.max_members))
    if isinstance(config, StaticGroupConfig):
        if mode is Mode.WORKQUEUE:
            raise ConfigError(f"group {label} is a static group: it has no work-queue "
                              "stream; read it with mode 'read' (the default)")
        return Layout(origin, origin, stored.group, mode, PREFIXED, partitions,
                      config.max_members, static_filters=tuple(config.filters))
    assert isinstance(config, ElasticGroupConfig)
    if mode is Mode.WORKQUEUE:
        return Layout(stored.consume_stream, origin, stored.group, mode, PREFIXED,
                      partitions, config.max_members,
                      partitioning=config.effective_filters)
    return Layout(origin, origin, stored.group, mode, HASHED, partitions,
                  config.max_members, partitioning=config.effective_filters)
