"""What the benchmarks (bench/) compute is right: their analysis, fed hand-made records
and profiles (each benchmark run end to end, tiny: tests/integration/test_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import failover, fleet, profile, revision, table, throughput, variant
from bench.common import Records, Reowned
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter


def _event(event: str, instance: str, n: int, t: float, seq: int | None = None) -> dict[str, Any]:
    return {"event": event, "instance": instance, "t": t, "subject": f"k{n % 2}", "n": n,
            "seq": n if seq is None else seq, "partition": 0}


# -- analysis ----------------------------------------------------------------------------
def test_records_read_only_complete_lines(tmp_path: Path) -> None:
    """A line still being written (or cut by kill -9) is not parsed until it ends."""
    path = tmp_path / "a.jsonl"
    first = json.dumps(_event("end", "a", 1, 1.0))
    second = json.dumps(_event("end", "a", 2, 2.0))
    path.write_text(first + "\n" + second[:10])
    records = Records(tmp_path)
    assert [e["n"] for e in records.poll()] == [1]
    assert records.count_ends() == 1
    with open(path, "a") as out:
        out.write(second[10:] + "\n")
    assert [e["n"] for e in records.poll()] == [2]
    assert records.count_ends() == 2
    assert records.poll() == []


def _end(member: str, partition: int, n: int, t: float, pt: float | None = None
         ) -> dict[str, Any]:
    return {"event": "end", "instance": f"{member}-0", "member": member, "t": t, "n": n,
            "partition": partition, "pt": pt}


def test_a_moved_partition_is_reowned_by_its_new_owner_with_new_traffic() -> None:
    """Members a, b own partitions 0-1 and 2-3; c and d added at t=1.0 take 2 and 3 and
    b moves to 1. Only a completion after the change, by the new owner, of a message
    published after the change (n >= 100) counts."""
    def config(*members: str) -> ElasticGroupConfig:
        return ElasticGroupConfig(max_members=4, members=members,
                                  partitioning_filters=(PartitioningFilter("x.*", (1,)),))

    reowned = Reowned(config("a", "b"), config("a", "b", "c", "d"), 1.0,
                      lambda e: e["member"], first_n=100)
    assert reowned.moved == {1, 2, 3}
    assert not reowned.see([
        _end("b", 1, 101, 0.5),  # before the change
        _end("a", 1, 102, 1.2),  # the old owner, still at it
        _end("b", 1, 99, 1.3),  # the new owner, but a backlog message
        _end("b", 1, 103, 1.4),
        _end("c", 2, 104, 1.1),
        _end("a", 0, 105, 1.1),  # not moved
    ])
    assert reowned.see([_end("d", 3, 106, 2.0)])
    assert sorted(round(s, 3) for s in reowned.seconds()) == [0.1, 0.4, 1.0]


def test_fleet_latency_counts_each_message_once_within_its_window() -> None:
    """Publish to first completion, for messages of the windows' partitions published
    within their window; a rerun, another partition or an unstamped message is not."""
    ends = [_end("b", 1, 5, 1.35, pt=1.1), _end("c", 1, 5, 1.6, pt=1.1),
            _end("b", 1, 6, 1.7, pt=1.5), _end("b", 2, 7, 1.3, pt=1.1),
            _end("b", 1, 8, 1.3)]
    assert [round(s, 3) for s in fleet.waited(ends, {1: (1.0, 1.4)})] == [0.25]


def test_a_stall_taken_over_is_judged() -> None:
    """Old owner ``a`` blocks in #2 from 1.0 to 3.0 s; ``b`` starts #3 at 2.0 s (while
    ``a`` is busy: an overlap) and runs #2 again; ``a`` starts #4 after that."""
    events = [
        _event("start", "a", 1, 0.89), _event("end", "a", 1, 0.9),
        _event("start", "a", 2, 1.0),
        _event("start", "b", 3, 2.0), _event("end", "b", 3, 2.01),
        _event("start", "b", 2, 2.5), _event("end", "b", 2, 2.51),
        _event("end", "a", 2, 3.0),
        _event("start", "a", 4, 3.1), _event("end", "a", 4, 3.11),
    ]
    records = Records()
    records.events = events
    judged = failover.judge_stall(records, "a", "b", 1.0, 5.0)
    assert judged["took_over"]
    assert judged["overlapping_runs"] >= 1
    assert judged["run_by_both"] == 1
    assert judged["old_starts_after_takeover"] == 1
    assert judged["longest_gap_s"] == pytest.approx(1.11)  # 0.9 (#1) to 2.01 (#3)
    quiet = failover.judge_stall(records, "a", "b", 3.05, 5.0)
    assert not quiet["took_over"] and quiet["overlapping_runs"] == 0


