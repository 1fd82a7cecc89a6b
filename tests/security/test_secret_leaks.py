"""No secret leaves the process (issue 25 rows 3 and 6): for each credential kind, one
run of the command line and a member instance, with a server restart under the running
``join`` (its "nats reconnected" line names the server) and CLI error paths (an
unreachable server, a refused credential); every output is grepped for the secret:
admin command output and ``--json``, CLI errors, the join's log, /metrics, /healthz,
/readyz, and ``/proc/<pid>/cmdline`` of the join (what ``ps`` shows).

Secrets go on the command line on purpose (the worst case for ``ps``). On main the URL
password was in the reconnect log line, in every "cannot connect to" error and in the
join's command line."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from tests.security.test_auth_methods import PASSWORD, Method, method
from tests.support.cli import restore_logging  # noqa: F401 - autouse fixture
from tests.support.natsserver import NatsServer, find_free_port, running_server
from tests.support.polling import eventually
from tests.support.secure import Run, admin_round_trip, join_handles_one, make_stream, run_cli

pytestmark = pytest.mark.slow


def _client(kind: str, tmp: Path) -> tuple[str, Method, str]:
    """Server config, client side, and the URL's userinfo (``url-userinfo``: the
    password travels in the server URL only)."""
    if kind == "url-userinfo":
        config, m = method("user-password", tmp)
        return config, Method([], replace(m.options, user=None, password=None),
                              m.secrets), f"member:{PASSWORD}@"
    config, m = method(kind, tmp)
    return config, m, ""


@pytest.mark.parametrize("kind", ["user-password", "token", "nkey", "creds", "url-userinfo"])
async def test_no_secret_in_any_output(kind: str, tmp_path: Path) -> None:
    """Nothing a run prints (CLI output, errors, --json, logs, metrics, probes, ps)
    holds the password, token, nkey seed or user JWT it connected with."""
    config, m, userinfo = _client(kind, tmp_path)
    run = Run()
    with running_server(workdir=tmp_path / "nats", extra_config=config) as server:
        assert isinstance(server, NatsServer)
        url = f"nats://{userinfo}127.0.0.1:{server.port}"
        options = replace(m.options, servers=(url,))
        args = ["--server", url, *m.args]
        await make_stream(options)
        await admin_round_trip(args, run)

        async def restart(log: Path) -> None:
            await asyncio.to_thread(server.restart)
            await eventually(lambda: b"nats reconnected" in log.read_bytes(), 30,
                             what="the join to reconnect")

        await join_handles_one(args, options, tmp_path, run, during=restart)
        assert "nats reconnected" in run.outputs["join log"]
        # Error paths: nobody listening, and (where there is one) a wrong secret.
        dead = f"nats://{userinfo}127.0.0.1:{find_free_port()}"
        unreachable = await asyncio.to_thread(run_cli, "--server", dead, *m.args,
                                              "--connect-timeout", "0.5", "group", "ls", "X")
        run.add("CLI error (unreachable)", unreachable.output)
        assert unreachable.exit_code != 0 and "cannot connect" in unreachable.stderr
        refused = await asyncio.to_thread(
            run_cli, "--server", f"nats://{userinfo}127.0.0.1:{server.port}", "--token",
            "wrong", "group", "ls", "X")
        run.add("CLI error (refused)", refused.output)
        assert refused.exit_code != 0
    assert m.secrets
    for secret in m.secrets:
        assert run.containing(secret) == [], (secret, {w: run.outputs[w][-800:]
                                                       for w in run.containing(secret)})
