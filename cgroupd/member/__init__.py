"""The member runtime, one module per job; the facade is :class:`Member` (``supervisor``).
Each job is an object that holds the member; what differs between the exclusivity modes
is one mode object (``modes``) that owns its mode's jobs.

    supervisor       Member: the supervisor loop over the states (start, stop, health)
    core             MemberCore (Member's one base class): identity, settings, helpers
    modes            ExclusivityMode, SyncMode, PinnedMode: chosen once per member
    state            MemberState, StepDown, the wake-up event, the transition table
    generation       Generation: one period of activity, its partitions and consumers
    config_watch     following the group record; membership changes
    election_sync    sync mode: election, standby watch, takeover, reclaim
    election_pinned  pinned mode: pin, pin lease, takeover of a holder's messages
    pinned_reset     pinned mode: the one hush/reset/retry loop of the member consumer
    pinned_acks      acks count only while the pin is provably ours
    rebalance        incremental rebalance (sync)
    rebalance_pinned incremental rebalance on the shared member consumer (pinned)
    selfcheck        sync mode: self-check and the lease before each handler start
    release          stepping down and giving up consumers or the pin
    listener         Kafka's rebalance listener: partitions assigned, revoked, lost
    dispatch         running handlers: in order per key, concurrent across keys
    keyqueues        which queue a message waits in, by ordering
    settlements      acks the server has not confirmed yet
    calling          calling a handler, sync or async
"""

from cgroupd.core.naming import (
    HOLDER_KEY,
    INSTANCE_KEY,
    MEMBER_KEY,
    RELEASED_KEY,
    RESET_KEY,
    SKIP_KEY,
    TOKEN_KEY,
)
from cgroupd.member.generation import Generation
from cgroupd.member.state import MemberState, StepDown, new_instance_id
from cgroupd.member.supervisor import Member

__all__ = [
    "HOLDER_KEY",
    "INSTANCE_KEY",
    "MEMBER_KEY",
    "RELEASED_KEY",
    "RESET_KEY",
    "SKIP_KEY",
    "TOKEN_KEY",
    "Generation",
    "Member",
    "MemberState",
    "StepDown",
    "new_instance_id",
]
