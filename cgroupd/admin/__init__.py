"""Group administration: create, delete, list, membership, mappings (:mod:`._groups`), and
status: who owns what, what is waiting, step-down (:mod:`._status`).

Async functions over the :class:`~cgroupd.nats.jetstream.JetStream` adapter.
"""

from cgroupd.admin._groups import (
    CAS_ATTEMPTS,
    CAS_MAX_PAUSE,
    ListedGroup,
    StoredGroup,
    add_members,
    clear_mappings,
    create_elastic_group,
    create_static_group,
    delete_group,
    drop_members,
    get_group,
    list_every_group,
    list_group_records,
    list_groups,
    set_mappings,
)
from cgroupd.admin._status import (
    ConsumerView,
    GroupStatus,
    PartitionStatus,
    group_consumers,
    group_status,
    owned_partitions,
    partition_pending,
    step_down,
)

__all__ = [
    "CAS_ATTEMPTS",
    "CAS_MAX_PAUSE",
    "ConsumerView",
    "GroupStatus",
    "ListedGroup",
    "PartitionStatus",
    "StoredGroup",
    "add_members",
    "clear_mappings",
    "create_elastic_group",
    "create_static_group",
    "delete_group",
    "drop_members",
    "get_group",
    "group_consumers",
    "group_status",
    "list_every_group",
    "list_group_records",
    "list_groups",
    "owned_partitions",
    "partition_pending",
    "set_mappings",
    "step_down",
]
