"""deploy/monitoring (alerting rules, Grafana dashboard) checked with the real tools.

* ``promtool check rules`` and ``promtool test rules``: every alert has a unit test that
  makes it fire and one that keeps it quiet, and a broken rule makes those tests fail;
* every metric the rules and the dashboard name is one cgroupd exports (or a recording
  rule makes);
* a real Prometheus scrapes real ``cgroupd join`` processes: when every instance of one
  member is SIGKILLed, CgroupdUnownedPartitions fires as Prometheus's HTTP API reports it
  (``for:`` shortened for the test), and every PromQL expression of the dashboard,
  evaluated against that Prometheus, returns series.

Needs promtool and prometheus (Debian's ``prometheus`` package; scripts/test.sh installs
it): without them these tests fail in CI and are skipped elsewhere, saying how to get them.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.aio.client import Client

from cgroupd import admin
from cgroupd.join.metrics import Metrics
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import JoinProcess
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer
from tests.support.polling import eventually
from tests.support.prometheus_tools import PrometheusServer, check_rules, promtool, require

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "cgroupd.rules.yaml"
RULE_TESTS = MONITORING / "cgroupd.rules.test.yaml"
DASHBOARD = MONITORING / "cgroupd-dashboard.json"
HANDLER = "tests.support.handlers.record_handler:handle"

pytestmark = pytest.mark.prometheus


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


# -- promtool ---------------------------------------------------------------------------
def test_rules_pass_promtool_check() -> None:
    """promtool accepts the rules file (syntax, PromQL, templates)."""
    out = check_rules(RULES)
    assert f"SUCCESS: {len(rules())} rules found" in out


def test_rule_unit_tests_pass() -> None:
    """promtool's unit tests of the rules pass (run from deploy/monitoring, as the README
    says)."""
    done = promtool("test", "rules", RULE_TESTS.name, cwd=MONITORING)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    """Each alert has a unit test where it fires (with its labels and annotations) and
    one where, with series present, it does not."""
    spec = yaml.safe_load(RULE_TESTS.read_text())
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fires == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"


@pytest.mark.parametrize(("alert", "change"), [
    ("CgroupdUnownedPartitions", ("> 0", "> 5")),
    ("CgroupdLagHigh", ("> 300", "> 3000")),
    ("CgroupdGroupStreamSourceStalled", ("> 5", "> 500")),
    ("CgroupdGroupStreamSourceStalled", ("for: 2m", "for: 1m")),
    ("CgroupdGroupStreamSourceStalled", ("max by (stream, group) (", "(")),
    ("CgroupdFrequentStepDowns", ('reason!~"stopping|config-changed"', 'reason!="x"')),
    ("CgroupdHandlerErrors", ("> 0.05", "> 0.5")),
    ("CgroupdDeadLetters", ("dead_letter|term", "term")),
    ("CgroupdNatsDisconnected", ("for: 2m", "for: 10m")),
    ("CgroupdBadGroupRecord", ("invalid_group_record|replaced_group_record",
                               "invalid_group_record")),
    ("CgroupdPermissionDenied", ("[5m])) > 0", "[5m])) > 100")),
    ("CgroupdDeadLetterIdTaken", ("[1h])) > 0", "[1h])) > 1")),
    ("CgroupdAcksNotApplied", (">= 0.5 *", ">= 0.001 *")),
])
def test_unit_tests_catch_a_broken_rule(tmp_path: Path, alert: str,
                                        change: tuple[str, str]) -> None:
    """The unit tests bite: the same tests against a copy of the rules with one alert's
    threshold (or filter, or duration) changed fail, naming that alert."""
    text = RULES.read_text()
    start = text.index(f"- alert: {alert}")
    end = text.find("- alert:", start + 1)
    end = len(text) if end < 0 else end
    block = text[start:end]
    assert change[0] in block
    (tmp_path / RULES.name).write_text(text[:start] + block.replace(*change) + text[end:])
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    done = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and f"alertname: {alert}" in output, output


def _metric_names(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b(cgroupd_[a-z_:]+)", expr)}


def test_rules_and_dashboard_name_only_exported_metrics() -> None:
    """Every cgroupd_* name in the rules and the dashboard is a series the daemon exports
    or a recording rule defines (a typo would make a panel or an alert silently empty)."""
    metrics = Metrics("S", "G", "M")
    metrics.set_lag({0: (1, 1.0)}, 0.1)
    metrics.set_source(0.5, 0)
    metrics.stepped_down("stopping")
    exported = {s.name for family in metrics.registry.collect() for s in family.samples}
    recorded = {r["record"] for r in rules() if "record" in r}
    used: set[str] = set()
    for rule in rules():
        used |= _metric_names(rule["expr"])
    for _, expr in dashboard_targets():
        used |= _metric_names(expr)
    assert used - exported - recorded == set()


def test_dashboard_is_well_formed() -> None:
    """Unique panel ids, every query on the data-source variable and filtered by the
    stream and group variables, and a description on every panel (the README lists
    them)."""
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "stream", "group"}
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'stream=~"$stream",group=~"$group"' in target["expr"], panel["title"]
    readme = (ROOT / "README.md").read_text()
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert f"**{panel['title']}**" in readme, f"README does not describe {panel['title']}"


# -- a real Prometheus ------------------------------------------------------------------
def short_rules(tmp_path: Path, duration: str = "2s") -> Path:
    """The rules with every ``for:`` shortened (the test-only value), still checked."""
    spec = copy.deepcopy(yaml.safe_load(RULES.read_text()))
    for group in spec["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = duration
    path = tmp_path / "cgroupd.short.rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    check_rules(path)
    return path


@pytest.mark.slow
async def test_alert_fires_in_prometheus_and_dashboard_queries_return_series(
        nats_server: NatsServer, nc: Client, jetstream: JetStream, tmp_path: Path,
        closing: list[Any]) -> None:
    """Real Prometheus, real `cgroupd join` processes (m1 with one instance, m2 with two),
    scraped every 0.5 s: once every partition is consumed CgroupdUnownedPartitions is
    quiet; after SIGKILL of both m2 instances it fires for ORDERS/g with the number of
    partitions m2 held, as /api/v1/alerts reports. Every dashboard expression then
    returns series, and the template variables find the group."""
    require("prometheus")
    require("promtool")
    await make_group(jetstream, partitions=4, members=("m1", "m2"))
    record = tmp_path / "handled.jsonl"

    def join(name: str, member: str) -> JoinProcess:
        proc = JoinProcess(nats_server.url, tmp_path, name, "--stream", "ORDERS", "--group",
                           "g", "--member", member, "--handler", HANDLER,
                           "--status-interval", "0.5", record=record)
        closing.append(proc)
        return proc

    m1, m2a, m2b = join("m1", "m1"), join("m2a", "m2"), join("m2b", "m2")
    prom = PrometheusServer(tmp_path / "prometheus",
                            [f"127.0.0.1:{p.port}" for p in (m1, m2a, m2b)],
                            [short_rules(tmp_path)])
    try:
        await asyncio.to_thread(prom.wait_ready)

        async def query(expr: str) -> list[dict[str, Any]]:
            return await asyncio.to_thread(prom.query, expr)

        async def firing() -> list[dict[str, Any]]:
            return [a for a in await asyncio.to_thread(prom.alerts)
                    if a["labels"]["alertname"] == "CgroupdUnownedPartitions"
                    and a["state"] == "firing"]

        # Scraped, each member active, every partition consumed and messages handled.
        async def formed() -> bool:
            active = await query("sum by (member) (cgroupd_member_active)")
            owned = await query("max(cgroupd_group_unowned_partitions)")
            return (sorted((r["metric"]["member"], r["value"][1]) for r in active)
                    == [("m1", "1"), ("m2", "1")] and bool(owned)
                    and owned[0]["value"][1] == "0")

        await eventually(formed, 60, what="Prometheus to see both members active")
        for i in range(40):
            await jetstream.publish(f"orders.k{i % 8}", json.dumps({"n": i}).encode())
        await eventually(lambda: _lines(record, 40), 30, what="40 messages handled")
        # A step-down (m1 takes its partitions back at once) so the step-down series
        # exists; lag series come from the active instances.
        assert await admin.step_down(jetstream, "ORDERS", "g", "m1")
        await eventually(lambda: query('cgroupd_step_downs_total{reason="sync-consumer-lost"}'),
                   30, what="the step-down counter in Prometheus")
        await eventually(lambda: _count(query("cgroupd_partition_lag_seconds"), 4), 30,
                   what="lag series of all 4 partitions")
        # The step-down left partitions unowned for a moment (the alert may have gone
        # pending); with every partition consumed again it is quiet.
        await eventually(lambda: _none(query('ALERTS{alertname="CgroupdUnownedPartitions"}')), 30,
                   what="the alert to be quiet while every partition is consumed")
        assert await firing() == []

        for proc in (m2a, m2b):
            proc.proc.send_signal(signal.SIGKILL)
        fired = await eventually(firing, 60, what="CgroupdUnownedPartitions to fire")
        assert [(a["labels"]["stream"], a["labels"]["group"], a["labels"]["severity"])
                for a in fired] == [("ORDERS", "g", "critical")]
        assert fired[0]["annotations"]["summary"] == \
            "ORDERS/g: 2 partitions have no active instance"

        # The dashboard, as Grafana would ask (variables and $__rate_interval filled in).
        assert "ORDERS" in await asyncio.to_thread(prom.label_values, "stream",
                                                   "cgroupd_member_active")
        assert "g" in await asyncio.to_thread(prom.label_values, "group",
                                              'cgroupd_member_active{stream=~"ORDERS"}')
        empty = []
        for title, expr in dashboard_targets():
            concrete = (expr.replace("$stream", "ORDERS").replace("$group", "g")
                        .replace("$__rate_interval", "10s"))
            if not await query(concrete):
                empty.append(f"{title}: {concrete}")
        assert empty == [], "dashboard queries without series:\n" + "\n".join(empty)
        for rule in rules():
            if "record" in rule:
                assert await query(rule["record"]), rule["record"]
    finally:
        await asyncio.to_thread(prom.stop)


def _lines(path: Path, n: int) -> bool:
    return path.exists() and len(path.read_text().splitlines()) >= n


async def _none(result: Any) -> bool:
    return not await result


async def _count(result: Any, n: int) -> bool:
    return len(await result) >= n
