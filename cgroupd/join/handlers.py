"""What the daemon does with each message: a Python function or a webhook, guarded by the
dead-letter policy and measured.

Contract with the member runtime (:class:`~cgroupd.member.Member`): a handler that returns
gets its message acked (unless it acked, naked or termed it itself); one that raises gets
it retried with the runtime's backoff (in place for ordered modes, so nothing of its key
overtakes it, or by a nak), and ``delivery_count`` counts the attempts. On top of that:

* :class:`WebhookHandler` POSTs the payload; 2xx returns (ack), a status listed as
  non-retryable raises :class:`NonRetryable`, anything else (other statuses, timeouts,
  connection errors) raises :class:`WebhookFailed` (redelivery).
* :class:`HandlerWrapper` gives up on a message that raised :class:`NonRetryable`, or that
  failed on its ``max_deliver``-th delivery: it publishes it to the dead-letter subject
  (when one is set) and then terms it. If that publish fails, it raises instead, so the
  message is redelivered and nothing is lost. It also feeds :class:`~cgroupd.join.metrics.Metrics`.

No nats-py here: dead letters go through a ``publish`` callable the daemon provides.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import math
import os
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from cgroupd.core import logs
from cgroupd.core.errors import (
    ConfigError,
    DeadLetterFailed,
    HandlerError,
    NonRetryable,
    WebhookFailed,
)
from cgroupd.core.errors import (
    HandlerLoadError as HandlerLoadError,  # the CLI imports it from here
)
from cgroupd.core.redact import safe_url
from cgroupd.join.metrics import Metrics
from cgroupd.member.calling import call_handler, handler_failure, is_async
from cgroupd.member.dispatch import run_in_thread
from cgroupd.nats.message import Message

if TYPE_CHECKING:  # aiohttp is imported only when a webhook is used (memory)
    import aiohttp

log = logs.get_logger("cgroupd.handlers")

#: Default webhook statuses that mean "this message will never succeed": term it.
DEFAULT_NON_RETRYABLE = frozenset({400, 422})
DEFAULT_WEBHOOK_TIMEOUT = 10.0
#: Longest ``Cgroupd-Error`` header value.
MAX_ERROR_HEADER = 1000

Handler = Callable[[Message], Any]
#: Publishes ``(subject, payload, headers)`` durably; raises when not confirmed.
Publish = Callable[[str, bytes, dict[str, str]], Awaitable[None]]


# -- options ---------------------------------------------------------------------------
@dataclass(frozen=True)
class WebhookOptions:
    """Where and how to POST messages.

    Credentials never travel in what is shown: ``url`` may carry ``user:password@`` (sent
    as HTTP Basic auth, never logged: :attr:`display_url` is what logs and errors say), and
    ``header_file`` / ``token_file`` name files read at start and again whenever they
    change (a rotated Kubernetes Secret needs no restart).
    """

    url: str = field(repr=False)
    #: Bound on one request, connect to last byte (seconds).
    timeout: float = DEFAULT_WEBHOOK_TIMEOUT
    #: Statuses that term the message instead of retrying it.
    non_retryable: frozenset[int] = DEFAULT_NON_RETRYABLE
    #: Also POST partition listener events (``Cgroupd-Event`` header, JSON body; see
    #: :class:`WebhookEvents`). Off by default: a webhook that does not expect them would
    #: take them for messages.
    events: bool = False
    #: A file of ``Name: value`` lines sent with every request (e.g. ``Authorization:
    #: Bearer …``, ``X-Api-Key: …``).
    header_file: str | None = None
    #: A file holding a token sent as ``Authorization: Bearer <token>``.
    token_file: str | None = None
    #: CA bundle (PEM) that verifies the webhook's certificate (default: the system's).
    ca_file: str | None = None
    #: Client certificate (PEM, may hold the key too) and its key, for mutual TLS.
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "non_retryable", frozenset(self.non_retryable))
        problems = []
        if not self.url.startswith(("http://", "https://")):
            problems.append(f"webhook URL {self.display_url!r} must start with http:// or "
                            "https://")
        else:
            try:
                if not urlsplit(self.url).hostname:
                    problems.append(f"webhook URL {self.display_url!r} names no host")
            except ValueError:
                problems.append(f"webhook URL {self.display_url!r} is not a valid URL")
        if self.header_file is not None and self.token_file is not None:
            problems.append("give one of --webhook-header-file or --webhook-token-file")
        if self.key_file is not None and self.cert_file is None:
            problems.append("--webhook-key needs --webhook-cert")
        if self.basic_auth is not None and (self.header_file or self.token_file):
            problems.append("give the webhook's credentials once: in the URL or in a file")
        if not math.isfinite(self.timeout) or self.timeout <= 0:
            problems.append(f"webhook timeout must be a positive number of seconds, "
                            f"not {self.timeout}")
        bad = sorted(s for s in self.non_retryable if not 300 <= s <= 599)
        if bad:
            problems.append(f"non-retryable statuses must be within 300..599, not {bad}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def display_url(self) -> str:
        return safe_url(self.url)

    @property
    def endpoint(self) -> str:
        """The URL requested: without its userinfo (that goes in the Authorization header)."""
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))

    @property
    def basic_auth(self) -> tuple[str, str] | None:
        """``(user, password)`` of the URL's userinfo, percent-decoded; None without."""
        try:
            parts = urlsplit(self.url)
        except ValueError:
            return None
        if "@" not in parts.netloc:
            return None
        return unquote(parts.username or ""), unquote(parts.password or "")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings of ``--webhook-ca/--webhook-cert``; None: aiohttp's default
        (the system's CAs). ConfigError names a file that does not load."""
        if self.ca_file is None and self.cert_file is None:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--webhook-ca {self.ca_file}: {_os_error(exc)}") from exc
        if self.cert_file is not None:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"--webhook-cert {self.cert_file}: {_os_error(exc)}"
                                  ) from exc
        return ctx


