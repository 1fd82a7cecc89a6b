"""bench.fleet_growth's arithmetic, plot and table, on a canned sweep (the sweep itself,
tiny, against real servers: tests/integration/test_fleet_growth.py)."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from bench import fleet, fleet_growth, table

SVG = "{http://www.w3.org/2000/svg}"


def _row(instances: int, active_s: float, server: float, api: float, own: float,
         load: tuple[float, float] = (1.5, 1.7)) -> dict[str, Any]:
    """What a size's fleet run reports (bench.fleet's keys), made into a sweep row."""
    result = {"instances": instances, "members": instances // 2, "processes": 4,
              "all_active_s": active_s, "all_settled_s": active_s + 0.5,
              "active_members": instances // 2,
              "first_round_served_s": 0.4, "died": 0, "died_examples": [],
              "workers_exited": 0, "connect_failed": 0, "connect_retries": 0,
              "idle_server_cpu_pct": server, "idle_api_per_s": api,
              "idle_cpu_per_instance_pct": own, "states": {"active": instances // 2},
              "machine": {"cores": 2}}
    return fleet_growth.size_row(instances, 2, result, load)


def _canned() -> dict[str, Any]:
    """Server CPU and API rate linear in the instances, the start flat, each instance's
    own CPU the same at every size."""
    rows = [_row(32, 1.0, 0.8, 12.8, 0.07), _row(64, 1.0, 1.6, 25.6, 0.07),
            _row(128, 1.0, 3.2, 51.2, 0.07)]
    return {"benchmark": "fleet_growth",
            "machine": {"cores": 2, "python": "3.11.7", "nats_server": "nats-server: v2.15.1"},
            "settings": {"sizes": [32, 64, 128], "copies": 2, "processes": 4, "idle_s": 20.0,
                         "timeout_s": 120.0},
            "sizes": rows, "growth": fleet_growth.growth(rows),
            "lines": fleet_growth.lines(rows)}


def test_a_size_keeps_the_fleets_measures_and_derives_per_instance_and_per_member() -> None:
    row = _row(128, 2.5, 3.2, 51.2, 0.07, load=(1.234, 2.345))
    assert (row["instances"], row["members"]) == (128, 64)
    assert row["states"] == {"active": 64}
    assert "machine" not in row  # only what the sweep keeps
    assert row["load_average_1min"] == [1.23, 2.35]
    assert row["server_cpu_pct_per_instance"] == 0.025  # 3.2 % over 128 instances
    assert row["api_per_s_per_member"] == 0.8  # 51.2/s over 64 members
    assert row["idle_workers_cpu_pct"] == 8.96  # 0.07 % x 128
    assert row["all_active_ms_per_member"] == 39.06  # 2.5 s over 64 members


def test_the_fleet_is_at_rest_only_once_every_instance_reports_active_or_standby(
        tmp_path: Path) -> None:
    """The idle window waits for the standbys too: an instance still starting (or one
    whose worker has not written yet) keeps the fleet from being settled."""
    workers = fleet.Fleet("nats://unused", tmp_path)

    def report(n: int, **states: str) -> None:
        path = tmp_path / f"worker-{n}.json"
        if path not in workers.files:
            workers.files.append(path)
        path.write_text(json.dumps({"pid": 1, "processed": [], "instances": {
            name: {"member": fleet.member_of_instance(name), "state": state, "error": None,
                   "connect_retries": 0} for name, state in states.items()}}))

    report(0, **{"m0-0": "active", "m0-1": "standby"})
    assert not workers.settled(4)  # the second worker has not written yet
    report(1, **{"m1-0": "active", "m1-1": "starting"})
    assert not workers.settled(4)
    report(1, **{"m1-0": "active", "m1-1": "standby"})
    assert workers.settled(4)
    report(1, **{"m1-0": "active", "m1-1": "died"})
    assert not workers.settled(4)


def test_a_size_that_measured_nothing_derives_nothing() -> None:
    """A run that timed out or failed leaves None, not a division by zero or a made-up 0."""
    row = fleet_growth.size_row(8, 2, {"error": "boom"}, (1.0, 1.0))
    assert row["instances"] == 8 and row["members"] == 4
    assert all(row[k] is None for k in ("server_cpu_pct_per_instance", "api_per_s_per_member",
                                        "idle_workers_cpu_pct", "all_active_ms_per_member"))


def test_growth_exponents_tell_linear_from_flat_and_from_quadratic() -> None:
    grown = _canned()["growth"]
    assert grown["idle_server_cpu_pct"] == 1.0
    assert grown["idle_api_per_s"] == 1.0
    assert grown["idle_workers_cpu_pct"] == 1.0
    assert grown["all_active_s"] == 0.0
    assert fleet_growth.exponent([(10, 1.0), (20, 4.0), (40, 16.0)]) == 2.0
    # Sizes without a positive value are left out; one size has no slope.
    assert fleet_growth.exponent([(10, 1.0), (20, None), (40, 0.0)]) is None
    assert fleet_growth.exponent([(10, 2.0), (20, None), (40, 8.0)]) == 1.0


def test_the_straight_line_splits_a_fixed_cost_from_the_cost_per_instance() -> None:
    """Server CPU 0.6 % with no fleet and 0.0135 % per instance grows slower than the
    instances on log-log axes (exponent below 1), yet each instance adds the same."""
    points = [(32, 0.6 + 0.0135 * 32), (64, 0.6 + 0.0135 * 64), (128, 0.6 + 0.0135 * 128)]
    assert fleet_growth.straight_line(points) == {"fixed": 0.6, "per_instance": 0.0135}
    exponent = fleet_growth.exponent(points)
    assert exponent is not None and 0.3 < exponent < 0.9
    assert fleet_growth.straight_line([(32, 1.0), (64, None)]) is None
    fits = fleet_growth.lines(_canned()["sizes"])
    assert fits["idle_api_per_s"] == {"fixed": 0.0, "per_instance": 0.4}
    assert fits["all_active_s"] == {"fixed": 1.0, "per_instance": 0.0}


def test_merging_sweeps_replaces_sizes_and_marks_the_ones_not_measured() -> None:
    first = _canned()
    later = copy.deepcopy(first)
    later["sizes"] = [_row(128, 9.0, 6.4, 51.2, 0.07)]  # 128 measured again
    merged = fleet_growth.merge([first, later])
    sizes = {r["instances"]: r for r in merged["sizes"]}
    assert sorted(sizes) == [32, 64, 128, 250, 500, 1000]
    assert sizes[128]["all_active_s"] == 9.0
    assert [n for n, r in sizes.items() if r.get("pending")] == [250, 500, 1000]
    assert sizes[500]["members"] == 250
    # The growth is refitted over the merged sizes, the pending ones apart.
    assert merged["growth"]["all_active_s"] is not None
    assert merged["growth"]["all_active_s"] > 0
    with pytest.raises(ValueError, match="not a fleet_growth result"):
        fleet_growth.merge([{"benchmark": "scale"}])


def _points(svg: str) -> dict[str, list[tuple[int, float]]]:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    out: dict[str, list[tuple[int, float]]] = {}
    for series in root.iter(f"{SVG}g"):
        if series.get("class") == "series":
            out[str(series.get("data-key"))] = [
                (int(str(c.get("data-instances"))), float(str(c.get("data-value"))))
                for c in series.iter(f"{SVG}circle")]
    return out


def test_the_plot_is_svg_with_one_point_per_measured_size_in_every_panel() -> None:
    svg = fleet_growth.svg(fleet_growth.merge([_canned()]))
    assert "not measured yet: 250, 500, 1000 instances" in svg
    points = _points(svg)
    assert sorted(points) == sorted(key for key, _ in fleet_growth.PANELS)
    for key, series in points.items():
        assert [n for n, _ in series] == [32, 64, 128], key  # the pending sizes have none
    assert points["idle_server_cpu_pct"] == [(32, 0.8), (64, 1.6), (128, 3.2)]


def test_the_plot_places_points_on_log_x_and_leaves_out_what_was_not_measured() -> None:
    doc = _canned()
    doc["sizes"][1]["all_active_s"] = None  # 64: no member set active in time
    root = ET.fromstring(fleet_growth.svg(doc))
    xs = {int(str(c.get("data-instances"))): float(str(c.get("cx")))
          for c in root.iter(f"{SVG}circle")}
    # 32 -> 64 -> 128 are equal steps on a log axis.
    assert xs[64] - xs[32] == pytest.approx(xs[128] - xs[64], abs=0.2)
    assert [n for n, _ in _points(fleet_growth.svg(doc))["all_active_s"]] == [32, 128]


def test_the_table_has_a_row_per_size_and_marks_the_ones_to_measure() -> None:
    text = table.render(fleet_growth.merge([_canned()]))
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| 128 (64) |"))
    assert "3.2 (0.0250)" in row and "51.2 (0.80)" in row and "1.50 / 1.70" in row
    assert "| 1.00 (15.6) / 1.50 |" in row  # all active (ms per member) / all settled
    assert sum("**to be measured**" in line for line in lines) == 3
    assert any(line.startswith("| 1,000 (500) | **to be measured**") for line in lines)
    assert lines[-2].startswith("| growth exponent") and "| 1.00 |" in lines[-2]
    assert lines[-1].startswith("| least-squares line") and "| 0.00 + 0.02500 n |" in lines[-1]


def test_the_command_line_plots_and_tabulates_files_and_refuses_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "growth.json"
    result.write_text(json.dumps(_canned()))
    plot = tmp_path / "growth.svg"
    assert fleet_growth.main(["--plot", str(plot), "--table", str(result)]) == 0
    assert len(_points(plot.read_text())["idle_api_per_s"]) == 3
    assert "| 64 (32) |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"nosuch\.json"):
        fleet_growth.main(["--table", str(tmp_path / "nosuch.json")])
    for argv in (["--sizes", "32,65"], ["--sizes", "32,x"], ["--table"], [str(result)]):
        with pytest.raises(SystemExit) as exited:
            fleet_growth.main(argv)
        assert exited.value.code == 2, argv
    assert "multiples of --copies 2: [65]" in capsys.readouterr().err
