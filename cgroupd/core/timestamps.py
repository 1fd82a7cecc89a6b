"""The server's timestamps (RFC 3339 in UTC, nanoseconds) as Unix seconds."""

from __future__ import annotations

from datetime import datetime


def rfc3339(text: str) -> float | None:
    """``2026-06-08T13:05:57.123456789Z`` → Unix seconds; None when it is not one."""
    text = text.strip()
    if not text.endswith("Z"):
        return None
    head, _, frac = text[:-1].partition(".")
    try:
        base = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    digits = "".join(c for c in frac if c.isdigit())[:9]
    return base + (int(digits) / 10 ** len(digits) if digits else 0.0)
