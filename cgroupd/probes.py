"""The daemon's HTTP probes (``/metrics``, ``/healthz``, ``/readyz``): what Kubernetes and
Prometheus ask a running instance. Imported only when the daemon serves HTTP (aiohttp
costs ~10 MB resident; see :mod:`cgroupd.natsload`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from cgroupd.errors import StartupError
from cgroupd.metrics import Metrics


class ProbeServer:
    """Serves ``/metrics`` (Prometheus text), ``/healthz`` (200 while ``problems()`` is
    empty, else 503 listing them) and ``/readyz`` (200 while ``ready()``), each with the
    instance's ``state()`` as JSON."""

    def __init__(self, metrics: Metrics, *, problems: Callable[[], list[str]],
                 ready: Callable[[], bool], state: Callable[[], dict[str, Any]]) -> None:
        self._metrics = metrics
        self._problems = problems
        self._ready = ready
        self._state = state
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; StartupError when that is not possible."""
        app = web.Application()
        app.router.add_get("/metrics", self._http_metrics)
        app.router.add_get("/healthz", self._http_health)
        app.router.add_get("/readyz", self._http_ready)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise StartupError(f"cannot listen on {host}:{port}: "
                               f"{exc.strerror or exc}") from exc
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _http_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(),
                            headers={"Content-Type": self._metrics.content_type})

    async def _http_health(self, request: web.Request) -> web.Response:
        problems = self._problems()
        return _json_response({**self._state(), "problems": problems},
                              503 if problems else 200)

    async def _http_ready(self, request: web.Request) -> web.Response:
        return _json_response(self._state(), 200 if self._ready() else 503)


def _json_response(body: dict[str, Any], status: int) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")
