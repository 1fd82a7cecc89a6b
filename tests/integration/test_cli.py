"""The ``cgroupd`` command line: admin round-trips, output, exit codes, and the demo.

Admin commands run in-process through typer's CliRunner against one real nats-server per
module (each test uses its own stream). ``join`` runs as real processes in
test_daemon.py; its argument checks, which fail before connecting, and the pure parsers
are unit tests (tests/unit/test_cli_parsing.py). The demo
runs as a real process in its own session, so every process it starts can be found
afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import api
from typer.testing import Result

from tests.support.cli import (
    assert_one_line_error,
    child_env,
    cli,
    restore_logging,  # noqa: F401 - autouse fixture
    session_processes,
)
from tests.support.natsserver import NatsServer, find_free_port, running_server
from tests.support.polling import eventually_blocking


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One server for the module's admin tests; each test has its own stream."""
    with running_server(workdir=tmp_path_factory.mktemp("cli-nats")) as srv:
        yield srv  # type: ignore[misc]


def ok_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def wait_pending(url: str, stream: str, group: str, count: int, timeout: float = 10) -> None:
    """Poll ``status --json`` until the group's stream has sourced ``count`` messages."""
    status: dict[str, Any] = {}

    def sourced() -> bool:
        status.update(ok_json(cli(url, "--json", "status", stream, group)))
        return bool(status["pending"] == count)

    eventually_blocking(sourced, timeout, 0.02, f"{count} pending in {stream}/{group}",
                        diagnostics=lambda: f"pending stayed {status.get('pending')}")


def make_stream(url: str, name: str, subjects: Sequence[str],
                publish: Sequence[str] = ()) -> None:
    async def go() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            await js.add_stream(api.StreamConfig(name=name, subjects=list(subjects)))
            for subject in publish:
                await js.publish(subject, b"{}")
        finally:
            await nc.close()

    asyncio.run(go())


# -- admin round trips ------------------------------------------------------------------
def test_admin_commands_round_trip_as_json(server: NatsServer) -> None:
    """create, ls, info, member add/drop/ls, mapping set/clear, status, step-down, delete:
    each one's --json output parsed and checked against the next read."""
    url = server.url
    make_stream(url, "RT", ["rt.>"], publish=[f"rt.k{i}" for i in range(12)])
    created = ok_json(cli(url, "--json", "group", "create", "RT", "g", "--partitions", "4",
                          "--filter", "rt.*", "--wildcards", "1", "--member", "m1",
                          "--member", "m2", "--max-buffered-msgs", "1000"))
    assert created["type"] == "elastic" and created["partitions"] == 4
    assert created["filters"] == [{"filter": "rt.*", "wildcards": [1]}]
    assert created["assignment"] == {"m1": [0, 1], "m2": [2, 3]}

    listed = ok_json(cli(url, "--json", "group", "ls", "RT"))
    assert [(g["group"], g["type"], g["members"]) for g in listed] == [
        ("g", "elastic", ["m1", "m2"])]
    info = ok_json(cli(url, "--json", "group", "info", "RT", "g"))
    assert info["max_buffered_msgs"] == 1000 and info["consume_stream"] == "RT-g"
    assert info["revision"] >= 1

    added = ok_json(cli(url, "--json", "member", "add", "RT", "g", "m3", "m4"))
    assert added["members"] == ["m1", "m2", "m3", "m4"]
    dropped = ok_json(cli(url, "--json", "member", "drop", "RT", "g", "m4"))
    assert dropped["members"] == ["m1", "m2", "m3"]
    members = ok_json(cli(url, "--json", "member", "ls", "RT", "g"))
    assert [m["member"] for m in members] == ["m1", "m2", "m3"]
    assert all(m["active_instance"] is None for m in members)

    mapped = ok_json(cli(url, "--json", "mapping", "set", "RT", "g", "m1=0-2", "m2=3"))
    assert mapped["mappings"] == [{"member": "m1", "partitions": [0, 1, 2]},
                                  {"member": "m2", "partitions": [3]}]
    assert ok_json(cli(url, "--json", "group", "info", "RT", "g"))["assignment"] == {
        "m1": [0, 1, 2], "m2": [3]}
    cleared = ok_json(cli(url, "--json", "mapping", "clear", "RT", "g"))
    assert cleared["mappings"] == [] and cleared["members"] == ["m1", "m2"]

    wait_pending(url, "RT", "g", 12)
    status = ok_json(cli(url, "--json", "status", "RT", "g"))
    assert [p["partition"] for p in status["partitions"]] == [0, 1, 2, 3]
    assert sum(p["pending"] for p in status["partitions"]) == status["pending"] == 12
    assert status["unowned_partitions"] == [0, 1, 2, 3]
    assert status["members_without_instance"] == ["m1", "m2"]

    assert_one_line_error(cli(url, "step-down", "RT", "g", "m1"), 1, "no active instance")
    deleted = ok_json(cli(url, "--json", "group", "delete", "RT", "g", "--yes"))
    assert deleted == {"stream": "RT", "group": "g", "deleted": True}
    assert ok_json(cli(url, "--json", "group", "ls", "RT")) == []
    assert_one_line_error(cli(url, "group", "info", "RT", "g"), 1, "no consumer group")


