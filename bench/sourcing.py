"""The server-side ceiling of elastic groups: how fast the group's work-queue stream
receives what is published to the origin stream (sourcing with a subject transform).
Run: ``python -m bench.sourcing [--messages 50000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench.common import (
    connected,
    emit,
    keyed_group,
    machine,
    origin_stream,
    publish,
    server,
    stream_messages,
    wait_for,
)


async def main(messages: int) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "sourcing", "messages": messages,
                              "machine": machine()}
    with server() as srv:
        async with connected(srv.url) as js:
            await origin_stream(js)
            await keyed_group(js, "g", 16, ("m1",))
            t0 = time.perf_counter()
            await publish(js, messages)
            published = time.perf_counter() - t0
            await wait_for(lambda: _has(js, messages), 600, 0.005, "sourcing")
            sourced = time.perf_counter() - t0
    result["publish_msgs_per_s"] = round(messages / published)
    result["sourced_msgs_per_s"] = round(messages / sourced)
    result["sourcing_lag_after_publish_s"] = round(sourced - published, 3)
    result["ratio_sourced_to_published"] = round(published / sourced, 2)
    return result


async def _has(js: Any, n: int) -> bool:
    return await stream_messages(js, "BENCH-g") >= n


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=50000)
    emit(asyncio.run(main(parser.parse_args().messages)))
