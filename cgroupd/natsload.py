"""Loading nats-py lean: without aiohttp unless a websocket server is used.

nats-py imports aiohttp at import time whenever it is installed, only for ``ws://`` and
``wss://`` servers: ~10 MB resident, a fifth of an idle member instance (bench.scale).
:mod:`cgroupd` imports this module before anything else, so nats-py's transport module
finds no aiohttp; :func:`enable_websockets` hands it aiohttp when a websocket server is
named (:func:`cgroupd.connect.connect` does). A process that imported nats-py or aiohttp
before cgroupd keeps what it loaded. It also makes nats-py's flow control answering
sleep while no request is pending (see :func:`_flow_control_on_demand`).
"""

from __future__ import annotations

import importlib
from typing import Any

from cgroupd.lazyimport import import_without


def enable_websockets() -> None:
    """Let nats-py connect to ``ws://``/``wss://`` servers (imports aiohttp)."""
    import nats.aio.transport

    if getattr(nats.aio.transport, "aiohttp", None) is None:
        nats.aio.transport.aiohttp = importlib.import_module("aiohttp")  # type: ignore[attr-defined]


def _flow_control_on_demand() -> None:
    """nats-py answers an ordered push consumer's flow control from a task that polls
    every 0.25 s for the whole life of the subscription: four wakeups a second in every
    idle member, for its group config watch, where a flow control request comes once in a
    long while (bench.footprint: as many as all presence probes). Same answers, but the
    task sleeps until a request is pending; only then does it poll, until it answered."""
    import asyncio
    import contextlib

    from nats.js.client import JetStreamContext

    jsi: Any = getattr(JetStreamContext, "_JSI", None)
    needed = ("schedule_flow_control_response", "check_flow_control_response")
    if jsi is None or not all(hasattr(jsi, name) for name in needed) \
            or getattr(jsi, "_cgroupd_on_demand", False):
        return  # another nats-py than the one this was written for: leave it alone
    schedule = jsi.schedule_flow_control_response

    def schedule_and_wake(self: Any, reply: str) -> None:
        schedule(self, reply)
        pending = getattr(self, "_cgroupd_fc_pending", None)
        if pending is not None:
            pending.set()

    async def answer_when_due(self: Any) -> None:
        pending = self._cgroupd_fc_pending = asyncio.Event()
        try:
            while not self._conn.is_closed:
                if self._fcr is None:
                    pending.clear()
                    await pending.wait()
                    continue
                # As nats-py: answer once what preceded the request was handed over.
                if self._fciseq - self._psub._pending_queue.qsize() >= self._fcd:
                    with contextlib.suppress(Exception):
                        await self._conn.publish(self._fcr)
                    self._fcr = None
                    self._fcd = 0
                else:
                    await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            return

    jsi.schedule_flow_control_response = schedule_and_wake
    jsi.check_flow_control_response = answer_when_due
    jsi._cgroupd_on_demand = True


import_without("nats.aio.transport", "aiohttp")
_flow_control_on_demand()
