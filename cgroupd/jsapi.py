"""Raw ``$JS.API`` requests for what nats-py 2.16 does not expose.

The only module that builds JetStream API subjects by hand: consumer create with an
``action`` (create-only fails with err_code 10148 when a differing consumer exists),
priority-group fields, pulls with ``group``/``id``, unpin, and error translation. Every
reply's ``error`` becomes an :class:`~cgroupd.errors.ApiError` (or a more specific one).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd.errors import (
    ApiError,
    CgroupdError,
    ConsumerExists,
    ConsumerNotFound,
    JetStreamNotEnabled,
    PermissionDenied,
    ServerUnreachable,
    StreamNotFound,
    WorkQueueOverlap,
)

API = "$JS.API"

# JetStream err_codes this package reacts to (nats-server errors.json).
ERR_STREAM_NOT_FOUND = 10059
ERR_CONSUMER_NOT_FOUND = 10014
ERR_CONSUMER_EXISTS = 10148
ERR_WQ_NOT_UNIQUE = 10100
ERR_JS_NOT_ENABLED = 10039
ERR_NO_MESSAGE_FOUND = 10037

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
        raise ServerUnreachable(f"no answer to {subject} within {timeout:.1f}s") from exc
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
    typed = _TYPED.get(err_code, ApiError)
    return typed(code, err_code, description)


class StreamNotFoundApi(ApiError, StreamNotFound):
    """A stream-not-found API reply: both an ApiError and a StreamNotFound."""


#: err_codes the runtime reacts to, as their own ApiError subclasses.
_TYPED: dict[int, type[ApiError]] = {
    ERR_CONSUMER_NOT_FOUND: ConsumerNotFound,
    ERR_CONSUMER_EXISTS: ConsumerExists,
    ERR_WQ_NOT_UNIQUE: WorkQueueOverlap,
}


async def create_consumer(
    nc: Client, stream: str, name: str, config: dict[str, Any], action: str = "create"
) -> dict[str, Any]:
    """Create a named consumer; ``action="create"`` fails (10148) if a different one exists."""
    body: dict[str, Any] = {"stream_name": stream, "config": {**config, "name": name}}
    if action:
        body["action"] = action
    return await request(nc, f"{API}.CONSUMER.CREATE.{stream}.{name}", body)


async def delete_consumer(nc: Client, stream: str, name: str) -> bool:
    """Delete a consumer; False if it did not exist."""
    try:
        await request(nc, f"{API}.CONSUMER.DELETE.{stream}.{name}")
    except ApiError as exc:
        if exc.err_code == ERR_CONSUMER_NOT_FOUND or exc.code == 404:
            return False
        raise
    return True


async def consumer_info(nc: Client, stream: str, name: str) -> dict[str, Any] | None:
    """Consumer info, or None if the consumer does not exist."""
    try:
        return await request(nc, f"{API}.CONSUMER.INFO.{stream}.{name}")
    except ApiError as exc:
        if exc.err_code == ERR_CONSUMER_NOT_FOUND or exc.code == 404:
            return None
        raise


async def list_consumers(nc: Client, stream: str) -> list[dict[str, Any]]:
    """Infos of every consumer on a stream (paged)."""
    out: list[dict[str, Any]] = []
    while True:
        reply = await request(nc, f"{API}.CONSUMER.LIST.{stream}", {"offset": len(out)})
        page = reply.get("consumers") or []
        out.extend(page)
        if not page or len(out) >= int(reply.get("total", 0)):
            return out


async def reset_consumer(nc: Client, stream: str, consumer: str,
                         seq: int = 0) -> dict[str, Any]:
    """Move a consumer back to stream sequence ``seq`` (0: just past its ack floor), as if
    nothing above it had been delivered: its pending messages are dropped and delivered
    again, in stream order (server >= 2.14). The reply is the consumer info after it."""
    return await request(nc, f"{API}.CONSUMER.RESET.{stream}.{consumer}",
                         {"seq": seq} if seq else {})
async def message_stored(nc: Client, stream: str, seq: int,
                         timeout: float = API_TIMEOUT) -> bool:
    """Whether ``stream`` holds the message with sequence ``seq`` (work-queue streams
    delete a message once a consumer acknowledged it)."""
    try:
        await request(nc, f"{API}.STREAM.MSG.GET.{stream}", {"seq": seq}, timeout)
    except ApiError as exc:
        if exc.err_code == ERR_NO_MESSAGE_FOUND or exc.code == 404:
            return False
        raise
    return True


async def unpin(nc: Client, stream: str, consumer: str, group: str) -> None:
    """Clear a pinned client so the server picks another (priority groups ADR)."""
    await request(nc, f"{API}.CONSUMER.UNPIN.{stream}.{consumer}", {"group": group})


def pull_subject(stream: str, consumer: str) -> str:
    """Subject a pull request is published to."""
    return f"{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


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
