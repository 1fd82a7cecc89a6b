"""From connection options to a connected NATS client.

The CLI reads argv and the environment and hands a frozen :class:`ConnectionOptions` down;
this module turns it into ``nats.connect`` keyword arguments (credentials, TLS context,
reconnect forever) and connects with a bounded first attempt: an unreachable or refusing
server fails within ``connect_timeout`` with one readable :class:`ServerUnreachable`,
instead of nats-py's endless initial retry loop (it retries forever when
``max_reconnect_attempts`` is -1, which is what a daemon wants *after* the first connect).

TLS intended means TLS or no connection. nats-py (measured on 2.16.0) upgrades to TLS only
when the server's INFO says ``tls_required`` (or with ``tls_handshake_first``), whatever
the URL scheme or the TLS context given; a server, or a man in the middle, that answers
"no TLS" would get ``CONNECT`` with the user and password, token or URL userinfo in clear.
:func:`_require_tls` closes that: the CONNECT line is built (``Client._connect_command``,
called right before it is written, on the first connect and on every reconnect) only on a
connection that is TLS by then; otherwise the attempt fails with :class:`TlsNotOffered`
and nothing is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.transport import TcpTransport

from cgroupd.core import logs
from cgroupd.core.errors import ConfigError, PermissionDenied, ServerBusy, ServerUnreachable
from cgroupd.core.redact import redact_text, redact_url
from cgroupd.core.tasks import cancel_and_wait
from cgroupd.nats import jsapi
from cgroupd.nats.natsload import enable_websockets

log = logs.get_logger("cgroupd.connect")

#: Used when neither ``--server`` nor ``NATS_URL`` names a server.
DEFAULT_SERVER = "nats://127.0.0.1:4222"
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_RECONNECT_WAIT = 0.5


@dataclass(frozen=True)
class ConnectionOptions:
    """How to reach and authenticate to NATS. Paths are checked when connecting."""

    #: Server URLs; empty means :data:`DEFAULT_SERVER`.
    servers: tuple[str, ...] = ()
    #: A ``.creds`` file (user JWT and nkey seed).
    creds: Path | None = None
    #: A file holding an nkey seed.
    nkey_seed: Path | None = None
    token: str | None = None
    user: str | None = None
    password: str | None = None
    #: Client certificate and key (mutual TLS), and a CA bundle to verify the server.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    #: Bound on the first connect (all servers, all attempts) and on each later attempt.
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    #: Pause between reconnect attempts to one server, forever, after the first connect.
    reconnect_wait: float = DEFAULT_RECONNECT_WAIT
    #: Client name shown in the server's connection list.
    name: str = "cgroupd"
    #: TLS handshake before the server's INFO (server ``tls { handshake_first: true }``).
    tls_first: bool = False
    #: JetStream domain: every API request goes to ``$JS.<domain>.API``.
    js_domain: str | None = None
    #: A JetStream API prefix given as such (a ``nats`` context's ``jetstream_api_prefix``).
    js_api_prefix: str | None = None
    #: Prefix of this connection's reply subjects (nats-py's default ``_INBOX``; a
    #: ``nats`` context's ``inbox_prefix``): give each member's user its own
    #: (``_INBOX_<member>``) so that its permissions can allow ``sub _INBOX_<member>.>``
    #: instead of ``_INBOX.>``, which would let it read every other member's replies and
    #: deliveries (docs/security.md, "Permissions").
    inbox_prefix: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "servers", tuple(self.servers))
        problems = []
        if not math.isfinite(self.connect_timeout) or self.connect_timeout <= 0:
            problems.append(f"connect timeout must be a positive number of seconds, "
                            f"not {self.connect_timeout}")
        if not math.isfinite(self.reconnect_wait) or self.reconnect_wait < 0:
            problems.append("reconnect wait must not be negative")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("give both a TLS certificate and its key, or neither")
        if self.password is not None and self.user is None:
            problems.append("a password needs a user")
        if sum(x is not None for x in (self.creds, self.nkey_seed, self.token, self.user)) > 1:
            problems.append("choose one of credentials file, nkey seed, token, user/password")
        if self.js_domain is not None and not _is_token(self.js_domain):
            problems.append(f"JetStream domain {self.js_domain!r} must be one subject token "
                            "(no spaces, '.', '*' or '>')")
        if self.js_api_prefix is not None and self.js_domain is not None:
            problems.append("give a JetStream domain or an API prefix, not both")
        if self.inbox_prefix is not None and not _valid_prefix(self.inbox_prefix):
            problems.append(f"inbox prefix {self.inbox_prefix!r} must be a subject without "
                            "wildcards, whitespace or empty tokens")
        if problems:
            raise ConfigError(problems)

    @property
    def server_list(self) -> list[str]:
        """The servers to try; comma-separated entries (as in ``NATS_URL``) are split."""
        out = [s.strip() for entry in self.servers for s in entry.split(",") if s.strip()]
        return out or [DEFAULT_SERVER]

    @property
    def uses_tls(self) -> bool:
        """Whether TLS was asked for: then no credential is ever sent without it."""
        return (self.tls_ca is not None or self.tls_cert is not None or self.tls_first
                or any(s.startswith(("tls://", "wss://")) for s in self.server_list))

    @property
    def api_prefix(self) -> str:
        """The JetStream API prefix: ``$JS.API``, or ``$JS.<domain>.API`` with a domain."""
        if self.js_api_prefix is not None:
            return self.js_api_prefix.rstrip(".")
        if self.js_domain is not None:
            return f"$JS.{self.js_domain}.API"
        return jsapi.API

    @property
    def where(self) -> str:
        """The servers, for messages: any userinfo replaced by ``***``."""
        return ", ".join(redact_url(s) for s in self.server_list)


def _is_token(text: str) -> bool:
    return bool(text) and not any(c.isspace() or c in ".*>" for c in text)


class TlsNotOffered(nats.errors.Error):
    """TLS was asked for but this connection is not TLS: nothing was sent on it."""

    def __str__(self) -> str:
        return ("the server did not offer TLS although TLS was asked for (tls:// URL, "
                "--tls-* option or CA): refusing to send credentials in clear")


def _is_tls(nc: Client) -> bool:
    """Whether ``nc``'s current transport is encrypted (TLS, or a ``wss://`` websocket)."""
    transport = nc._transport
    if isinstance(transport, TcpTransport):
        writer = transport._io_writer
        return writer is not None and writer.get_extra_info("ssl_object") is not None
    server = nc._current_server
    return server is not None and server.uri.scheme == "wss"


