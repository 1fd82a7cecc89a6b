"""Reads of a stream's stored messages outside any consumer of the group, for the lag and
replay tools: the first match of each filter from a sequence on (batched direct gets), one
stored message (message get), and the subjects of the messages from a sequence on (a
short-lived ephemeral consumer). Built on :mod:`cgroupd.nats.jsapi`'s request forms.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from cgroupd.core.errors import ApiError, CgroupdError, DirectGetUnavailable, ServerUnreachable
from cgroupd.core.timestamps import rfc3339
from cgroupd.nats.jsapi import (
    API_TIMEOUT,
    DESCRIPTION,
    STATUS,
    api,
    create_consumer,
    delete_consumer,
    direct_get_subject,
    pull_subject,
    request,
    server_status,
)


@dataclass(frozen=True)
class FirstMatch:
    """The first message at or after a sequence matching a subject filter, and how many
    match from there on (a batched direct get of one message, server >= 2.11)."""

    #: Messages matching the filter from the start sequence on (0: none).
    count: int
    #: Stream sequence and store time (Unix seconds) of the first of them.
    seq: int | None = None
    time: float | None = None


async def first_matches(nc: Client, stream: str, queries: list[tuple[str, int]],
                        timeout: float = API_TIMEOUT, concurrency: int = 64
                        ) -> list[FirstMatch]:
    """For each ``(subject filter, start sequence)``: one batched direct get of one
    message, answered by the message and an end-of-batch status whose
    ``Nats-Num-Pending`` counts the matching messages after it.

    One request per query, at most ``concurrency`` outstanding, all answers on one inbox
    subscription. The count is read from the end-of-batch status, which only the server
    writes; the time from the message's ``Nats-Time-Stamp``, which the server appends
    after any header the publisher set (nats-py keeps the last of repeated headers).
    """
    if not queries:
        return []
    inbox = nc.new_inbox()
    loop = asyncio.get_running_loop()
    waiting: dict[str, asyncio.Future[FirstMatch]] = {}
    partial: dict[str, tuple[int, float | None]] = {}

    async def on_reply(msg: Msg) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        fut = waiting.get(key)
        if fut is None or fut.done():
            return
        headers = msg.headers or {}
        if "Nats-Stream" in headers and "Nats-Sequence" in headers:
            # A message (a status never carries these; the server appends its own last).
            try:
                seq = int(headers["Nats-Sequence"])
            except ValueError:
                seq = 0
            partial[key] = (seq, rfc3339(headers.get("Nats-Time-Stamp", "")))
            return
        code = headers.get(STATUS, "")
        if code == "204":  # end of batch: pending after the one message sent
            try:
                rest = int(headers.get("Nats-Num-Pending", "0"))
            except ValueError:
                rest = 0
            seq, at = partial.pop(key, (0, None))
            fut.set_result(FirstMatch(rest + 1, seq, at) if seq else FirstMatch(rest))
        elif code == "404":
            fut.set_result(FirstMatch(0))
        elif code == "503":
            fut.set_exception(DirectGetUnavailable(
                503, 0, f"stream {stream} does not answer direct gets (allow_direct off?)"))
        else:
            fut.set_exception(ApiError(int(code) if code.isdigit() else 500, 0,
                                       f"direct get on {stream}: {code} "
                                       f"{headers.get(DESCRIPTION, '')}".strip()))

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, subject: str, start: int) -> FirstMatch:
        key = str(i)
        fut: asyncio.Future[FirstMatch] = loop.create_future()
        waiting[key] = fut
        body: dict[str, Any] = {"batch": 1, "next_by_subj": subject}
        if start > 0:
            body["seq"] = start
        async with gate:
            try:
                await nc.publish(direct_get_subject(stream, api(nc)), json.dumps(body).encode(),
                                 reply=f"{inbox}.{key}")
                await asyncio.wait({fut}, timeout=timeout)
                if not fut.done():
                    raise ServerUnreachable(f"no answer to a direct get on {stream} within "
                                            f"{timeout:.1f}s")
                return fut.result()
            except (nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError) as exc:
                raise ServerUnreachable(f"not connected to NATS: {exc}") from exc
            finally:
                waiting.pop(key, None)
                partial.pop(key, None)

    try:
        return list(await asyncio.gather(*(one(i, s, n) for i, (s, n) in enumerate(queries))))
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass


@dataclass(frozen=True)
class StoredMessage:
    """A message as the message-get API returns it (time and sequence apart from the
    headers, which a publisher controls)."""

    subject: str
    seq: int
    time: float | None
    headers: dict[str, str]
    data: bytes


def parse_header_block(raw: bytes) -> dict[str, str]:
    """``NATS/1.0\\r\\nName: value\\r\\n...`` → dict; the last of repeated names wins (the
    server appends its own headers after the publisher's)."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip():
            out[name.strip().decode(errors="replace")] = value.strip().decode(errors="replace")
    return out


async def msg_get(nc: Client, stream: str, seq: int = 0,
                  next_subject: str | None = None,
                  start_time: float | None = None) -> StoredMessage | None:
    """One stored message (``STREAM.MSG.GET``): by sequence, the first at or after ``seq``
    (or ``start_time``, Unix seconds) matching ``next_subject``, or the first at or after
    ``start_time``; None when there is none."""
    body: dict[str, Any] = {"seq": seq} if seq else {}
    if start_time is not None:
        body = {"start_time": datetime.fromtimestamp(start_time, UTC).isoformat().replace(
            "+00:00", "Z")}
    if next_subject is not None:
        body["next_by_subj"] = next_subject
        if start_time is None:
            body.setdefault("seq", 0)
    try:
        reply = await request(nc, f"{api(nc)}.STREAM.MSG.GET.{stream}", body)
    except ApiError as exc:
        if exc.code == 404:
            return None
        raise
    m = reply.get("message") or {}
    hdrs = base64.b64decode(m["hdrs"]) if m.get("hdrs") else b""
    return StoredMessage(
        subject=str(m.get("subject", "")), seq=int(m.get("seq", 0)),
        time=rfc3339(str(m.get("time", ""))), headers=parse_header_block(hdrs),
        data=base64.b64decode(m["data"]) if m.get("data") else b"")


async def scan_subjects(nc: Client, stream: str, filters: list[str], start_seq: int,
                        batch: int = 1000, timeout: float = API_TIMEOUT
                        ) -> AsyncIterator[tuple[int, str]]:
    """``(sequence, subject)`` of every message from ``start_seq`` on matching ``filters``,
    as it is now (later messages are not waited for): a headers-only, unacknowledged,
    in-memory ephemeral consumer pulled with ``no_wait``, deleted afterwards. The stream
    sequence and the messages still pending come from each delivery's reply subject
    (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``)."""
    name = f"cgroupd_scan_{secrets.token_hex(6)}"
    config: dict[str, Any] = {
        "ack_policy": "none", "deliver_policy": "by_start_sequence",
        "opt_start_seq": max(1, start_seq), "headers_only": True, "mem_storage": True,
        "inactive_threshold": int(30e9), "num_replicas": 1, "max_waiting": 1,
    }
    if len(filters) == 1:
        config["filter_subject"] = filters[0]
    elif filters:
        config["filter_subjects"] = filters
    await create_consumer(nc, stream, name, config)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        while True:
            await nc.publish(pull_subject(stream, name, api(nc)),
                             json.dumps({"batch": batch, "no_wait": True}).encode(),
                             reply=inbox)
            received = 0
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout)
                except nats.errors.TimeoutError as exc:
                    raise ServerUnreachable(f"scanning {stream}: no answer in "
                                            f"{timeout:.1f}s") from exc
                status = server_status(msg)
                if status is not None:
                    if status.code in ("404", "408", "409"):
                        break  # no more now, or the batch is done
                    raise ApiError(int(status.code), 0, f"scanning {stream}: "
                                   f"{status.code} {status.description}")
                # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>, or
                # with <domain>.<account hash> after ACK (and a token at the end).
                tokens = (msg.reply or "").split(".")
                if len(tokens) < 9:
                    continue
                at = 2 if len(tokens) == 9 else 4
                received += 1
                yield int(tokens[at + 3]), msg.subject
                if int(tokens[at + 6]) == 0:
                    return
                if received >= batch:
                    break
            if received == 0:
                return
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass
        try:
            await delete_consumer(nc, stream, name)
        except CgroupdError:
            pass  # it expires by itself

