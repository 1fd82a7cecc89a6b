"""Reading the ``nats`` CLI's context files and merging them under explicit options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cgroupd.cli.natscontext import read_context, selected_context, with_context
from cgroupd.core.errors import ConfigError
from cgroupd.nats.connect import ConnectionOptions


def _env(tmp_path: Path, **contexts: dict[str, object]) -> dict[str, str]:
    for name, body in contexts.items():
        (tmp_path / "nats" / "context").mkdir(parents=True, exist_ok=True)
        (tmp_path / "nats" / "context" / f"{name}.json").write_text(json.dumps(body))
    return {"XDG_CONFIG_HOME": str(tmp_path), "HOME": str(tmp_path / "home")}


def test_every_connection_key_of_a_context(tmp_path: Path) -> None:
    """natscli's keys (ADR-21) map to ConnectionOptions; empty strings mean unset."""
    files = {n: tmp_path / n for n in ("u.creds", "ca.pem", "c.pem", "c.key")}
    for f in files.values():
        f.write_text("x")
    env = _env(tmp_path, a={
        "description": "d", "url": "tls://a:1, tls://b:2", "token": "", "user": "",
        "password": "", "creds": str(files["u.creds"]), "nkey": "", "cert": str(files["c.pem"]),
        "key": str(files["c.key"]), "ca": str(files["ca.pem"]), "nsc": "",
        "jetstream_domain": "HUB", "jetstream_api_prefix": "", "jetstream_event_prefix": "",
        "inbox_prefix": "_INBOX_a", "user_jwt": "", "tls_first": True,
        "color_scheme": "later-natscli-key"})
    conn = with_context({}, "a", env)
    assert conn.server_list == ["tls://a:1", "tls://b:2"]
    assert (conn.creds, conn.tls_cert, conn.tls_key, conn.tls_ca) == (
        files["u.creds"], files["c.pem"], files["c.key"], files["ca.pem"])
    assert (conn.api_prefix, conn.inbox_prefix, conn.tls_first) == ("$JS.HUB.API", "_INBOX_a",
                                                                     True)


def test_explicit_options_win(tmp_path: Path) -> None:
    """One explicit credential replaces the context's; servers and domain too."""
    env = _env(tmp_path, a={"url": "nats://ctx:1", "user": "u", "password": "p",
                            "jetstream_domain": "HUB"})
    conn = with_context({"token": "t", "servers": ("nats://cli:2",), "js_domain": "X"}, "a",
                        env)
    assert (conn.token, conn.user, conn.password) == ("t", None, None)
    assert conn.server_list == ["nats://cli:2"] and conn.api_prefix == "$JS.X.API"
    assert with_context({}, None, env) == ConnectionOptions()  # nothing selected


def test_selected_context(tmp_path: Path) -> None:
    """``context.txt`` names the context used when none is given."""
    env = _env(tmp_path, a={"url": "nats://sel:1"})
    (tmp_path / "nats" / "context.txt").write_text("a\n")
    assert selected_context(env) == "a"
    assert with_context({}, None, env).server_list == ["nats://sel:1"]


@pytest.mark.parametrize(("body", "message"), [
    ({"nsc": "nsc://op/acc/user"}, "'nsc' is not supported"),
    ({"user_jwt": "eyJ..."}, "'user_jwt' is not supported"),
    ({"creds": "/no/such.creds"}, "creds file '/no/such.creds' does not exist"),
    ({"url": 5}, "'url' must be a string"),
    ({"tls_first": "yes"}, "'tls_first' must be true or false"),
])
def test_unusable_contexts_are_refused(tmp_path: Path, body: dict[str, object],
                                       message: str) -> None:
    env = _env(tmp_path, bad=body)
    with pytest.raises(ConfigError, match=message):
        read_context("bad", env)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ""])
def test_context_names_cannot_escape(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError):
        read_context(name, _env(tmp_path))


def test_missing_and_broken_files(tmp_path: Path) -> None:
    env = _env(tmp_path)
    with pytest.raises(ConfigError, match="no file"):
        read_context("nope", env)
    (tmp_path / "nats" / "context").mkdir(parents=True)
    (tmp_path / "nats" / "context" / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_context("bad", env)


def test_js_domain_is_one_token() -> None:
    with pytest.raises(ConfigError, match="one subject token"):
        ConnectionOptions(js_domain="a.b")
    assert ConnectionOptions().api_prefix == "$JS.API"
    assert ConnectionOptions(js_api_prefix="$JS.x.API.").api_prefix == "$JS.x.API"
