"""NATS conventions (issue 31): the ``nats`` CLI's contexts and JetStream domains.

- ``--context NAME`` / ``NATS_CONTEXT`` / the selected context (``context.txt``) read
  natscli's context files; explicit options win over the context.
- ``--js-domain``: every JetStream request goes to ``$JS.<domain>.API``. Proven across a
  leaf node: a hub with domain HUB and a leaf with its own JetStream (domain LEAF); a
  client of the leaf that says ``--js-domain HUB`` creates the group, joins and reads
  status on the hub, and nothing of it lands in the leaf's JetStream. Without the domain
  the same commands would use the leaf's own JetStream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgroupd.core.config import ELASTIC_BUCKET, group_key
from cgroupd.nats.connect import ConnectionOptions, connect
from cgroupd.nats.jetstream import JetStream, Record
from tests.support.cli import restore_logging  # noqa: F401 - autouse fixture
from tests.support.natsserver import NatsServer, find_free_port
from tests.support.secure import Run, admin_round_trip, join_handles_one, make_stream, run_cli

pytestmark = pytest.mark.slow

PASSWORD = "ctx-pw-4Rw"


def _write_context(config: Path, name: str, body: dict[str, object],
                   select: bool = False) -> None:
    (config / "nats" / "context").mkdir(parents=True, exist_ok=True)
    (config / "nats" / "context" / f"{name}.json").write_text(json.dumps(body))
    if select:
        (config / "nats" / "context.txt").write_text(name + "\n")


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(workdir=tmp_path / "nats", extra_config=(
            f'authorization {{ user: ctxuser, password: "{PASSWORD}" }}')) as server:
        yield server


async def test_context_file_with_user_password(auth_server: NatsServer,
                                               tmp_path: Path) -> None:
    """``--context`` (and ``NATS_CONTEXT``, and the selected context) connect with the
    context's server and credentials; an explicit --server overrides the context's."""
    config = tmp_path / "xdg"
    body = {"description": "test", "url": auth_server.url, "user": "ctxuser",
            "password": PASSWORD, "token": "", "creds": "", "nkey": "", "cert": "",
            "key": "", "ca": "", "nsc": "", "jetstream_domain": "", "inbox_prefix": ""}
    _write_context(config, "prod", body)
    env = {"XDG_CONFIG_HOME": str(config)}
    await make_stream(ConnectionOptions(servers=(auth_server.url,), user="ctxuser",
                                        password=PASSWORD))
    await admin_round_trip(["--context", "prod"], Run(), env=env)
    by_env = await asyncio.to_thread(run_cli, "--json", "group", "ls", "ORDERS",
                                     env={**env, "NATS_CONTEXT": "prod"})
    assert by_env.exit_code == 0, by_env.output
    assert [g["group"] for g in json.loads(by_env.stdout)] == ["g"]
    # Selected by `nats context select` (context.txt): used when nothing is named.
    _write_context(config, "prod", body, select=True)
    selected = await asyncio.to_thread(run_cli, "group", "ls", "ORDERS", env=env)
    assert selected.exit_code == 0, selected.output
    # Explicit options win: a server nobody listens on replaces the context's url.
    dead = f"nats://127.0.0.1:{find_free_port()}"
    overridden = await asyncio.to_thread(run_cli, "--context", "prod", "--server", dead,
                                         "--connect-timeout", "0.5", "group", "ls", "ORDERS",
                                         env=env)
    assert overridden.exit_code == 1 and dead in overridden.stderr, overridden.output
    # A context that does not exist is a usage error naming it.
    missing = await asyncio.to_thread(run_cli, "--context", "nope", "group", "ls", "ORDERS",
                                      env=env)
    assert missing.exit_code == 2 and "'nope'" in missing.stderr, missing.output
    assert PASSWORD not in missing.output + overridden.output


@pytest.fixture
def hub_and_leaf(tmp_path: Path) -> Iterator[tuple[NatsServer, NatsServer]]:
    """A hub (JetStream domain HUB) and a leaf node with its own JetStream (LEAF)."""
    leaf_port = find_free_port()
    hub_store = tmp_path / "hub" / "store"
    leaf_store = tmp_path / "leaf" / "store"
    hub = NatsServer(workdir=tmp_path / "hub", extra_config=(
        f'jetstream {{ store_dir: "{hub_store}", domain: HUB }}\n'
        f"leafnodes {{ listen: \"127.0.0.1:{leaf_port}\" }}"))
    leaf = NatsServer(workdir=tmp_path / "leaf", extra_config=(
        f'jetstream {{ store_dir: "{leaf_store}", domain: LEAF }}\n'
        f'leafnodes {{ remotes: [ {{ url: "nats-leaf://127.0.0.1:{leaf_port}" }} ] }}'))
    with hub, leaf:
        yield hub, leaf


async def _stream_names(url: str) -> list[str]:
    nc = await connect(ConnectionOptions(servers=(url,)))
    try:
        js = JetStream(nc)
        return sorted([s.config.name for s in await js.jsm.streams_info()])
    finally:
        await nc.close()


async def _record_changes_reach_the_leaf(args: list[str], options: ConnectionOptions
                                         ) -> None:
    """A member's config watch on the leaf hears a membership change made through it
    within seconds (nats-server passes no ``$KV.>`` traffic across a leaf to another
    domain: a watch that only listened there would learn of it at its minute's re-read)."""
    from tests.support.polling import eventually

    nc = await connect(options)
    seen: list[Record] = []

    async def follow() -> None:
        async for record in JetStream(nc).watch_record(ELASTIC_BUCKET,
                                                       group_key("ORDERS", "g")):
            seen.append(record)

    task = asyncio.create_task(follow())
    try:
        await eventually(lambda: bool(seen), 10, what="the record, read through the leaf")
        added = await asyncio.to_thread(run_cli, *args, "member", "add", "ORDERS", "g", "zz")
        assert added.exit_code == 0, added.output
        await eventually(lambda: b'"zz"' in (seen[-1].value or b""), 10,
                         what="the membership change, heard through the leaf")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()


async def test_js_domain_across_a_leaf_node(hub_and_leaf: tuple[NatsServer, NatsServer],
                                            tmp_path: Path) -> None:
    """group create, group ls, status and a join handling a message, all from the leaf
    with ``--js-domain HUB``: the group lives in the hub's JetStream only."""
    hub, leaf = hub_and_leaf
    options = ConnectionOptions(servers=(leaf.url,), js_domain="HUB")
    args = ["--server", leaf.url, "--js-domain", "HUB"]
    from tests.support.polling import eventually

    async def made() -> bool:
        try:
            await make_stream(options)
        except Exception:  # noqa: BLE001 - the leaf connection may not be up yet
            return False
        return True

    await eventually(made, 20, what="the stream created through the leaf")
    run = Run()
    await admin_round_trip(args, run)
    status = await asyncio.to_thread(run_cli, *args, "--json", "status", "ORDERS", "g")
    assert status.exit_code == 0, status.output
    await join_handles_one(args, options, tmp_path, run)
    await _record_changes_reach_the_leaf(args, options)
    on_hub = await _stream_names(hub.url)
    assert "ORDERS" in on_hub and "ORDERS-g" in on_hub, on_hub
    assert any(name.startswith("KV_") for name in on_hub), on_hub
    assert await _stream_names(leaf.url) == []
