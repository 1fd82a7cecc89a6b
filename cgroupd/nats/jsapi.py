"""Raw ``$JS.API`` requests for what nats-py 2.16 does not expose.

With :mod:`cgroupd.nats.streamread` (its reads of stored messages), the only module that
builds JetStream API subjects by hand: consumer create with an
``action`` (create-only fails with err_code 10148 when a differing consumer exists),
priority-group fields, pulls with ``group``/``id``, unpin, and error translation. Every
reply's ``error`` becomes an :class:`~cgroupd.core.errors.ApiError` (or a more specific one).
"""

from __future__ import annotations

import base64
import functools
import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd.core.errors import (
    ApiError,
    CgroupdError,
    ConsumerExists,
    ConsumerNotFound,
    JetStreamNotEnabled,
    NoAnswer,
    PermissionDenied,
    ServerUnreachable,
    StreamNotFoundApi,
    WorkQueueOverlap,
)

#: The JetStream API prefix of the default domain.
API = "$JS.API"

#: The API prefix each connection was made for (``$JS.<domain>.API`` with a JetStream
#: domain): set once by :func:`cgroupd.nats.connect.connect`, read by every subject built here.
_PREFIXES: weakref.WeakKeyDictionary[Client, str] = weakref.WeakKeyDictionary()


def set_api_prefix(nc: Client, prefix: str) -> None:
    """Address every request over ``nc`` to ``prefix`` (a JetStream domain's API)."""
    _PREFIXES[nc] = prefix


def api(nc: Client) -> str:
    """The JetStream API prefix of ``nc``: ``$JS.API`` unless a domain was chosen."""
    try:
        return _PREFIXES.get(nc, API)
    except TypeError:  # not weakly referenceable (a stand-in for a client): never set
        return API

# JetStream err_codes this package reacts to (nats-server errors.json).
ERR_STREAM_NOT_FOUND = 10059
ERR_CONSUMER_NOT_FOUND = 10014
ERR_CONSUMER_EXISTS = 10148
ERR_WQ_NOT_UNIQUE = 10100
ERR_JS_NOT_ENABLED = 10039
ERR_NO_MESSAGE_FOUND = 10037
ERR_MAX_CONSUMERS = 10026

#: Default time to wait for an API answer, seconds.
API_TIMEOUT = 2.0

STATUS = "Status"
DESCRIPTION = "Description"


@dataclass(frozen=True)
class ServerStatus:
    """A status the server sent instead of a message (a pull's heartbeat, timeout, end)."""

    code: str
    description: str
    #: The status message's headers (the server's own, e.g. ``Nats-Pending-Messages``).
    headers: Mapping[str, str]


def server_status(msg: Msg) -> ServerStatus | None:
    """The server's status carried by ``msg``; None when ``msg`` is a message.

    nats-py merges a status line and a message's own headers into one dict, so a
    publisher's header ``Status: 404`` reads like the server's. Decide by what only the
    server sends (checked against nats-server 2.15): a status (100 heartbeat, 404, 408,
    409, 423, 503 on a pull; the answer to an ack request) has an empty body and no
    reply subject, while every JetStream delivery carries its ``$JS.ACK.`` reply subject,
    whatever headers and body its publisher gave it.
    """
    headers = msg.headers
    if not headers or msg.data or msg.reply:
        return None
    code = headers.get(STATUS)
    if not code or len(code) != 3 or not code.isascii() or not code.isdigit():
        return None
    return ServerStatus(code, headers.get(DESCRIPTION, "") or "", headers)


async def request(
    nc: Client, subject: str, body: dict[str, Any] | None = None, timeout: float = API_TIMEOUT
) -> dict[str, Any]:
    """Send one API request and return its JSON reply, raising on any API error."""
    payload = json.dumps(body).encode() if body is not None else b""
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        raise JetStreamNotEnabled(
            "no JetStream answered (is JetStream enabled on the server and account?)"
        ) from exc
    except nats.errors.TimeoutError as exc:
        raise NoAnswer(f"no answer to {subject} within {timeout:.1f}s") from exc
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
        raise ServerUnreachable(f"not connected to NATS: {exc}") from exc
    try:
        reply: dict[str, Any] = json.loads(msg.data)
    except ValueError as exc:
        raise ApiError(500, 0, f"undecodable reply to {subject}: {msg.data[:200]!r}") from exc
    error = reply.get("error")
    if error:
        raise api_error(error)
    return reply