def test_py_spy_samples_are_attributed(tmp_path: Path) -> None:
    """Samples go to their innermost cgroupd (or handler) frame below the event loop's
    dispatch, or to the loop callback when no cgroupd frame is in it; areas by file."""
    loop = ("<module> (/v/cgroupd/__main__.py);run (/py/lib/python3.11/asyncio/runners.py);"
            "Handle._run (/py/lib/python3.11/asyncio/events.py)")
    raw = tmp_path / "raw.txt"
    raw.write_text(
        f"{loop};Dispatcher._invoke (/v/cgroupd/member/dispatch.py);events (/w/bench/handlers.py);"
        "dumps (/py/lib/python3.11/json/__init__.py) 3\n"
        f"{loop};Client._read_loop (/v/site-packages/nats/aio/client.py);"
        "Parser.parse (/v/site-packages/nats/protocol/parser.py) 1\n"
        # py-spy caught the loop inside Handle._run itself, and a thread with no Python
        # frame: the first is the loop's own time, the second no sample at all.
        f"{loop} 1\nprocess 12:\"python\";thread (0x7f) 2\n"
        # Waiting for the socket is not CPU: counted apart, the rest scaled to the CPU.
        "<module> (/v/cgroupd/__main__.py);run (/py/lib/python3.11/asyncio/runners.py);"
        "BaseEventLoop._run_once (/py/lib/python3.11/asyncio/base_events.py);"
        "EpollSelector.select (/py/lib/python3.11/selectors.py) 5\n")
    result = profile.analyse_py_spy(raw, 125.0, 10)
    assert result["samples"] == 10 and result["waiting_in_select_share"] == 0.5
    owners = {r["what"]: (r["share"], r["us_per_msg"])
              for r in result["by_innermost_cgroupd_frame"]}
    assert owners["events (bench/handlers.py)"] == (0.6, 75.0)
    assert owners["(no cgroupd frame) Client._read_loop (nats/aio/client.py)"] == (0.2, 25.0)
    assert owners["(no cgroupd frame) Handle._run (asyncio/events.py)"] == (0.2, 25.0)
    areas = {r["what"]: r["share"] for r in result["by_area"]}
    assert areas == {"json": 0.6, "nats-py": 0.2, "asyncio": 0.2}
    inclusive = {r["what"] for r in result["inclusive_within_loop_callbacks"]}
    assert "run (asyncio/runners.py)" not in inclusive  # outside the loop's callbacks


def test_wall_split_times_each_step_between_two_messages() -> None:
    """One-at-a-time member: handler 0.1 ms, then ack, pull, write, receive, submit, and
    the next start; a gap whose message came before the handler ended is not a round
    trip, and another instance's records do not count."""
    records = [_event("start", "a", 1, 10.0), _event("end", "a", 1, 10.0001),
               _event("start", "a", 2, 10.0020), _event("end", "a", 2, 10.0021),
               _event("start", "a", 3, 10.0022), _event("end", "a", 3, 10.0023),
               _event("start", "b", 4, 10.0010), _event("end", "b", 4, 10.0011)]
    steps = [{"t": t, "step": s} for t, s in (
        (10.0002, "ack"), (10.0003, "pull"), (10.0004, "write"), (10.0016, "receive"),
        (10.0017, "submit"),
        (10.00205, "receive"),  # message 3 arrived while message 2 ran: prefetched
        (10.00215, "ack"))]
    split = profile.wall_split(records, steps, "a")
    assert split["messages"] == 3 and split["handlers_overlapping"] == 0
    assert split["gaps_with_message_already_received"] == 1
    assert split["steps_per_message"]["ack"] == pytest.approx(2 / 3, abs=0.01)
    assert split["handler"]["p50_us"] == pytest.approx(100, abs=1)
    between = split["between_messages"]
    expected = {"settle": 100, "refill": 100, "flush": 100, "server round trip": 1200,
                "puller": 100, "dispatch": 300}
    for name, part in between.items():
        assert part["count"] == 1
        assert part["mean_us"] == pytest.approx(expected[name.split(":")[0]], abs=1), name


