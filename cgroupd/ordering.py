"""The order messages are processed in within one member (``MemberSettings.ordering``).

Pure core: settings name it without loading the dispatcher (and nats-py with it).
"""

from __future__ import annotations

from enum import Enum


class Ordering(Enum):
    """What order messages are processed in within one member."""

    PARTITION = "partition"  # per partition (max in flight 1: the whole member in order)
    KEY = "key"  # per key: same key in stream order, different keys concurrently
    NONE = "none"  # no order: maximum concurrency
