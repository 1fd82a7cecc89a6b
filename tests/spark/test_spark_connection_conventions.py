"""The Spark source and sink connect as the CLI does (issues 30 row 4, 31): ``NATS_URL``
without ``servers``, ``context`` / ``NATS_CONTEXT`` / the selected ``nats`` context,
``jsDomain``; options given explicitly win. Read on the driver, where the query is
defined (the parsed options travel to the tasks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from cgroupd.core.errors import ConfigError
from cgroupd.spark.options import SinkOptions, SourceOptions, connect_reader
from tests.support.natsserver import NatsServer


def _context(config: Path, name: str, body: dict[str, object]) -> None:
    (config / "nats" / "context").mkdir(parents=True, exist_ok=True)
    (config / "nats" / "context" / f"{name}.json").write_text(json.dumps(body))


def test_nats_url_is_the_default_server(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """No ``servers`` option: ``NATS_URL`` (comma-separated) is used, for source and sink;
    the option wins over it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("NATS_URL", "nats://envhost:4222,nats://other:4222")
    source = SourceOptions.parse({"stream": "S"})
    assert source.connection.server_list == ["nats://envhost:4222", "nats://other:4222"]
    sink = SinkOptions.parse({"subject": "x"})
    assert sink.connection.server_list == ["nats://envhost:4222", "nats://other:4222"]
    given = SourceOptions.parse({"stream": "S", "servers": "nats://given:1"})
    assert given.connection.server_list == ["nats://given:1"]


def test_context_and_js_domain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``context`` (or ``NATS_CONTEXT``) supplies servers, credentials and the domain;
    ``jsDomain`` and explicit credentials override it; a missing context is refused."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NATS_URL", raising=False)
    _context(tmp_path, "hub", {"url": "nats://ctx:4222", "user": "u", "password": "p",
                               "jetstream_domain": "HUB", "inbox_prefix": "_I.u"})
    conn = SourceOptions.parse({"stream": "S", "context": "hub"}).connection
    assert (conn.server_list, conn.user, conn.password, conn.api_prefix, conn.inbox_prefix) \
        == (["nats://ctx:4222"], "u", "p", "$JS.HUB.API", "_I.u")
    monkeypatch.setenv("NATS_CONTEXT", "hub")
    conn = SinkOptions.parse({"subject": "x", "jsDomain": "EDGE", "token": "t"}).connection
    assert (conn.api_prefix, conn.token, conn.user) == ("$JS.EDGE.API", "t", None)
    with pytest.raises(ConfigError, match="'nope'"):
        SourceOptions.parse({"stream": "S", "context": "nope"})


async def test_a_context_connects_to_a_real_server(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """The source's connection, from a context with user and password, is let in."""
    with NatsServer(workdir=tmp_path / "nats",
                    extra_config='authorization { user: sp, password: "sp-pw" }') as srv:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
        _context(tmp_path, "spark", {"url": srv.url, "user": "sp", "password": "sp-pw"})
        monkeypatch.setenv("NATS_CONTEXT", "spark")
        nc = await connect_reader(SourceOptions.parse({"stream": "S"}).connection,
                                  reconnect=False)
        try:
            assert nc.is_connected
        finally:
            await nc.close()
