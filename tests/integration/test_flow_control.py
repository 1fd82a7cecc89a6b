"""The group config watch's flow control (cgroupd.natsload answers nats-py's deferred
flow control requests on demand instead of polling four times a second): a request that
nats-py defers is answered on the wire at once, and between requests the answering task
sleeps on an event instead of waking up every 0.25 s.

nats-py answers most flow control requests inline (everything before them was handed
over already); the deferred path is taken by a watch that fell behind. The server
decides when it asks (24 MB of changes to a watch blocked for a second did not make it
ask), so the request is handed to the real watch's flow control state directly, and its
answer is read off a real server."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.client import JetStreamContext

from cgroupd.jetstream import JetStream
from tests.support.polling import eventually


def _frames(task: asyncio.Task[Any]) -> list[Any]:
    """Every frame of the suspended task, its coroutine's awaits followed down."""
    out = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None)
        if frame is not None:
            out.append(frame)
        coro = getattr(coro, "cr_await", None)
    return out


def _sleeps_until_asked(task: asyncio.Task[Any]) -> bool:
    """Suspended in Event.wait (no timer), not in asyncio.sleep."""
    names = [f.f_code.co_name for f in _frames(task)]
    return "wait" in names and "sleep" not in names


async def test_deferred_flow_control_is_answered_without_polling(
        nc: Client, jetstream: JetStream, js: JetStreamContext) -> None:
    assert getattr(JetStreamContext._JSI, "_cgroupd_on_demand", False)
    kv = await js.create_key_value(KeyValueConfig(bucket="fc", history=1))
    await kv.put("k", b"0")
    seen: list[int] = []

    async def watch() -> None:
        async for record in jetstream.watch_record("fc", "k"):
            seen.append(record.revision)

    before = set(asyncio.all_tasks())
    watching = asyncio.create_task(watch())
    try:
        await eventually(lambda: bool(seen), 10, what="the initial record")
        answerers = [t for t in asyncio.all_tasks() - before
                     if getattr(t.get_coro(), "__name__", "") == "answer_when_due"]
        assert len(answerers) == 1, answerers
        answerer = answerers[0]
        await eventually(lambda: _sleeps_until_asked(answerer), 5,
                         what="the flow control task to sleep until a request")
        # Still asleep a while later: nothing woke it (nats-py's own task polls).
        await asyncio.sleep(0.6)
        assert _sleeps_until_asked(answerer)

        answers: list[bytes] = []
        inbox = nc.new_inbox()

        async def answered(msg: Any) -> None:
            answers.append(msg.data)

        sub = await nc.subscribe(inbox, cb=answered)
        await nc.flush()
        jsi = next(f.f_locals["self"] for f in _frames(answerer)
                   if f.f_code.co_name == "answer_when_due")
        jsi.schedule_flow_control_response(inbox)  # as nats-py does for a deferred one
        await eventually(lambda: len(answers) == 1, 5, what="the flow control answer")
        assert jsi._fcr is None
        await eventually(lambda: _sleeps_until_asked(answerer), 5,
                         what="the task to sleep again after answering")
        # And the watch still follows changes.
        revision = await kv.put("k", b"1")
        await eventually(lambda: seen[-1] == revision, 10, what="the next change")
        await sub.unsubscribe()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)

