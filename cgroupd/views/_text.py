"""Text building blocks every view uses: partition ranges, aligned tables, durations."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def ranges(partitions: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (``-`` when empty)."""
    parts = sorted(set(partitions))
    out: list[str] = []
    i = 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1] == parts[j] + 1:
            j += 1
        out.append(str(parts[i]) if i == j else f"{parts[i]}-{parts[j]}")
        i = j + 1
    return ",".join(out) or "-"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in cells]
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    """``0.4`` → ``0.4s``, ``75`` → ``1m15s``, ``7300`` → ``2h01m``, ``None`` → ``-``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