def api_error(error: dict[str, Any]) -> CgroupdError:
    """Map a JetStream ``error`` object to the most specific exception."""
    code = int(error.get("code", 500))
    err_code = int(error.get("err_code", 0))
    description = str(error.get("description", "unknown error"))
    if code == 403 or "permission" in description.lower():
        return PermissionDenied(f"permission denied: {description}")
    if err_code == ERR_JS_NOT_ENABLED or "jetstream not enabled" in description.lower():
        return JetStreamNotEnabled(description)
    if err_code == ERR_STREAM_NOT_FOUND:
        return StreamNotFoundApi(code, err_code, description)
    if err_code == ERR_MAX_CONSUMERS:
        description += (" (the stream's max_consumers; nats-server allows 1,000 per stream "
                        "unless it says more: raise it with `nats stream edit STREAM "
                        "--max-consumers N`, or `cgroupd group create` again, which sizes a "
                        "group's stream for its max_members)")
    typed = _TYPED.get(err_code, ApiError)
    return typed(code, err_code, description)


#: err_codes the runtime reacts to, as their own ApiError subclasses.
_TYPED: dict[int, type[ApiError]] = {
    ERR_CONSUMER_NOT_FOUND: ConsumerNotFound,
    ERR_CONSUMER_EXISTS: ConsumerExists,
    ERR_WQ_NOT_UNIQUE: WorkQueueOverlap,
}


async def create_consumer(
    nc: Client, stream: str, name: str, config: dict[str, Any], action: str = "create",
    timeout: float = API_TIMEOUT
) -> dict[str, Any]:
    """Create a named consumer; ``action="create"`` fails (10148) if a different one exists."""
    body: dict[str, Any] = {"stream_name": stream, "config": {**config, "name": name}}
    if action:
        body["action"] = action
    return await request(nc, f"{api(nc)}.CONSUMER.CREATE.{stream}.{name}", body, timeout)


async def delete_consumer(nc: Client, stream: str, name: str,
                          timeout: float = API_TIMEOUT) -> bool:
    """Delete a consumer; False if it did not exist."""
    try:
        await request(nc, f"{api(nc)}.CONSUMER.DELETE.{stream}.{name}", None, timeout)
    except ApiError as exc:
        if exc.err_code == ERR_CONSUMER_NOT_FOUND or exc.code == 404:
            return False
        raise
    return True


async def consumer_info(nc: Client, stream: str, name: str,
                        timeout: float = API_TIMEOUT) -> dict[str, Any] | None:
    """Consumer info, or None if the consumer does not exist."""
    try:
        return await request(nc, f"{api(nc)}.CONSUMER.INFO.{stream}.{name}", None, timeout)
    except ApiError as exc:
        if exc.err_code == ERR_CONSUMER_NOT_FOUND or exc.code == 404:
            return None
        raise


async def step_down_consumer_leader(nc: Client, stream: str, name: str,
                                    timeout: float = API_TIMEOUT) -> None:
    """Ask a clustered consumer's leader to hand its leadership to another peer. The
    consumer's leader answers (and acts), so only a client whose server reaches it can."""
    await request(nc, f"{api(nc)}.CONSUMER.LEADER.STEPDOWN.{stream}.{name}", None, timeout)


async def list_consumers(nc: Client, stream: str,
                         timeout: float = API_TIMEOUT) -> list[dict[str, Any]]:
    """Infos of every consumer on a stream (paged)."""
    out: list[dict[str, Any]] = []
    while True:
        reply = await request(nc, f"{api(nc)}.CONSUMER.LIST.{stream}", {"offset": len(out)},
                              timeout)
        page = reply.get("consumers") or []
        out.extend(page)
        if not page or len(out) >= int(reply.get("total", 0)):
            return out


async def reset_consumer(nc: Client, stream: str, consumer: str,
                         seq: int = 0, timeout: float = API_TIMEOUT) -> dict[str, Any]:
    """Move a consumer back to stream sequence ``seq`` (0: just past its ack floor), as if
    nothing above it had been delivered: its pending messages are dropped and delivered
    again, in stream order (server >= 2.14). The reply is the consumer info after it."""
    return await request(nc, f"{api(nc)}.CONSUMER.RESET.{stream}.{consumer}",
                         {"seq": seq} if seq else {}, timeout)
