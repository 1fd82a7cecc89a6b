"""The growth sweep (``bench.fleet_growth``, issue 27) still runs end to end: two tiny
sizes, each a real ``bench.fleet`` mass start on its own nats-server with an idle window,
then its plot and table. The numbers mean nothing at this size (the sweep from 32 to
1,000 instances: docs/performance.md); the arithmetic on canned numbers:
tests/unit/test_fleet_growth.py."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from bench import fleet_growth, table


@pytest.mark.slow
async def test_a_tiny_sweep_measures_each_size_and_plots_it() -> None:
    result = json.loads(json.dumps(await fleet_growth.sweep(
        [4, 8], copies=2, processes=2, idle=2.0, timeout=30.0), allow_nan=False))
    rows = result["sizes"]
    assert [(r["instances"], r["members"]) for r in rows] == [(4, 2), (8, 4)]
    for row in rows:
        assert "error" not in row, row
        assert row["died"] == 0 and row["workers_exited"] == 0, row
        assert row["active_members"] == row["members"], row
        assert row["all_active_s"] is not None and row["first_round_served_s"] is not None
        # At rest was measured with every standby started, not only the actives.
        assert row["all_settled_s"] >= row["all_active_s"], row
        assert row["states_settled"] == {"active": row["members"], "standby": row["members"]}
        # An idle window was measured (the server answers JetStream API calls at rest).
        assert row["idle_api_per_s"] > 0, row
        assert row["api_per_s_per_member"] == round(row["idle_api_per_s"] / row["members"], 4)
        assert row["idle_server_cpu_pct"] is not None and row["idle_workers_cpu_pct"] >= 0
        assert len(row["load_average_1min"]) == 2
    assert result["growth"]["idle_api_per_s"] is not None, result["growth"]
    merged = fleet_growth.merge([result])
    root = ET.fromstring(fleet_growth.svg(merged))
    points = [c.get("data-instances") for c in root.iter("{http://www.w3.org/2000/svg}circle")]
    # A point per size in every panel (each measure was taken at both sizes).
    assert points.count("4") == points.count("8") == len(fleet_growth.PANELS), points
    text = table.render(merged)
    assert "| 4 (2) |" in text and "| 8 (4) |" in text
