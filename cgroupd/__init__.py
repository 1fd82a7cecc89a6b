"""cgroupd: partitioned consumer groups for NATS JetStream.

Strict per-key order with horizontal scale (Kafka-style consumer groups) and hot standbys,
following the NATS ADR "Partitioned consumer groups". Layers, bottom up: the pure core
(:mod:`~cgroupd.config`, :mod:`~cgroupd.partitions`), the JetStream adapter
(:mod:`~cgroupd.jsapi`, :mod:`~cgroupd.pull`, :mod:`~cgroupd.jetstream`), the member
runtime (:mod:`~cgroupd.member`) and group administration (:mod:`~cgroupd.admin`).
"""

from cgroupd import natsload  # noqa: F401 - first: nats-py without aiohttp (see there)
from cgroupd.admin import (
    GroupStatus,
    StoredGroup,
    add_members,
    clear_mappings,
    create_elastic_group,
    create_static_group,
    delete_group,
    drop_members,
    get_group,
    group_consumers,
    group_status,
    list_groups,
    partition_pending,
    set_mappings,
    step_down,
)
from cgroupd.config import (
    ElasticGroupConfig,
    GroupConfig,
    MemberMapping,
    PartitioningFilter,
    StaticGroupConfig,
)
from cgroupd.errors import (
    AckNotConfirmed,
    AckOutcomeUnknown,
    ApiError,
    BucketNotFound,
    CgroupdError,
    ConfigError,
    ConflictError,
    DataLoss,
    GroupExists,
    GroupNotFound,
    InstanceIdInUse,
    JetStreamNotEnabled,
    LeaseLost,
    LeaseUnavailable,
    PermissionDenied,
    ReplicaBehind,
    ServerUnreachable,
    StreamNotFound,
)
from cgroupd.jetstream import JetStream
from cgroupd.member import Member, MemberState, StepDown
from cgroupd.message import Message
from cgroupd.partitions import assignment, member_partitions
from cgroupd.settings import Exclusivity, MemberSettings

#: The version, written only here (pyproject.toml reads it when building).
__version__ = "0.1.0"

__all__ = [
    "AckNotConfirmed",
    "AckOutcomeUnknown",
    "ApiError",
    "BucketNotFound",
    "CgroupdError",
    "ConfigError",
    "ConflictError",
    "DataLoss",
    "ElasticGroupConfig",
    "Exclusivity",
    "GroupConfig",
    "GroupExists",
    "GroupNotFound",
    "GroupStatus",
    "InstanceIdInUse",
    "JetStream",
    "JetStreamNotEnabled",
    "LeaseLost",
    "LeaseUnavailable",
    "Member",
    "MemberMapping",
    "MemberSettings",
    "MemberState",
    "Message",
    "PartitioningFilter",
    "PermissionDenied",
    "ReplicaBehind",
    "ServerUnreachable",
    "StaticGroupConfig",
    "StepDown",
    "StoredGroup",
    "StreamNotFound",
    "add_members",
    "assignment",
    "clear_mappings",
    "create_elastic_group",
    "create_static_group",
    "delete_group",
    "drop_members",
    "get_group",
    "group_consumers",
    "group_status",
    "list_groups",
    "member_partitions",
    "partition_pending",
    "set_mappings",
    "step_down",
]