def test_tables_render_every_benchmark() -> None:
    """Each benchmark's JSON becomes a Markdown table with its rows and targets; a file
    that is no benchmark's output is refused with a clear message."""
    result = {"benchmark": "throughput", "shape": {"members": 4, "messages": 20000},
              "machine": {"cores": 2}, "rows": {
                  "defaults": {"msgs_per_s": 3062, "x_peer": 0.88, "cpu_us_per_msg": 408.5,
                               "lost": 0, "order_violations": 0, "duplicates": 0},
                  "peer": {"skipped": "no Python >= 3.12"}},
              "targets": {"defaults >= 4x peer": False, "key >= 1.2x raw": None}}
    text = table.render(result)
    assert "| `defaults` | 3,062 | 0.88 | - | 408.5 | - | - | 0 / 0 / 0 |" in text
    assert "| `peer` | skipped: no Python >= 3.12 |" in text
    assert "| defaults >= 4x peer | no |" in text and "| key >= 1.2x raw | not run |" in text
    fail = {"benchmark": "failover", "setup": {"trials": 20},
            "sigkill": {"p50_s": 0.61, "p99_s": 1.35, "max_s": 1.4},
            "stall": {"sigstop": {"trials": 3, "takeovers": 0, "overlaps": 0}}}
    text = table.render(fail)
    assert "| kill -9 of the active instance | 0.610 | 1.350 | 1.400 |" in text
    assert "| stall `sigstop`: takeovers / overlaps in 3 trials | 0 / 0 |" in text
    assert "| server CPU, idle | 11.00 % | - |" in table.render(
        {"benchmark": "scale", "cgroupd": {"idle": {"server_cpu_percent": 11}}})
    gap = {"benchmark": "scale", "cgroupd": {"add_members": {
        "longest_gap_s": {"partition": 16, "seconds": 1.693}}}}
    assert "| longest gap of a partition (s) | 1.69 | |" in table.render(gap)
    with pytest.raises(ValueError, match="not a benchmark's output"):
        table.render({"rows": {}})


def test_tables_show_a_baseline_beside() -> None:
    """--baseline: throughput gets each row's ratios against its twin (every round's
    too); failover shows each cgroupd part on the baseline under ours."""
    result = {"benchmark": "throughput", "shape": {}, "machine": {},
              "baseline": {"revision": "54b2c95", "rows": {"key": "key@54b2c95"}},
              "rows": {"key@54b2c95": {"msgs_per_s": 10000}, "key": {
                  "msgs_per_s": 9000, "x_baseline": 0.9, "x_baseline_by_cpu": 1.02,
                  "x_baseline_rounds": [0.9, 1.1]}}}
    text = table.render(result)
    assert "| `key` | 0.90 | 1.02 | 0.90, 1.10 |" in text
    assert "against `54b2c95`" in text and "| `key@54b2c95` | 10,000 |" in text
    fail = {"benchmark": "failover", "setup": {}, "baseline": {"revision": "54b2c95"},
            "sigkill": {"p50_s": 0.3, "p99_s": 0.5, "max_s": 0.5},
            "sigkill@54b2c95": {"p50_s": 0.4, "p99_s": 0.6, "max_s": 0.7}}
    lines = table.render(fail).splitlines()
    at = lines.index("| kill -9 of the active instance | 0.300 | 0.500 | 0.500 |")
    assert lines[at + 1] == ("| kill -9 of the active instance, on `54b2c95` | 0.400 | "
                             "0.600 | 0.700 |")


