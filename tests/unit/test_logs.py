"""cgroupd's library loggers: the application's logging configuration decides.

Nothing configured: routine events are silent, warnings reach stderr (Python's last
resort); stdlib configured: records under ``cgroupd.<module>`` with the fields in the
message and in ``record.cgroupd``; structlog configured (the ``cgroupd`` command):
structlog's chain, JSON off a terminal.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import structlog

from cgroupd.core import logs
from tests.support.cli import (
    child_env,
    restore_logging,  # noqa: F401 - autouse fixture
)

NOTHING_CONFIGURED = """
import structlog
from cgroupd.core import logs
log = logs.get_logger("cgroupd.member")
log.debug("pull status", status=408)
log.info("state", new="active")
log.bind(member="a").warning("handler failed; retrying", error="boom here")
print("done")
"""


def test_nothing_configured_prints_warnings_only() -> None:
    """With no logging configuration, debug and info lines go nowhere; a warning reaches
    stderr as `event key=value` (the last-resort handler), stdout stays the app's."""
    proc = subprocess.run([sys.executable, "-c", NOTHING_CONFIGURED], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert proc.stderr == "handler failed; retrying member=a error='boom here'\n"


def test_stdlib_configuration_decides(caplog: pytest.LogCaptureFixture) -> None:
    """An application's stdlib config sees records named cgroupd.<module>, at the level
    it asked for, with the message readable and the fields structured."""
    assert not structlog.is_configured()
    log = logs.get_logger("cgroupd.pull")
    with caplog.at_level(logging.INFO, logger="cgroupd"):
        log.debug("pull status", status=408)
        log.bind(consumer="c1").info("became active", partitions=[0, 1])
        try:
            raise RuntimeError("x")
        except RuntimeError:
            log.exception("member runtime failed")
    records = [r for r in caplog.records if r.name.startswith("cgroupd")]
    assert [(r.name, r.levelname, r.getMessage()) for r in records] == [
        ("cgroupd.pull", "INFO", "became active consumer=c1 partitions=[0, 1]"),
        ("cgroupd.pull", "ERROR", "member runtime failed")]
    fields = records[0].cgroupd  # type: ignore[attr-defined]
    assert fields == {"event": "became active", "consumer": "c1", "partitions": [0, 1]}
    assert records[1].exc_info is not None and records[1].exc_info[0] is RuntimeError


def test_command_line_configuration_keeps_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Once the cgroupd command configured structlog, the library loggers render through
    it: one JSON object per event off a terminal, filtered by --log-level."""
    logs.configure("info", json=None)
    log = logs.get_logger("cgroupd.member")
    log.debug("pull status", status=408)
    log.bind(member="m1").info("joined")
    events = [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]
    assert len(events) == 1
    assert events[0]["event"] == "joined" and events[0]["member"] == "m1"
    assert events[0]["level"] == "info" and "timestamp" in events[0]
