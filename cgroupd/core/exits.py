"""Exit codes and the one-line error format every ``cgroupd`` process shares.

Its own module, importing only the redaction, because two processes print them: the typer CLI and
the lean process ``cgroupd join`` turns into (:mod:`cgroupd.join.run`), which must not
import the CLI. One definition keeps a user's scripts and log filters seeing one format.
"""

from __future__ import annotations

from cgroupd.core.redact import redact_text

PROG = "cgroupd"
#: Exit codes: success is 0.
FAILURE = 1
USAGE = 2
INTERRUPTED = 130


def error_line(message: object) -> str:
    """``cgroupd: error: <message>`` on one line (whitespace and newlines collapsed, URL
    userinfo replaced: whatever raised it, no password reaches the terminal)."""
    text = redact_text(" ".join(str(message).split())) or "error"
    return f"{PROG}: error: {text}"
