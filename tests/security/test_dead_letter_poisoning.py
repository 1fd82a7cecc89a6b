"""Issue 25 row 5: nobody who can publish to the dead-letter subject can make a real
dead letter vanish as a "duplicate".

Today's ids were ``cgroupd-dl-<stream>-<group>-<seq>``: decoys published under them
first made the stream drop the real dead letters while the member termed the originals
and logged "dead-lettered". Against a real nats-server: decoys under those ids, then a
real ``cgroupd join`` dead-letters every message; every real one must be stored. And the
publisher itself, given a decoy under its exact id (a leaked id), stores the dead letter
under a new one, while a retry of its own publish stays one dead letter.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js import api

from cgroupd.join.daemon import jetstream_publisher
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess, restore_logging  # noqa: F401 - autouse fixture
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

MESSAGES = 12


async def _dead_letters(nc: Client) -> list[dict[str, str]]:
    js = nc.jetstream()
    info = await js.stream_info("DLQ")
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg("DLQ", seq)
        out.append({k: str(v) for k, v in (msg.headers or {}).items()}
                   | {"data": msg.data.decode()})
    return out


async def test_decoys_under_the_old_ids_cannot_swallow_dead_letters(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path) -> None:
    """12 decoys under the ids of the old scheme are in the DLQ first; then every one of
    12 messages is given up on: all 12 real dead letters are stored next to the decoys."""
    await make_group(jetstream, partitions=2, members=("m1",))
    await jetstream.add_stream(api.StreamConfig(name="DLQ", subjects=["dlq.orders"]))
    js = nc.jetstream()
    for seq in range(1, MESSAGES + 1):
        await js.publish("dlq.orders", b"decoy",
                         headers={"Nats-Msg-Id": f"cgroupd-dl-ORDERS-g-{seq}"})
    for i in range(MESSAGES):
        await js.publish(f"orders.k{i}", json.dumps({"n": i}).encode())
    proc = JoinProcess(nats_server.url, tmp_path, "join", "--stream", "ORDERS", "--group",
                       "g", "--member", "m1", "--handler",
                       "tests.security.poison_handler:handle",
                       "--dead-letter-subject", "dlq.orders")
    try:
        async with aiohttp.ClientSession() as http:
            async def all_given_up() -> bool:
                done = await proc.metric(http, "cgroupd_messages_processed_total",
                                         outcome="dead_letter")
                return done is not None and done >= MESSAGES

            await eventually(all_given_up, 30, what="every message dead-lettered",
                             diagnostics=proc.log_tail)
        letters = await _dead_letters(nc)
        events = proc.events()
    finally:
        proc.close()
    said = [e for e in events if str(e.get("event", "")).startswith("message dead-lettered")]
    assert len(said) == MESSAGES
    real = [d for d in letters if d["data"] != "decoy"]
    assert sorted(int(d["Cgroupd-Stream-Sequence"]) for d in real) == list(
        range(1, MESSAGES + 1)), f"dead letters lost: {letters}"
    assert len(letters) == 2 * MESSAGES
    assert all(d["Cgroupd-Error"].startswith("NonRetryable: cannot handle") for d in real)


async def test_publisher_republishes_over_a_decoy_and_dedups_its_own_retry(
        jetstream: JetStream, nc: Client) -> None:
    """A decoy stored under the dead letter's exact id: the PubAck says duplicate, the
    stored message is read back, is not ours, and the dead letter is published again
    under a fresh id (counted). A retry of a publish that did store ours stays one."""
    await jetstream.add_stream(api.StreamConfig(name="DLQ", subjects=["dlq.orders"]))
    js = nc.jetstream()
    taken: list[int] = []
    publish = jetstream_publisher(jetstream, on_decoy=lambda: taken.append(1))
    headers = {"Cgroupd-Error": "NonRetryable: no", "Cgroupd-Stream-Sequence": "7",
               "Cgroupd-Original-Subject": "orders.k7", "Nats-Msg-Id": "cgroupd-dl-7-abc"}
    await js.publish("dlq.orders", b"decoy", headers={"Nats-Msg-Id": "cgroupd-dl-7-abc"})

    await publish("dlq.orders", b"payload", headers)
    letters = await _dead_letters(nc)
    assert [d["data"] for d in letters] == ["decoy", "payload"]
    assert letters[1]["Nats-Msg-Id"].startswith("cgroupd-dl-7-abc-")
    assert letters[1]["Cgroupd-Stream-Sequence"] == "7" and taken == [1]

    # Our own dead letter, stored; the same publish again (a lost PubAck's retry).
    own = {**headers, "Cgroupd-Stream-Sequence": "8", "Nats-Msg-Id": "cgroupd-dl-8-def"}
    await publish("dlq.orders", b"eight", own)
    await publish("dlq.orders", b"eight", own)
    letters = await _dead_letters(nc)
    assert [d["data"] for d in letters] == ["decoy", "payload", "eight"]
    assert taken == [1], "a duplicate of our own is no decoy"

    # A decoy that copies the headers but not the payload is still not ours.
    forged = {**headers, "Cgroupd-Stream-Sequence": "9", "Nats-Msg-Id": "cgroupd-dl-9-ghi"}
    await js.publish("dlq.orders", b"forged", headers=forged)
    await publish("dlq.orders", b"nine", forged)
    letters = await _dead_letters(nc)
    assert [d["data"] for d in letters][-2:] == ["forged", "nine"] and taken == [1, 1]