def _os_error(exc: BaseException) -> str:
    """An OSError's reason without the file's contents (an SSLError may quote them)."""
    if isinstance(exc, ssl.SSLError):
        return f"not a usable certificate or key ({exc.reason or 'unreadable'})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


class AuthHeaders:
    """The credential headers of a webhook, re-read when their file changes (checked with
    one ``stat`` per request); the last good ones stay when a rewrite cannot be read."""

    def __init__(self, options: WebhookOptions) -> None:
        self._path = options.header_file or options.token_file
        self._token = options.token_file is not None
        self._seen: tuple[int, int] | None = None
        self.headers: dict[str, str] = {}
        basic = options.basic_auth
        if basic is not None:
            import base64

            raw = f"{basic[0]}:{basic[1]}".encode()
            self.headers = {"Authorization": "Basic " + base64.b64encode(raw).decode()}
        if self._path is not None:
            self.reload(strict=True)

    def secrets(self) -> list[str]:
        """The values to scrub from any text shown (e.g. a webhook echoing them back)."""
        out = [v for v in self.headers.values() if len(v) >= 4]
        for v in list(out):
            _, _, rest = v.partition(" ")
            if rest and len(rest) >= 4:
                out.append(rest)
        return out

    def current(self) -> dict[str, str]:
        if self._path is not None:
            self.reload(strict=False)
        return self.headers

    def reload(self, *, strict: bool) -> None:
        """Read the file again if it changed; ConfigError (strict) or a warning if it
        cannot be read or parsed. Messages name the file and line, never a value."""
        assert self._path is not None
        try:
            st = os.stat(self._path)
            seen = (st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return
            with open(self._path, encoding="utf-8") as f:
                text = f.read(64 * 1024)
            headers = (_token_header(text, self._path) if self._token
                       else _parse_header_file(text, self._path))
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            why = (str(exc) if isinstance(exc, ConfigError)
                   else f"cannot read {self._path}: {_os_error(exc)}")
            if strict:
                raise ConfigError(why) from exc
            if self._seen != (-1, -1):
                log.warning("webhook credentials file unusable; keeping the last good one",
                            error=why)
                self._seen = (-1, -1)
            return
        self._seen = seen
        self.headers = headers


def _token_header(text: str, path: str) -> dict[str, str]:
    token = text.strip()
    if not token or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in token):
        raise ConfigError(f"{path} must hold one token (no spaces or line breaks)")
    return {"Authorization": f"Bearer {token}"}


