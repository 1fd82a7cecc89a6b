"""Names cgroupd gives things on the server: consumer names, metadata keys, and the one
consumer configuration every cgroupd consumer starts from.

Pure (no I/O): the member runtime, the admin API and the Spark lease read and write the
same names, so they live here rather than in any one of them.
"""

from __future__ import annotations

from typing import Any

#: Metadata key carrying the instance id in the consumers the runtime creates.
INSTANCE_KEY = "cgroupd_instance"
#: Metadata key naming the member a consumer serves.
MEMBER_KEY = "cgroupd_member"
#: Static groups, member consumer metadata: how far each partition this member gave away
#: was processed, and which redelivered messages were processed already (SkipRules).
RELEASED_KEY = "cgroupd_released"
SKIP_KEY = "cgroupd_skip"
#: Pinned mode: a standby changed the member consumer's filters while nobody held the pin
#: (pinning needs a delivery); the next holder resets it before running anything.
RESET_KEY = "cgroupd_reset"
#: Metadata key carrying a random token per process: two processes given the same instance
#: id create differing consumers, so the second one's create fails instead of sharing.
TOKEN_KEY = "cgroupd_token"
#: Metadata key marking a synchronization consumer held by something other than a member
#: instance (a Spark query, :mod:`cgroupd.spark.lease`): it answers no presence probe and
#: is never replaced by a standby; it ends by itself.
HOLDER_KEY = "cgroupd_holder"
#: Such a holder's host and when it took the consumer (RFC 3339, UTC): ``cgroupd status``
#: shows them for a holder that answers no discovery of its own.
HOST_KEY = "cgroupd_host"
SINCE_KEY = "cgroupd_since"

#: Pull requests a consumer may have waiting at once.
MAX_WAITING = 512


def sync_consumer(group: str, member: str, static: bool) -> str:
    """The member's election consumer (pinned mode: its only consumer). Elastic groups
    have a work-queue stream of their own; a static group's stream is shared, so the
    group's name is part of it."""
    return f"{group}-{member}" if static else member


def data_consumer(member: str, instance: str, rebalances: int = 0) -> str:
    """One instance's data consumer (sync exclusivity); an incremental rebalance that
    gains partitions replaces it with a fresh one numbered after it."""
    name = f"{member}-{instance}"
    return f"{name}-{rebalances}" if rebalances else name


def consumer_config(filters: list[str], *, ack_wait: float, max_ack_pending: int,
                    metadata: dict[str, str], **extra: Any) -> dict[str, Any]:
    """The configuration every cgroupd pull consumer starts from (``extra`` overrides or
    adds fields); durations in seconds."""
    config: dict[str, Any] = {
        "ack_policy": "explicit",
        "deliver_policy": "all",
        "filter_subjects": filters,
        "ack_wait": int(ack_wait * 1e9),
        "max_ack_pending": max_ack_pending,
        "max_waiting": MAX_WAITING,
        "metadata": metadata,
    }
    config.update(extra)
    return config
