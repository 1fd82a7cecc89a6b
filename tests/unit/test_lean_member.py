"""An idle member instance's memory (issue 15: RSS <= 40 MB): what it does not load.

structlog imports rich (and pygments) at import time for console tracebacks, and
prometheus_client pulls in its HTTP exposition modules: ~5.5 MB of a ~47 MB instance.
A member process without a terminal and without a metrics server needs neither; each
check runs in a fresh interpreter (a test process has loaded everything already).
"""

from __future__ import annotations

import subprocess
import sys

from cgroupd.join.metrics import Metrics


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)


MEMBER_PROCESS = """
import sys
import cgroupd.cli, cgroupd.join.daemon, cgroupd.member
from cgroupd.core import logs
from cgroupd.join.metrics import Metrics

logs.configure("info", json=True)
m = Metrics("S", "G", "M")
m.exported = False  # as the daemon without --metrics-port
m.became_active([0, 1])
m.message_started()
m.message_finished("ack", 0.01)
m.set_connected(True)
m.set_lag({0: (3, 1.5)}, 0.01)
m.event_published("active")
assert m.stepped_down("config-changed")
took = m.became_active([0])
log = logs.get_logger("cgroupd.test")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("boom")
loaded = sorted(p for p in ("rich", "pygments", "prometheus_client")
                if sys.modules.get(p) is not None)
print(took is not None, m.in_flight(), loaded)
"""


def test_a_member_process_loads_neither_rich_nor_prometheus_client() -> None:
    """JSON logs (an exception's traceback included) and metrics nobody scrapes: neither
    library is imported, and what the instance reports about itself (in flight, a
    rebalance's duration) is still kept."""
    out = run(MEMBER_PROCESS)
    assert out.stdout.strip() == "True 0 []", out.stderr
    assert '"exception"' in out.stderr and "ZeroDivisionError" in out.stderr


CONSOLE = """
import sys
{hide}
from cgroupd.core import logs

logs.configure("info", json=False)
try:
    1 / 0
except ZeroDivisionError:
    logs.get_logger("cgroupd.test").exception("boom")
"""


def test_the_console_renderer_draws_rich_tracebacks_when_it_needs_one() -> None:
    out = run(CONSOLE.format(hide=""))
    assert "Traceback" in out.stderr and "╭" in out.stderr  # rich's box
    assert "ZeroDivisionError" in out.stderr


def test_the_console_renderer_without_rich_prints_a_plain_traceback() -> None:
    out = run(CONSOLE.format(hide="sys.modules['rich'] = None"))
    assert "Traceback (most recent call last)" in out.stderr and "╭" not in out.stderr
    assert "ZeroDivisionError: division by zero" in out.stderr


def test_exported_metrics_are_rendered_after_the_events() -> None:
    """Built on first use, the series still show every event since (the default)."""
    m = Metrics("S", "G", "M")
    m.became_active([0, 1, 2])
    m.message_started()
    m.message_finished("nak", 0.2)
    text = m.render().decode()
    assert 'cgroupd_partitions_owned{group="G",member="M",stream="S"} 3.0' in text
    assert ('cgroupd_messages_processed_total{group="G",member="M",outcome="nak",'
            'stream="S"} 1.0') in text
    assert m.content_type.startswith("text/plain")