def _parse_header_file(text: str, path: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if (not sep or not name or not set(name) <= _TOKEN or not value
                or any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value)):
            raise ConfigError(f"line {number} of {path} is not a 'Name: value' header")
        headers[name] = value
    if not headers:
        raise ConfigError(f"{path} holds no 'Name: value' header")
    return headers


@dataclass(frozen=True)
class DeadLetterOptions:
    """When to give up on a message, and where it goes then."""

    #: Give up when the handler fails on this delivery (0: never give up on retryable
    #: failures; strict per-key order then waits for the handler to recover).
    max_deliver: int = 0
    #: Subject given-up messages are published to (a stream should capture it); None:
    #: they are termed and logged.
    subject: str | None = None
    #: Keep the start of a webhook's error answer in ``Cgroupd-Error`` (off: a webhook may
    #: echo what it was sent, or say more than the readers of the dead letters may see).
    error_body: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.max_deliver < 0:
            problems.append("max deliver must not be negative")
        if self.subject is not None:
            tokens = self.subject.split(".")
            if (not self.subject or any(not t for t in tokens)
                    or any(ch.isspace() for ch in self.subject)
                    or any(t in ("*", ">") for t in tokens)):
                problems.append(f"dead-letter subject {self.subject!r} must be a valid "
                                "subject without wildcards")
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass(frozen=True)
class HandlerOptions:
    """The handler of a ``cgroupd join``: exactly one of a function or a webhook."""

    function: Handler | None = None
    #: The ``pkg.module:function`` the function was loaded from (for logs).
    reference: str | None = None
    webhook: WebhookOptions | None = None
    dead_letter: DeadLetterOptions = field(default_factory=DeadLetterOptions)

    def __post_init__(self) -> None:
        if (self.function is None) == (self.webhook is None):
            raise ConfigError("give exactly one handler: a function or a webhook")


def parse_statuses(text: str) -> frozenset[int]:
    """``"400,422"`` → ``{400, 422}``; ConfigError naming the bad item otherwise."""
    out = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ConfigError(f"status {item!r} is not a number (expected e.g. 400,422)")
        out.add(int(item))
    return frozenset(out)


