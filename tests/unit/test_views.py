"""The operator views and parsers, without a server: advisory lines, the live view's
layout, replay plans and targets, durations and times, event payloads."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from cgroupd import views
from cgroupd.admin import replay
from cgroupd.admin.replay import PartitionPlan, Plan, Target, _origin_seq
from cgroupd.cli import app
from cgroupd.cli.parsers import parse_duration, parse_time
from cgroupd.nats import events
from tests.support.cli import restore_logging  # noqa: F401 - autouse fixture

runner = CliRunner()


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("1h30m", 5400), ("2d", 172800), ("500ms", 0.5), ("1m0.5s", 60.5),
    ("PT1H30M", 5400), ("P1DT2H", 93600), ("pt15s", 15), ("P2D", 172800),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "10", "1h-5m", "s", "P", "PT", "1y", "nan s",
                                  "5m 3s", "11000d", "-1h"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_time() -> None:
    assert parse_time("2026-05-01T10:00:00Z") == datetime(2026, 5, 1, 10, tzinfo=UTC).timestamp()
    assert parse_time("2026-05-01T12:00:00+02:00") == parse_time("2026-05-01T10:00:00Z")
    local = datetime(2026, 5, 1, 10).astimezone().timestamp()
    assert parse_time("2026-05-01T10:00:00") == local
    for bad in ("yesterday", "2026-13-01", ""):
        with pytest.raises(ValueError):
            parse_time(bad)


def test_target_needs_exactly_one_point() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Target()
    with pytest.raises(ValueError, match="exactly one"):
        Target(earliest=True, sequence=3)
    with pytest.raises(ValueError, match="at least 1"):
        Target(sequence=0)
    assert Target(time=0).describe() == "1970-01-01T00:00:00Z"


@pytest.mark.parametrize(("args", "message"), [
    ([], "exactly one of --to-earliest"),
    (["--to-earliest", "--to-sequence", "3"], "exactly one"),
    (["--by-duration", "soon"], "not a duration"),
    (["--to-time", "noon"], "not a time"),
    (["--to-earliest", "--execute", "--dry-run"], "not both"),
    (["--to-sequence", "0"], "greater than or equal to 1"),
    (["--shift-by", "-2", "--to-latest"], "exactly one of"),
    (["--to-current", "--from-file", "/nonexistent/plan.json"], "cannot read"),
    (["--to-latest", "--all-groups"], "give a GROUP or --all-groups"),
    (["--to-latest", "--export", "/nonexistent/dir/plan.json"], "does not exist"),
])
def test_replay_usage_errors(args: list[str], message: str) -> None:
    """Replay arguments are checked before connecting: exit 2 and one line."""
    result = runner.invoke(app, ["--server", "nats://127.0.0.1:1", "replay", "S", "g", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_replay_needs_a_group_or_all_groups() -> None:
    """Without GROUP, --all-groups is required (exit 2, one line)."""
    result = runner.invoke(app, ["--server", "nats://127.0.0.1:1", "replay", "S",
                                 "--to-latest"])
    assert result.exit_code == 2 and "give a GROUP or --all-groups" in result.stderr


def test_event_lines() -> None:
    """Each advisory kind reads as one line, like `nats events`."""
    base = {"member": "m1", "instance": "abc", "host": "pod-0"}
    active = events.make_event("active", "S", "g", **base, partitions=[0, 1, 2, 5])
    assert views.event_line(active).endswith(
        "S/g ACTIVE m1 instance abc on pod-0 became active: partitions 0-2,5")
    down = events.make_event("stepped_down", "S", "g", **base, reason="stalled",
                             partitions=[3])
    assert "STEPPED_DOWN m1 instance abc on pod-0 stepped down (stalled): released " \
           "partitions 3" in views.event_line(down)
    moved = events.make_event("rebalanced", "S", "g", **base, partitions=[0, 1], gained=[],
                              lost=[2, 3], seconds=0.0312)
    assert "rebalanced in 0.031s: now 0-1 (gained -, lost 2-3)" in views.event_line(moved)
    idle = events.make_event("unowned", "S", "g", **base, unowned_partitions=[0, 1],
                             members_without_instance=["m1"], idle=True, pending=7)
    assert "THE GROUP IS IDLE: partitions 0-1 have no active instance (members without " \
           "one: m1; 7 messages waiting there)" in views.event_line(idle)
    assert "INVALID advisory" in views.event_line({"type": "invalid", "data": "x"})
    with pytest.raises(ValueError):
        events.make_event("exploded", "S", "g")
    stamp = active["timestamp"]
    assert stamp.endswith("Z") and abs(datetime.fromisoformat(stamp[:-1] + "+00:00")
                                       .timestamp() - time.time()) < 5


def _data(n: int, pending: int = 3) -> dict[str, object]:
    rows = [{"partition": p, "member": f"m{p % 2}", "instance": "i" if p % 2 else None,
             "host": "h" if p % 2 else None, "pending": p * pending, "lag_seconds": float(p),
             "in_flight": 0} for p in range(n)]
    return {"stream": "S", "group": "g", "type": "elastic", "partitions": rows,
            "pending": sum(int(r["pending"]) for r in rows),  # type: ignore[call-overload]
            "max_lag_messages": (n - 1) * pending, "max_lag_seconds": float(n - 1),
            "in_flight": 0, "unowned_partitions": [p for p in range(n) if p % 2 == 0],
            "members_without_instance": ["m0"], "idle": False, "appended": 100}


def test_watch_frame_fits_the_terminal_and_shows_the_furthest_behind() -> None:
    """1,000 partitions on a 30-line terminal: the frame has at most 30 lines of at most
    the terminal's width, shows the partitions furthest behind in partition order and
    says how many it left out; rates come from the previous frame."""
    now, before = _data(1000), _data(1000, pending=2)
    before["appended"] = 40
    frame = views.watch_frame(now, before, 2.0, 80, 30, "12:00:00")
    lines = frame.splitlines()
    assert len(lines) <= 30 and max(len(line) for line in lines) <= 80
    shown = [int(line.split()[0]) for line in lines if line[:1].isdigit()]
    assert shown == sorted(shown) and shown[-1] == 999 and min(shown) > 900
    assert any(line.startswith(f"... {1000 - len(shown)} more partitions") for line in lines)
    assert "in 30/s" in lines[1]
    assert "UNOWNED partitions" in lines[2]
    full = next(line for line in lines if line.startswith("999 "))
    assert full.rstrip().endswith("#") and "#" * views.BAR_WIDTH not in full  # shrunk
    wide = views.watch_frame(now, before, 2.0, 140, 30, "12:00:00").splitlines()
    assert next(line for line in wide if line.startswith("999 ")).endswith(
        "#" * views.BAR_WIDTH)


def test_replay_text() -> None:
    plan = Plan("S", "g", False, Target(sequence=5), 5, ("m1",), [
        PartitionPlan(0, "m1", 5, 3, 0, 1), PartitionPlan(1, "m1", 5, 0, 0, 0)],
        blockers=["2 cgroupd instances of S/g are running (m1: 2)"])
    text = views.replay_text(plan.to_json())
    assert text.startswith("DRY RUN: would replay S/g (elastic) from sequence 5")
    assert "3 messages would be processed again" in text
    assert "REFUSED now:" in text and "--execute" in text
    assert json.loads(json.dumps(plan.to_json()))["partitions"][0]["dropped_pending"] == 1


def test_duration() -> None:
    assert [views.duration(x) for x in (0.04, 9.96, 59, 61, 3661, 90000, None)] == [
        "0.0s", "10.0s", "59s", "1m01s", "1h01m", "1d01h", "-"]


def test_watch_problem_frame_keeps_the_last_view_within_the_terminal() -> None:
    """A failed refresh says what failed first and keeps the last good view under it,
    marked with its time, still within the terminal's lines and width; without a view to
    keep (not a terminal) it is the two problem lines."""
    good = views.watch_frame(_data(1000), None, 0.0, 80, 30, "12:00:00")
    problem = "no consumer group 'g' on stream 'S' " + "x" * 100
    frame = views.watch_problem_frame("S", "g", problem, "12:00:05", "12:00:00", good, 80,
                                      30).splitlines()
    assert frame[0].startswith("S/g   12:00:05   CANNOT REFRESH: no consumer group 'g'")
    assert frame[1] == "retrying; the view below is from 12:00:00"
    assert frame[3] == good.splitlines()[0]
    assert len(frame) <= 29 and max(len(line) for line in frame) <= 80
    bare = views.watch_problem_frame("S", "g", "timeout", "12:00:05", "12:00:00", None,
                                     80, 30).splitlines()
    assert bare == ["S/g   12:00:05   CANNOT REFRESH: timeout",
                    "retrying; last refreshed at 12:00:00"]


def test_event_subjects_kinds_and_ids() -> None:
    """Subjects per kind under one group filter, unknown kinds refused before anything is
    published, a foreign ``type`` passed through as its own kind, fresh ids."""
    subjects = [events.event_subject("S", "g", k) for k in events.KINDS]
    assert all(s.startswith("_CGROUPD.event.S.g.") for s in subjects)
    assert events.events_filter("S", "g") == "_CGROUPD.event.S.g.>"
    assert events.info_subject("S", "g") == "_CGROUPD.info.S.g"
    with pytest.raises(ValueError):
        events.event_subject("S", "g", "exploded")
    a, b = (events.make_event("active", "S", "g") for _ in range(2))
    assert a["id"] != b["id"] and events.kind_of(a) == "active"
    assert events.kind_of({"type": "something.else"}) == "something.else"
    assert events.kind_of({}) == ""


def test_origin_sequence_of_a_sourced_message() -> None:
    """The origin sequence is the second field of Nats-Stream-Source; a missing or
    mangled header (a publisher's own, or an unsourced message) gives None, never a
    wrong number."""
    assert _origin_seq({"Nats-Stream-Source": "ORDERS 42 orders.* 0.> orders.k abc"}) == 42
    for headers in ({}, {"Nats-Stream-Source": "ORDERS"},
                    {"Nats-Stream-Source": "ORDERS -3 x"},
                    {"Nats-Stream-Source": "ORDERS 4x2 x"}):
        assert _origin_seq(headers) is None


@pytest.mark.parametrize("event", [
    {"type": events.TYPE_PREFIX + "active", "partitions": "abc"},
    {"type": events.TYPE_PREFIX + "active", "partitions": [1, "a"]},
    {"type": events.TYPE_PREFIX + "rebalanced", "seconds": "x"},
    {"type": events.TYPE_PREFIX + "rebalanced", "gained": {"a": 1}},
    {"type": events.TYPE_PREFIX + "unowned", "members_without_instance": [1, 2]},
    {"type": 5}, {}, {"type": "invalid", "subject": "s", "data": "\ufffd"},
])
def test_event_line_never_raises_on_hostile_advisories(event: dict[str, object]) -> None:
    """Whatever arrives on an advisory subject reads as one line saying what it is."""
    line = views.event_line(event)
    assert "\n" not in line
    assert any(w in line for w in ("MALFORMED", "UNKNOWN", "INVALID"))


def test_discovery_answers_are_cleaned() -> None:
    """Discovery answers keep their known fields with the right types: not an instance
    answer (wrong type, no member or instance, bad partitions) gives None; wrong-typed
    optional fields become None; long text is cut."""
    good = {"type": events.INFO_TYPE, "member": "m1", "instance": "i", "state": "active",
            "host": "h" * 500, "pid": 12, "since": "t", "partitions": [3, 1, 1],
            "in_flight": 2, "version": "1", "extra": {"big": "x"}}
    clean = events.clean_info(good)
    assert clean is not None
    assert clean["partitions"] == [1, 3] and clean["pid"] == 12 and "extra" not in clean
    assert len(clean["host"]) == 200
    for bad in ([], "x", {**good, "type": "other"}, {**good, "member": None},
                {**good, "instance": 3}, {**good, "partitions": "0-3"},
                {**good, "partitions": [True]}, {**good, "partitions": [-1]},
                {**good, "partitions": [1.5]}):
        assert events.clean_info(bad) is None, bad
    odd = events.clean_info({**good, "pid": "x", "in_flight": -1, "state": 1, "host": None})
    assert odd is not None and (odd["pid"], odd["in_flight"], odd["state"], odd["host"]) == (
        None, None, None, None)


def test_read_document_refuses_what_is_not_a_plan() -> None:
    """Not JSON, another format, a group entry without positions: one clear message."""
    with pytest.raises(ValueError, match="is not JSON"):
        replay.read_document("{", "f")
    with pytest.raises(ValueError, match="not a cgroupd replay plan"):
        replay.read_document('{"format": "x"}', "f")
    with pytest.raises(ValueError, match="group entry 0 is not valid"):
        replay.read_document(json.dumps({"format": replay.EXPORT_FORMAT, "groups": [
            {"stream": "S", "group": "g", "type": "elastic", "revision": 1,
             "partitions": 2}]}), "f")
    with pytest.raises(ValueError, match="listed twice"):
        replay.read_document(json.dumps({"format": replay.EXPORT_FORMAT, "groups": [
            {"stream": "S", "group": "g", "type": "elastic", "revision": 1,
             "partitions": 2, "positions": [{"partition": 0, "sequence": 3},
                                            {"partition": 0, "sequence": 4}]}]}), "f")


def test_replay_text_of_a_move() -> None:
    """A per-partition move (not one replay point) says where each partition is and
    resumes, what runs again and what is skipped; a clamped shift says so."""
    plan = Plan("S", "g", False, Target(shift=-2), 3, ("m1",), [
        PartitionPlan(0, "m1", 3, 2, 0, 1, current=9),
        PartitionPlan(1, "m1", 12, 0, 0, 0, current=12)],
        notes=["partition 0: only 1 of its messages are stored before it; from its first "
               "one, 3"])
    text = views.replay_text(plan.to_json())
    assert text.startswith("DRY RUN: would move S/g (elastic) to a shift of -2 per partition")
    lines = text.splitlines()
    assert lines[2].split() == ["PARTITION", "MEMBER", "NOW", "AT", "FROM", "SEQ", "AGAIN",
                                "SKIPPED", "WAITING", "(KEPT", "IN", "ORDER)"]
    assert lines[3].split() == ["0", "m1", "9", "3", "2", "0", "1"]
    assert "2 messages would be processed again" in text and "from its first one" in text
    latest = Plan("S", "g", True, Target(latest=True), 41, ("m1",), [
        PartitionPlan(0, "m1", 41, 0, 5, current=36)])
    assert "would move S/g (static) to the latest (skipping what waits)" in \
        views.replay_text(latest.to_json())
    assert "0 messages would be processed again, 5 skipped" in views.replay_text(
        latest.to_json())
