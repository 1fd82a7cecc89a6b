"""Every way a NATS deployment authenticates, from this install (issue 25 row 1): a real
nats-server configured for the method, and the real command line run against it
(``group create``, ``group ls --json``, and a ``cgroupd join`` process that handles one
message). user/password, token, nkey, an operator/account/user JWT chain (``.creds``,
made by the test), mutual TLS with a throwaway CA, and TLS-handshake-first.

On main before this change ``--creds`` and ``--nkey`` failed with ``No module named
'nkeys'`` (nats-py imports it and does not depend on it)."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nkeys
import pytest

from cgroupd.nats.connect import ConnectionOptions
from tests.support.authsetup import make_operator, make_pki, new_seed, public_key, tls_config
from tests.support.cli import (
    ROOT,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.natsserver import NatsServer, running_server
from tests.support.secure import Run, admin_round_trip, join_handles_one, make_stream, run_cli

pytestmark = pytest.mark.slow

PASSWORD = "pw-Zq81vLkT3"
TOKEN = "tok-Hm4Rx9cW2s"


@dataclass(frozen=True)
class Method:
    """How one test connects: CLI arguments, the same as ConnectionOptions, and the
    secrets it holds (for the leak tests)."""

    args: list[str]
    options: ConnectionOptions
    secrets: tuple[str, ...]


def _server(tmp: Path, config: str) -> Iterator[NatsServer]:
    with running_server(workdir=tmp / "nats", extra_config=config) as server:
        yield server  # type: ignore[misc]


def method(kind: str, tmp: Path) -> tuple[str, Method]:
    """The server configuration and the client side of ``kind``."""
    if kind == "user-password":
        return (f'authorization {{ user: member, password: "{PASSWORD}" }}',
                Method(["--user", "member", "--password", PASSWORD],
                       ConnectionOptions(user="member", password=PASSWORD), (PASSWORD,)))
    if kind == "token":
        return (f'authorization {{ token: "{TOKEN}" }}',
                Method(["--token", TOKEN], ConnectionOptions(token=TOKEN), (TOKEN,)))
    if kind == "nkey":
        seed = new_seed(nkeys.PREFIX_BYTE_USER)
        seed_file = tmp / "member.nk"
        seed_file.write_bytes(seed + b"\n")
        return (f"authorization {{ users: [ {{ nkey: {public_key(seed)} }} ] }}",
                Method(["--nkey", str(seed_file)], ConnectionOptions(nkey_seed=seed_file),
                       (seed.decode(),)))
    if kind == "creds":
        op = make_operator(tmp)
        return (op.config, Method(["--creds", str(op.creds)], ConnectionOptions(creds=op.creds),
                                  (op.user_seed.decode(), op.user_jwt)))
    pki = make_pki(tmp)
    if kind == "mutual-tls":
        tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key",
               str(pki.client_key)]
        return (tls_config(pki, verify=True),
                Method(tls, ConnectionOptions(tls_ca=pki.ca, tls_cert=pki.client_cert,
                                              tls_key=pki.client_key), ()))
    assert kind == "tls-first"
    return (tls_config(pki, verify=False, handshake_first=True),
            Method(["--tls-ca", str(pki.ca), "--tls-first"],
                   ConnectionOptions(tls_ca=pki.ca, tls_first=True), ()))


KINDS = ["user-password", "token", "nkey", "creds", "mutual-tls", "tls-first"]


def _with_server(m: Method, url: str) -> Method:
    from dataclasses import replace
    return Method(["--server", url, *m.args], replace(m.options, servers=(url,)), m.secrets)


@pytest.mark.parametrize("kind", KINDS)
async def test_every_auth_method_runs_the_command_line(kind: str, tmp_path: Path) -> None:
    """Admin commands and a member instance work with this method, against a server that
    requires it; and the same commands without the credentials are refused."""
    config, m = method(kind, tmp_path)
    for server in _server(tmp_path, config):
        scheme = "tls" if "tls" in kind else "nats"
        url = f"{scheme}://127.0.0.1:{server.port}"
        m = _with_server(m, url)
        await make_stream(m.options)
        run = Run()
        await admin_round_trip(m.args, run)
        await join_handles_one(m.args, m.options, tmp_path, run)
        # The server does require the method: without it, a clear refusal.
        ca = ["--tls-ca", str(m.options.tls_ca)] if m.options.tls_ca else []
        bare = await asyncio.to_thread(run_cli, "--server", url, *ca, "group", "ls", "ORDERS")
        assert bare.exit_code != 0, bare.output


def test_nkeys_is_a_runtime_dependency() -> None:
    """A fresh install (and the image, which installs the package's dependencies) gets
    nkeys: nats-py imports it for --creds and --nkey but does not depend on it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip().lower()
             for dep in project["dependencies"]}
    assert "nkeys" in names, project["dependencies"]
