"""Loading nats-py lean: without aiohttp unless a websocket server is used.

nats-py imports aiohttp at import time whenever it is installed, only for ``ws://`` and
``wss://`` servers: ~10 MB resident, a fifth of an idle member instance (bench.scale).
:mod:`cgroupd` imports this module before anything else, so nats-py's transport module
finds no aiohttp; :func:`enable_websockets` hands it aiohttp when a websocket server is
named (:func:`cgroupd.nats.connect.connect` does). A process that imported nats-py or aiohttp
before cgroupd keeps what it loaded. It also makes nats-py's flow control answering
sleep while no request is pending (see :func:`_flow_control_on_demand`).
"""

from __future__ import annotations

import importlib

from cgroupd.core.lazyimport import import_without


def enable_websockets() -> None:
    """Let nats-py connect to ``ws://``/``wss://`` servers (imports aiohttp)."""
    import nats.aio.transport

    if getattr(nats.aio.transport, "aiohttp", None) is None:
        nats.aio.transport.aiohttp = importlib.import_module("aiohttp")  # type: ignore[attr-defined]


import_without("nats.aio.transport", "aiohttp")
