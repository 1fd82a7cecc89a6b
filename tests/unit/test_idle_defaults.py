"""Idle-cost defaults (issue 15 §3): what they trade, checked where it could break."""

from __future__ import annotations

import sys

from cgroupd.core.settings import Exclusivity, MemberSettings


def test_sync_pulls_are_long_and_pinned_pulls_keep_the_pin() -> None:
    """Sync mode: long pulls and sparse heartbeats (crash detection is the presence
    probe's); pinned mode pulls well within its pinned TTL, also when a static group turns
    default sync settings into pinned ones."""
    sync = MemberSettings()
    assert sync.pull_expires == 5.0 and sync.heartbeat == 2.5
    assert MemberSettings(pull_expires=2.0).heartbeat == 1.0  # half the expiry
    assert sync.inactive_threshold >= sync.lease + sync.takeover_margin + sync.pull_expires
    pinned = MemberSettings(exclusivity=Exclusivity.PINNED)
    assert pinned.pull_expires / 2 < pinned.pinned_ttl and pinned.heartbeat == 0.25
    assert sync.with_exclusivity(Exclusivity.PINNED) == pinned
    chosen = MemberSettings(pull_expires=1.5, heartbeat=0.5)
    assert chosen.with_exclusivity(Exclusivity.PINNED).pull_expires == 1.5


def test_kill_detection_and_silence_bounds() -> None:
    """A dead owner is probed at least 4 times a second; an answer is asked for often
    enough that a live owner is never silent for the takeover threshold."""
    s = MemberSettings()
    assert s.presence_interval <= 0.25
    assert 3 * s.presence_answer_every < s.lease + s.takeover_margin


def test_a_member_process_does_not_load_aiohttp() -> None:
    """nats-py and the daemon leave aiohttp (~10 MB) out unless a webhook, the HTTP server
    or a websocket server needs it."""
    import subprocess

    code = ("import sys, cgroupd.cli, cgroupd.join.daemon, cgroupd.member; "
            "print('aiohttp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_websocket_transport_gets_aiohttp_when_asked() -> None:
    import nats.aio.transport

    from cgroupd.nats.natsload import enable_websockets

    enable_websockets()
    assert nats.aio.transport.aiohttp is not None
