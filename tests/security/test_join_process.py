"""The process ``cgroupd join`` turns into (issue 25 row 12): ``python -P -m
cgroupd.join.run``.

- Modules planted in the directory ``join`` is started from (``pickle.py``,
  ``secrets.py``, ... shadowing the standard library) never run; a ``--handler`` module
  in that directory is still found, as documented (the image's ``/app``).
- Its command line (``ps``, ``/proc/<pid>/cmdline``) names the member and holds no
  password, token or webhook userinfo given on the command line.
- A spec over a pipe's 64 KiB buffer (a 100 KiB webhook URL) starts as any other: on main
  the CLI blocked forever writing it before the exec.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgroupd.nats.jetstream import JetStream
from tests.support.cli import child_env
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually
from tests.support.secure import CGROUPD, cmdline

pytestmark = pytest.mark.slow

#: Standard-library modules the join process imports (some before, some after it loads
#: the handler), each planted in the working directory as a module that leaves a mark.
PLANTED = ("pickle", "secrets", "uuid", "random", "socket", "json", "ssl", "hashlib")


class Join:
    """A ``cgroupd`` console-script ``join`` process started in ``cwd``."""

    def __init__(self, args: list[str], cwd: Path, log: Path, **env: str) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([CGROUPD, *args], cwd=cwd, env=child_env(**env),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def active(self) -> None:
        await eventually(lambda: '"became active"' in self.text() or self.proc.poll() is not None,
                         30, what="join to become active")
        assert self.proc.poll() is None, self.text()[-3000:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def joins() -> Iterator[list[Join]]:
    started: list[Join] = []
    yield started
    for join in started:
        join.close()


async def test_planted_modules_do_not_run_and_handlers_are_found(
        nats_server: NatsServer, jetstream: JetStream, tmp_path: Path,
        joins: list[Join]) -> None:
    """A directory holding stdlib-named modules and the user's handler module: join runs
    the handler on a message, none of the planted modules ran."""
    await make_group(jetstream, partitions=2, members=("m1",))
    work = tmp_path / "app"
    work.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    for name in PLANTED:
        (work / f"{name}.py").write_text(
            f"open({str(marks / name)!r}, 'w').write('planted {name} ran')\n")
    handled = tmp_path / "handled"
    (work / "myhandler.py").write_text(
        "def handle(message):\n"
        f"    with open({str(handled)!r}, 'a') as out:\n"
        "        out.write(message.data.decode() + '\\n')\n")
    join = Join(["--server", nats_server.url, "join", "--stream", "ORDERS", "--group", "g",
                 "--member", "m1", "--handler", "myhandler:handle"], work,
                tmp_path / "join.log")
    joins.append(join)
    await join.active()
    await jetstream.publish("orders.k1", b"from-cwd-handler")
    await eventually(lambda: handled.exists() and "from-cwd-handler" in handled.read_text(),
                     20, what="the working directory's handler to run")
    assert join.stop() == 0, join.text()[-2000:]
    assert sorted(p.name for p in marks.iterdir()) == []


async def test_no_secret_on_the_command_line(nats_server: NatsServer, jetstream: JetStream,
                                             tmp_path: Path, joins: list[Join]) -> None:
    """Secrets given as options are gone from /proc/<pid>/cmdline once join runs; the
    member is still named there."""
    await make_group(jetstream, partitions=2, members=("m1",))
    password, token = "pw-on-argv-5Tn", "hook-secret-8Lp"
    # The server has no auth: the password is sent and ignored, which is all we need.
    host = nats_server.url.removeprefix("nats://")
    join = Join(["--server", f"nats://member:{password}@{host}", "join", "--stream",
                 "ORDERS", "--group", "g", "--member", "m1", "--webhook",
                 f"http://hook:{token}@127.0.0.1:9/"], tmp_path, tmp_path / "join.log")
    joins.append(join)
    await join.active()
    shown = cmdline(join.proc.pid)
    assert "--member m1" in shown and "cgroupd.join.run" in shown, shown
    assert password not in shown and token not in shown, shown
    assert join.stop() == 0
    assert password not in join.text() and token not in join.text()


async def test_settings_larger_than_a_pipe_start(nats_server: NatsServer,
                                                 jetstream: JetStream, tmp_path: Path,
                                                 joins: list[Join]) -> None:
    """100 KiB of settings (a webhook URL with a long query) reach the lean process."""
    await make_group(jetstream, partitions=2, members=("m1",))
    url = "http://127.0.0.1:9/hook?pad=" + "x" * (100 * 1024)
    join = Join(["--server", nats_server.url, "join", "--stream", "ORDERS", "--group", "g",
                 "--member", "m1"], tmp_path, tmp_path / "join.log", CGROUPD_WEBHOOK=url)
    joins.append(join)
    await join.active()
    assert "cgroupd.join.run" in cmdline(join.proc.pid)
    assert join.stop() == 0
