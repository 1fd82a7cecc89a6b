"""The docs' code blocks run (README.md and docs/, against an embedded nats-server), and
the README's library example is quiet: a library prints nothing its user did not ask for.

Which blocks run and how: tests/support/docblocks.py. Unmarked runnable blocks are run as they
are; marked ones are skipped with a reason or driven by a named test below.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

import tests.integration.test_docs as this_module
from cgroupd import JetStream, admin
from cgroupd.core.partitions import member_partitions, partition_of
from tests.support.cli import child_env
from tests.support.docblocks import Block, all_blocks, block_by_marker, blocks, with_server
from tests.support.natsserver import NatsServer, find_free_port, running_server
from tests.support.polling import eventually_blocking


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with running_server(workdir=tmp_path_factory.mktemp("docs-nats")) as srv:
        yield srv  # type: ignore[misc]


def run_block(block: Block, url: str, cwd: Path, timeout: float = 120) -> None:
    """Run one unmarked block as a reader would, against ``url``; fail with its output."""
    code = with_server(block.code, url)
    env = child_env(NATS_URL=url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.language == "python":
        script = cwd / "block.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        script = cwd / "block.sh"
        script.write_text(code)
        argv = ["bash", "-euo", "pipefail", str(script)]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"{block.where}: the {block.info} block exits "
                                  f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}")


def check_marker(block: Block) -> str | None:
    """What is wrong with a block's docs-test marker, or None."""
    if block.marker is None:
        return None
    if block.marker.startswith("skip:") and block.marker[5:].strip():
        return None
    if block.marker.startswith("by "):
        name = block.marker[3:].strip()
        if callable(getattr(this_module, name, None)) and name.startswith("test_"):
            return None
        return f"{block.where}: no test {name} in tests/integration/test_docs.py"
    return f"{block.where}: unknown docs-test marker {block.marker!r}"


def check_block(block: Block) -> str | None:
    """Why a block cannot stand as it is (no info string, bad marker), or None."""
    if not block.info:
        return f"{block.where}: a code block without an info string (bash, python, text...)"
    return check_marker(block)


DOC_BLOCKS = all_blocks()


@pytest.mark.parametrize("block", DOC_BLOCKS, ids=[b.where for b in DOC_BLOCKS])
def test_doc_block(block: Block, server: NatsServer, tmp_path: Path) -> None:
    """Each block of README.md and docs/ is well-marked, and runs unless marked."""
    problem = check_block(block)
    assert problem is None, problem
    if block.language is None or block.marker is not None:
        return  # data or output, or skipped with a reason, or driven by its own test
    run_block(block, server.url, tmp_path)


def test_the_checker_fails_on_what_it_should(tmp_path: Path, server: NatsServer) -> None:
    """A block that does not run fails its test; a block with no info string, a skip with
    no reason, or a `by` naming no test are refused; marked blocks are recognised."""
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "```bash", "cgroupd group info NOSUCH nosuch", "```",
        "<!-- docs-test: skip: why not -->", "```bash", "false", "```",
        "<!-- docs-test: skip: -->", "```python", "pass", "```",
        "```", "plain", "```",
        "  <!-- docs-test: by test_no_such_thing -->", "  ```py", "  pass", "  ```",
        "```python", "import cgroupd, nats", "print(cgroupd.__version__)", "```",
        "```yaml", "a: 1", "```", ""]))
    found = blocks(doc)
    assert [(b.info, b.language, b.marker) for b in found] == [
        ("bash", "bash", None), ("bash", "bash", "skip: why not"),
        ("python", "python", "skip:"), ("", None, None),
        ("py", "python", "by test_no_such_thing"), ("python", "python", None),
        ("yaml", None, None)]
    with pytest.raises(AssertionError, match="exits 1"):
        run_block(found[0], server.url, tmp_path)
    assert check_block(found[1]) is None
    assert "unknown docs-test marker" in str(check_block(found[2]))
    assert "without an info string" in str(check_block(found[3]))
    assert "no test test_no_such_thing" in str(check_block(found[4]))
    run_block(found[5], server.url, tmp_path)


# -- the README's library example ----------------------------------------------------------
def lines_of(stream: object, into: list[str]) -> threading.Thread:
    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.rstrip("\n"))
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


async def test_library_example_prints_only_what_its_handler_prints(
        server: NatsServer, tmp_path: Path) -> None:
    """The README's library example, run as a newcomer runs it (no logging configured):
    its stdout holds exactly the lines its callbacks print (on_active, one per message of
    member a, on_standby), its stderr nothing, through the election, idle pulls and the
    group's deletion; it ends by itself with exit 0 when the group is deleted."""
    await drive_library_example(sys.executable, child_env(), server, tmp_path)


