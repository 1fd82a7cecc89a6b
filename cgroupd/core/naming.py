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

#: Metadata key saying where the consumer's instance answers presence probes: present
#: (value :data:`PRESENCE_BY_MEMBER`) on consumers of versions that put the member in the
#: presence subject (:func:`cgroupd.nats.lease.presence_subject`); absent on those of earlier
#: versions, whose instances answer on :func:`cgroupd.nats.lease.legacy_presence_subject`.
PRESENCE_KEY = "cgroupd_presence"
PRESENCE_BY_MEMBER = "member"

#: Sync exclusivity: how many data consumer names each member has (see
#: :func:`data_consumer`). A member's consumers coexist briefly only while one owner
#: hands over to the next (at most the old owner's, the new owner's and an abandoned one).
DATA_SLOTS = 4
#: Between the member and the slot of a data consumer's name: a character that cgroupd
#: never writes into a member's name, so that no other member's consumer names collide.
DATA_SEPARATOR = "~"

#: Pull requests a consumer may have waiting at once.
MAX_WAITING = 512


def sync_consumer(group: str, member: str, static: bool) -> str:
    """The member's election consumer (pinned mode: its only consumer). Elastic groups
    have a work-queue stream of their own; a static group's stream is shared, so the
    group's name is part of it."""
    return f"{group}-{member}" if static else member


def data_consumer(member: str, slot: int) -> str:
    """A data consumer's name (sync exclusivity): ``<member>~<slot>``, ``slot`` in
    ``range(DATA_SLOTS)``.

    Every name a member's instances ever give a consumer is known in advance (its
    synchronization consumer and these), so a NATS permission can name them one by one:
    permissions wildcard whole subject tokens only, and a consumer's name is one token of
    ``$JS.API.CONSUMER.*.<stream>.<consumer>``. (Earlier versions named data consumers
    ``<member>-<instance>[-<n>]``, which no permission could confine to a member.) An
    owner uses a slot other than the one it just deleted, and a successor one that the
    previous owner's consumer does not hold.
    """
    if not 0 <= slot < DATA_SLOTS:
        raise ValueError(f"data consumer slot {slot} out of range(0, {DATA_SLOTS})")
    return f"{member}{DATA_SEPARATOR}{slot}"


def data_consumers(member: str) -> list[str]:
    """Every data consumer name a member may use (for permission templates)."""
    return [data_consumer(member, slot) for slot in range(DATA_SLOTS)]


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
