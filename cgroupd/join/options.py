"""What ``cgroupd join`` is told beyond the member's settings: who this instance is, what it
exposes, and the checks that refuse a combination before anything connects."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cgroupd.core.config import name_problems
from cgroupd.core.errors import ConfigError
from cgroupd.core.settings import MemberSettings
from cgroupd.join.handlers import HandlerOptions
from cgroupd.join.loopmonitor import MAX_LOOP_LAG

#: How often the unowned-partitions gauge is refreshed from the group status.
STATUS_INTERVAL = 10.0
#: Bound on reading the group config for the first time.
START_TIMEOUT = 10.0
#: The HTTP server's defaults (cgroupd.join.probes holds the why; no aiohttp import here).
DEFAULT_METRICS_HOST = "0.0.0.0"
HTTP_READ_TIMEOUT = 5.0
HTTP_MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class JoinOptions:
    """Who this instance is and what it exposes."""

    stream: str
    group: str
    member: str
    #: Require a static group; otherwise the group's kind is read from its record.
    static: bool = False
    #: Instance id (default: random); names the data consumer ``<member>-<id>``.
    instance_id: str | None = None
    #: Port of the /metrics, /healthz, /readyz server; 0 disables it.
    metrics_port: int = 0
    #: Every interface by default: Kubernetes probes and Prometheus reach a pod on its
    #: pod IP, and the port serves no secret and no control (docs/security.md).
    metrics_host: str = DEFAULT_METRICS_HOST
    #: A client must send its request within this (and read the answer within it again).
    http_read_timeout: float = HTTP_READ_TIMEOUT
    #: Connections the HTTP server holds at once (see cgroupd.join.probes).
    http_max_connections: int = HTTP_MAX_CONNECTIONS
    status_interval: float = STATUS_INTERVAL
    start_timeout: float = START_TIMEOUT
    #: /healthz fails after the event loop was blocked this long (see LAG_WINDOW).
    max_loop_lag: float = MAX_LOOP_LAG

    def __post_init__(self) -> None:
        problems = (name_problems("stream", self.stream) + name_problems("group", self.group)
                    + name_problems("member", self.member))
        if self.instance_id is not None:
            problems += name_problems("instance", self.instance_id)
        if not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics port {self.metrics_port} is outside 0..65535")
        if not all(math.isfinite(x) and x > 0
                   for x in (self.status_interval, self.start_timeout)):
            problems.append("status interval and start timeout must be positive")
        if not (math.isfinite(self.http_read_timeout) and 0 < self.http_read_timeout <= 300):
            problems.append(f"HTTP read timeout {self.http_read_timeout:g} is outside "
                            "(0, 300] seconds")
        if not 1 <= self.http_max_connections <= 100_000:
            problems.append(f"HTTP max connections {self.http_max_connections} is outside "
                            "1..100000")
        if problems:
            raise ConfigError(problems)


def drain_problems(settings: MemberSettings, handler: HandlerOptions) -> list[str]:
    """Settings that would let the next owner run a key while this instance's handler may
    still be running it: a webhook cancelled at the drain timeout may go on on the far
    side for up to its own timeout (issue 13 item 7)."""
    hook = handler.webhook
    if hook is not None and settings.drain_timeout < hook.timeout:
        return [f"--drain-timeout ({settings.drain_timeout:g}s) must be at least "
                f"--webhook-timeout ({hook.timeout:g}s): a webhook still running when a "
                "stopping instance gives up waiting may go on at the far side while the "
                "next owner already runs the same key"]
    return []