def _require_tls(nc: Client) -> None:
    """Make ``nc`` refuse to send CONNECT on a connection that is not TLS (see the module
    docstring: the seam is nats-py 2.16's ``_connect_command``, which builds the line
    holding the credentials right before it is written)."""
    build = nc._connect_command

    def connect_command() -> bytes:
        if not _is_tls(nc):
            # Closed here: nats-py's reconnect loop goes on to the next attempt without
            # closing a transport that failed this way.
            if nc._transport is not None:
                nc._transport.close()  # type: ignore[no-untyped-call]
            raise TlsNotOffered()
        line: bytes = build()
        return line

    nc._connect_command = connect_command  # type: ignore[method-assign]


def _valid_prefix(prefix: str) -> bool:
    """A literal subject: tokens of printable characters, no wildcard, none empty."""
    return bool(prefix) and all(
        token and token not in ("*", ">") and all(ch.isprintable() and not ch.isspace()
                                                 for ch in token)
        for token in prefix.split("."))


def ssl_context(options: ConnectionOptions) -> ssl.SSLContext:
    """A client TLS context: the system CAs (or ``tls_ca``), plus the client certificate."""
    try:
        ctx = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH,
            cafile=str(options.tls_ca) if options.tls_ca is not None else None)
        if options.tls_cert is not None and options.tls_key is not None:
            ctx.load_cert_chain(str(options.tls_cert), str(options.tls_key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS files: {exc}") from exc
    return ctx


def _readable(path: Path | None, what: str) -> str | None:
    if path is None:
        return None
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} is not a readable file")
    return str(path)


def connect_kwargs(options: ConnectionOptions) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect``: reconnect forever, quick dead-peer detection."""
    kwargs: dict[str, Any] = {
        "servers": options.server_list,
        "name": options.name,
        "connect_timeout": options.connect_timeout,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": options.reconnect_wait,
        # A half-open TCP connection is noticed within ~15 s rather than nats-py's 4 min.
        "ping_interval": 5,
        "max_outstanding_pings": 3,
    }
    creds = _readable(options.creds, "credentials file")
    if creds is not None:
        kwargs["user_credentials"] = creds
    seed = _readable(options.nkey_seed, "nkey seed file")
    if seed is not None:
        kwargs["nkeys_seed"] = seed
    if options.token is not None:
        kwargs["token"] = options.token
    if options.user is not None:
        kwargs["user"] = options.user
        kwargs["password"] = options.password or ""
    if options.inbox_prefix is not None:
        kwargs["inbox_prefix"] = options.inbox_prefix
    if options.uses_tls:
        kwargs["tls"] = ssl_context(options)
    if options.tls_first:
        kwargs["tls_handshake_first"] = True
    return kwargs


def describe(exc: BaseException | None) -> str:
    """A short human reason for a connection failure."""
    if exc is None:
        return "no answer"
    if isinstance(exc, nats.errors.AuthorizationError):
        return "authorization violation (check credentials)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timed out"
    text = str(exc).strip() or type(exc).__name__
    return redact_text(text.removeprefix("nats: "))


Callback = Callable[[], Awaitable[None]]
#: A connection to NATS, as :func:`connect` returns it (layers above the adapter name the
#: type through this alias, never through nats-py).
Connection = Client


async def connect(options: ConnectionOptions, *,
                  disconnected_cb: Callback | None = None,
                  reconnected_cb: Callback | None = None,
                  client: Client | None = None,
                  reconnect: bool = True) -> Client:
    """Connect, failing within ``connect_timeout`` if no server lets us in.

    Raises :class:`ServerUnreachable` (nobody answered) or :class:`PermissionDenied`
    (a server refused the credentials). Once connected, the client reconnects forever,
    unless ``reconnect`` is false (a Spark task fails fast and Spark retries it).
    ``client``: an unconnected client of a subclass to use (the Spark reader's).
    """
    kwargs = connect_kwargs(options)
    if any(url.startswith(("ws://", "wss://")) for url in kwargs["servers"]):
        enable_websockets()
    if not reconnect:
        kwargs.update(allow_reconnect=False, max_reconnect_attempts=0)
    errors: list[BaseException] = []
    refused = asyncio.get_running_loop().create_future()
    connected = False

    async def error_cb(exc: Exception) -> None:
        # Replaces nats-py's default, which logs a full traceback for every attempt.
        errors.append(exc)
        if (not connected and isinstance(exc, (nats.errors.AuthorizationError, TlsNotOffered))
                and not refused.done()):
            refused.set_result(exc)
        if connected:
            log.warning("nats error", error=describe(exc))

    nc = client if client is not None else Client()
    jsapi.set_api_prefix(nc, options.api_prefix)
    if options.uses_tls:
        _require_tls(nc)
    attempt = asyncio.create_task(
        nc.connect(error_cb=error_cb, disconnected_cb=disconnected_cb,
                   reconnected_cb=reconnected_cb, **kwargs))
    try:
        done, _ = await asyncio.wait({attempt, refused}, timeout=options.connect_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await cancel_and_wait(attempt)
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    failure: BaseException | None = None
    if attempt in done and attempt.exception() is None:
        connected = True
        refused.cancel()
        return nc
    if attempt in done:
        failure = attempt.exception()
    # Cancelled until it ends: nats-py's connect waits for the server's INFO under its own
    # asyncio.wait_for of the same timeout, which on Python 3.11 swallows a cancellation
    # that arrives as it fires; one cancel then left `cgroupd group ls` waiting forever on
    # a server that expects the TLS handshake first (CI on 4c1708a, test_auth_methods).
    await cancel_and_wait(attempt)
    with contextlib.suppress(Exception):
        await nc.close()
    refused.cancel()
    reason = failure or (errors[-1] if errors else None)
    where = options.where
    if isinstance(reason, TlsNotOffered):
        raise ServerUnreachable(f"cannot connect to {where}: {reason}")
    if isinstance(reason, nats.errors.AuthorizationError):
        raise PermissionDenied(f"{where}: {describe(reason)}")
    if reason is None or isinstance(reason, (TimeoutError, asyncio.TimeoutError)):
        raise ServerBusy(f"cannot connect to {where}: {describe(reason)}")
    raise ServerUnreachable(f"cannot connect to {where}: {describe(reason)}")
