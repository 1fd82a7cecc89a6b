"""Keys and in-flight defaults of the ordering modes, without a server (the modes
themselves, on a real nats-server: tests/integration/test_dispatch.py)."""

from __future__ import annotations

import pytest

from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.partitions import key_function
from cgroupd.core.settings import MemberSettings
from cgroupd.member.dispatch import Ordering

CONFIG = ElasticGroupConfig(
    max_members=4,
    partitioning_filters=(PartitioningFilter("orders.*.*", (2,)), PartitioningFilter("x.>")))


@pytest.mark.parametrize(("spec", "subject", "headers", "key"), [
    ("auto", "orders.eu.17", {}, "17"),
    ("auto", "x.a.b", {}, "x.a.b"),
    ("auto", "unmatched", {}, "unmatched"),
    ("subject", "orders.eu.17", {}, "orders.eu.17"),
    ("partition", "orders.eu.17", {}, "3"),
    ("tokens:1,3", "orders.eu.17", {}, "orders.17"),
    ("header:Order-Id", "orders.eu.17", {"Order-Id": "A1"}, "A1"),
    ("header:Order-Id", "orders.eu.17", {}, "orders.eu.17"),
])
def test_key_functions(spec: str, subject: str, headers: dict[str, str], key: str) -> None:
    """Each key spec groups messages as documented (partition number here is 3)."""
    assert key_function(spec, CONFIG)(subject, headers, 3) == key


@pytest.mark.parametrize("spec", ["tokens:", "tokens:0", "tokens:a", "header:", "bogus"])
def test_bad_key_specs_are_refused_with_a_message(spec: str) -> None:
    """A key spec that cannot work is a clear ValueError, before any message flows."""
    with pytest.raises(ValueError, match="key"):
        key_function(spec, CONFIG)


def test_max_in_flight_defaults_follow_the_ordering() -> None:
    """Every ordering defaults to 256 in flight (the server sends ahead; the dispatcher
    keeps the order)."""
    assert MemberSettings().max_in_flight == 256
    assert MemberSettings(ordering=Ordering.KEY).max_in_flight == 256
    assert MemberSettings(ordering=Ordering.KEY, max_in_flight=8).max_in_flight == 8
