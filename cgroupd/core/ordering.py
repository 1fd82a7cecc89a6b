"""The order messages are processed in within one member (``MemberSettings.ordering``).

Pure core: settings name it without loading the dispatcher (and nats-py with it).
"""

from __future__ import annotations

from enum import Enum


class Ordering(Enum):
    """What order messages are processed in within one member."""

    #: Per partition: a partition's messages start one at a time, in stream order (each
    #: after the previous one settled); different partitions run at once.
    PARTITION = "partition"
    #: Per key: same key in stream order, different keys concurrently.
    KEY = "key"
    #: The whole member in stream order: one handler at a time, the server sending ahead
    #: (held messages start strictly in stream order).
    STREAM = "stream"
    #: No order: maximum concurrency.
    NONE = "none"
