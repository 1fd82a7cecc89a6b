"""The group record watch (``JetStream.watch_record``) on a real server: a plain
subscription to the record's subject plus a read of the record, no consumer per watcher
(nats-server 2.15 caps a stream at 1,000 consumers by default, and every instance on a
server watches the one bucket: issue 27, ``bench.fleet``). It must still see every
change, a deletion, a change made while the connection was down, and a bucket with more
watchers than the server's consumer limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.client import JetStreamContext

from cgroupd.nats.jetstream import JetStream, Record
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually


async def _follow(watch: AsyncIterator[Record], seen: list[Record]) -> None:
    async for record in watch:
        seen.append(record)


async def test_every_change_and_the_deletion_are_seen_without_a_consumer(
        jetstream: JetStream, js: JetStreamContext) -> None:
    """The current record first, then each put and the delete, in order; the bucket's
    stream has no consumer for the watcher."""
    kv = await js.create_key_value(KeyValueConfig(bucket="w", history=1))
    first = await kv.put("S.g", b"one")
    seen: list[Record] = []
    task = asyncio.create_task(_follow(jetstream.watch_record("w", "S.g"), seen))
    try:
        await eventually(lambda: len(seen) == 1, 10, what="the current record")
        assert seen[0] == Record(b"one", first)
        assert (await js.stream_info("KV_w")).state.consumer_count == 0
        second = await kv.put("S.g", b"two")
        await eventually(lambda: seen[-1].revision == second, 10, what="the change")
        await kv.put("S.other", b"not ours")
        await kv.delete("S.g")
        await eventually(lambda: seen[-1].value is None, 10, what="the deletion")
        assert [r.value for r in seen] == [b"one", b"two", None]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_read_that_comes_before_the_stream_stored_the_change_is_repeated(
        jetstream: JetStream, js: JetStreamContext) -> None:
    """Subscribers hear a write before the stream has stored it: the read after the
    notification can still show the old record (injected here: the first read after the
    deletion answers as before). The watch reads again a moment later and yields the
    deletion within a second, not at the 60 s resync (CI on 868810b: a standby missed its
    group's deletion)."""
    kv = await js.create_key_value(KeyValueConfig(bucket="w", history=1))
    first = await kv.put("S.g", b"one")
    seen: list[Record] = []
    read = jetstream.get_record
    early: list[bool] = []

    async def too_early(bucket: str, key: str) -> Record | None:
        if seen and not early:
            early.append(True)
            return Record(b"one", first)  # what the stream held a moment earlier
        return await read(bucket, key)

    jetstream.get_record = too_early  # type: ignore[method-assign]
    task = asyncio.create_task(_follow(jetstream.watch_record("w", "S.g"), seen))
    try:
        await eventually(lambda: len(seen) == 1, 10, what="the current record")
        loop = asyncio.get_running_loop()
        deleted_at = loop.time()
        await kv.delete("S.g")
        await eventually(lambda: seen[-1].value is None, 5, what="the deletion")
        assert early and loop.time() - deleted_at < 1.5
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_change_nobody_announced_is_read_after_a_reconnect(
        nats_server: NatsServer, nc: Client, js: JetStreamContext) -> None:
    """A change the watch cannot hear (the record purged through the stream API, which
    publishes nothing on its subject, as a notification lost while the connection was
    down would be) is read after the next reconnect, not only at the 60 s resync."""
    kv = await js.create_key_value(KeyValueConfig(bucket="w", history=1))
    await kv.put("S.g", b"before")
    seen: list[Record] = []
    jetstream = JetStream(nc)
    task = asyncio.create_task(_follow(jetstream.watch_record("w", "S.g"), seen))
    try:
        await eventually(lambda: len(seen) == 1, 10, what="the current record")
        await js.purge_stream("KV_w", subject="$KV.w.S.g")
        assert (await jetstream.get_record("w", "S.g")) is None
        await asyncio.sleep(0.5)  # nothing to hear: the watch must not have noticed
        assert len(seen) == 1
        nats_server.restart()
        await eventually(lambda: seen[-1].value is None, 20,
                         what="the purge, read after the reconnect")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_more_watchers_than_the_servers_consumer_limit(
        jetstream: JetStream, js: JetStreamContext, nats_server: NatsServer) -> None:
    """A bucket stream limited to 5 consumers (as 2.15's default limits it to 1,000): 20
    watchers all start and all see a change (with one ordered consumer each, the sixth
    failed with err_code 10026)."""
    kv = await js.create_key_value(KeyValueConfig(bucket="w", history=1))
    info = await js.stream_info("KV_w")
    info.config.max_consumers = 5
    await js.update_stream(info.config)
    await kv.put("S.g", b"one")
    seen: list[list[Record]] = [[] for _ in range(20)]
    tasks = [asyncio.create_task(_follow(jetstream.watch_record("w", "S.g"), s))
             for s in seen]
    try:
        await eventually(lambda: all(len(s) == 1 for s in seen), 10, what="every watcher")
        revision = await kv.put("S.g", b"two")
        await eventually(lambda: all(s[-1].revision == revision for s in seen), 10,
                         what="the change at every watcher")
        assert all(not t.done() for t in tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