def test_static_groups_and_paired_filters(server: NatsServer) -> None:
    """--static records filters as given; elastic filters keep their own wildcards."""
    url = server.url
    make_stream(url, "ST", ["st.>"])
    static = ok_json(cli(url, "--json", "group", "create", "ST", "s", "--partitions", "2",
                         "--static", "--filter", "st.>", "--member", "a"))
    assert static["type"] == "static" and static["consume_stream"] == "ST"
    make_stream(url, "PF", ["pf.>", "refunds.>"])
    both = ok_json(cli(url, "--json", "group", "create", "PF", "e", "--partitions", "3",
                       "--filter", "pf.*.*", "--wildcards", "2,1", "--filter",
                       "refunds.*", "--member", "a"))
    assert both["filters"] == [{"filter": "pf.*.*", "wildcards": [2, 1]},
                               {"filter": "refunds.*", "wildcards": []}]
    again = cli(url, "group", "create", "PF", "e", "--partitions", "3", "--filter",
                "pf.*.*", "--wildcards", "2,1", "--filter", "refunds.*", "--member", "a")
    assert again.exit_code == 0, "an identical re-create is a no-op"
    different = cli(url, "group", "create", "PF", "e", "--partitions", "4",
                    "--filter", "pf.*.*")
    assert_one_line_error(different, 1, "already exists")
    assert [g["type"] for g in ok_json(cli(url, "--json", "group", "ls", "ST"))] == [
        "static"]


