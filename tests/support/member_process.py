"""A member instance in its own process, recording everything it does to a JSON-lines file.

Tests start it with ``python -m tests.support.member_process ...`` so they can SIGKILL, SIGSTOP
and SIGTERM a real process. Each line is one event: ``state`` changes, and per message a
``start`` and an ``end`` (with whether ``double_ack`` was confirmed). Lines are flushed at
once, so a killed process leaves every completed event behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any, TextIO

import nats

from cgroupd.core.settings import Exclusivity, MemberSettings
from cgroupd.member import Member
from cgroupd.member.dispatch import Ordering
from cgroupd.nats.jetstream import JetStream
from cgroupd.nats.message import Message


class Recorder:
    def __init__(self, out: TextIO, instance: str) -> None:
        self.out = out
        self.instance = instance

    def write(self, event: str, **fields: Any) -> None:
        fields.update(event=event, instance=self.instance, t=time.time())
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()


async def main(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    settings = MemberSettings(
        exclusivity=Exclusivity(args.exclusivity),
        ordering=Ordering(args.ordering),
        max_in_flight=args.max_in_flight,
    )
    out = open(args.record, "a", buffering=1)
    member: Member

    async def handler(msg: Message) -> None:
        n = json.loads(msg.data).get("n")
        rec.write("start", subject=msg.subject, partition=msg.partition, n=n,
                  seq=msg.stream_sequence, deliveries=msg.delivery_count)
        if args.handler_delay:
            await asyncio.sleep(random.uniform(0, 2 * args.handler_delay)
                                if args.jitter else args.handler_delay)
        # At-least-once: the work is recorded before it is acknowledged, so a crash between
        # the two shows up as a duplicate, never as a loss.
        rec.write("end", subject=msg.subject, partition=msg.partition, n=n,
                  seq=msg.stream_sequence)
        try:
            await msg.double_ack()
            confirmed = True
        except Exception:  # noqa: BLE001 - recorded, the runtime redelivers
            confirmed = False
        rec.write("ack", subject=msg.subject, n=n, seq=msg.stream_sequence,
                  confirmed=confirmed)

    member = Member(
        JetStream(nc), args.stream, args.group, args.member, handler, settings,
        static=args.static,
        on_active=lambda parts: rec.write("active", partitions=list(parts)),
        on_standby=lambda why: rec.write("standby", reason=why),
    )
    rec = Recorder(out, member.instance_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await member.start()
    rec.write("started", pid=os.getpid())
    done = asyncio.ensure_future(member.wait_stopped())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({done, waiter}, return_when=asyncio.FIRST_COMPLETED)
    await member.stop()
    waiter.cancel()
    rec.write("stopped", reason=member.stop_reason)
    await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--member", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--handler-delay", type=float, default=0.0)
    parser.add_argument("--max-in-flight", type=int, default=0)
    parser.add_argument("--ordering", default="partition")
    parser.add_argument("--jitter", action="store_true")
    parser.add_argument("--exclusivity", default="sync")
    parser.add_argument("--static", action="store_true")
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
