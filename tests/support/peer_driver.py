"""Drives the reference implementation (natsio-pcgroups) for interop tests and benchmarks.

Run by the peer's own Python (>= 3.12, see :mod:`tests.support.peer`), so it imports nothing from
cgroupd or the tests: only the standard library and natsio. One JSON command per line on
stdin, one JSON answer per line on stdout, in order::

    {"op": "create_elastic", "stream": "S", "group": "g", "max_members": 4,
     "filters": [["orders.*", [1]]]}
    -> {"ok": true, "result": {...the stored config, as the peer writes it...}}
    -> {"ok": false, "error": "ConsumerGroupExistsError: ..."}

``consume`` starts a member instance in this process and returns at once; its handler
appends ``start`` and ``end`` events (the format of :class:`tests.support.groups.Record`) to
``record``, reading ``{"key": ..., "n": ...}`` from each JSON payload, and acks. Kill the
process to crash the instance.

Usage: ``python peer_driver.py NATS_URL``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import natsio
from natsio import pcgroups
from natsio.jetstream import ConsumerConfig


def _record(path: str, event: str, msg: pcgroups.PartitionedMsg) -> None:
    try:
        body = json.loads(msg.data)
        key, n = body["key"], body["n"]
    except (ValueError, KeyError, TypeError):
        key, n = msg.subject, -1
    meta = msg.metadata
    line = json.dumps({"event": event, "instance": f"peer-{os.getpid()}", "t": time.time(),
                       "subject": key, "n": n, "seq": meta.stream_seq,
                       "partition": msg.partition, "delivered": meta.num_delivered})
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")


class Driver:
    def __init__(self, url: str) -> None:
        self.url = url
        self.nc: Any = None
        self.js: Any = None
        self.sessions: list[Any] = []

    async def start(self) -> None:
        self.nc = await natsio.connect(self.url)
        self.js = self.nc.jetstream()

    async def run(self, op: str, args: dict[str, Any]) -> Any:
        js = self.js
        p = pcgroups
        if op == "create_elastic":
            filters = [p.PartitioningFilter(filter=f, partitioning_wildcards=list(w))
                       for f, w in args["filters"]]
            extra = {k: args[k] for k in ("max_buffered_msgs", "max_buffered_bytes")
                     if k in args}
            config = await p.create_elastic(js, args["stream"], args["group"],
                                            args["max_members"], filters, **extra)
            return config.to_wire()
        if op == "create_static":
            mappings = [p.MemberMapping(member=m, partitions=list(ps))
                        for m, ps in args.get("mappings") or []]
            config = await p.create_static(js, args["stream"], args["group"],
                                           args["max_members"], args.get("filters"),
                                           args.get("members"), mappings or None)
            return config.to_wire()
        if op == "get":
            get = p.get_elastic_config if args["kind"] == "elastic" else p.get_static_config
            return (await get(js, args["stream"], args["group"])).to_wire()
        if op == "list":
            lister = (p.list_elastic_groups if args["kind"] == "elastic"
                      else p.list_static_groups)
            return sorted(await lister(js, args["stream"]))
        if op == "add_members":
            return await p.add_members(js, args["stream"], args["group"], args["members"])
        if op == "delete_members":
            return await p.delete_members(js, args["stream"], args["group"], args["members"])
        if op == "set_mappings":
            mappings = [p.MemberMapping(member=m, partitions=list(ps))
                        for m, ps in args["mappings"]]
            await p.set_member_mappings(js, args["stream"], args["group"], mappings)
            return None
        if op == "delete_mappings":
            await p.delete_member_mappings(js, args["stream"], args["group"])
            return None
        if op == "delete":
            delete = p.delete_elastic if args["kind"] == "elastic" else p.delete_static
            await delete(js, args["stream"], args["group"])
            return None
        if op == "consume":
            consume = p.elastic_consume if args["kind"] == "elastic" else p.static_consume
            path = args["record"]

            async def handle(msg: pcgroups.PartitionedMsg) -> None:
                _record(path, "start", msg)
                _record(path, "end", msg)
                await msg.ack()

            template = ConsumerConfig(ack_wait=timedelta(seconds=args.get("ack_wait", 5)),
                                      max_ack_pending=args.get("max_ack_pending"))
            session = await consume(js, args["stream"], args["group"], args["member"],
                                    handle, template)
            self.sessions.append(session)
            return {"pid": os.getpid()}
        if op == "consuming":
            return [s.consuming for s in self.sessions]
        if op == "errors":
            return [repr(s.error) if s.error else None for s in self.sessions]
        if op == "stop":
            for session in self.sessions:
                await session.stop()
            self.sessions.clear()
            return None
        raise ValueError(f"unknown op {op!r}")


async def main(url: str) -> None:
    driver = Driver(url)
    await driver.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        try:
            command = json.loads(line)
            result = await driver.run(command.pop("op"), command)
            answer = {"ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the test
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    for session in driver.sessions:
        await session.stop()
    await driver.nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