# -- Python function handlers ----------------------------------------------------------
def load_handler(reference: str) -> Handler:
    """Import ``pkg.module:function`` (attribute paths like ``mod:obj.method`` work)."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerLoadError(
            f"handler {reference!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise HandlerLoadError(f"handler module {module_name!r} not found "
                                   f"(no module named {exc.name!r})") from exc
        raise HandlerLoadError(f"handler module {module_name!r} failed to import: "
                               f"{exc}") from exc
    except Exception as exc:  # any import-time error of the user's code
        raise HandlerLoadError(f"handler module {module_name!r} failed to import: "
                               f"{type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise HandlerLoadError(
                f"handler module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise HandlerLoadError(f"handler {reference!r} is not callable")
    return obj  # type: ignore[no-any-return]


# -- webhooks --------------------------------------------------------------------------
#: At most this many NATS headers are forwarded, each as one line of at most
#: MAX_WEBHOOK_HEADER_LINE bytes: common web servers refuse more (aiohttp: 128 headers,
#: 8,190-byte lines; nginx: 8 KiB lines) with a 400, which would give up on the message.
MAX_WEBHOOK_HEADERS = 64
MAX_WEBHOOK_HEADER_LINE = 4096
#: Bytes of a webhook's answer that are read (for the error message); the rest is not.
MAX_WEBHOOK_ANSWER = 64 * 1024
#: Characters of an HTTP header name (RFC 9110 token).
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_CONTROLS = {c: " " for c in [*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F]}


def _header_value(value: str) -> str:
    """HTTP cannot carry line breaks or other control characters in a header: each
    becomes a space (a tab stays)."""
    return " ".join(str(value).splitlines()).translate(_CONTROLS)


def webhook_headers(message: Message) -> dict[str, str]:
    """Request headers: where the message came from, and its NATS headers prefixed.

    A NATS header that HTTP cannot carry as ``Nats-Header-<name>`` (a name that is not an
    HTTP token, a line longer than MAX_WEBHOOK_HEADER_LINE, more than MAX_WEBHOOK_HEADERS
    of them) is left out, and ``Cgroupd-Headers-Omitted`` names it: the payload still
    reaches the webhook instead of a 400 giving up on the message.
    """
    headers = {
        "Content-Type": _header_value(_find(message.headers, "Content-Type")
                                      or "application/octet-stream"),
        "Cgroupd-Subject": _header_value(message.subject),
        "Cgroupd-Stream-Sequence": str(message.stream_sequence),
        "Cgroupd-Delivery-Count": str(message.delivery_count),
    }
    if message.partition is not None:
        headers["Cgroupd-Partition"] = str(message.partition)
    omitted: list[str] = []
    forwarded = 0
    for name, value in message.headers.items():
        line = f"Nats-Header-{name}"
        text = _header_value(value)
        if (not name or not set(name) <= _TOKEN or forwarded >= MAX_WEBHOOK_HEADERS
                or len(line) + 2 + len(text.encode()) > MAX_WEBHOOK_HEADER_LINE):
            omitted.append(name)
        else:
            headers[line] = text
            forwarded += 1
    if omitted:
        listed: list[str] = []
        room = MAX_WEBHOOK_HEADER_LINE - 64
        for name in omitted:
            shown = _header_value(name if name and set(name) <= _TOKEN else repr(name))
            room -= len(shown.encode()) + 1
            if room < 0:
                listed.append(f"+{len(omitted) - len(listed)} more")
                break
            listed.append(shown)
        headers["Cgroupd-Headers-Omitted"] = ",".join(listed)
    return headers


def _find(headers: Mapping[str, str], name: str) -> str | None:
    lower = name.lower()
    return next((v for k, v in headers.items() if k.lower() == lower), None)


def scrubbed(text: str, options: WebhookOptions, auth: AuthHeaders) -> str:
    """``text`` with every credential value of the webhook (its header and token files'
    values, the URL's password and query values) replaced by ``***``."""
    basic = options.basic_auth
    values = auth.secrets() + ([basic[1]] if basic and len(basic[1]) >= 4 else [])
    values += [v for _, v in parse_qsl(urlsplit(options.url).query) if len(v) >= 4]
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text


class WebhookHandler:
    """POSTs each message to one URL over a shared session (connections are reused).

    What it raises says :attr:`WebhookOptions.display_url` (no userinfo, no query) and,
    for an error answer, its first 200 bytes with the credentials scrubbed; the dead
    letter leaves that answer out (:func:`dead_letter_error`) unless asked for it.
    """

    def __init__(self, options: WebhookOptions, session: aiohttp.ClientSession) -> None:
        self.options = options
        self.session = session
        import aiohttp

        self._client_error = aiohttp.ClientError
        self._timeout = aiohttp.ClientTimeout(total=options.timeout)
        self._endpoint = options.endpoint
        self._auth = AuthHeaders(options)

    def scrub(self, text: str) -> str:
        """``text`` with every credential value (and the URL's password) replaced."""
        return scrubbed(text, self.options, self._auth)

    async def __call__(self, message: Message) -> None:
        url = self.options.display_url
        headers = webhook_headers(message)
        headers.update(self._auth.current())
        try:
            # No redirects: aiohttp would follow a 301/302/303 with a GET without the
            # payload, and a 2xx from there would ack a message nobody received.
            async with self.session.post(self._endpoint, data=message.data,
                                         headers=headers, timeout=self._timeout,
                                         allow_redirects=False) as resp:
                # A bounded read: an endless or huge answer must not fill our memory.
                body = await resp.content.read(MAX_WEBHOOK_ANSWER)
                if not resp.content.at_eof():
                    resp.close()  # drop the connection rather than read the rest
                status = resp.status
        except TimeoutError as exc:
            raise WebhookFailed(f"webhook {url} timed out after "
                                f"{self.options.timeout:g}s") from exc
        except self._client_error as exc:
            reason = self.scrub(str(exc).replace(self._endpoint, url)) or type(exc).__name__
            raise WebhookFailed(f"webhook {url} failed: {reason}") from exc
        if 200 <= status < 300:
            return
        summary = f"webhook {url} answered {status}"
        if 300 <= status < 400:
            summary += (f" (a redirect to {safe_url(resp.headers.get('Location', '?'))!r}: "
                        "redirects are not followed, give the final URL)")
        snippet = self.scrub(body[:200].decode(errors="replace").strip())
        cls = NonRetryable if status in self.options.non_retryable else WebhookFailed
        raise _answered(cls, summary, snippet)


def _answered(cls: type[HandlerError], summary: str, body: str) -> HandlerError:
    """``cls`` whose message (logged) has the webhook's answer, and whose ``summary``
    attribute (what a dead letter keeps by default) has not."""
    exc = cls(summary + (f": {_header_value(body)}" if body else ""))
    exc.summary = summary  # type: ignore[attr-defined]
    exc.answer = body  # type: ignore[attr-defined]
    return exc


# -- partition listener hooks ----------------------------------------------------------
#: The names a handler module defines to hear of its instance's partitions (see
#: :mod:`cgroupd.member.listener`): called with a tuple of partition numbers.
LISTENER_HOOKS = ("on_partitions_assigned", "on_partitions_revoked", "on_partitions_lost")
#: ``Cgroupd-Event`` values of the webhook's listener events, by hook.
WEBHOOK_EVENTS = {"on_partitions_assigned": "partitions-assigned",
                  "on_partitions_revoked": "partitions-revoked",
                  "on_partitions_lost": "partitions-lost"}


def module_hooks(reference: str) -> dict[str, Callable[..., Any]]:
    """The listener hooks defined by the module of the handler ``reference``
    (``pkg.module:function``): module-level ``on_partitions_assigned`` /
    ``_revoked`` / ``_lost``, sync or async. One that is not callable is refused."""
    module_name = reference.partition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise HandlerLoadError(f"handler module {module_name!r} failed to import: "
                               f"{type(exc).__name__}: {exc}") from exc
    hooks: dict[str, Callable[..., Any]] = {}
    for name in LISTENER_HOOKS:
        hook = getattr(module, name, None)
        if hook is None:
            continue
        if not callable(hook):
            raise HandlerLoadError(f"{module_name}.{name} is not callable (a partition "
                                   "listener hook takes a tuple of partitions)")
        hooks[name] = hook
    return hooks


class WebhookEvents:
    """Partition listener events POSTed to the webhook: header ``Cgroupd-Event``
    (``partitions-assigned``, ``partitions-revoked``, ``partitions-lost``), a JSON body
    ``{"event", "stream", "group", "member", "instance", "partitions"}``. A 2xx answer
    returns; anything else raises, which the runtime logs and counts (never retried)."""

    def __init__(self, options: WebhookOptions, session: aiohttp.ClientSession,
                 context: Mapping[str, str]) -> None:
        self.options = options
        self.session = session
        #: stream, group, member and (once known) instance: read at each event.
        self.context = context
        self._auth = AuthHeaders(options)

    def hooks(self) -> dict[str, Callable[[tuple[int, ...]], Awaitable[None]]]:
        def hook(event: str) -> Callable[[tuple[int, ...]], Awaitable[None]]:
            async def post(partitions: tuple[int, ...]) -> None:
                await self.post(event, partitions)
            return post
        return {name: hook(event) for name, event in WEBHOOK_EVENTS.items()}

    async def post(self, event: str, partitions: tuple[int, ...]) -> None:
        import aiohttp

        body = {"event": event, **{k: self.context.get(k) for k in
                                   ("stream", "group", "member", "instance")},
                "partitions": list(partitions)}
        url = self.options.display_url  # what errors say: no userinfo, no query
        try:
            async with self.session.post(
                    self.options.endpoint, json=body, allow_redirects=False,
                    headers={**self._auth.current(), "Cgroupd-Event": event},
                    timeout=aiohttp.ClientTimeout(total=self.options.timeout)) as resp:
                status = resp.status
        except TimeoutError as exc:
            raise WebhookFailed(f"webhook {url} timed out on {event}") from exc
        except aiohttp.ClientError as exc:
            reason = scrubbed(str(exc).replace(self.options.endpoint, url), self.options,
                              self._auth) or type(exc).__name__
            raise WebhookFailed(f"webhook {url} failed on {event}: {reason}") from exc
        if not 200 <= status < 300:
            raise WebhookFailed(f"webhook {url} answered {status} to {event}")


def listener_hooks(options: HandlerOptions, session: aiohttp.ClientSession | None,
                   context: Mapping[str, str]) -> dict[str, Callable[..., Any]]:
    """The ``Member`` keyword arguments for the daemon's partition listener: the handler
    module's hooks, or the webhook's events when asked for (``--webhook-events``)."""
    if options.webhook is not None:
        if not options.webhook.events or session is None:
            return {}
        return dict(WebhookEvents(options.webhook, session, context).hooks())
    return module_hooks(options.reference) if options.reference else {}


# -- dead letters and measurement ------------------------------------------------------
def dead_letter_headers(message: Message, error: str, msg_id: str) -> dict[str, str]:
    """The original headers (minus JetStream's own ``Nats-*`` controls) and why it died.

    ``Nats-Msg-Id`` makes a retried publish after a lost PubAck a duplicate the
    dead-letter stream drops, instead of a second dead letter (:func:`dead_letter_id`).
    """
    headers = {k: v for k, v in message.headers.items() if not k.lower().startswith("nats-")}
    headers.update({
        "Cgroupd-Error": _header_value(error)[:MAX_ERROR_HEADER],
        "Cgroupd-Original-Subject": message.subject,
        "Cgroupd-Stream-Sequence": str(message.stream_sequence),
        "Cgroupd-Deliveries": str(message.delivery_count),
        "Nats-Msg-Id": msg_id,
    })
    if message.partition is not None:
        headers["Cgroupd-Partition"] = str(message.partition)
    return headers


def dead_letter_id(key: bytes, stream: str, group: str, seq: int) -> str:
    """The ``Nats-Msg-Id`` of the dead letter of ``stream``'s message ``seq``.

    The same for every attempt of this process (``key`` is its own random secret), so a
    publish retried after a lost PubAck is a duplicate the dead-letter stream drops; but
    nobody else can compute it, even from the ids of dead letters they can read, so no
    other publisher can store a decoy under it first and make the real dead letter a
    "duplicate" that is thrown away (issue 25 row 5). Another instance that gives up on
    the same message after a failover uses another key: at worst a second dead letter.
    """
    mac = hmac.new(key, f"{stream}\0{group}\0{seq}".encode(), hashlib.sha256)
    return f"cgroupd-dl-{seq}-{mac.hexdigest()[:32]}"


def dead_letter_error(exc: BaseException, *, answer: bool = False) -> str:
    """What ``Cgroupd-Error`` says: a webhook's error answer only when ``answer``."""
    summary = getattr(exc, "summary", None)
    if isinstance(summary, str) and not answer:
        return f"{type(exc).__name__}: {summary}"
    return _describe(exc)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class HandlerWrapper:
    """The handler the member runtime calls: user handler + dead-letter policy + metrics."""

    def __init__(self, handler: Handler, dead_letter: DeadLetterOptions,
                 publish: Publish | None = None, metrics: Metrics | None = None, *,
                 context: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if dead_letter.subject is not None and publish is None:
            raise ConfigError("a dead-letter subject needs a publish function")
        self.handler = handler
        self._handler_is_async = is_async(handler)
        self.dead_letter = dead_letter
        self.publish = publish
        self.metrics = metrics
        self.context = dict(context or {})
        self._clock = clock
        self._log = log.bind(**self.context)
        #: This process's secret for dead-letter ids (never leaves it).
        self._id_key = secrets.token_bytes(32)
        #: Messages handled to an ack (the daemon compares the runtime's count of acks
        #: that did not take effect with it: cgroupd.join.healthwatch.AckWatch).
        self.acked = 0

    async def __call__(self, message: Message) -> None:
        await self.handle(message)

    async def handle(self, message: Message) -> None:
        """Handle one message. Give the runtime this bound method: it recognises it as
        async (it would run an object with an async ``__call__`` through a thread)."""
        started = self._clock()
        if self.metrics is not None:
            self.metrics.message_started()
        outcome = "nak"
        try:
            try:
                await call_handler(self.handler, message, self._handler_is_async, run_in_thread)
            except NonRetryable as exc:
                outcome = await self._give_up(message, exc, "not retryable")
            except BaseException as exc:  # SystemExit & co. from a handler: its failure
                if not handler_failure(exc):
                    raise
                limit = self.dead_letter.max_deliver
                if message.acknowledged or not limit or message.delivery_count < limit:
                    raise  # the runtime retries with backoff (and logs it)
                outcome = await self._give_up(message, exc, f"failed {limit} deliveries")
            else:
                outcome = message.outcome.value if message.outcome is not None else "ack"
        finally:
            if message.outcome is not None and outcome != "dead_letter":
                outcome = message.outcome.value
            if outcome == "ack":
                self.acked += 1
            if self.metrics is not None:
                self.metrics.message_finished(outcome, self._clock() - started)

    async def _give_up(self, message: Message, exc: BaseException, why: str) -> str:
        """Dead-letter (if configured) and term; raise if the dead letter was not stored."""
        if message.acknowledged:
            return message.outcome.value if message.outcome is not None else "ack"
        error = _describe(exc)
        fields = {"subject": message.subject, "partition": message.partition,
                  "seq": message.stream_sequence, "deliveries": message.delivery_count,
                  "error": error}
        subject = self.dead_letter.subject
        if subject is None:
            self._log.error(f"giving up on message ({why}); terminated", **fields)
            await message.term(why)
            return "term"
        assert self.publish is not None
        msg_id = dead_letter_id(self._id_key, self.context.get("stream", ""),
                                self.context.get("group", ""), message.stream_sequence)
        stored_error = dead_letter_error(exc, answer=self.dead_letter.error_body)
        try:
            await self.publish(subject, message.data,
                               dead_letter_headers(message, stored_error, msg_id))
        except Exception as pub_exc:
            self._log.error("dead-letter publish failed; message kept for redelivery",
                            dead_letter_subject=subject, publish_error=_describe(pub_exc),
                            **fields)
            raise DeadLetterFailed(f"dead-letter publish to {subject} failed: "
                                   f"{_describe(pub_exc)}") from pub_exc
        self._log.warning(f"message dead-lettered ({why})", dead_letter_subject=subject,
                          **fields)
        await message.term(f"dead-lettered to {subject}")
        return "dead_letter"


def build_handler(options: HandlerOptions, *, session: aiohttp.ClientSession | None,
                  publish: Publish | None, metrics: Metrics | None,
                  context: Mapping[str, str]) -> HandlerWrapper:
    """The wrapped handler for ``options`` (a webhook needs ``session``)."""
    inner: Handler
    if options.webhook is not None:
        if session is None:
            raise ConfigError("a webhook handler needs an HTTP session")
        inner = WebhookHandler(options.webhook, session)
    else:
        assert options.function is not None
        inner = options.function
    return HandlerWrapper(inner, options.dead_letter, publish, metrics, context=context)
