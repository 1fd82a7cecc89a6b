"""The benchmarks (bench/, run on demand) still run.

Here each benchmark's ``main`` runs with tiny parameters against a real
nats-server and real ``cgroupd join`` processes (about 20 s together), so a change that
breaks a benchmark is seen here, not months later by whoever measures next; the
numbers themselves mean nothing at this size. The network-namespace part of
``bench.failover`` is left to the real runs (it needs root and takes ~7 s even when tiny).
Their analysis, fed hand-made records and profiles: tests/unit/test_bench_analysis.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import ack_cost, failover, fleet, fleet_peer, profile, revision, scale, table, throughput
from bench.common import ROOT


# -- end to end, tiny --------------------------------------------------------------------
def _json(result: dict[str, Any]) -> dict[str, Any]:
    """The printed form: valid JSON (no NaN) that reads back the same."""
    return json.loads(json.dumps(result, allow_nan=False))  # type: ignore[no-any-return]


@pytest.mark.slow
async def test_throughput_runs() -> None:
    result = _json(await throughput.main(throughput.Shape(2, 2, 8, 100),
                                         ["key", "raw", "raw_round_trip", "peer"]))
    rows = result["rows"]
    assert "| `raw_round_trip` |" in table.render(result)
    for name in ("key", "raw", "raw_round_trip"):
        assert rows[name]["lost"] == 0 and rows[name]["order_violations"] == 0, rows[name]
        assert rows[name]["msgs_per_s"] > 0 and rows[name]["cpu_us_per_msg"] >= 0
    assert rows["key"]["x_raw"] > 0
    assert "skipped" in rows["peer"] or rows["peer"]["lost"] == 0, rows["peer"]


@pytest.mark.slow
async def test_failover_runs() -> None:
    # One SIGTERM trial comes right after a kill -9 failover: both signals are exercised.
    result = _json(await failover.main({"sigterm", "stall"}, trials=1, rate=100, stall=0.3,
                                       stall_trials=1, settle=0.0, observe=0.5))
    sigterm = result["sigterm"]
    assert sigterm["p50_s"] > 0 and len(sigterm["right_after_failover"]["trials_s"]) == 1
    assert len(sigterm["the_kill_before"]["trials_s"]) == 1
    assert result["stall"]["sigstop"]["trials"] == 1
    checks = result["cgroupd_checks"]
    assert checks["lost"] == 0 and checks["order_violations"] == 0, checks


def _baseline(tmp_path: Path) -> tuple[Path, str, list[str], list[str]]:
    """A baseline made as a user makes one (``git archive HEAD cgroupd``: a copy of this
    tree's code, so the run is quick and both sides behave alike): its path, its name, and
    the ``cgroupd.__file__`` each side must have imported."""
    base = tmp_path / "base"
    short = revision.checkout("HEAD", base)
    return (base, short, [str(base.resolve() / "cgroupd" / "__init__.py")],
            [str(ROOT / "cgroupd" / "__init__.py")])


@pytest.mark.slow
async def test_throughput_runs_a_baseline_beside_each_row(tmp_path: Path) -> None:
    """--baseline: the row's twin, named by the baseline's revision, ran its processes
    from the baseline's cgroupd (the row from this tree's), and the row has its ratios."""
    base, short, theirs, ours = _baseline(tmp_path)
    result = _json(await throughput.main(throughput.Shape(2, 2, 8, 100), ["key"],
                                         with_peer=False, baseline=base))
    rows, twin = result["rows"], f"key@{short}"
    assert set(rows) == {"key", twin}
    assert rows[twin]["cgroupd_files"] == theirs and rows["key"]["cgroupd_files"] == ours
    for row in rows.values():
        assert row["lost"] == 0 and row["order_violations"] == 0 and row["msgs_per_s"] > 0
    assert rows["key"]["baseline"] == twin and rows["key"]["x_baseline"] > 0
    assert result["baseline"] == {"path": str(base.resolve()), "revision": short,
                                  "rows": {"key": twin},
                                  "x_baseline": {"key": rows["key"]["x_baseline"]}}


@pytest.mark.slow
async def test_failover_runs_a_baseline_beside(tmp_path: Path) -> None:
    """--baseline with two rounds: each side's kill -9 trials ran on its own cgroupd
    (the baseline's parts named by its revision), pooled over the rounds, with x_baseline."""
    base, short, theirs, ours = _baseline(tmp_path)
    result = _json(await failover.main({"sigkill"}, trials=1, rate=100, settle=0.0,
                                       baseline=base, rounds=2))
    assert result["cgroupd_files"] == ours and result[f"cgroupd_files@{short}"] == theirs
    for suffix in ("", f"@{short}"):
        assert len(result[f"sigkill{suffix}"]["trials_s"]) == 2, result
        assert len(result[f"sigkill{suffix}"]["p50_s_rounds"]) == 2, result
        checks = result[f"cgroupd_checks{suffix}"]
        assert checks["lost"] == 0 and checks["order_violations"] == 0, checks
    assert result["sigkill"]["x_baseline"]["p50_s"] > 0
    assert result["baseline"]["revision"] == short
    assert result["baseline"]["x_baseline"]["sigkill"] == result["sigkill"]["x_baseline"]


@pytest.mark.slow
async def test_scale_runs() -> None:
    result = _json(await scale.main(scale.Shape(
        partitions=4, members=1, instances=2, added=1, keys=16, rate=200, idle=0.5,
        settle=0.0, window=0.5), with_peer=False))
    idle = result["cgroupd"]["idle"]
    assert idle["processes"] == 2 and idle["rss_mb_each"]["max"] > 0
    added = result["cgroupd"]["add_members"]
    assert added["moved_partitions"] > 0 and added["reowned_s"] >= 0
    assert added["lost"] == 0 and added["order_violations"] == 0, added
    handover = added["handover_gap_s"]  # every moved partition's dark time, measured
    assert handover["partitions"] == added["moved_partitions"], handover
    assert 0 < handover["p50"] <= handover["p99"] <= handover["max"], handover


@pytest.mark.slow
@pytest.mark.interop
async def test_fleet_peer_side_runs(peer_python: str, tmp_path: Path) -> None:
    """The reference in host mode (many instances, a connection each, per process) goes
    through bench.fleet's mass start, idle window and --add under traffic."""
    plan = fleet.Plan(members=4, copies=2, idle=0.5, add=1, rate=200, timeout=60, window=0.5)
    result = _json(await fleet_peer.peer_side(plan, 2, peer_python, tmp_path))
    assert result["instances"] == 8 and result["processes"] == 2, result
    assert result["all_active_s"] is not None and result["first_round_served_s"] is not None
    assert result["died"] == result["workers_exited"] == result["connect_failed"] == 0, result
    assert result["states_settled"] == {"active": 8}, result  # every instance pulls
    assert result["idle_server_cpu_pct"] >= 0 and result["idle_api_per_s"] >= 0
    assert result["moved_partitions"] > 0, result
    assert result["reowned"] == result["moved_partitions"], result
    assert result["active_members_after_add"] == 5 and result["traffic_lost"] == 0, result


@pytest.mark.slow
async def test_ack_cost_runs() -> None:
    """Every message published is acked, at each number of idle consumers."""
    result = _json(await ack_cost.run([0, 3], rate=200, seconds=0.5))
    rows = result["rows"]
    assert [r["idle_consumers"] for r in rows] == [0, 3]
    assert all(r["acked"] == 100 and r["server_cpu_pct"] >= 0 for r in rows), rows
    assert all(0 < r["wait_s_p50"] <= r["wait_s_p99"] for r in rows), rows


@pytest.mark.slow
async def test_profile_runs() -> None:
    result = _json(await profile.main(200, "cprofile", 100, 5, members=2))
    assert result["profiled_member"]["messages"] > 0
    assert result["profile"]["self"] and result["profile"]["by_area"]


@pytest.mark.slow
async def test_profile_trace_runs() -> None:
    """The step trace of a one-at-a-time member: every gap is split, in order."""
    result = _json(await profile.main(100, "trace", 100, 5, members=2, case="one_in_flight"))
    split = result["wall_split"]
    assert split["messages"] > 0 and split["handlers_overlapping"] == 0, split
    trips = split["between_messages"]["server round trip: write -> next message read"]
    assert trips["count"] > 0 and trips["p50_us"] > 0, split
    assert "server round trip" in table.render(result)
