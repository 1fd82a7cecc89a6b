"""A group record written right after its bucket was made on a cluster: the bucket's
stream has no leader for a moment and the write gets "no responders" (CI on 8b9f385,
test_admin.py::test_r3_group_on_cluster). The write is tried again while it fails in
passing; a conflict or a refusal is not retried."""

from __future__ import annotations

import pytest

from cgroupd.admin import _groups
from cgroupd.core.errors import ApiError, ConflictError

pytestmark = pytest.mark.virtual_clock


class Writes:
    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return 7


async def test_a_write_without_responders_is_tried_again() -> None:
    no_leader = ApiError(503, 0, "no stream stored it")
    write = Writes(no_leader, no_leader, no_leader)
    assert await _groups._stored_once_available(write) == 7
    assert write.calls == 4


@pytest.mark.parametrize("failure", [ConflictError("changed"), ApiError(400, 10052, "bad")])
async def test_a_conflict_or_a_refusal_is_not_retried(failure: Exception) -> None:
    write = Writes(failure)
    with pytest.raises(type(failure)):
        await _groups._stored_once_available(write)
    assert write.calls == 1


async def test_a_stream_that_never_answers_fails_after_the_wait() -> None:
    write = Writes(*[ApiError(503, 0, "no stream stored it")] * 1000)
    with pytest.raises(ApiError):
        await _groups._stored_once_available(write)
    assert 5 < write.calls < 200
