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

Host mode, for fleet benchmarks (:mod:`bench.fleet_peer`): ``python peer_driver.py host
NATS_URL STATUS_FILE RECORDS_FILE m1-0,m1-1,m2-0 STREAM GROUP [MAX_ACK_PENDING
[RESTART_AFTER]]`` starts
every named instance (``member-index``) at once in this process, each with a NATS
connection of its own (so the server sees one client per instance, as with a process per
instance), and writes what they do to ``STATUS_FILE`` every half second until SIGTERM
(the format of ``bench.fleet``'s workers): ``active`` while the instance holds its
member's consumer and pulls (every instance of a member pulls; the server serves the
pinned one), ``standby`` while its session runs without one (not in the membership, or
between consumers), ``failed`` when its start raised, ``died`` when its session ended by
itself. A timed-out connect is retried (``connect_retries``); ``elastic_consume`` is
called once, as an application would; with ``RESTART_AFTER`` > 0 seconds, an instance
whose start failed or whose session ended is started again after that long, doubling
each time up to 5 minutes, each wait spread by +-25% (``restarting`` meanwhile;
``restarts``), as Kubernetes restarts a crashed container.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
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


# -- host mode: many instances in one process ---------------------------------------------
class _Hosted:
    """One instance of host mode: its connection and its session."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.member = name.rsplit("-", 1)[0]
        self.nc: Any = None
        self.session: Any = None
        self.error: str | None = None
        self.connect_retries = 0
        self.connect_failed = False
        #: Restarts after a failed start or a session that ended (``restart_after``).
        self.restarts = 0
        self.restarting = False

    def state(self) -> str:
        if self.restarting:
            return "restarting"
        if self.session is None:
            if self.connect_failed:
                return "connect-failed"
            return "failed" if self.error else "starting"
        if self.session.error is not None or self.session._done.is_set():
            self.error = self.error or f"session ended: {self.session.error!r}"
            return "died"
        return "active" if self.session.consuming else "standby"


#: Payloads of the non-JSON (round) messages this process's instances processed.
_round_payloads: list[str] = []


def _host_handler(out: Any, inst: _Hosted) -> Any:
    async def handle(msg: pcgroups.PartitionedMsg) -> None:
        data = msg.data
        if data[:1] != b"{":
            _round_payloads.append(data.decode())
        else:
            body = json.loads(data)
            # Written (line-buffered) before the ack: what a SIGKILL leaves was processed.
            out.write(json.dumps({
                "event": "end", "instance": inst.name, "member": inst.member,
                "t": time.time(), "subject": body["key"], "n": body["n"],
                "partition": msg.partition, "seq": msg.metadata.stream_seq,
                "pt": body.get("pt")}) + "\n")
        await msg.ack()
    return handle


async def _host_one(url: str, inst: _Hosted, stream: str, group: str, out: Any,
                    template: ConsumerConfig) -> None:
    while inst.nc is None:
        try:
            inst.nc = await natsio.connect(url, name=f"peer-fleet-{inst.name}")
        except TimeoutError:  # natsio's connect timeout is one (its TimeoutError subclasses it)
            inst.connect_retries += 1
            await asyncio.sleep(min(10.0, 0.5 * 2 ** min(inst.connect_retries, 5)))
        except Exception as exc:  # noqa: BLE001 - a refused connect is what we count
            inst.connect_failed, inst.error = True, f"{type(exc).__name__}: {exc}"
            return
    try:
        inst.session = await pcgroups.elastic_consume(
            inst.nc.jetstream(), stream, group, inst.member, _host_handler(out, inst), template)
    except Exception as exc:  # noqa: BLE001 - a start that failed is what we count
        inst.error = f"start failed: {type(exc).__name__}: {exc}"


async def _supervise(url: str, inst: _Hosted, stream: str, group: str, out: Any,
                     template: ConsumerConfig, restart_after: float) -> None:
    """Start the instance. Once its start failed or its session ended by itself, close
    its connection (as its process would exit); with ``restart_after`` > 0, start it
    again after that long, doubling each time up to 5 minutes (each spread by +-25%), as a
    supervisor restarts a crashed process (Kubernetes: 10 s, doubling up to 5 minutes).
    Cancelled by the host's stop."""
    while True:
        await _host_one(url, inst, stream, group, out, template)
        if inst.session is not None:
            await inst.session._done.wait()  # ended by itself: the host cancels us first
        if inst.nc is not None:
            with contextlib.suppress(Exception):
                await inst.nc.close()
        if restart_after <= 0:
            return
        inst.restarting = True
        # Spread: processes that crashed together are not restarted in lockstep.
        await asyncio.sleep(min(300.0, restart_after * 2 ** inst.restarts)
                            * random.uniform(0.75, 1.25))
        inst.restarts += 1
        inst.nc = inst.session = inst.error = None
        inst.connect_failed = inst.restarting = False


def _write_host_status(path: str, hosted: list[_Hosted]) -> None:
    states = {i.name: {"member": i.member, "state": i.state(), "error": i.error,
                       "connect_retries": i.connect_retries, "restarts": i.restarts}
              for i in hosted}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "instances": states, "processed": _round_payloads}, f)
    os.replace(tmp, path)


async def host(url: str, status: str, records: str, names: list[str], stream: str,
               group: str, max_ack_pending: int | None, restart_after: float) -> None:
    """Start the named instances at once; report their states until SIGTERM, then stop."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    hosted = [_Hosted(n) for n in names]
    template = ConsumerConfig(ack_wait=timedelta(seconds=5), max_ack_pending=max_ack_pending)
    with open(records, "a", buffering=1, encoding="utf-8") as out:
        starting = [asyncio.create_task(_supervise(url, i, stream, group, out, template,
                                                   restart_after)) for i in hosted]
        while not stop.is_set():
            _write_host_status(status, hosted)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()
        for task in starting:  # a start still retrying, a supervisor waiting
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        await asyncio.gather(*(i.session.stop() for i in hosted if i.session is not None),
                             return_exceptions=True)
        await asyncio.gather(*(i.nc.close() for i in hosted if i.nc is not None),
                             return_exceptions=True)


if __name__ == "__main__":
    if sys.argv[1] == "host":
        url_, status_, records_, names_, stream_, group_ = sys.argv[2:8]
        pending = int(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[8] != "-" else None
        restart = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
        asyncio.run(host(url_, status_, records_, names_.split(","), stream_, group_,
                         pending, restart))
    else:
        asyncio.run(main(sys.argv[1]))
