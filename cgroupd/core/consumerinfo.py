"""A typed view of a JetStream consumer-info reply.

The server's reply is a JSON object whose parts may be missing (an older server, a
consumer made by another client, the Go reference's consumers without metadata): every
accessor here answers a sane empty value instead of raising.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cgroupd.core.timestamps import rfc3339


@dataclass(frozen=True)
class ConsumerInfo:
    """One consumer's info (``raw`` is the server's reply; empty when it does not exist)."""

    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, info: Mapping[str, Any] | None) -> ConsumerInfo:
        return cls(info or {})

    @property
    def exists(self) -> bool:
        return bool(self.raw)

    @property
    def name(self) -> str:
        return str(self.raw.get("name", ""))

    @property
    def config(self) -> dict[str, Any]:
        config = self.raw.get("config") or {}
        return config if isinstance(config, dict) else {}

    @property
    def metadata(self) -> dict[str, Any]:
        meta = self.config.get("metadata") or {}
        return meta if isinstance(meta, dict) else {}

    def meta(self, key: str) -> Any:
        """One metadata entry (None if absent)."""
        return self.metadata.get(key)

    def json_map(self, key: str) -> dict[str, Any]:
        """A JSON object kept in the metadata (empty if absent or unreadable)."""
        text = self.metadata.get(key)
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @property
    def filters(self) -> list[str]:
        """The filter subjects (one ``filter_subject`` counts as a list of one)."""
        config = self.config
        return list(config.get("filter_subjects") or [config.get("filter_subject") or ""])

    @property
    def priority_groups(self) -> list[str]:
        return list(self.config.get("priority_groups") or [])

    def pinned_client(self, group: str) -> str | None:
        """The pin id the server gave priority group ``group`` (None: nobody pinned)."""
        return next((g.get("pinned_client_id") for g in self.raw.get("priority_groups") or []
                     if g.get("group") == group), None)

    @property
    def anyone_pinned(self) -> bool:
        return any(g.get("pinned_client_id") for g in self.raw.get("priority_groups") or [])

    def _count(self, key: str) -> int:
        return int(self.raw.get(key, 0))

    @property
    def num_pending(self) -> int:
        return self._count("num_pending")

    @property
    def num_ack_pending(self) -> int:
        return self._count("num_ack_pending")

    @property
    def num_waiting(self) -> int:
        return self._count("num_waiting")

    @property
    def delivered_consumer_seq(self) -> int:
        return int((self.raw.get("delivered") or {}).get("consumer_seq", 0))

    @property
    def delivered_stream_seq(self) -> int:
        return int((self.raw.get("delivered") or {}).get("stream_seq", 0))

    @property
    def ack_floor_stream_seq(self) -> int:
        return int((self.raw.get("ack_floor") or {}).get("stream_seq", 0))

    @property
    def age(self) -> float | None:
        """Seconds since the consumer was created, by the server's clock (its ``created``
        and the reply's ``ts``); None when either is missing."""
        created = rfc3339(str(self.raw.get("created") or ""))
        now = rfc3339(str(self.raw.get("ts") or ""))
        return None if created is None or now is None else max(0.0, now - created)

    @property
    def leader(self) -> str:
        """The server that leads the consumer (answered this), "" when not clustered."""
        cluster = self.raw.get("cluster")
        return str(cluster.get("leader") or "") if isinstance(cluster, dict) else ""

    @property
    def quorum_age(self) -> float:
        """Seconds since the server that answered last heard from a quorum of the
        consumer's replicas, as that server saw it when it answered: 0 for an unreplicated
        consumer, infinite when too few replicas are known or online.

        Why: in a cluster, only the consumer's leader answers consumer info, and a leader
        cut off from the rest keeps answering from its old state while the majority elects
        another (nats-server 2.15.1, measured: an isolated leader still named itself leader
        15 s into a cut, its replicas ``current`` for 10 s; only ``active``, the time since
        it last heard each one, told the truth). An answer proves the state it shows only
        as of that long ago.
        """
        cluster = self.raw.get("cluster")
        if not isinstance(cluster, dict) or "replicas" not in cluster:
            return 0.0
        replicas = [r for r in cluster.get("replicas") or [] if isinstance(r, dict)]
        needed = (len(replicas) + 1) // 2  # followers that, with the leader, are a quorum
        if needed == 0:
            return 0.0
        ages = sorted(int(r.get("active") or 0) / 1e9 for r in replicas
                      if not r.get("offline"))
        return ages[needed - 1] if len(ages) >= needed else float("inf")
