"""Which queue a message waits in (its key, by ordering) and where in it: a key's messages
start one at a time in stream order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from cgroupd.core.ordering import Ordering
from cgroupd.nats.message import Message

KeyOf = Callable[[str, Mapping[str, str], int | None], str]


def by_partition(subject: str, headers: Mapping[str, str], partition: int | None) -> str:
    """``partition`` ordering: a partition's messages one at a time, partitions at once."""
    return str(partition)


def whole_member(subject: str, headers: Mapping[str, str], partition: int | None) -> str:
    """``stream`` ordering: one queue, so one handler at a time, in stream order."""
    return ""


def queue_key(ordering: Ordering, key_of: KeyOf) -> KeyOf:
    """The key function of ``ordering`` (``key``: the member's ``--key`` function)."""
    return {Ordering.PARTITION: by_partition, Ordering.STREAM: whole_member}.get(
        ordering, key_of)


def insert_in_order(queue: deque[Message], message: Message,
                    running: Mapping[int, Message]) -> None:
    """Queue ``message`` behind its key's messages of lower stream sequence (a message
    handed back by a previous holder can arrive after later ones); never ahead of one
    whose handler already runs."""
    seq = message.stream_sequence
    if not queue or queue[-1].stream_sequence < seq:
        queue.append(message)
        return
    floor = 1 if queue[0].stream_sequence in running else 0
    at = len(queue)
    while at > floor and queue[at - 1].stream_sequence > seq:
        at -= 1
    queue.insert(at, message)