def test_throughput_ratios_and_targets() -> None:
    rows: dict[str, dict[str, Any]] = {
        "defaults": {"msgs_per_s": 8000, "lost": 0, "order_violations": 0, "duplicates": 0,
                     "cpu_us_per_msg": 100.0, "server_cpu_us_per_msg": 50.0},
        "key": {"msgs_per_s": 30000, "cpu_us_per_msg": 60.0},
        "peer": {"msgs_per_s": 2000, "cpu_us_per_msg": 400.0, "server_cpu_us_per_msg": 200.0},
        "raw": {"msgs_per_s": 24000},
    }
    throughput.ratios(rows)
    assert rows["defaults"]["x_peer"] == 4.0 and rows["key"]["x_raw"] == 1.25
    # (400 + 200) / (100 + 50): the peer's and the server's CPU per message over the row's
    assert rows["defaults"]["x_peer_by_cpu"] == 4.0 and "x_peer_by_cpu" not in rows["key"]
    goals = throughput.targets(rows)
    assert goals["defaults >= 4x peer"] is True
    assert goals["key >= 1.2x raw"] is True
    assert goals["member_in_stream_order >= 2.5x peer"] is None  # that row did not run
    rows["key"]["duplicates"] = 1
    assert throughput.targets(rows)[
        "every row: nothing lost, per-key order, no duplicates"] is False


def test_rounds_merge_to_medians_and_summed_checks() -> None:
    """Three rounds: each row reports its median round, ratios are the medians of the
    ratios within a round (not of medians), and a loss in any round shows."""
    def run(key: int, peer: int, lost: int = 0) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {
            name: {"msgs_per_s": rate, "cpu_us_per_msg": 1.0, "server_cpu_us_per_msg": 1.0,
                   "lost": lost if name == "key" else 0, "order_violations": 0,
                   "duplicates": 0} for name, rate in (("key", key), ("peer", peer))}
        throughput.ratios(rows)
        return rows

    merged = throughput.merge_rounds([run(9000, 3000), run(4000, 1000, lost=1),
                                      run(6000, 2500)])
    assert merged["key"]["msgs_per_s"] == 6000
    assert merged["key"]["x_peer_rounds"] == [3.0, 4.0, 2.4]
    assert merged["key"]["x_peer"] == 3.0  # the median ratio, not 6000 / 2500
    assert merged["key"]["lost"] == 1
    assert throughput.targets(merged)[
        "every row: nothing lost, per-key order, no duplicates"] is False


def test_baseline_twins_run_beside_their_rows_and_give_ratios() -> None:
    """--baseline: each cgroupd row is preceded by its twin on the baseline (named by its
    revision), the order flips on odd rounds, and the row's ratios are against its twin:
    msg/s over the twin's, the twin's CPU per message (and the server's) over the row's."""
    rows = [row for row in throughput.ROWS if row.name in ("key", "raw")]
    ran, twins = throughput.with_baseline(rows, Path("/base"), "54b2c95")
    assert [r.name for r in ran] == ["key@54b2c95", "key", "raw"]
    assert twins == {"key": "key@54b2c95"}
    assert ran[0].code == Path("/base") and ran[0].args == ran[1].args == ("--ordering", "key")
    assert ran[1].code == throughput.ROOT and ran[2].code is None  # same launcher both sides
    assert [r.name for r in throughput.in_turn(ran, twins, 1)] == ["key", "key@54b2c95", "raw"]
    assert throughput.in_turn(ran, twins, 2) == ran

    def run(mine: int, theirs: int) -> dict[str, dict[str, Any]]:
        done: dict[str, dict[str, Any]] = {
            name: {"msgs_per_s": rate, "cpu_us_per_msg": cpu, "server_cpu_us_per_msg": 10.0,
                   "lost": 0, "order_violations": 0, "duplicates": 0}
            for name, rate, cpu in (("key", mine, 40.0), ("key@54b2c95", theirs, 50.0))}
        throughput.ratios(done, twins)
        return done

    one = run(9000, 10000)
    assert one["key"]["x_baseline"] == 0.9 and one["key"]["x_baseline_by_cpu"] == 1.2
    assert "x_baseline" not in one["key@54b2c95"]
    merged = throughput.merge_rounds([one, run(5000, 4000), run(6000, 6000)])
    assert merged["key"]["x_baseline_rounds"] == [0.9, 1.25, 1.0]
    assert merged["key"]["x_baseline"] == 1.0


