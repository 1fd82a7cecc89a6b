"""``cgroupd console`` and ``cgroupd demo --console`` as commands: bad arguments, an
address in use, the demo's group served while the demo runs."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support.cli import (
    ROOT,
    assert_one_line_error,
    child_env,
    cli,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.natsserver import NatsServer, find_free_port
from tests.support.polling import eventually


@pytest.mark.parametrize(("listen", "fragment"), [
    ("8480", "give HOST:PORT"),
    ("127.0.0.1:http", "give HOST:PORT"),
    ("127.0.0.1:70000", "give HOST:PORT"),
    ("::1:8480", "write an IPv6 address in brackets"),
    ("[nope]:8480", "is not an IPv6 address"),
])
def test_a_bad_listen_address_is_a_usage_error(listen: str, fragment: str) -> None:
    """Checked before connecting: exit 2, one line saying what is wrong."""
    result = cli("nats://127.0.0.1:1", "console", "--listen", listen)
    assert_one_line_error(result, 2, fragment)


def test_a_bad_stream_name_is_a_usage_error() -> None:
    result = cli("nats://127.0.0.1:1", "console", "--stream", "A.B")
    assert_one_line_error(result, 2, "stream")


def test_an_address_in_use_is_a_failure(nats_server: NatsServer) -> None:
    """Another process holds the port: exit 1, saying which address."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli(nats_server.url, "console", "--listen", f"127.0.0.1:{port}")
    assert_one_line_error(result, 1, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.slow
async def test_the_demo_serves_its_group_in_the_console(tmp_path: Path) -> None:
    """``cgroupd demo --console``: while the demo runs, its console lists the demo's
    group and serves its partitions; the demo still ends with exit 0."""
    port = find_free_port()
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cgroupd", "demo", "--duration", "3", "--members", "1",
             "--partitions", "2", "--console",
             "--console-listen", f"127.0.0.1:{port}"],
            cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession() as http:
                async def listed() -> list[dict[str, str]] | None:
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/api/groups") as r:
                            groups = (await r.json())["groups"]
                            return groups or None
                    except aiohttp.ClientError:
                        return None

                groups = await eventually(listed, 40, what="the demo's console")
                assert [g["group"] for g in groups] == ["demo"]
                stream = groups[0]["stream"]
                assert stream.startswith("DEMO_")

                async def partitions() -> int:
                    async with http.get(f"http://127.0.0.1:{port}/api/groups/{stream}/demo"
                                        ) as r:
                        return len((await r.json())["status"]["partitions"])

                assert await partitions() == 2
            code = await asyncio.to_thread(proc.wait, 90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    assert code == 0, text
    assert f"console on http://127.0.0.1:{port}/ (actions enabled)" in text
