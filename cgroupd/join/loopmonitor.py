"""How late the event loop runs a timer: the daemon's /healthz reports a handler that
blocks the loop, or a process starved of CPU, through it."""

from __future__ import annotations

import asyncio
import time
from collections import deque

#: /healthz fails when the event loop ran a timer this late (seconds) ...
MAX_LOOP_LAG = 1.0
#: ... within this many seconds.
LAG_WINDOW = 30.0


class LoopMonitor:
    """How late the event loop runs a timer: a handler blocking the loop, or a process
    starved of CPU, shows here (and in /healthz) before anywhere else."""

    def __init__(self, interval: float = 0.25, window: float = LAG_WINDOW) -> None:
        self.interval = interval
        self.window = window
        self._lags: deque[tuple[float, float]] = deque()
        self._last = time.monotonic()

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.interval)
            self._last = now = time.monotonic()
            lag = now - before - self.interval
            if lag > self.interval:
                self._lags.append((now, lag))
            while self._lags and self._lags[0][0] < now - self.window:
                self._lags.popleft()

    def worst(self) -> float:
        """The longest stall seen within the window, including one still going on."""
        now = time.monotonic()
        ongoing = now - self._last - self.interval
        recent = max((lag for at, lag in self._lags if at >= now - self.window), default=0.0)
        return max(ongoing, recent, 0.0)
