"""Tests of the real-server harness itself (tests/support/natsserver.py and the fixtures).

If these fail, every integration test's failure is suspect, so they check the
things other tests lean on: JetStream answers, state survives kill+restart,
pause really stalls the server, cluster failover works, nothing is leaked.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from tests.support import natsserver
from tests.support.natsserver import (
    DockerNatsServer,
    NatsCluster,
    NatsServer,
    NatsServerError,
    client_options,
    running_cluster,
    running_server,
)
from tests.support.polling import eventually

#: What a request or publish raises while the server is paused, down or electing: not yet.
NOT_YET = (nats.errors.Error, TimeoutError, OSError)


def assert_reaped(pid: int | None) -> None:
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def assert_alive(pid: int | None) -> None:
    assert pid is not None
    os.kill(pid, 0)


def test_binary_is_found() -> None:
    assert os.access(natsserver.find_nats_server_binary(), os.X_OK)


def test_find_free_port_never_repeats() -> None:
    ports = {natsserver.find_free_port() for _ in range(20)}
    assert len(ports) == 20


async def test_single_node_jetstream_roundtrip(
    nats_server: NatsServer | DockerNatsServer, nc: Client, js: JetStreamContext
) -> None:
    assert nats_server.is_running()
    assert nats_server.url == f"nats://{nats_server.host}:{nats_server.port}"
    await js.add_stream(name="ROUND", subjects=["round.>"])
    for i in range(3):
        ack = await js.publish(f"round.{i}", f"m{i}".encode())
        assert ack.seq == i + 1
    assert (await js.stream_info("ROUND")).state.messages == 3
    msg = await js.get_msg("ROUND", seq=2)
    assert (msg.subject, msg.data) == ("round.1", b"m1")
    health = nats_server.monitor("/healthz?js-enabled-only=true")
    assert health["status"] == "ok"


async def test_kill_and_restart_keep_stream_and_client_reconnects(
    nats_server: NatsServer | DockerNatsServer, nc: Client, js: JetStreamContext
) -> None:
    await js.add_stream(name="KEEP", subjects=["keep"])
    for i in range(5):
        await js.publish("keep", str(i).encode())
    port, old_pid = nats_server.port, nats_server.pid

    nats_server.kill()
    assert not nats_server.is_running()
    if isinstance(nats_server, NatsServer):
        assert_reaped(old_pid)
    # kill() blocks the loop; let the client see the EOF before the server returns,
    # or a request sent in between is silently lost and only times out.
    await eventually(lambda: not nc.is_connected, timeout=5, what="client notices the crash")

    nats_server.restart()
    assert nats_server.is_running()
    assert nats_server.port == port
    assert nats_server.pid != old_pid
    # The fixture's client reconnects on its own (same URL) and sees the old data.
    await eventually(lambda: nc.is_connected, timeout=10, what="client reconnects")
    info = await js.stream_info("KEEP")
    assert info.state.messages == 5
    assert (await js.get_msg("KEEP", seq=5)).data == b"4"
    assert (await js.publish("keep", b"5")).seq == 6


async def test_pause_stalls_requests_until_resume(
    nats_server: NatsServer | DockerNatsServer, nc: Client
) -> None:
    await nc.request("$JS.API.INFO", b"", timeout=2)
    nats_server.pause()
    try:
        assert nats_server.is_paused and nats_server.is_running()
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("$JS.API.INFO", b"", timeout=0.3)
    finally:
        nats_server.resume()
    assert not nats_server.is_paused
    reply = await eventually(
        lambda: nc.request("$JS.API.INFO", b"", timeout=0.5), timeout=5,
        what="request after resume", retry=NOT_YET,
    )
    assert b"memory" in reply.data


def test_context_manager_reaps_process_even_on_error(tmp_path: Path) -> None:
    with running_server(backend="process", workdir=tmp_path / "a") as server:
        pid = server.pid
        assert_alive(pid)
    assert_reaped(pid)
    assert not server.is_running()

    with (
        pytest.raises(RuntimeError, match="boom"),
        running_server(backend="process", workdir=tmp_path / "b") as server,
    ):
        pid = server.pid
        raise RuntimeError("boom")
    assert_reaped(pid)


def test_stop_of_paused_server_and_kill_both_reap(tmp_path: Path) -> None:
    with NatsServer(workdir=tmp_path) as server:
        server.pause()
        pid = server.pid
        server.stop(timeout=5)  # must SIGCONT first, or SIGTERM would just queue
        assert_reaped(pid)
        server.restart()
        server.pause()
        pid = server.pid
        server.kill()
        assert_reaped(pid)
        assert natsserver._LIVE_PROCS.isdisjoint({server._proc})


def test_startup_failure_reports_log_tail_and_reaps(tmp_path: Path) -> None:
    server = NatsServer(workdir=tmp_path, extra_config="this_is_not { valid")
    with pytest.raises(NatsServerError, match="log tail"), server:
        pass
    assert not server.is_running()
    assert_reaped(server.pid)


def test_port_taken_before_bind_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real = natsserver.find_free_port
        handed = iter([taken])
        monkeypatch.setattr(
            natsserver, "find_free_port", lambda host="127.0.0.1": next(handed, None) or real(host)
        )
        with NatsServer(workdir=tmp_path) as server:
            assert server.port != taken
            assert "address already in use" in server.log_tail(1000)


def test_docker_backend_without_testcontainers_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(natsserver.BACKEND_ENV, "docker")
    monkeypatch.setitem(sys.modules, "testcontainers", None)
    with pytest.raises(NatsServerError, match="pip install testcontainers"), running_server():
        pass
    monkeypatch.setenv(natsserver.BACKEND_ENV, "podman")
    with pytest.raises(NatsServerError, match="expected 'process' or 'docker'"):
        natsserver.backend_from_env()


@pytest.mark.cluster
@pytest.mark.slow
async def test_cluster_failover_and_rejoin(nats_cluster: NatsCluster) -> None:
    assert len(nats_cluster.urls) == 3
    nats_cluster.meta_leader()
    client = await nats.connect(servers=nats_cluster.urls, **client_options())
    try:
        # Requests wait up to 20 s, not nats-py's 5: forming an R3 file stream's group
        # took longer than 5 s on a starved machine (CI with a CPU hog and another
        # cluster test beside it, on 56e33a6). Waits that must be short say so below.
        js = client.jetstream(timeout=20)
        # The fixture's cluster places an R3 stream at once (NatsCluster._wait_placement).
        await js.add_stream(name="HA", subjects=["ha.>"], num_replicas=3)
        for i in range(3):
            await js.publish("ha.x", str(i).encode())
        leader = nats_cluster.stream_leader("HA")
        old_pid = nats_cluster.servers[leader].pid

        nats_cluster.kill(leader)
        assert not nats_cluster.servers[leader].is_running()
        assert_reaped(old_pid)
        # No responders / timeouts until the two survivors elect a new leader.
        ack = await eventually(
            lambda: js.publish("ha.x", b"after-failover", timeout=1),
            timeout=30,
            interval=0.1,
            what="publish after leader kill",
            retry=NOT_YET,
        )
        assert ack.seq == 4
        new_leader = nats_cluster.stream_leader("HA")
        assert new_leader != leader

        nats_cluster.restart(leader)  # waits for /healthz: node back, maybe still behind
        rejoined = nats_cluster.servers[leader]
        assert rejoined.is_running() and rejoined.pid != old_pid
        assert nats_cluster.wait_stream_synced("HA") == 4
        streams = rejoined.monitor("/jsz?streams=true")["account_details"][0]["stream_detail"]
        assert [(s["name"], s["state"]["messages"]) for s in streams] == [("HA", 4)]
        # The restarted ex-leader does not win back (or falsely claim) leadership.
        assert nats_cluster.stream_leader("HA") == new_leader
        # The client may still be settling onto the new topology (a publish right after
        # the rejoin can find no responder): retry, de-duplicated by message id.
        rejoin_ack = await eventually(
            lambda: js.publish("ha.x", b"after-rejoin", timeout=2,
                               headers={"Nats-Msg-Id": "after-rejoin"}),
            timeout=30,
            interval=0.1,
            what="publish after rejoin",
            retry=NOT_YET,
        )
        assert rejoin_ack.seq == 5
    finally:
        await client.close()


@pytest.mark.cluster
def test_cluster_teardown_reaps_every_node(tmp_path: Path) -> None:
    with running_cluster(workdir=tmp_path) as cluster:
        pids = [s.pid for s in cluster.servers]
        names = {s.server_name for s in cluster.servers}
        assert names == {"n0", "n1", "n2"}
        for pid in pids:
            assert_alive(pid)
        cluster.pause(cluster.meta_leader())  # a paused node must not block teardown
    for pid in pids:
        assert_reaped(pid)