def test_human_output_is_readable(server: NatsServer) -> None:
    """Default output: sentences and aligned tables a person can scan."""
    url = server.url
    make_stream(url, "HU", ["hu.>"], publish=["hu.a", "hu.b", "hu.c"])
    created = cli(url, "group", "create", "HU", "g", "--partitions", "3", "--filter",
                  "hu.*", "--wildcards", "1", "--member", "m1", "--member", "m2")
    assert created.exit_code == 0, created.output
    assert created.stdout.splitlines()[0] == "created elastic group HU/g with 3 partitions"
    assert "MEMBER  PARTITIONS\nm1      0,2\nm2      1" in created.stdout

    info = cli(url, "group", "info", "HU", "g").stdout
    assert "group       HU/g (elastic)" in info
    assert "filters     hu.* (wildcards 1)" in info
    assert "consumes    HU-g (work queue)" in info

    wait_pending(url, "HU", "g", 3)
    status = cli(url, "status", "HU", "g").stdout
    lines = status.splitlines()
    assert lines[0] == "HU/g (elastic): 3 partitions, 3 pending"
    assert lines[1].startswith("max lag ") and lines[1].endswith("; 0 in flight")
    assert lines[3].split() == ["PARTITION", "MEMBER", "INSTANCE", "HOST", "PENDING",
                                "LAG-TIME", "IN-FLIGHT"]
    assert lines[4].split()[:4] == ["0", "m1", "-", "-"]
    assert "members with no active instance (partitions not consumed): m1 (0,2), m2 (1)" \
        in status

    members = cli(url, "member", "ls", "HU", "g").stdout.splitlines()
    assert members[0].split() == ["MEMBER", "PARTITIONS", "ACTIVE", "INSTANCE", "PENDING",
                                  "LAG-TIME", "INSTANCES"]
    assert "NONE (not consumed)" in members[1]
    assert cli(url, "group", "ls", "HU").stdout.splitlines()[1].split() == [
        "g", "elastic", "3", "m1,", "m2"]
    # Global flags are accepted after the subcommand too.
    assert json.loads(cli(url, "status", "HU", "g", "--json").stdout)["pending"] == 3


def test_delete_asks_unless_yes(server: NatsServer) -> None:
    """Without --yes, deletion needs a 'y'; anything else keeps the group (exit 1)."""
    url = server.url
    make_stream(url, "DL", ["dl.>"])
    assert cli(url, "group", "create", "DL", "g", "--partitions", "1",
               "--filter", "dl.*").exit_code == 0
    kept = cli(url, "group", "delete", "DL", "g", input="n\n")
    assert_one_line_error(kept, 1, "not deleted")
    assert cli(url, "group", "info", "DL", "g").exit_code == 0
    gone = cli(url, "group", "delete", "DL", "g", input="y\n")
    assert gone.exit_code == 0 and "deleted group DL/g" in gone.stdout


def test_servers_come_from_the_environment(server: NatsServer) -> None:
    """NATS_URL (and CGROUPD_SERVER) stand in for --server; CGROUPD_JSON for --json."""
    make_stream(server.url, "EV", ["ev.>"])
    by_nats_url = cli(None, "group", "ls", "EV", env={"NATS_URL": server.url})
    assert by_nats_url.exit_code == 0 and "no consumer groups" in by_nats_url.stdout
    by_cgroupd = cli(None, "group", "ls", "EV",
                     env={"CGROUPD_SERVER": server.url, "CGROUPD_JSON": "1"})
    assert json.loads(by_cgroupd.stdout) == []


# -- bad input --------------------------------------------------------------------------
def test_operational_failures_exit_1_with_one_line(server: NatsServer) -> None:
    """Unknown group or stream: exit 1, one line, no traceback (--debug adds it)."""
    url = server.url
    make_stream(url, "BAD", ["bad.>"])
    assert_one_line_error(cli(url, "status", "BAD", "nope"), 1,
                          "no consumer group 'nope' on stream 'BAD'")
    assert_one_line_error(cli(url, "group", "ls", "MISSING"), 1, "does not exist")
    assert_one_line_error(cli(url, "member", "add", "BAD", "nope", "m1"), 1)
    debug = cli(url, "--debug", "status", "BAD", "nope")
    assert debug.exit_code == 1 and "Traceback" in debug.stderr


