"""One redaction of URL userinfo, and the log processor that applies it to every line."""

from __future__ import annotations

import structlog

from cgroupd.core import logs
from cgroupd.core.redact import redact_text, redact_url
from cgroupd.nats.connect import ConnectionOptions


def test_userinfo_is_replaced_whole() -> None:
    """User and password, a lone token, a password holding '@', several URLs in a text."""
    assert redact_url("nats://u:pw@h:4222") == "nats://***@h:4222"
    assert redact_url("nats://TOKEN@h") == "nats://***@h"
    assert redact_url("https://u:p@ss@h/x?y=a@b") == "https://***@h/x?y=a@b"
    assert redact_text("to nats://a:b@x:1, tls://c:d@y:2: refused") == \
        "to nats://***@x:1, tls://***@y:2: refused"
    assert redact_text("nats://h:4222 and mail a@b") == "nats://h:4222 and mail a@b"


def test_every_log_field_is_redacted() -> None:
    """Whatever a caller logs (event text, fields, an exception), no URL password."""
    logs.configure("info", json=True)
    try:
        with structlog.testing.capture_logs(processors=[logs.redact_secrets]) as captured:
            logs.get_logger("t").info("to nats://u:pw@h", server="nats://u:pw@h",
                                      error=ValueError("tls://t0k@h"))
        assert "pw" not in repr(captured) and "t0k" not in repr(captured), captured
    finally:
        structlog.reset_defaults()


def test_connection_errors_name_servers_without_secrets() -> None:
    assert ConnectionOptions(servers=("nats://u:pw@a:1,nats://b:2",)).where == \
        "nats://***@a:1, nats://b:2"
