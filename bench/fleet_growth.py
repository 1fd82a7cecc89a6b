"""Growth: how a fleet's start and rest costs grow from 32 to 1,000 instances (issue 27).

One :mod:`bench.fleet` run per size (``--sizes``, instances; ``--copies`` instances per
member), one after the other, each on a fresh nats-server: a mass start, then an idle
window of ``--idle`` seconds. Per size it keeps the fleet's start and at-rest measures
(``all_active_s``, ``all_settled_s``: every standby started too,
``first_round_served_s``, ``died``, ``workers_exited``,
``idle_server_cpu_pct``, ``idle_api_per_s``, ``idle_cpu_per_instance_pct``) and the load
average before and after, and derives what one instance or member costs
(``server_cpu_pct_per_instance``, ``api_per_s_per_member``, ``idle_workers_cpu_pct``,
``all_active_ms_per_member``): a per-instance figure that stays flat grows linearly. The
``growth`` section fits each total on log-log axes over the sizes measured: an exponent
of 1 grows linearly with the instances, 0 stays constant, above 1 grows faster than the
fleet. The ``lines`` section fits each as ``fixed + per_instance x instances``: below an
exponent of 1, how much is the fixed part.

The plot (an SVG written here, no plotting library) and the Markdown table read one or
more such documents (a later file's size replaces an earlier one's, so a sweep can be
run in parts); sizes of :data:`SIZES` not measured yet are marked as such.

Run: ``python -m bench.fleet_growth [--sizes 32,64,128,250,500,1000] [--idle 20]
[--processes 4] > growth.json``, then ``python -m bench.fleet_growth --plot
docs/fleet-growth.svg growth.json [more.json]`` and ``python -m bench.fleet_growth
--table growth.json [more.json]`` (``python -m bench.table growth.json`` as well).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from bench import fleet, table
from bench.common import emit, machine

#: Instances per size of the default sweep (members = instances / copies).
SIZES = (32, 64, 128, 250, 500, 1000)
#: Worker processes per size: the 1,000-instance fleet ran in 4 on 2 cores.
PROCESSES = 4

#: What each size keeps of its :func:`bench.fleet.run` result.
KEPT = ("instances", "members", "processes", "all_active_s", "active_members", "states",
        "all_settled_s", "states_settled", "first_round_served_s", "died", "died_examples",
        "workers_exited", "connect_failed", "connect_retries", "idle_server_cpu_pct",
        "idle_api_per_s", "idle_cpu_per_instance_pct")

#: Totals whose growth with the instances is fitted (the ``growth`` section).
GROWN = ("all_active_s", "all_settled_s", "first_round_served_s", "idle_server_cpu_pct",
         "idle_api_per_s", "idle_workers_cpu_pct")


def _ratio(value: Any, by: Any, scale: float = 1.0, digits: int = 4) -> float | None:
    if not isinstance(value, int | float) or not isinstance(by, int | float) or by <= 0:
        return None
    return round(scale * value / by, digits)


def derived(row: dict[str, Any]) -> dict[str, Any]:
    """Per-instance and per-member figures of one size (None where a measure is absent)."""
    instances, members = row.get("instances"), row.get("members")
    per_instance = row.get("idle_cpu_per_instance_pct")
    workers = (round(per_instance * instances, 2)
               if isinstance(per_instance, int | float) and isinstance(instances, int)
               else None)
    return {
        "server_cpu_pct_per_instance": _ratio(row.get("idle_server_cpu_pct"), instances),
        "api_per_s_per_member": _ratio(row.get("idle_api_per_s"), members),
        "idle_workers_cpu_pct": workers,
        "all_active_ms_per_member": _ratio(row.get("all_active_s"), members, 1000.0, 2),
    }


def _fit(xy: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares ``y = a + b x``: (a, b); None under two distinct x."""
    if len({x for x, _ in xy}) < 2:
        return None
    mx = sum(x for x, _ in xy) / len(xy)
    my = sum(y for _, y in xy) / len(xy)
    slope = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
    return my - slope * mx, slope


def exponent(points: Iterable[tuple[float, Any]]) -> float | None:
    """The slope of log(value) over log(instances), least squares: 1 is linear growth.
    Sizes without a positive value are left out; None under two sizes."""
    fit = _fit([(math.log(n), math.log(v)) for n, v in points
                if n > 0 and isinstance(v, int | float) and v > 0])
    return None if fit is None else round(fit[1], 2)


