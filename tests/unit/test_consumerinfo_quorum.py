"""ConsumerInfo.quorum_age: how old a clustered consumer-info answer's proof is (no server).

The replies below have the shape nats-server 2.15.1 sent from a consumer leader cut off
from its two replicas (tests/faults/test_cluster_node_cut.py measures it): it still names
itself leader and calls its replicas ``current`` for ~10 s; ``active`` (nanoseconds since
it last heard each replica) is what grows.
"""

from __future__ import annotations

import math

from cgroupd.core.consumerinfo import ConsumerInfo


def _info(*replicas: dict[str, object]) -> ConsumerInfo:
    return ConsumerInfo.of({"name": "m1", "cluster": {
        "name": "c", "leader": "n2", "replicas": list(replicas)}})


def test_an_unreplicated_or_unclustered_answer_is_fresh() -> None:
    assert ConsumerInfo.of({"name": "m1"}).quorum_age == 0.0
    assert ConsumerInfo.of({"name": "m1", "cluster": {"leader": "n0"}}).quorum_age == 0.0
    assert _info().quorum_age == 0.0


def test_r3_is_as_fresh_as_the_freshest_follower() -> None:
    """Leader plus one follower is a quorum of three."""
    info = _info({"name": "n0", "current": True, "active": 680_000_000},
                 {"name": "n1", "current": True, "active": 7_200_000_000})
    assert math.isclose(info.quorum_age, 0.68)


def test_an_isolated_leader_whose_replicas_still_look_current_is_stale() -> None:
    info = _info({"name": "n0", "current": True, "active": 9_480_000_000},
                 {"name": "n1", "current": True, "active": 9_480_500_000})
    assert info.quorum_age > 9.4


def test_r5_needs_two_followers_and_offline_ones_do_not_count() -> None:
    info = _info({"name": "a", "active": 100_000_000},
                 {"name": "b", "active": 5_000_000_000},
                 {"name": "c", "active": 200_000_000, "offline": True},
                 {"name": "d", "active": 6_000_000_000})
    assert math.isclose(info.quorum_age, 5.0)
    lonely = _info({"name": "a", "active": 1, "offline": True},
                   {"name": "b", "active": 1, "offline": True})
    assert lonely.quorum_age == math.inf