async def message_stored(nc: Client, stream: str, seq: int,
                         timeout: float = API_TIMEOUT) -> bool:
    """Whether ``stream`` holds the message with sequence ``seq`` (work-queue streams
    delete a message once a consumer acknowledged it)."""
    try:
        await request(nc, f"{api(nc)}.STREAM.MSG.GET.{stream}", {"seq": seq}, timeout)
    except ApiError as exc:
        if exc.err_code == ERR_NO_MESSAGE_FOUND or exc.code == 404:
            return False
        raise
    return True


async def unpin(nc: Client, stream: str, consumer: str, group: str,
                timeout: float = API_TIMEOUT) -> None:
    """Clear a pinned client so the server picks another (priority groups ADR)."""
    await request(nc, f"{api(nc)}.CONSUMER.UNPIN.{stream}.{consumer}", {"group": group},
                  timeout)


def pull_subject(stream: str, consumer: str, prefix: str = API) -> str:
    """Subject a pull request is published to."""
    return f"{prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


@functools.lru_cache(maxsize=1024)
def pull_body(
    batch: int,
    expires: float,
    heartbeat: float,
    group: str | None = None,
    pin_id: str | None = None,
    max_bytes: int = 0,
) -> bytes:
    """A pull request body (ADR-13, plus ADR-42 priority-group fields); times in seconds.
    ``max_bytes`` (when set) ends the request, with a 409 status, before it would bring
    more. Cached: a busy member sends the same few bodies thousands of times a second."""
    body: dict[str, Any] = {
        "batch": batch,
        "expires": int(expires * 1e9),
        "idle_heartbeat": int(heartbeat * 1e9),
    }
    if max_bytes > 0:
        body["max_bytes"] = max_bytes
    if group:
        body["group"] = group
    if pin_id:
        body["id"] = pin_id
    return json.dumps(body).encode()


# -- direct get (lag, Spark), consumer reset (replay) ----------------------------------
# A stream with ``allow_direct`` answers ``$JS.API.DIRECT.GET.<stream>`` on every replica
# (and on mirrors with ``mirror_direct``): any of them may answer, a lagging follower too.
# Checked against nats-server 2.15.1:
#
# * A reply that carries a message has the message's own header block (its publisher's
#   headers, kept as stored, even a line that looks like a status) with the server's
#   trailer appended: ``Nats-Stream``, ``Nats-Subject``, ``Nats-Sequence``,
#   ``Nats-Time-Stamp`` and, in a batch, ``Nats-Num-Pending`` (messages of the filter
#   after this one) and ``Nats-Last-Sequence`` (the previous message sent).
# * A status never carries that trailer and has an empty body: ``204 EOB`` (the end of a
#   batch: ``Nats-Num-Pending`` and ``Nats-Last-Sequence``), ``404`` (nothing there),
#   ``408`` (bad request), ``413``, ``503`` (no responders: no stream, or no
#   ``allow_direct``; ``Nats-Subject`` names the request subject).
#
# nats-py's header dict merges a status line with a message's headers, so a publisher's
# ``Status: 404`` is indistinguishable there: these functions read the raw header block.

#: Trailer lines the server appends to a batched direct-get reply, in order.
DIRECT_TRAILER = (b"Nats-Stream: ", b"Nats-Subject: ", b"Nats-Sequence: ",
                  b"Nats-Time-Stamp: ", b"Nats-Num-Pending: ", b"Nats-Last-Sequence: ")
_TRAILER_START = b"\r\n" + DIRECT_TRAILER[0]


def direct_get_subject(stream: str, prefix: str = API) -> str:
    return f"{prefix}.DIRECT.GET.{stream}"



def direct_get_body(*, seq: int | None = None, next_by_subj: str | None = None,
                    batch: int | None = None, max_bytes: int | None = None,
                    last_by_subj: str | None = None, start_time: str | None = None) -> bytes:
    """A direct-get request; ``up_to_seq`` is not offered: the server ignores it unless
    ``multi_last`` is given, so readers stop at their end sequence themselves."""
    body: dict[str, Any] = {}
    if seq is not None:
        body["seq"] = seq
    if start_time is not None:
        body["start_time"] = start_time
    if next_by_subj is not None:
        body["next_by_subj"] = next_by_subj
    if last_by_subj is not None:
        body["last_by_subj"] = last_by_subj
    if batch is not None:
        body["batch"] = batch
    if max_bytes is not None:
        body["max_bytes"] = max_bytes
    return json.dumps(body, separators=(",", ":")).encode()


