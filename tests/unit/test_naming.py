"""Consumer names, the consumer-config builder, the typed consumer info and the typed API
errors (no server)."""

from __future__ import annotations

import pytest

from cgroupd.core.config import name_problems
from cgroupd.core.consumerinfo import ConsumerInfo
from cgroupd.core.errors import (
    ApiError,
    ConsumerExists,
    ConsumerNotFound,
    PermissionDenied,
    StreamNotFound,
    WorkQueueOverlap,
)
from cgroupd.core.naming import (
    DATA_SLOTS,
    MEMBER_KEY,
    consumer_config,
    data_consumer,
    data_consumers,
    sync_consumer,
)
from cgroupd.nats import jsapi


def test_consumer_names() -> None:
    """Static groups share their stream: the group is part of the election consumer."""
    assert sync_consumer("g", "m1", static=False) == "m1"
    assert sync_consumer("g", "m1", static=True) == "g-m1"
    assert data_consumer("m1", 0) == "m1~0"
    assert data_consumers("m1") == [f"m1~{slot}" for slot in range(DATA_SLOTS)]
    with pytest.raises(ValueError, match="out of range"):
        data_consumer("m1", DATA_SLOTS)


def test_data_consumer_names_never_collide_with_a_member_name() -> None:
    """A member's data consumers are named from a fixed set (so a NATS permission can
    list them), with a separator no cgroupd member name contains: member ``m1-0``'s
    consumer is not member ``m1``'s first data consumer."""
    assert name_problems("member", data_consumer("m1", 0))
    assert sync_consumer("g", "m1-0", static=False) not in data_consumers("m1")


def test_consumer_config_extra_overrides() -> None:
    """The one builder: durations in nanoseconds; extra fields override the defaults."""
    cfg = consumer_config(["a.>"], ack_wait=1.5, max_ack_pending=7,
                          metadata={MEMBER_KEY: "m"},
                          inactive_threshold=5)
    assert cfg["ack_wait"] == 1_500_000_000
    assert cfg["max_ack_pending"] == 7 and cfg["inactive_threshold"] == 5
    assert consumer_config([], ack_wait=1, max_ack_pending=7, metadata={},
                           max_waiting=3)["max_waiting"] == 3


def test_consumer_info_of_nothing() -> None:
    """A missing consumer (None) or one with no config reads as empty, never raises."""
    for raw in (None, {}, {"config": None}, {"config": {"metadata": None}}):
        info = ConsumerInfo.of(raw)
        assert info.metadata == {} and info.meta(MEMBER_KEY) is None
        assert info.filters == [""] and info.num_pending == 0
        assert info.pinned_client("PCG") is None and not info.anyone_pinned


def test_consumer_info_reads_fields() -> None:
    info = ConsumerInfo({
        "name": "c", "num_waiting": 2, "num_ack_pending": 3,
        "delivered": {"consumer_seq": 5, "stream_seq": 9}, "ack_floor": {"stream_seq": 4},
        "priority_groups": [{"group": "PCG", "pinned_client_id": "pin"}],
        "config": {"filter_subject": "x.>", "priority_groups": ["PCG"],
                   "metadata": {"k": '{"1": 3}', "bad": "{", "list": "[1]"}}})
    assert (info.name, info.num_waiting, info.num_ack_pending) == ("c", 2, 3)
    assert (info.delivered_consumer_seq, info.delivered_stream_seq) == (5, 9)
    assert info.ack_floor_stream_seq == 4 and info.filters == ["x.>"]
    assert info.pinned_client("PCG") == "pin" and info.pinned_client("other") is None
    assert info.priority_groups == ["PCG"]
    assert info.json_map("k") == {"1": 3}
    assert info.json_map("bad") == {} and info.json_map("list") == {}


@pytest.mark.parametrize(("err_code", "kind"), [
    (jsapi.ERR_CONSUMER_EXISTS, ConsumerExists),
    (jsapi.ERR_WQ_NOT_UNIQUE, WorkQueueOverlap),
    (jsapi.ERR_CONSUMER_NOT_FOUND, ConsumerNotFound),
    (jsapi.ERR_STREAM_NOT_FOUND, StreamNotFound),
    (12345, ApiError),
])
def test_api_errors_are_typed(err_code: int, kind: type[Exception]) -> None:
    """The adapter raises the runtime's error types, keeping code and err_code."""
    exc = jsapi.api_error({"code": 400, "err_code": err_code, "description": "x"})
    assert type(exc) is kind or (kind is StreamNotFound and isinstance(exc, kind))
    assert isinstance(exc, ApiError) and exc.err_code == err_code


def test_permission_wins_over_type() -> None:
    exc = jsapi.api_error({"code": 403, "err_code": jsapi.ERR_CONSUMER_EXISTS,
                           "description": "no"})
    assert isinstance(exc, PermissionDenied)