def growth(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    measured = [r for r in rows if not r.get("pending")]
    return {key: exponent((r["instances"], r.get(key)) for r in measured) for key in GROWN}


def straight_line(points: Iterable[tuple[float, Any]]) -> dict[str, float] | None:
    """``value = fixed + per_instance x instances``, least squares: what a size costs
    whatever its fleet, and what each more instance adds (a line to read a size not
    measured from). None under two sizes with a value."""
    fit = _fit([(float(n), float(v)) for n, v in points if isinstance(v, int | float)])
    if fit is None:
        return None
    return {"fixed": round(fit[0], 3), "per_instance": round(fit[1], 5)}


def lines(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    measured = [r for r in rows if not r.get("pending")]
    return {key: straight_line((r["instances"], r.get(key)) for r in measured)
            for key in GROWN}


def size_row(instances: int, copies: int, result: dict[str, Any],
             load: tuple[float, float]) -> dict[str, Any]:
    """What the sweep keeps of one size's fleet run, with its derived figures."""
    row: dict[str, Any] = {key: result.get(key) for key in KEPT}
    for key in ("all_active_s", "all_settled_s", "first_round_served_s"):
        if isinstance(row[key], float):
            row[key] = round(row[key], 3)
    row["instances"], row["members"] = instances, instances // copies
    row["load_average_1min"] = [round(load[0], 2), round(load[1], 2)]
    row.update(derived(row))
    return row


async def measure_size(instances: int, copies: int, processes: int, idle: float,
                       timeout: float) -> dict[str, Any]:
    """One size: a fleet run at rest (no traffic, no restart). A run that raised is kept
    as an ``error`` row, so a sweep that fails at 500 still reports the sizes below."""
    before = os.getloadavg()[0]
    args = argparse.Namespace(members=instances // copies, copies=copies, processes=processes,
                              idle=idle, restart=False, timeout=timeout)
    try:
        result = await fleet.run(args)
    except Exception as exc:  # noqa: BLE001 - one size's failure is a result, not the end
        result = {"error": f"{type(exc).__name__}: {exc}"}
    row = size_row(instances, copies, result, (before, os.getloadavg()[0]))
    row["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # sizes merge across runs
    if "error" in result:
        row["error"] = result["error"]
    return row


async def sweep(sizes: Sequence[int], copies: int = 2, processes: int = PROCESSES,
                idle: float = 20.0, timeout: float = 120.0) -> dict[str, Any]:
    measured_on = machine()  # the load average before the first size
    rows = []
    for n in sizes:
        print(f"fleet_growth: {n} instances", file=sys.stderr)
        rows.append(await measure_size(n, copies, processes, idle, timeout))
    return {"benchmark": "fleet_growth", "machine": measured_on,
            "settings": {"sizes": list(sizes), "copies": copies, "processes": processes,
                         "idle_s": idle, "timeout_s": timeout},
            "sizes": rows, "growth": growth(rows), "lines": lines(rows)}


def merge(docs: Sequence[dict[str, Any]], expected: Sequence[int] = SIZES) -> dict[str, Any]:
    """One document from several sweeps (a later one's size replaces an earlier one's),
    with a ``pending`` row for each expected size none of them measured."""
    if not docs:
        raise ValueError("no sweep to merge")
    for doc in docs:
        if doc.get("benchmark") != "fleet_growth":
            raise ValueError(f"not a fleet_growth result (benchmark: {doc.get('benchmark')!r})")
    by_size: dict[int, dict[str, Any]] = {}
    for doc in docs:
        for row in doc.get("sizes", []):
            if not row.get("pending"):
                by_size[int(row["instances"])] = row
    copies = int(docs[-1].get("settings", {}).get("copies", 2))
    for n in expected:
        by_size.setdefault(n, {"instances": n, "members": n // copies, "pending": True})
    rows = [by_size[n] for n in sorted(by_size)]
    return {**docs[-1], "sizes": rows, "growth": growth(rows), "lines": lines(rows)}


# -- the plot -------------------------------------------------------------------------------
#: The panels, top to bottom: (key, title).
PANELS = (
    ("all_active_s", "mass start: seconds until every member has an active instance"),
    ("idle_server_cpu_pct", "at rest: nats-server CPU, % of one core"),
    ("idle_api_per_s", "at rest: JetStream API requests per second"),
    ("idle_workers_cpu_pct", "at rest: all instances' CPU, % of one core"),
)
WIDTH, PANEL_H, TOP, LEFT, RIGHT, GAP = 640, 150, 76, 64, 28, 58


def nice_step(value: float, lines: int = 4) -> float:
    """A grid step (1, 2, 2.5 or 5 times a power of ten) that covers ``value`` in at
    most ``lines`` steps."""
    if value <= 0:
        return 0.25
    want = value / lines
    power = 10.0 ** math.floor(math.log10(want))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= want)


def _num(value: float) -> str:
    return f"{value:g}"


def _panel(key: str, title: str, rows: Sequence[dict[str, Any]], top: float,
           xs: Sequence[int]) -> list[str]:
    lo, hi = math.log(xs[0]), math.log(xs[-1])
    inner = WIDTH - LEFT - RIGHT

    def x(n: float) -> float:
        return LEFT + (inner * (math.log(n) - lo) / (hi - lo) if hi > lo else inner / 2)

    points = [(int(r["instances"]), float(r[key])) for r in rows
              if not r.get("pending") and isinstance(r.get(key), int | float)]
    top_value = max((v for _, v in points), default=0.0) * 1.05
    step = nice_step(top_value)
    lines = max(1, math.ceil(top_value / step - 1e-9))
    ymax = step * lines

    def y(v: float) -> float:
        return top + PANEL_H * (1 - v / ymax)

    clip = f"clip-{key}"
    out = [f'<g class="panel" data-key={quoteattr(key)}>',
           f'<text x="{LEFT}" y="{top - 8}" class="title">{escape(title)}</text>',
           f'<clipPath id="{clip}"><rect x="{LEFT}" y="{top}" width="{inner}" '
           f'height="{PANEL_H}"/></clipPath>']
    for i in range(lines + 1):  # horizontal grid with its labels
        v = step * i
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'class="grid"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">'
                   f'{_num(round(v, 6))}</text>')
    for n in xs:  # one tick per size, measured or not
        out.append(f'<line x1="{x(n):.1f}" x2="{x(n):.1f}" y1="{top}" y2="{top + PANEL_H}" '
                   f'class="grid"/>')
        out.append(f'<text x="{x(n):.1f}" y="{top + PANEL_H + 14}" text-anchor="middle">'
                   f'{n}</text>')
    if points:
        n0, v0 = points[0]  # what linear growth from the smallest size would give
        steps = [math.exp(lo + (hi - lo) * i / 48) for i in range(49)]
        linear = " ".join(f"{x(n):.1f},{y(v0 * n / n0):.1f}"
                          for n in [n0, *(s for s in steps if s > n0)])
        out.append(f'<polyline class="linear" clip-path="url(#{clip})" points="{linear}"/>')
        line = " ".join(f"{x(n):.1f},{y(v):.1f}" for n, v in points)
        out.append(f'<g class="series" data-key={quoteattr(key)}>')
        out.append(f'<polyline class="measured" points="{line}"/>')
        for n, v in points:
            out.append(f'<circle class="point" cx="{x(n):.1f}" cy="{y(v):.1f}" r="3.5" '
                       f'data-instances="{n}" data-value="{_num(v)}">'
                       f'<title>{n} instances: {_num(v)}</title></circle>')
        out.append("</g>")
    out.append("</g>")
    return out


def svg(doc: dict[str, Any]) -> str:
    """The growth plot: one panel per measure of :data:`PANELS`, log-x instances, a point
    per measured size, and dashed what linear growth from the smallest size would give."""
    rows = doc.get("sizes", [])
    xs = sorted({int(r["instances"]) for r in rows} | set(SIZES))
    height = TOP + len(PANELS) * (PANEL_H + GAP)
    m = doc.get("machine", {})
    caption = f"cgroupd fleet growth: {m.get('cores')} cores, {m.get('nats_server')}"
    legend = ("x: instances (log scale), a point per size measured; "
              "dashed: linear growth from the smallest size")
    pending = [str(r["instances"]) for r in rows if r.get("pending")]
    missing = f"not measured yet: {', '.join(pending)} instances" if pending else ""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
           "<style>.grid{stroke:#ddd;stroke-width:1}"
           ".measured{fill:none;stroke:#1f5fa8;stroke-width:2}"
           ".linear{fill:none;stroke:#999;stroke-width:1.2;stroke-dasharray:5 4}"
           ".point{fill:#1f5fa8}.title{font-weight:bold}</style>",
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{LEFT}" y="16" class="title">{escape(caption)}</text>',
           f'<text x="{LEFT}" y="31">{escape(legend)}</text>',
           f'<text x="{LEFT}" y="45">{escape(missing)}</text>']
    for i, (key, title) in enumerate(PANELS):
        out += _panel(key, title, rows, TOP + i * (PANEL_H + GAP), xs)
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- the command line -------------------------------------------------------------------------
def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of instance counts: {text!r}") from None
    if not sizes or any(n < 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"sizes are instance counts of 2 or more: {text!r}")
    return sizes


def _read(paths: Sequence[str]) -> dict[str, Any]:
    docs = []
    for path in paths:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"fleet_growth: {path}: {exc}") from None
    try:
        return merge(docs)
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"fleet_growth: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", type=_sizes, default=list(SIZES),
                   help="instances per size, comma-separated (default %(default)s)")
    p.add_argument("--copies", type=int, default=2, help="instances per member")
    p.add_argument("--processes", type=int, default=PROCESSES, help="worker processes per size")
    p.add_argument("--idle", type=float, default=20.0, help="seconds at rest measured per size")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per wait of a size")
    p.add_argument("--plot", metavar="SVG", help="write the plot of RESULT.json files here")
    p.add_argument("--table", action="store_true",
                   help="print the Markdown table of RESULT.json files")
    p.add_argument("results", nargs="*", metavar="RESULT.json")
    args = p.parse_args(argv)
    if args.plot or args.table:
        if not args.results:
            p.error("--plot and --table read RESULT.json files")
        doc = _read(args.results)
        if args.plot:
            Path(args.plot).write_text(svg(doc))
        if args.table:
            print(table.render(doc))
        return 0
    if args.results:
        p.error("RESULT.json files go with --plot or --table")
    if args.copies < 1 or args.processes < 1:
        p.error("--copies and --processes are 1 or more")
    odd = [n for n in args.sizes if n % args.copies]
    if odd:
        p.error(f"sizes must be multiples of --copies {args.copies}: {odd}")
    emit(asyncio.run(sweep(args.sizes, args.copies, args.processes, args.idle, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
