"""Reading what the recording handlers stored, and judging it against the promises.

The promises (the issue's checkers), evaluated on a *view* of the recorded work:

- nothing published is missing (``lost``);
- per key, the order in which messages were first completed follows publish order;
- two instances of the same member never process at the same time (``overlaps``); and,
  stricter, two instances never process the same key at the same time (``key overlaps``:
  this is what a membership change must not break);
- exactly-once variant: each message is committed once (``committed twice``);
- an instance that another replaced on a partition starts nothing there again
  (``starts after replaced``, judged on every recorded start, finished or not).

Views:

``processed``
    every handler run that finished its work (at-least-once ``done``; exactly-once
    ``prepared``/``committed``/``aborted``). Its interval is start → the handler being
    done with the message (end of work; after the commit or rollback for exactly-once).
``committed``
    exactly-once only: ``committed`` rows, plus in-doubt ``prepared`` rows of a process
    that died between a confirmed ack and the commit, resolved as committed unless the
    message was committed elsewhere (see :mod:`tests.faults.recorder`). Its interval is
    start → commit.

Why overlaps are judged on committed work after a crash or a suspension: an instance
suspended inside a handler (SIGSTOP, or cut off the network) and then resumed finishes the
handler it was running: it is, by definition, processing at the same time as the instance
that replaced it. The guarantee cgroupd gives there is that such work can never *commit*:
its ``double_ack`` fails, the handler rolls back. So the processed view of those scenarios
shows overlaps that are expected and reported ("raw overlaps"); the committed view must
show none.

The ordering, loss and overlap arithmetic is :func:`tests.support.groups.check`, fed with events
built from the rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.groups import Record, check

FINISHED = ("done", "prepared", "committed", "aborted")


@dataclass(frozen=True)
class Row:
    """One handler run (see :data:`tests.faults.recorder.SCHEMA`)."""

    instance: str
    member: str
    subject: str
    i: int
    n: int
    seq: int
    partition: int | None
    deliveries: int
    status: str
    t_start: float
    t_end: float | None
    t_done: float | None
    note: str | None


def load_rows(db_dir: Path) -> list[Row]:
    """Every row of every instance database under ``db_dir`` (safe while they write)."""
    rows: list[Row] = []
    for path in sorted(db_dir.glob("*.db")):
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        except sqlite3.Error:
            continue
        try:
            cur = db.execute(
                "SELECT instance, member, subject, i, n, seq, partition, deliveries, status,"
                " t_start, t_end, t_done, note FROM work ORDER BY id")
            rows.extend(Row(*r) for r in cur.fetchall())
        except sqlite3.OperationalError:
            pass  # created but no table yet
        finally:
            db.close()
    return rows


@dataclass(frozen=True)
class Span:
    """One unit of work in a view: who did which message, from when to when."""

    row: Row
    start: float
    end: float


def processed(rows: Iterable[Row]) -> list[Span]:
    """Every handler run that finished its work, from its start until the handler was
    done with it (after the commit or rollback, in the exactly-once variant)."""
    return [Span(r, r.t_start, r.t_done or r.t_end) for r in rows
            if r.status in FINISHED and r.t_end is not None]


def committed(rows: Sequence[Row]) -> tuple[list[Span], int]:
    """Committed work (start → commit) and how many in-doubt rows were resolved."""
    done = [Span(r, r.t_start, r.t_done) for r in rows
            if r.status == "committed" and r.t_done is not None]
    have = {s.row.n for s in done}
    in_doubt = 0
    for r in rows:
        if r.status == "prepared" and r.t_end is not None:
            in_doubt += 1
            if r.n not in have:  # its ack went through: nobody else got the message
                done.append(Span(r, r.t_start, r.t_end))
                have.add(r.n)
    return done, in_doubt


def confirmed_across_stall(rows: Sequence[Row], stalled: str, at: float
                           ) -> tuple[list[Row], list[int]]:
    """``rows`` with the commits of ``stalled`` whose ``double_ack`` the server applied
    before the stall began at ``at`` but whose confirmation the stall delayed (the event
    loop blocked, or the process stopped, between the ack going out and its reply being
    read) dated at their ack (``t_end``), and their messages' indexes.

    Otherwise such a commit would end after the successor's later work, by the stall
    alone. Sound only if nobody else ever ran the message (asserted: an ack that went out
    before the stall and was applied removed it from the work-queue stream).
    """
    others = {r.n for r in rows if r.instance != stalled}
    late = [r for r in rows if r.instance == stalled and r.status == "committed"
            and r.t_end is not None and r.t_end <= at + 0.05
            and (r.t_done or 0) > at + 0.5]
    assert not [r.n for r in late if r.n in others], "committed after its successor ran it"
    adjusted = {id(r) for r in late}
    return ([dataclasses.replace(r, t_done=r.t_end) if id(r) in adjusted else r
             for r in rows], [r.n for r in late])


def to_record(spans: Iterable[Span]) -> Record:
    """The events :func:`tests.support.groups.check` reads: a start and an end per span."""
    events: list[dict[str, Any]] = []
    for s in spans:
        common = {"instance": s.row.instance, "member": s.row.member, "seq": s.row.seq,
                  "n": s.row.n, "subject": s.row.subject, "partition": s.row.partition}
        events.append({"event": "start", "t": s.start, **common})
        events.append({"event": "end", "t": s.end, **common})
    events.sort(key=lambda e: (e["t"], e["event"] == "start"))
    return Record(events)


def start_violations(rows: Iterable[Row], *, returns: bool = False) -> list[str]:
    """Handler starts by an instance that another instance had already replaced.

    Per member and partition, every handler start (finished or not: the recorder writes
    the row before any work) in time order. Once another instance has started work on a
    partition, the one it replaced must not start anything there again: a stalled,
    suspended or cut-off owner may finish the handler it was running, but starts nothing
    new. With ``returns`` (scenarios whose full rejoins may hand a member back to an
    instance it had before), a return is allowed once nothing of the current owner is
    running on that partition any more.
    """
    by_partition: dict[tuple[str, int | None], list[Row]] = defaultdict(list)
    for r in rows:
        by_partition[(r.member, r.partition)].append(r)
    out = []
    for (member, partition), items in sorted(by_partition.items(), key=lambda kv: str(kv[0])):
        items.sort(key=lambda r: r.t_start)
        owner: str | None = None
        replaced: dict[str, float] = {}
        for r in items:
            if r.instance == owner:
                continue
            busy = owner is not None and any(
                o.instance == owner and o.t_start < r.t_start
                and (o.t_done or o.t_end or float("inf")) > r.t_start for o in items)
            if r.instance in replaced and (busy or not returns):
                out.append(f"{member} partition {partition}: {r.instance} started #{r.n} at "
                           f"{r.t_start:.3f}, after being replaced at "
                           f"{replaced[r.instance]:.3f}")
            if owner is not None:
                replaced[owner] = r.t_start
            owner = r.instance
    return out


def switches(spans: Iterable[Span]) -> list[tuple[str, str, str, float]]:
    """Per member, each hand-over between instances: (member, old, new, gap seconds).

    The gap runs from the old instance's last completion to the new one's first
    completion, within the view (so rolled-back work does not count as progress).
    """
    by_member: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_member[s.row.member].append(s)
    out = []
    for member, items in sorted(by_member.items()):
        items.sort(key=lambda s: s.end)
        for a, b in itertools.pairwise(items):
            if a.row.instance != b.row.instance:
                out.append((member, a.row.instance, b.row.instance, b.end - a.end))
    return out


def max_stall(spans: Iterable[Span], start: float, end: float) -> float:
    """Longest time in [start, end] during which some member completed nothing.

    Every member has traffic all the time in these scenarios (keys spread over all
    partitions), so this is how long a fault stopped progress.
    """
    by_member: dict[str, list[float]] = defaultdict(list)
    for s in spans:
        by_member[s.row.member].append(s.end)
    worst = 0.0
    for times in by_member.values():
        inside = sorted(t for t in times if start <= t <= end)
        if not inside:
            continue
        points = [start, *inside]
        worst = max(worst, *(b - a for a, b in itertools.pairwise(points)), 0.0)
    return worst


@dataclass
class FaultVerdict:
    """What one scenario run showed; ``rows`` of the table printed per scenario."""

    scenario: str
    variant: str
    messages: int
    lost: list[int]
    order_violations: list[str]
    overlaps: list[str]
    duplicates: int
    committed_twice: list[int] = field(default_factory=list)
    in_doubt: int = 0
    aborted: int = 0
    raw_overlaps: list[str] = field(default_factory=list)
    key_overlaps: list[str] = field(default_factory=list)
    #: Starts by an instance after another replaced it (see :func:`start_violations`).
    late_starts: list[str] = field(default_factory=list)
    handovers: list[tuple[str, str, str, float]] = field(default_factory=list)
    stall: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def failover_gap(self) -> float | None:
        return max((g for *_, g in self.handovers), default=None)

    def table(self) -> str:
        gap = self.failover_gap
        gaps = ", ".join(f"{m} {old}->{new} {g:.2f}s" for m, old, new, g in self.handovers)
        rows = [
            ("messages", self.messages),
            ("lost", len(self.lost)),
            ("order violations", len(self.order_violations)),
            ("overlaps", len(self.overlaps)),
            ("duplicates", self.duplicates),
            ("failover gap", f"{gap:.2f}s" if gap is not None else "- (no hand-over)"),
        ]
        if self.variant == "exactly_once":
            rows += [("committed twice", len(self.committed_twice)),
                     ("aborted (rolled back)", self.aborted),
                     ("in doubt (resolved)", self.in_doubt),
                     ("raw overlaps (uncommitted)", len(self.raw_overlaps))]
        rows += [("key overlaps", len(self.key_overlaps)),
                 ("starts after replaced", len(self.late_starts)),
                 ("max stall", f"{self.stall:.2f}s")]
        if gaps:
            rows.append(("hand-overs", gaps))
        rows += [("note", n) for n in self.notes]
        width = max(len(k) for k, _ in rows)
        title = f"== fault scenario: {self.scenario} ({self.variant}) =="
        return "\n".join([title, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])

    def assert_ok(self) -> None:
        problems = []
        if self.lost:
            problems.append(f"lost {len(self.lost)} messages, e.g. {self.lost[:5]}")
        if self.order_violations:
            problems.append(f"order violations: {self.order_violations[:5]}")
        if self.overlaps:
            problems.append(f"overlaps: {self.overlaps[:5]}")
        if self.key_overlaps:
            problems.append(f"key overlaps: {self.key_overlaps[:5]}")
        if self.committed_twice:
            problems.append(f"committed twice: {self.committed_twice[:5]}")
        if self.late_starts:
            problems.append(f"starts after being replaced: {self.late_starts[:5]}")
        assert not problems, f"{self.scenario}: " + "; ".join(problems) + "\n" + self.table()


def judge(scenario: str, variant: str, rows: Sequence[Row], sent: Sequence[tuple[str, int]],
          *, window: tuple[float, float] | None = None, rewinds: bool = False,
          returns: bool = False) -> FaultVerdict:
    """Apply every checker to ``rows`` for the messages ``sent`` ((subject, n) pairs).

    ``rewinds``: a crash (SIGKILL of a member or a server) may have lost acks, so redoing
    the tail of the work is allowed (see :func:`tests.support.groups.check`). ``returns``: an
    instance may win back partitions it lost (see :func:`start_violations`).
    """
    raw = processed(rows)
    raw_record = to_record(raw)
    raw_verdict = check(raw_record, list(sent), lambda e: e["member"], rewinds=rewinds)
    if variant == "exactly_once":
        view, in_doubt = committed(rows)
    else:
        view, in_doubt = raw, 0
    record = to_record(view)
    verdict = check(record, list(sent), lambda e: e["member"], rewinds=rewinds)
    by_key = check(record, list(sent), lambda e: e["subject"])
    counts = Counter(s.row.n for s in view)
    out = FaultVerdict(
        scenario=scenario, variant=variant, messages=len(sent), lost=verdict.lost,
        order_violations=verdict.order_violations,
        overlaps=verdict.overlaps, duplicates=raw_verdict.duplicates,
        key_overlaps=by_key.overlaps, handovers=switches(view), in_doubt=in_doubt,
        late_starts=start_violations(rows, returns=returns))
    if variant == "exactly_once":
        out.committed_twice = sorted(n for n, c in counts.items() if c > 1)
        out.aborted = sum(r.status == "aborted" for r in rows)
        out.raw_overlaps = raw_verdict.overlaps
        if raw_verdict.order_violations:
            out.notes.append(f"{len(raw_verdict.order_violations)} order violations among "
                             f"uncommitted runs, e.g. {raw_verdict.order_violations[0]}")
    if window is not None:
        out.stall = max_stall(view, *window)
    return out