def test_failover_rounds_pool_trials_and_the_baseline_ratio() -> None:
    """A side's rounds pool their trials (the summary taken again over all), sum counts
    and take the longest gap; x_baseline divides the baseline's times by ours."""
    def side(times: list[float], lost: int, gap: float) -> dict[str, Any]:
        return {"sigkill": {"what": "kill", **failover.summary(times),
                            "from_last_processed": failover.summary(times)},
                "stall": {"sigstop": {"trials": 1, "stall_s": 2.0, "takeovers": 0,
                                      "longest_gap_s": gap}},
                "cgroupd_checks": {"published": 10, "lost": lost},
                "cgroupd_files": ["/a/cgroupd/__init__.py"]}

    pooled = failover.pool([side([0.2, 0.4], 0, 0.5), side([0.3], 1, 0.9)])
    assert pooled["sigkill"]["trials_s"] == [0.2, 0.4, 0.3]
    assert pooled["sigkill"]["p50_s"] == 0.3 and pooled["sigkill"]["max_s"] == 0.4
    assert pooled["sigkill"]["what"] == "kill"
    assert pooled["sigkill"]["p50_s_rounds"] == [0.4, 0.3]  # nearest rank: the upper of two
    assert pooled["sigkill"]["from_last_processed"]["trials_s"] == [0.2, 0.4, 0.3]
    assert pooled["stall"]["sigstop"] == {"trials": 2, "stall_s": 2.0, "takeovers": 0,
                                          "longest_gap_s": 0.9}
    assert pooled["cgroupd_checks"] == {"published": 20, "lost": 1}
    assert pooled["cgroupd_files"] == ["/a/cgroupd/__init__.py"]
    result = {"sigkill": failover.summary([0.2]), "sigkill@abc": failover.summary([0.3])}
    assert failover.add_x_baseline(result, "abc") == {"sigkill": {"p50_s": 1.5,
                                                                  "p99_s": 1.5}}
    assert result["sigkill"]["x_baseline"] == {"p50_s": 1.5, "p99_s": 1.5}


def test_a_baseline_is_checked_and_named(tmp_path: Path) -> None:
    """A directory without a cgroupd/ package is refused with how to make one; a copy
    that is no git checkout is named by its REVISION file, else by the directory."""
    with pytest.raises(ValueError, match=r"bench\.revision checkout"):
        revision.check(tmp_path)
    assert revision.main(["name", str(tmp_path)]) == 2
    (tmp_path / "cgroupd").mkdir()
    (tmp_path / "cgroupd" / "__init__.py").touch()
    assert revision.name(revision.check(tmp_path)) == tmp_path.name
    (tmp_path / "REVISION").write_text("54b2c95\n")
    assert revision.name(tmp_path) == "54b2c95"
    assert revision.name(throughput.ROOT) != "54b2c95"  # a git checkout: its own HEAD
    with pytest.raises(ValueError, match="not a commit"):
        revision.checkout("no-such-revision", tmp_path / "x")


def test_variant_settings_are_checked() -> None:
    """A proposed default is parsed as a literal; a name MemberSettings lacks is refused
    with the names it has (a typo must not measure the defaults by mistake)."""
    assert variant.parse("pull_expires=5,heartbeat=2.5") == {"pull_expires": 5,
                                                             "heartbeat": 2.5}
    with pytest.raises(SystemExit, match="pull_expires"):
        variant.parse("pull_expiry=5")