async def drive_library_example(python: str, env: dict[str, str], server: NatsServer,
                                tmp_path: Path) -> None:
    """Run the README's library example with ``python``, feed it, delete its group; check
    that it printed only its callbacks' lines and exited 0 (also used by test_wheel)."""
    block = block_by_marker("by test_library_example_prints_only_what_its_handler_prints")
    script = tmp_path / "example.py"
    script.write_text(with_server(block.code, server.url))
    env = {**env, "PYTHONUNBUFFERED": "1"}  # see each line as it is printed
    proc = subprocess.Popen([python, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    out: list[str] = []
    err: list[str] = []
    pumps = [lines_of(proc.stdout, out), lines_of(proc.stderr, err)]
    nc = await nats.connect(server.url)
    try:
        js = JetStream(nc)
        await asyncio.to_thread(eventually_blocking, lambda: out or proc.poll() is not None, 60,
                                what="the member to become active")
        assert proc.poll() is None, (out, err)
        stored = await admin.get_group(js, "ORDERS", "shipping")
        mine = set(member_partitions(stored.config, "a"))
        assert out == [str(tuple(sorted(mine)))], (out, err)  # on_active(partitions)
        filters = stored.config.partitioning_filters  # type: ignore[union-attr]
        expected = []
        for i in range(24):
            subject = f"orders.r{i % 6}.{i}"
            await nc.publish(subject, f"o{i}".encode())
            partition = partition_of(subject, filters, 8)
            if partition in mine:
                expected.append(f"{partition} {subject} b'o{i}'")
        assert expected, "no test message falls in member a's partitions"
        await nc.flush()
        await asyncio.to_thread(eventually_blocking, lambda: len(out) >= 1 + len(expected), 30,
                                what="the handler's lines")
        await asyncio.sleep(1.0)  # idle pulls time out a few times meanwhile: still quiet
        await admin.delete_group(js, "ORDERS", "shipping")
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # Also when an assertion above failed: an open pipe's GC would warn in the next test.
        for pump, pipe in zip(pumps, (proc.stdout, proc.stderr), strict=True):
            pump.join(5)
            if pipe is not None:
                pipe.close()
        await nc.close()
    assert code == 0, (out, err)
    assert err == [], err
    # The default ordering (partition) keeps each partition of member a in stream order;
    # on_standby says why the member stopped.
    assert out[0] == str(tuple(sorted(mine))) and out[-1] == "group-deleted", out

    def by_partition(lines: list[str]) -> dict[str, list[str]]:
        return {p: [x for x in lines if x.split()[0] == p] for p in {x.split()[0] for x in lines}}

    assert sorted(out[1:-1]) == sorted(expected), out
    assert by_partition(out[1:-1]) == by_partition(expected), out


# -- the README's command-line block --------------------------------------------------------
def commands(code: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        command = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if command:
            out.append(command)
    return out


@pytest.mark.slow
async def test_command_line_block(server: NatsServer, tmp_path: Path) -> None:
    """The README's command-line block, every command as written, in its order, each
    exiting 0. The stream comes from nats-py (the NATS CLI is not installed here); the
    two `join` lines run as instances of member a (a handler module `myapp.handlers:ship`
    in the working directory, the metrics port swapped for a free one) and are started
    before `step-down`, which needs an active instance; deleting the group ends them."""
    block = block_by_marker("by test_command_line_block")
    lines = commands(block.code)
    stream_lines = [c for c in lines if c.startswith("nats ")]
    assert stream_lines == ["nats stream add ORDERS --subjects 'orders.>' --defaults"]
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "handlers.py").write_text("def ship(msg):\n    pass\n")
    nc = await nats.connect(server.url)
    try:
        await nc.jetstream().add_stream(name="ORDERS", subjects=["orders.>"])
    finally:
        await nc.close()
    env = child_env(NATS_URL=server.url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    joins = [c for c in lines if c.startswith("cgroupd join ")]
    assert len(joins) == 2, joins
    instances: list[subprocess.Popen[str]] = []

    def run(command: str) -> str:
        proc = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stderr}"
        return proc.stdout

    def active_instance() -> bool:
        status = json.loads(run("cgroupd status ORDERS shipping --json"))
        return any(r["member"] == "a" and r["instance"] for r in status["partitions"])

    try:
        for command in lines:
            if command in stream_lines or command in joins:
                continue
            if command.startswith("cgroupd step-down"):
                for n, join in enumerate(joins):
                    join = join.replace("--metrics-port 9100",
                                        f"--metrics-port {find_free_port()}")
                    with open(tmp_path / f"join{n}.log", "w") as log:
                        instances.append(subprocess.Popen(
                            shlex.split(join), cwd=tmp_path, env=env, text=True,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                await asyncio.to_thread(eventually_blocking, active_instance, 30,
                                        what="an active instance of member a")
            await asyncio.to_thread(run, command)
        codes = [await asyncio.to_thread(p.wait, 30) for p in instances]
        assert codes == [0, 0], [(tmp_path / f"join{n}.log").read_text() for n in range(2)]
    finally:
        for p in instances:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
