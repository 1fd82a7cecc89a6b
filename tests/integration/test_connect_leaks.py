"""A connect that times out leaves no socket behind: a process that retries a server that
accepts and never answers (overloaded, or not a NATS server) must not run out of file
descriptors. The suite ignores unclosed-socket warnings from garbage collection (see
pyproject.toml: a test's leak surfaced in whichever later test the collector ran in), so
this test looks for them itself."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from cgroupd.core.errors import CgroupdError
from cgroupd.nats.connect import ConnectionOptions, connect


async def test_a_connect_that_times_out_leaves_no_socket_open() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # never sends INFO

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for attempt in range(20):
            # Timeouts around the moment the TCP connection is made, then while waiting
            # for INFO: the cancellation lands at different points of nats-py's connect.
            timeout = 0.002 * (attempt % 10 + 1)
            with pytest.raises(CgroupdError):
                await connect(ConnectionOptions(servers=(f"nats://127.0.0.1:{port}",),
                                                connect_timeout=timeout))
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()
    assert accepted, "the silent server was reached"
    assert not leaks, leaks
