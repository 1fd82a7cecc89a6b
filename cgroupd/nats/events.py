"""Group events on NATS subjects: advisories, and who is running (instance discovery).

The ordered-consumer-groups ADR asks for advisories other tools can react to ("notify all
clients that a rebalance was done", "publish advisories when a group has no active
consumers ... on a timer"). Every ``cgroupd join`` instance publishes them as JSON on
core NATS subjects (fire and forget, like the server's ``$JS.EVENT.ADVISORY.>``)::

    _CGROUPD.event.<stream>.<group>.active         an instance became its member's active one
    _CGROUPD.event.<stream>.<group>.stepped_down   an active instance stopped being active
    _CGROUPD.event.<stream>.<group>.rebalanced     partitions moved in place (no step-down)
    _CGROUPD.event.<stream>.<group>.unowned        on a timer: partitions nobody consumes

and answers requests on ``_CGROUPD.info.<stream>.<group>`` with what it is (member,
instance, state, host, since when, partitions): standbys included, which the server's
consumer list cannot show. README.md ("Operating") documents every payload field.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

PREFIX = "_CGROUPD"
#: Event kinds (the last subject token) and their payload ``type``.
KINDS = ("active", "stepped_down", "rebalanced", "unowned")
TYPE_PREFIX = "io.cgroupd.advisory.v1."
INFO_TYPE = "io.cgroupd.instance_info.v1"
#: How long ``discover`` waits for instances to answer.
DISCOVERY_WAIT = 0.5


def event_subject(stream: str, group: str, kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    return f"{PREFIX}.event.{stream}.{group}.{kind}"


def events_filter(stream: str, group: str) -> str:
    """Every event of one group (``_CGROUPD.event.*.*.>`` for all groups)."""
    return f"{PREFIX}.event.{stream}.{group}.>"


def info_subject(stream: str, group: str) -> str:
    return f"{PREFIX}.info.{stream}.{group}"


def hostname() -> str:
    """The pod name on Kubernetes (HOSTNAME), else the machine's name."""
    return os.environ.get("HOSTNAME") or socket.gethostname()


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def make_event(kind: str, stream: str, group: str, **fields: Any) -> dict[str, Any]:
    """An advisory payload: ``type``, a unique ``id``, ``timestamp`` (UTC, RFC 3339), the
    group, then the kind's own fields."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    return {"type": TYPE_PREFIX + kind, "id": secrets.token_hex(8),
            "timestamp": _iso(time.time()), "stream": stream, "group": group, **fields}


def kind_of(event: dict[str, Any]) -> str:
    kind = str(event.get("type", ""))
    return kind[len(TYPE_PREFIX):] if kind.startswith(TYPE_PREFIX) else kind


class Publisher:
    """Publishes one instance's events; never raises (an event is not worth a crash)."""

    def __init__(self, nc: Client, stream: str, group: str) -> None:
        self.nc = nc
        self.stream = stream
        self.group = group
        self.published = 0
        self.failed = 0

    async def publish(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = make_event(kind, self.stream, self.group, **fields)
        try:
            await self.nc.publish(event_subject(self.stream, self.group, kind),
                                  json.dumps(event).encode())
            self.published += 1
        except Exception:  # noqa: BLE001 - disconnected: the event is lost, say so in counts
            self.failed += 1
        return event


async def follow(nc: Client, stream: str, group: str,
                 ready: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
    """Every event of the group from now on, until cancelled; undecodable ones come as
    ``{"type": "invalid", "subject": ..., "data": ...}``. ``ready`` is called once the
    server has the subscription: no event published after that is missed."""
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    sub = await nc.subscribe(events_filter(stream, group), cb=on_msg)
    await nc.flush()
    if ready is not None:
        ready()
    try:
        while True:
            msg = await queue.get()
            try:
                event = json.loads(msg.data)
                if not isinstance(event, dict):
                    raise ValueError("not an object")
            except ValueError:
                event = {"type": "invalid", "subject": msg.subject,
                         "data": msg.data[:500].decode(errors="replace")}
            yield event
    finally:
        await sub.unsubscribe()


#: The server's advisories on pins of a priority group (pinned_client, nats-server >=
#: 2.11): the reference implementation's pin changes, announced by the server itself.
PIN_ADVISORIES = {"$JS.EVENT.ADVISORY.CONSUMER.PINNED": "pinned",
                  "$JS.EVENT.ADVISORY.CONSUMER.UNPINNED": "unpinned"}


def clean_pin_advisory(subject: str, data: bytes) -> dict[str, Any] | None:
    """A pin advisory reduced to what an operator reads (kind, time, consumer, priority
    group, reason), or None when it is not one; the pin id is left out (with pull rights
    it would let anyone pull as the pinned client)."""
    kind = next((k for prefix, k in PIN_ADVISORIES.items()
                 if subject.startswith(prefix + ".")), None)
    try:
        advisory = json.loads(data)
    except ValueError:
        return None
    if kind is None or not isinstance(advisory, dict):
        return None
    out: dict[str, Any] = {"type": kind}
    for key in ("timestamp", "stream", "consumer", "group", "reason"):
        value = advisory.get(key)
        out[key] = value[:_INFO_TEXT_MAX] if isinstance(value, str) else None
    return out if out["consumer"] else None


async def follow_pins(nc: Client, consume_stream: str,
                      ready: Callable[[], None] | None = None
                      ) -> AsyncIterator[dict[str, Any]]:
    """Every pin change the server announces on the consumers of ``consume_stream`` from
    now on (see :func:`clean_pin_advisory`), until cancelled; ``ready`` as in
    :func:`follow`."""
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    subs = [await nc.subscribe(f"{prefix}.{consume_stream}.*", cb=on_msg)
            for prefix in PIN_ADVISORIES]
    await nc.flush()
    if ready is not None:
        ready()
    try:
        while True:
            msg = await queue.get()
            event = clean_pin_advisory(msg.subject, msg.data)
            if event is not None:
                yield event
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def discover(nc: Client, stream: str, group: str,
                   wait: float = DISCOVERY_WAIT) -> list[dict[str, Any]]:
    """What every running ``cgroupd join`` instance of the group says of itself, sorted by
    member then instance (answers for ``wait`` seconds are collected)."""
    inbox = nc.new_inbox()
    answers: list[dict[str, Any]] = []

    async def on_msg(msg: Msg) -> None:
        try:
            info = json.loads(msg.data)
        except ValueError:
            return
        clean = clean_info(info)
        if clean is not None:
            answers.append(clean)

    sub = await nc.subscribe(inbox, cb=on_msg)
    try:
        await nc.publish(info_subject(stream, group), b"", reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait)
    finally:
        await sub.unsubscribe()
    return sorted(answers, key=lambda a: (str(a.get("member")), str(a.get("instance"))))


_INFO_TEXT = ("stream", "group", "member", "instance", "state", "host", "since",
              "exclusivity", "version",
              # A Spark query holding the member (cgroupd.spark.lease): "spark", its
              # application id.
              "holder", "application")
_INFO_COUNTS = ("pid", "in_flight")
#: Longest text field kept from an instance's answer (a table cell, not a payload).
_INFO_TEXT_MAX = 200


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def clean_info(info: Any) -> dict[str, Any] | None:
    """An instance's answer reduced to its known fields with their types, or None when it
    is not one: anyone allowed to publish may answer discovery, and a malformed answer
    must not break ``status`` or ``member ls``. Wrong-typed optional fields become None."""
    if not isinstance(info, dict) or info.get("type") != INFO_TYPE:
        return None
    parts = info.get("partitions", [])
    if (not isinstance(info.get("member"), str) or not isinstance(info.get("instance"), str)
            or not isinstance(parts, list) or not all(_count(p) for p in parts)):
        return None
    out: dict[str, Any] = {"type": INFO_TYPE}
    for key in _INFO_TEXT:
        value = info.get(key)
        out[key] = value[:_INFO_TEXT_MAX] if isinstance(value, str) else None
    for key in _INFO_COUNTS:
        value = info.get(key)
        out[key] = value if _count(value) else None
    out["partitions"] = sorted(set(parts))
    return out


def instance_info(**fields: Any) -> dict[str, Any]:
    """An instance's answer on the info subject."""
    return {"type": INFO_TYPE, "host": hostname(), "pid": os.getpid(), **fields}


def iso(unix: float | None) -> str | None:
    return _iso(unix) if unix is not None else None
