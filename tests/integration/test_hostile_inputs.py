"""Input from outside the process, fuzzed: environment variables, handlers, KV records.

(Message headers, payloads and subjects: tests/integration/test_hostile_messages.py;
webhook answers: tests/unit/test_handlers.py; records written by the reference:
tests/integration/test_interop.py.)

The promise under attack: a bad input gets a clear message and a non-zero exit, or a
logged, counted error; a running member never crashes, stalls or loses a message on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from structlog.testing import capture_logs
from typer.testing import CliRunner

from cgroupd import admin
from cgroupd.cli import app
from cgroupd.core.config import ELASTIC_BUCKET, group_key
from cgroupd.core.errors import ConfigError
from cgroupd.core.settings import MemberSettings
from cgroupd.member import MemberState
from tests.support.cli import (
    ROOT,
    JoinProcess,
    child_env,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import Record, all_done, check, make_group, publish_keyed
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually

runner = CliRunner()


def _envvars() -> list[str]:
    command = typer.main.get_command(app)
    params = [*command.params, *command.commands["join"].params]  # type: ignore[attr-defined]
    names = []
    for p in params:
        names += [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
    return sorted({n for n in names if n.startswith("CGROUPD_")})


#: Variables whose junk would reach the network or import arbitrary modules: fuzzed with
#: local or inert values only.
_CONFINED = {
    "CGROUPD_SERVER": st.sampled_from(["", "nats://127.0.0.1:1", "nats://[::1]:1", "junk://",
                                       "nats://127.0.0.1:99999", "127.0.0.1:notaport"]),
    "CGROUPD_METRICS_HOST": st.sampled_from(["", "127.0.0.1", "::1"]),
    "CGROUPD_HANDLER": st.sampled_from(["", ":", "a", "a:", ":b", "no_such_module_zz:fn",
                                        "tests.support.handlers.broken_handler:handle",
                                        "tests.support.handlers.record_handler:missing",
                                        "tests.support.handlers.record_handler:json"]),
    "CGROUPD_WEBHOOK": st.sampled_from(["", "ftp://x", "http://", "not a url",
                                        "http://127.0.0.1:1/hook"]),
}
_JUNK = st.one_of(
    st.sampled_from(["", " ", "nan", "NaN", "inf", "-inf", "1e309", "-1", "0", "-0",
                     "99999999999999999999", "1.5", "0x10", "true", "maybe", "é", "☃",
                     "a b", "a.b", "*", ">", "header:", "tokens:0", "tokens:a",
                     "100000000", "3600000000", "1e-300", "partition", "pinned"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=30),
)
ENVVARS = _envvars()


@st.composite
def junk_environment(draw: Any) -> dict[str, str]:
    names = draw(st.lists(st.sampled_from(ENVVARS), min_size=1, max_size=3, unique=True))
    return {n: draw(_CONFINED.get(n, _JUNK)) for n in names}


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(env=junk_environment())
def test_junk_environment_gives_a_clear_error_never_a_crash(env: dict[str, str]) -> None:
    """``cgroupd join`` configured from CGROUPD_* variables holding junk (non-numbers,
    NaN, infinities, huge and negative numbers, unicode, wildcards, empty strings) exits
    2 with a one-line reason, or, when the junk is acceptable, gets as far as connecting
    (here to a closed port: exit 1). Never a traceback."""
    base = {"CGROUPD_SERVER": "nats://127.0.0.1:1", "CGROUPD_STREAM": "S",
            "CGROUPD_GROUP": "g", "CGROUPD_MEMBER": "m", "CGROUPD_CONNECT_TIMEOUT": "0.2",
            "CGROUPD_HANDLER": "tests.support.handlers.record_handler:handle"}
    clean = {k: None for k in os.environ if k.startswith("CGROUPD_") or k == "NATS_URL"}
    merged = {**base, **env}
    if env.get("CGROUPD_WEBHOOK"):
        merged.pop("CGROUPD_HANDLER", None)
    result = runner.invoke(app, ["join"], env={**clean, **merged})
    assert result.exit_code in (1, 2), (merged, result.exit_code, result.output,
                                        result.exception)
    assert isinstance(result.exception, SystemExit), (merged, result.exception)
    assert "Traceback" not in result.output, (merged, result.output)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("cgroupd: error:"), (merged, result.output)
    assert len(lines[-1]) < 2000


@settings(max_examples=300, deadline=None, database=None)
@given(st.dictionaries(
    st.sampled_from(["ack_wait", "retry_interval", "inactive_threshold", "pull_expires",
                     "heartbeat", "pinned_ttl", "rejoin_delay", "transition_delay",
                     "transition_jitter", "drain_timeout", "retry_backoff",
                     "retry_backoff_max"]),
    st.floats(allow_nan=True, allow_infinity=True), max_size=4))
def test_member_settings_accept_only_usable_durations(values: dict[str, float]) -> None:
    """MemberSettings either refuses a duration with a reason or holds one the runtime
    can use: finite, within a week, convertible to nanoseconds."""
    try:
        s = MemberSettings(**values)  # type: ignore[arg-type]
    except ConfigError as exc:
        assert str(exc)
        return
    for name in values:
        value = getattr(s, name)
        assert value == value and 0 <= value <= 7 * 24 * 3600
        int(value * 1e9)


@pytest.mark.slow
@pytest.mark.parametrize(("var", "value", "reason"), [
    ("CGROUPD_ACK_WAIT", "nan", "ack_wait must be positive"),
    ("CGROUPD_ACK_WAIT", "inf", "ack_wait must be positive"),
    ("CGROUPD_INACTIVE_THRESHOLD", "1e309", "inactive_threshold must be positive"),
    ("CGROUPD_RETRY_INTERVAL", "inf", "retry_interval must be positive"),
    ("CGROUPD_DRAIN_TIMEOUT", "nan", "drain_timeout must not be negative"),
    ("CGROUPD_WEBHOOK_TIMEOUT", "nan", "webhook timeout must be a positive"),
    ("CGROUPD_MAX_IN_FLIGHT", "100000000", "max_in_flight must be at least 1 and at most 100000"),
])
async def test_values_that_used_to_crash_or_stall_a_running_member(
        nats_server: NatsServer, jetstream: Any, tmp_path: Path, var: str, value: str,
        reason: str) -> None:
    """Against a real server and group: NaN and infinite durations used to pass the
    checks and then crash the member runtime ("cannot convert float NaN to integer") or
    leave it never retrying (retry interval inf). Now: exit 2, before connecting."""
    await make_group(jetstream, partitions=2, members=("m",))
    env = child_env(**{var: value})
    hook = ["--webhook", "http://127.0.0.1:1/hook"] if "WEBHOOK" in var else [
        "--handler", "tests.support.handlers.record_handler:handle"]
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "cgroupd", "--server", nats_server.url, "join",
                         "--stream", "ORDERS", "--group", "g", "--member", "m", *hook],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert reason in done.stderr, done.stderr


# -- handlers that misbehave -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("handler", ["misbehave_async", "misbehave_sync"])
@pytest.mark.parametrize("ordering", ["partition", "key", "none"])
async def test_misbehaving_handlers_never_stop_a_member(
        nats_server: NatsServer, jetstream: Any, nc: Client, tmp_path: Path, handler: str,
        ordering: str) -> None:
    """A ``cgroupd join`` whose handler, on each message's first delivery, raises
    SystemExit, KeyboardInterrupt, GeneratorExit, a BaseException subclass or its own
    CancelledError, or returns a generator: each is retried (the daemon used to die of
    the first SystemExit, and a BaseException left its key stuck), every message
    completes exactly once, in order per key for the ordered modes, and the process
    never exits nor steps down."""
    await make_group(jetstream, partitions=2, members=("m",))
    record = tmp_path / "handled.jsonl"
    proc = JoinProcess(nats_server.url, tmp_path, "m", "--stream", "ORDERS", "--group", "g",
                       "--member", "m", "--ordering", ordering, "--handler",
                       f"tests.support.handlers.record_handler:{handler}", record=record,
                       metrics=False)
    try:
        js = nc.jetstream()
        sent = []
        for n in range(35):
            key = f"k{n % 3}"
            await js.publish(f"orders.{key}", json.dumps({"key": key, "n": n}).encode())
            sent.append((key, n))
        want = {n for _, n in sent}

        def finished() -> bool:
            assert proc.proc.poll() is None, proc.log_text()[-3000:]
            return want <= {e["n"] for e in Record.load([record]).ends()}

        await eventually(finished, 30, what="every message completed")
        verdict = check(Record.load([record]), sent)
        assert not verdict.lost and verdict.duplicates == 0, verdict
        if ordering != "none":
            assert not verdict.order_violations, verdict.order_violations[:5]
        starts = [e for e in Record.load([record]).events if e["event"] == "start"]
        assert len(starts) == 35 + 30  # every n % 7 != 6 failed once
        events = proc.events()
        assert not [e for e in events if e.get("event") == "stepped down"], events[-5:]
        assert sum("handler failed" in e.get("event", "") for e in events) >= 30
    finally:
        proc.close()


# -- group records written by anyone --------------------------------------------------------
async def _hostile_records(nc: Client, key: str, stop: asyncio.Event) -> int:
    """Write hostile records to the group's key until ``stop``: garbage, wrong shapes,
    records over the bounds, a 10,000-name member list (valid: the member loses its
    partitions), records whose message headers look like server statuses, deletes of
    nothing. Returns how many were written."""
    subject = f"$KV.elastic-consumer-groups.{key}"
    filters = [{"filter": "orders.*", "partitioning_wildcards": [1]}]
    big = [f"x{i:05}" for i in range(10_000)]
    records: list[tuple[bytes, dict[str, str] | None]] = [
        (b"not json", None), (b"", None), (b"[1,2]", None), (b"\xff\xfe", None),
        (b"[" * 50_000, None),
        (json.dumps({"max_members": 10**9, "partitioning_filters": filters}).encode(), None),
        (json.dumps({"max_members": 4, "partitioning_filters": filters,
                     "members": big}).encode(), None),
        (json.dumps({"max_members": 4, "partitioning_filters": filters,
                     "members": [*big, "y"] * 2}).encode(), None),
        (json.dumps({"max_members": 4, "partitioning_filters": filters,
                     "members": ["m1"]}).encode(), {"Status": "503"}),
        (json.dumps({"max_members": 4, "partitioning_filters": filters,
                     "members": ["m1"]}).encode(), {"Status": "404", "Description": "x"}),
        (b"", {"Status": "100", "Description": "Idle Heartbeat"}),
        (json.dumps({"max_members": 5, "partitioning_filters": filters,
                     "members": ["m1"]}).encode(), None),  # changed shape: ignored
    ]
    written = 0
    while not stop.is_set():
        for data, headers in records:
            await nc.publish(subject, data, headers=headers)
            written += 1
        await asyncio.sleep(0.01)
    return written


@pytest.mark.slow
async def test_member_survives_hostile_and_concurrent_record_writers(
        fleet: Any, jetstream: Any, nc: Client) -> None:
    """While traffic flows: one writer floods the group record with garbage, records over
    the bounds, 10,000-name member lists and records carrying Status headers (in a bucket
    with direct get, as the reference creates it), and six admin writers add and drop
    members concurrently (compare-and-set). The member never stops or crashes; once the
    record is put right it owns every partition again; every message is processed
    exactly once, in order per key; every concurrent membership change landed."""
    await nc.jetstream().create_key_value(KeyValueConfig(bucket=ELASTIC_BUCKET, direct=True))
    await make_group(jetstream, partitions=4, members=("m1",))
    m = await fleet.add("m1")
    await eventually(lambda: m.active, what="m1 active")

    async def churn(i: int) -> None:
        for j in range(5):
            await admin.add_members(jetstream, "ORDERS", "g", [f"w{i}-{j}"])
            await admin.drop_members(jetstream, "ORDERS", "g", [f"w{i}-{j}"])
        await admin.add_members(jetstream, "ORDERS", "g", [f"kept{i}"])

    # Six concurrent compare-and-set writers while traffic flows: every change lands.
    sent = await publish_keyed(jetstream, 30, keys=6)
    await asyncio.gather(*(churn(i) for i in range(6)))
    members = (await admin.get_group(jetstream, "ORDERS", "g")).config.members
    assert sorted(members) == ["kept0", "kept1", "kept2", "kept3", "kept4", "kept5", "m1"]
    # Then a flood of hostile records, raw (no compare-and-set) while traffic flows.
    stop = asyncio.Event()
    with capture_logs() as logged:
        flood = asyncio.create_task(_hostile_records(nc, group_key("ORDERS", "g"), stop))
        sent += await publish_keyed(jetstream, 60, keys=6, start=30)
        await asyncio.sleep(0.5)
        more = await publish_keyed(jetstream, 30, keys=6, start=90)
        stop.set()
        written = await flood
    assert written > 100
    assert m.state is not MemberState.STOPPED and m.stop_reason is None
    # The watch reads the latest record after each notification, so of a burst it may
    # read only the last: a record that changes the group's shape, logged as ignored too
    # (CI on b8f56d5, two workers: only those were read during the flood).
    ignored = [e for e in logged if e["event"] in (
        "invalid group record ignored", "group record changed more than membership; ignored")]
    assert ignored, "bad records are logged"
    assert not [e for e in logged if e["event"] == "member runtime failed"]
    # Put it right (as an operator would), then everything is processed by m1.
    rec = await jetstream.get_record(ELASTIC_BUCKET, group_key("ORDERS", "g"))
    good = json.dumps({"max_members": 4, "members": ["m1"], "partitioning_filters": [
        {"filter": "orders.*", "partitioning_wildcards": [1]}]}).encode()
    await jetstream.update_record(ELASTIC_BUCKET, group_key("ORDERS", "g"), good,
                                  last=rec.revision if rec else 0)
    await eventually(lambda: m.active and m.partitions == (0, 1, 2, 3), 20,
                     what="m1 owning every partition again")
    await all_done(fleet, sent + more, timeout=30)
    verdict = check(fleet.record, sent + more)
    verdict.assert_ok()
    assert verdict.duplicates == 0
