"""``cgroupd join`` outlives a server too busy to let it in (issue 27: a mass start of
250 processes on 2 cores ended 38 of them). The way to the server is a proxy that, for its
first seconds, accepts connections and says nothing (the handshake times out, as with an
overloaded server), then forwards to the real server: the instance retries with a
jittered, growing pause, counts the retries, and joins. A refused connection (nothing
listens there) still ends it at once: tests/integration/test_daemon.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest_asyncio

from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

HANDLER = "tests.support.handlers.record_handler:handle"
SILENT_FOR = 8.0


class SilentThenForwarding:
    """A TCP proxy to ``target`` that holds every connection silent until ``opens_at``."""

    def __init__(self, target_host: str, target_port: int, silent_for: float) -> None:
        self.target = (target_host, target_port)
        self.opens_at = time.monotonic() + silent_for
        self.held = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.opens_at:
            self.held += 1
            await reader.read()  # until the client gives up on its handshake
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for task in (asyncio.create_task(pipe(reader, up_writer)),
                     asyncio.create_task(pipe(up_reader, writer))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest_asyncio.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[SilentThenForwarding]:
    p = SilentThenForwarding(nats_server.host, nats_server.port, SILENT_FOR)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


async def test_a_join_whose_first_connect_times_out_retries_and_joins(
        nats_server: NatsServer, jetstream: JetStream, proxy: SilentThenForwarding,
        tmp_path: Path) -> None:
    """Connects time out for 8 s (connect timeout 2 s): the process does not exit, logs
    each retry, and becomes the active instance once the proxy forwards."""
    await make_group(jetstream, partitions=2, members=("m1",))
    proc = JoinProcess(proxy.url, tmp_path, "j", "--stream", "ORDERS", "--group", "g",
                       "--member", "m1", "--handler", HANDLER)
    try:
        async with aiohttp.ClientSession() as session:
            async def active() -> bool:
                assert proc.proc.poll() is None, proc.log_tail()
                status, body = await proc.get(session, "/readyz")
                return status == 200 and '"active"' in body

            async def says_why() -> bool:
                status, body = await proc.get(session, "/readyz")
                return status == 503 and "connect: cannot connect" in body

            # While the connects time out, the probes already answer and say why.
            await eventually(says_why, SILENT_FOR, what="/readyz naming the retried connect")
            await eventually(active, SILENT_FOR + 30, what="the instance to join")
            retries = [e for e in proc.events() if e.get("event") == "transient failure; "
                       "retrying" and e.get("step") == "connect"]
            assert retries, proc.log_tail()
            assert proxy.held >= 1
            assert await proc.metric(session, "cgroupd_startup_retries_total",
                                     step="connect") == len(retries)
    finally:
        proc.terminate()
        await proc.wait_exit()
        proc.close()