def direct_message(hdr: bytes | None, stream: bytes,
                   batch: bool = True) -> tuple[int, bytes, int, bytes, int] | None:
    """Where a direct-get reply's server trailer starts, and what it says: ``(own headers
    end, subject, sequence, time stamp, num pending)`` (num pending is -1 outside a
    batch). None when the reply is a status, not a message.

    Only the server appends the trailer, always last, and only to a message: a
    publisher's own ``Status``, ``Nats-Sequence`` or raw status line stays in front of
    it and changes nothing here.
    """
    if not hdr or not hdr.endswith(b"\r\n\r\n"):
        return None
    start = hdr.rfind(_TRAILER_START)
    if start < 0:
        return None
    lines = hdr[start + 2:-4].split(b"\r\n")
    if len(lines) != (6 if batch else 4):
        return None
    for line, name in zip(lines, DIRECT_TRAILER, strict=False):
        if not line.startswith(name):
            return None
    if lines[0][13:] != stream:
        return None
    seq = lines[2][15:]
    if not seq.isdigit():
        return None
    pending = int(lines[4][18:]) if batch and lines[4][18:].isdigit() else -1
    return start, lines[1][14:], int(seq), lines[3][17:], pending


def direct_status(hdr: bytes | None) -> tuple[str, str, dict[str, str]]:
    """``(code, description, headers)`` of a direct-get status reply (see above)."""
    if not hdr:
        return "", "", {}
    first, _, rest = hdr.partition(b"\r\n")
    status = first[len(b"NATS/1.0"):].strip().decode("ascii", "replace")
    code, _, description = status.partition(" ")
    headers: dict[str, str] = {}
    for line in rest.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().decode("ascii", "replace")] = value.strip().decode(
                "utf-8", "replace")
    return code, description, headers


def own_headers(hdr: bytes, end: int) -> list[tuple[str, bytes]]:
    """The message's own headers, in order, repeats kept: the lines between the header
    block's first line and the server's trailer at ``end``. A value is kept as bytes,
    with surrounding spaces removed; a line without a colon is skipped."""
    first = hdr.find(b"\r\n")
    if first < 0 or first >= end:
        return []
    out = []
    for line in hdr[first + 2:end].split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            out.append((name.strip().decode("utf-8", "replace"), value.strip()))
    return out



@dataclass(frozen=True)
class LeaderMessage:
    """A message read through the stream leader's message-get API."""

    seq: int
    subject: str
    #: The raw header block, as stored (None without headers).
    headers: bytes | None
    data: bytes
    time: str


async def get_message(nc: Client, stream: str, seq: int, next_by_subj: str | None = None,
                      timeout: float = API_TIMEOUT) -> LeaderMessage | None:
    """The message at ``seq`` (with ``next_by_subj``: the first one on that subject at or
    after ``seq``), answered by the stream leader only; None when there is none."""
    body: dict[str, Any] = {"seq": seq}
    if next_by_subj is not None:
        body["next_by_subj"] = next_by_subj
    try:
        reply = await request(nc, f"{api(nc)}.STREAM.MSG.GET.{stream}", body, timeout)
    except ApiError as exc:
        if exc.code == 404 and exc.err_code != ERR_STREAM_NOT_FOUND:
            return None
        raise
    msg = reply.get("message") or {}
    hdrs = msg.get("hdrs")
    return LeaderMessage(int(msg.get("seq", 0)), str(msg.get("subject", "")),
                         base64.b64decode(hdrs) if hdrs else None,
                         base64.b64decode(msg.get("data") or ""), str(msg.get("time", "")))


async def stream_state(nc: Client, stream: str,
                       timeout: float = API_TIMEOUT) -> dict[str, Any]:
    """A stream's info as JSON (``config``, ``state``, ``created``), from its leader."""
    return await request(nc, f"{api(nc)}.STREAM.INFO.{stream}", None, timeout)


async def stream_names(nc: Client, subject: str,
                       timeout: float = API_TIMEOUT) -> list[str]:
    """Names of the streams whose subjects capture ``subject``."""
    reply = await request(nc, f"{api(nc)}.STREAM.NAMES", {"subject": subject}, timeout)
    return [str(n) for n in reply.get("streams") or []]
