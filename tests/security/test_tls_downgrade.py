"""TLS intended means TLS or no connection (issue 25 row 2).

A fake server on loopback answers INFO without ``tls_required`` (what a server without
TLS, or a man in the middle, says) and records every byte the client sends. With a
``tls://`` URL, a CA, or a client certificate, nats-py 2.16 would go on in clear and send
``CONNECT {"user":…,"pass":…}``; cgroupd must send no CONNECT at all and exit non-zero
with a message that says why. The same client without TLS options does send CONNECT to
the fake server (the fake is good enough to be believed)."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cgroupd.nats.connect import ConnectionOptions, connect
from tests.support.authsetup import make_pki, tls_config
from tests.support.cli import restore_logging  # noqa: F401 - autouse fixture
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually
from tests.support.secure import run_cli

PASSWORD = "pw-downgrade-7Qx"
TOKEN = "tok-downgrade-3Kf"


class FakeServer:
    """Sends a plain INFO (no TLS) to each client and records what it sends back."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", port)
        return int(self._server.sockets[0].getsockname()[1])

    async def _client(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        info = {"server_id": "FAKE", "version": "2.15.1", "proto": 1, "host": "127.0.0.1",
                "port": 4222, "headers": True, "max_payload": 1048576, "auth_required": True,
                "tls_required": False, "tls_available": False}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        await writer.drain()
        try:
            while data := await reader.read(65536):
                self.received += data
                if b"PING" in data:
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # A connection accepted just before the close has its handler task created but
        # not yet run: let those run up to their first await, so that their writers are
        # listed and closed here (CI on b6fc8d9: one left unclosed was collected, and
        # warned, during the next test).
        for _ in range(3):
            await asyncio.sleep(0)
        for writer in self._writers:  # handlers the test's end would leave unfinished
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeServer, int]]:
    server = FakeServer()
    port = await server.start()
    yield server, port
    await server.stop()
    gc.collect()  # a transport left open warns in this test, not in a later one


@pytest.mark.parametrize("how", ["tls-url", "ca-only", "client-cert"])
@pytest.mark.parametrize("cred", ["password", "token", "url-userinfo"])
async def test_no_credential_in_clear_when_tls_was_asked(
        fake: tuple[FakeServer, int], tmp_path: Path, how: str, cred: str) -> None:
    """No CONNECT (so no password or token) reaches a server that offers no TLS when TLS
    was asked for; the command fails with a message naming the reason."""
    server, port = fake
    pki = make_pki(tmp_path) if how != "tls-url" else None
    scheme = "tls" if how == "tls-url" else "nats"
    userinfo = f"member:{PASSWORD}@" if cred == "url-userinfo" else ""
    args = ["--server", f"{scheme}://{userinfo}127.0.0.1:{port}", "--connect-timeout", "1"]
    if cred == "password":
        args += ["--user", "member", "--password", PASSWORD]
    elif cred == "token":
        args += ["--token", TOKEN]
    if pki is not None:
        args += ["--tls-ca", str(pki.ca)]
    if how == "client-cert" and pki is not None:
        args += ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    result = await asyncio.to_thread(run_cli, *args, "group", "ls", "ORDERS")
    assert server.connections >= 1, "the client never reached the fake server"
    assert b"CONNECT" not in server.received, bytes(server.received)
    assert PASSWORD.encode() not in server.received and TOKEN.encode() not in server.received
    assert result.exit_code != 0
    assert "did not offer TLS" in result.stderr, result.stderr
    assert PASSWORD not in result.output and TOKEN not in result.output


async def test_the_fake_server_gets_credentials_without_tls(
        fake: tuple[FakeServer, int]) -> None:
    """Control: with no TLS asked for, the same client does send CONNECT with the
    password to this fake server (so the test above could fail)."""
    server, port = fake
    await asyncio.to_thread(run_cli, "--server", f"nats://127.0.0.1:{port}",
                            "--connect-timeout", "1", "--user", "member", "--password",
                            PASSWORD, "group", "ls", "ORDERS")
    assert b"CONNECT" in server.received and PASSWORD.encode() in server.received


# The client's refused reconnect attempts can leave their socket to the garbage collector
# (nats-py), as can a connection the fake accepted as it stopped: collected below, in this
# test, and not counted against it (CI on 28bcb9c: one was collected in a later test).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_reconnect_to_a_server_without_tls_sends_nothing(tmp_path: Path) -> None:
    """A client connected over TLS to a real server (user and password) loses it; what
    answers on that address next offers no TLS: the client keeps trying and never sends
    CONNECT to it."""
    pki = make_pki(tmp_path)
    with NatsServer(workdir=tmp_path / "nats", extra_config=(
            tls_config(pki, verify=False)
            + f'authorization {{ user: member, password: "{PASSWORD}" }}')) as server:
        port = server.port
        nc = await connect(ConnectionOptions(servers=(f"tls://127.0.0.1:{port}",),
                                             tls_ca=pki.ca, user="member", password=PASSWORD,
                                             reconnect_wait=0.1))
        fake = FakeServer()
        try:
            assert nc.is_connected
            server.stop()
            await eventually(lambda: _listen(fake, port), 10, what="the fake on the port")
            await eventually(lambda: fake.connections >= 3 or b"CONNECT" in fake.received,
                             20, what="the client to try the fake server again and again")
            assert b"CONNECT" not in fake.received, bytes(fake.received)
            assert PASSWORD.encode() not in fake.received
            assert not nc.is_connected
        finally:
            await nc.close()
            await fake.stop()
        nc = fake = None  # type: ignore[assignment]  # what they held is collected here
        gc.collect()


async def _listen(fake: FakeServer, port: int) -> bool:
    try:
        await fake.start(port)
    except OSError:
        return False
    return True
