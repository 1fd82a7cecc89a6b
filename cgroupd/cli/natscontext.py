"""The ``nats`` CLI's contexts: where NATS users keep servers, credentials and TLS files.

A context is a JSON file ``$XDG_CONFIG_HOME/nats/context/<name>.json`` (``~/.config``
without ``XDG_CONFIG_HOME``); ``nats/context.txt`` names the selected one (ADR-21 of
nats-architecture-and-design, as natscli writes them). ``cgroupd --context NAME`` (or
``NATS_CONTEXT``, or the selected context when neither is given) starts from the
context; every option given explicitly overrides what the context says: one credential
given on the command line replaces the context's credentials, as with ``nats``.

Keys read: ``url`` (comma-separated), ``user``, ``password``, ``token``, ``creds``,
``nkey`` (a seed file), ``cert``, ``key``, ``ca``, ``tls_first``, ``jetstream_domain``,
``jetstream_api_prefix``, ``inbox_prefix``. A context that needs what cgroupd cannot do
(``nsc``, ``user_jwt``, ``jetstream_event_prefix``, Windows certificate stores) is refused
with a message rather than connected half-configured; ``description`` and keys of later
natscli versions are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cgroupd.core.errors import ConfigError
from cgroupd.nats.connect import ConnectionOptions

#: The environment variable ``nats`` reads a context name from.
CONTEXT_ENV = "NATS_CONTEXT"

#: Context keys that name files, and the ConnectionOptions field each sets.
_FILES = {"creds": "creds", "nkey": "nkey_seed", "cert": "tls_cert", "key": "tls_key",
          "ca": "tls_ca"}
_TEXT = {"user": "user", "password": "password", "token": "token",
         "jetstream_domain": "js_domain", "jetstream_api_prefix": "js_api_prefix",
         "inbox_prefix": "inbox_prefix"}
_UNSUPPORTED = ("nsc", "user_jwt", "jetstream_event_prefix", "windows_cert_store",
                "windows_cert_match_by", "windows_cert_match", "windows_ca_certs_match")
#: ConnectionOptions fields that are credentials: one given explicitly replaces them all.
CREDENTIALS = ("creds", "nkey_seed", "token", "user", "password")
_CLIENT_CERT = ("tls_cert", "tls_key")


def config_dir(env: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/nats``, or ``~/.config/nats``."""
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base).expanduser() / "nats"


def context_path(name: str, env: Mapping[str, str]) -> Path:
    """The file of context ``name`` (a path to a ``.json`` file is taken as it is)."""
    if name.endswith(".json") and ("/" in name or Path(name).is_file()):
        return Path(name).expanduser()
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ConfigError(f"invalid NATS context name {name!r}")
    return config_dir(env) / "context" / f"{name}.json"


def selected_context(env: Mapping[str, str]) -> str | None:
    """The context ``nats context select`` chose (``context.txt``), if any."""
    try:
        name = (config_dir(env) / "context.txt").read_text().strip()
    except OSError:
        return None
    return name or None


def read_context(name: str, env: Mapping[str, str]) -> dict[str, Any]:
    """ConnectionOptions fields from context ``name``; ConfigError naming the file and
    every problem when it cannot be used."""
    path = context_path(name, env)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"NATS context {name!r}: no file {str(path)!r} "
                          "(see `nats context ls`)") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"NATS context {name!r}: cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"NATS context {name!r}: {str(path)!r} is not a JSON object")
    problems = [f"NATS context {name!r}: {key!r} is not supported by cgroupd"
                for key in _UNSUPPORTED if raw.get(key)]
    out: dict[str, Any] = {}
    url = raw.get("url")
    if url:
        if not isinstance(url, str):
            problems.append(f"NATS context {name!r}: 'url' must be a string")
        else:
            out["servers"] = tuple(s.strip() for s in url.split(",") if s.strip())
    for key, field in _TEXT.items():
        value = raw.get(key)
        if value in (None, ""):
            continue
        if not isinstance(value, str):
            problems.append(f"NATS context {name!r}: {key!r} must be a string")
            continue
        out[field] = value
    for key, field in _FILES.items():
        value = raw.get(key)
        if value in (None, ""):
            continue
        if not isinstance(value, str):
            problems.append(f"NATS context {name!r}: {key!r} must be a file path")
            continue
        file = Path(value).expanduser()
        if not file.is_file():
            problems.append(f"NATS context {name!r}: {key} file {value!r} does not exist")
        out[field] = file
    tls_first = raw.get("tls_first")
    if tls_first not in (None, "", False):
        if tls_first is not True:
            problems.append(f"NATS context {name!r}: 'tls_first' must be true or false")
        out["tls_first"] = True
    if problems:
        raise ConfigError(problems)
    return out


def with_context(given: Mapping[str, Any], context: str | None, env: Mapping[str, str],
                 **defaults: Any) -> ConnectionOptions:
    """ConnectionOptions from ``given`` on top of the named ``context`` (None: the
    selected one, if any), on top of ``defaults`` (client name, timeouts).

    ``given``: the ConnectionOptions fields set explicitly (command line, environment,
    Spark options); they win. One explicit credential replaces all of the context's, an
    explicit client certificate replaces the context's certificate and key.
    """
    if context is None:
        context = selected_context(env)
    base = read_context(context, env) if context is not None else {}
    if given.keys() & set(CREDENTIALS):
        base = {k: v for k, v in base.items() if k not in CREDENTIALS}
    if given.keys() & set(_CLIENT_CERT):
        base = {k: v for k, v in base.items() if k not in _CLIENT_CERT}
    if given.keys() & {"js_domain", "js_api_prefix"}:
        base = {k: v for k, v in base.items() if k not in ("js_domain", "js_api_prefix")}
    return ConnectionOptions(**{**defaults, **base, **given})