def test_usage_errors_exit_2_with_one_line(server: NatsServer) -> None:
    """Bad names, mapping syntax, filters, handlers and arguments: exit 2, one line."""
    url = server.url
    make_stream(url, "USE", ["use.>"])
    assert cli(url, "group", "create", "USE", "g", "--partitions", "2",
               "--filter", "use.*").exit_code == 0
    assert_one_line_error(cli(url, "mapping", "set", "USE", "g", "m1:0,1"), 2,
                          "must look like MEMBER=0,1")
    assert_one_line_error(cli(url, "mapping", "set", "USE", "g", "m1=0-x"), 2,
                          "not a partition number")
    assert_one_line_error(cli(url, "mapping", "set", "USE", "g", "m1=0"), 2,
                          "partitions not mapped to any member: 1")
    assert_one_line_error(cli(url, "member", "add", "USE", "g", "bad.member"), 2,
                          "member name 'bad.member' must not contain .")
    assert_one_line_error(cli(url, "status", "USE", "with space"), 2, "whitespace")
    assert_one_line_error(cli(url, "group", "create", "USE", "h", "--partitions", "2",
                              "--static", "--filter", "use.*", "--wildcards", "1"), 2,
                          "elastic groups only")
    assert_one_line_error(cli(url, "group", "create", "USE", "h", "--partitions", "2",
                              "--wildcards", "1", "--filter", "use.*"), 2, "must follow")
    assert_one_line_error(cli(url, "group", "create", "USE", "h", "--partitions", "2",
                              "--filter", "use.*", "--wildcards", "2"), 2,
                          "outside 1..1")
    join = ["join", "--stream", "USE", "--group", "g", "--member", "m1"]
    assert_one_line_error(cli(url, *join, "--handler", "no_such_pkg.handlers:handle"), 2,
                          "handler module 'no_such_pkg.handlers' not found")
    assert_one_line_error(cli(url, *join, "--handler", "tests.support.handlers.record_handler"),
                          2, "package.module:function")
    assert_one_line_error(cli(url, *join), 2,
                          "missing 1 option: --handler PKG.MODULE:FUNCTION or --webhook URL")
    assert_one_line_error(cli(url, *join, "--handler", "a:b", "--webhook", "http://x"), 2,
                          "give one of --handler or --webhook, not both")
    assert_one_line_error(cli(url, *join, "--webhook", "http://x", "--ack-wait", "0"), 2,
                          "ack_wait must be positive")
    assert_one_line_error(cli(url, *join, "--webhook", "http://x", "--non-retryable",
                              "4xx"), 2, "not a number")
    assert_one_line_error(cli(url, "join", "--stream", "USE", "--group", "g",
                              "--member", "a.b", "--webhook", "http://x"), 2,
                          "member name 'a.b'")
    assert_one_line_error(cli(url, "group", "create", "USE", "h"), 2,
                          "Missing option '--partitions'")
    assert_one_line_error(cli(url, "frobnicate"), 2, "No such command")


def test_unreachable_server_fails_fast() -> None:
    """Nothing listening: exit 1 within a few seconds, naming the server."""
    url = f"nats://127.0.0.1:{find_free_port()}"
    started = time.monotonic()
    result = cli(url, "group", "ls", "S")
    took = time.monotonic() - started
    assert_one_line_error(result, 1, f"cannot connect to {url}", "connection refused")
    assert took < 5, f"took {took:.1f}s"
    join = cli(url, "--connect-timeout", "0.5", "join", "--stream", "S", "--group", "g",
               "--member", "m1", "--webhook", "http://127.0.0.1:1/x")
    assert_one_line_error(join, 1, "cannot connect")


# -- demo -------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_runs_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """``cgroupd demo --duration 8`` on its embedded server: exit 0, a failover shown,
    and no process of its session (server, members) left afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgroupd", "demo", "--duration", "8"],
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:  # left open when communicate timed out
            proc.stdout.close()
        leftovers = session_processes(proc.pid)
        for pid in leftovers:  # only processes of the session this test started
            os.kill(pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert not leftovers, f"left behind: {leftovers}\n{text}"
    assert "embedded nats-server on nats://127.0.0.1:" in text
    assert "--- snapshot" in text and "PARTITION  MEMBER  INSTANCE  PENDING" in text
    assert "SIGKILL active instance" in text
    assert "failover:" in text, text
    assert "every process stopped" in text
    store = next(line for line in text.splitlines() if "(store in " in line)
    assert not Path(store.split("(store in ")[1].rstrip(")")).exists()
