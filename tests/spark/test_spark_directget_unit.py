"""The direct-get reader's fast trailer match gives exactly what
:func:`cgroupd.nats.jsapi.direct_message` gives, for any header block a publisher and the
server can produce (hostile own headers, statuses, odd trailers)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

from cgroupd.nats import jsapi
from cgroupd.spark.directget import DirectGet, Item, _Call

_TEXT = st.binary(max_size=30).filter(lambda b: b"\r\n" not in b)
_NAMES = st.sampled_from([b"Nats-Stream", b"Nats-Subject", b"Nats-Sequence", b"Status",
                          b"Nats-Time-Stamp", b"Nats-Num-Pending", b"Nats-Last-Sequence",
                          b"X"])
_OWN = st.lists(st.tuples(_NAMES, _TEXT), max_size=4)
_NUMBER = st.one_of(st.integers(0, 10**12).map(lambda n: str(n).encode()), _TEXT)


@st.composite
def _header(draw: st.DrawFn) -> bytes:
    first = draw(st.sampled_from([b"NATS/1.0", b"NATS/1.0 204 EOB", b"NATS/1.0 404"]))
    own = b"".join(b"\r\n" + k + b": " + v for k, v in draw(_OWN))
    stream = draw(st.sampled_from([b"S", b"T", b"S\r"]))
    trailer = [b"Nats-Stream: " + stream, b"Nats-Subject: " + draw(_TEXT),
               b"Nats-Sequence: " + draw(_NUMBER),
               b"Nats-Time-Stamp: " + draw(_TEXT), b"Nats-Num-Pending: " + draw(_NUMBER),
               b"Nats-Last-Sequence: " + draw(_NUMBER)]
    cut = draw(st.integers(0, 6))
    if draw(st.booleans()):
        trailer = trailer[:cut]
    body = first + own + b"".join(b"\r\n" + line for line in trailer)
    return body + draw(st.sampled_from([b"\r\n\r\n", b"\r\n", b""]))


def _received(hdr: bytes) -> list[Item]:
    loop = asyncio.new_event_loop()
    try:
        dg = DirectGet(None, "S")  # type: ignore[arg-type]
        call = _Call(True, done=loop.create_future())
        dg._calls[b"1"] = call
        dg._receive(b"1", hdr, b"payload")
        return call.items
    finally:
        loop.close()


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(hdr=_header())
def test_fast_trailer_match_agrees_with_jsapi(hdr: bytes) -> None:
    found = jsapi.direct_message(hdr, b"S", True)
    want = [] if found is None else [(found[2], found[1], found[3], hdr, found[0],
                                      b"payload")]
    assert _received(hdr) == want
