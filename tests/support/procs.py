"""Which processes are alive, read from /proc (for leak checks in tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def live_processes(match: Callable[[list[str]], bool]) -> list[int]:
    """Pids of live (non-zombie) processes whose /proc/<pid>/stat fields after the command
    name (state, ppid, pgrp, session, ...) satisfy ``match``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and match(fields):
            out.append(int(entry.name))
    return out
