"""Recording handlers for ``cgroupd join --handler tests.faults.recorder:<function>``.

Every delivery a handler sees becomes one row in a SQLite database that outlives the
process: the message (subject, per-key index ``i``, global index ``n``, stream sequence),
the instance, and when work started and finished. One database file per instance (WAL
mode, autocommit): a shared file would let a SIGSTOPped writer hold the write lock and
stall every other instance, which would make the harness, not cgroupd, fail.

Two variants:

``at_least_once``
    Work, then mark the row ``done`` and return (the runtime acks). A crash between the
    two shows up as a duplicate, never as a loss.

``exactly_once``
    The ADR's double-ack pattern as a two-phase commit: mark the row ``prepared`` (a
    durable prepare), ``double_ack()``, then mark it ``committed``, or ``aborted`` when the
    server did not apply the ack (the runtime retries the message in place while this
    instance still owns it; otherwise the new owner gets it). A process killed between a
    confirmed ack and the commit, or a ``double_ack`` whose outcome cannot be known
    (:class:`~cgroupd.core.errors.AckOutcomeUnknown`, noted on the row), leaves a ``prepared``
    row: in doubt, resolved by the checker like a recovering transaction manager would
    (committed unless the message was committed elsewhere).

Row statuses: ``started`` (handler began; the only status of work cut short by a crash or
by a suspension that never resumed), ``done``, ``prepared``, ``committed``, ``aborted``,
``failed`` (the handler raised: poison message).

Configuration (environment, set by the harness per process):

- ``FAULTS_DB``: this instance's database file (required)
- ``FAULTS_INSTANCE``, ``FAULTS_MEMBER``: recorded with every row
- ``FAULTS_DELAY``: seconds of "work" per message (default 0)
- ``FAULTS_HOLD_DIR``: where hold markers are created. A message whose payload has
  ``"hold": seconds`` is held that long by the first handler (of any instance) that sees
  it, so a test can inject a fault while a handler is provably in flight. One with
  ``"block": seconds`` makes the first handler that sees it block its process's event
  loop that long (``time.sleep`` in an ``async def``: what a long GC pause, a blocking
  library call or a throttled pod does); the row is written before the block.
- ``FAULTS_POISON``: comma-separated global indexes ``n`` whose handling always raises.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from cgroupd.core.errors import AckNotConfirmed, AckOutcomeUnknown
from cgroupd.nats.message import Message

SCHEMA = """
CREATE TABLE IF NOT EXISTS work (
    id INTEGER PRIMARY KEY,
    instance TEXT NOT NULL,
    member TEXT NOT NULL,
    subject TEXT NOT NULL,
    i INTEGER NOT NULL,
    n INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    partition INTEGER,
    deliveries INTEGER NOT NULL,
    status TEXT NOT NULL,
    t_start REAL NOT NULL,
    t_end REAL,
    t_done REAL,
    note TEXT
)
"""


class PoisonMessage(Exception):
    """Raised for a message listed in ``FAULTS_POISON``."""


class _Store:
    """This process's database connection (opened on first use, in the handler's loop)."""

    def __init__(self) -> None:
        path = os.environ["FAULTS_DB"]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Autocommit: each statement is its own transaction, so no lock is ever held
        # across an await (the double-ack) and a crash loses at most the statement.
        self.db = sqlite3.connect(path, isolation_level=None, timeout=10)
        self.db.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL keeps every commit across a process crash (not a power cut).
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(SCHEMA)
        self.instance = os.environ.get("FAULTS_INSTANCE", "?")
        self.member = os.environ.get("FAULTS_MEMBER", "?")
        self.delay = float(os.environ.get("FAULTS_DELAY", "0") or 0)
        self.hold_dir = os.environ.get("FAULTS_HOLD_DIR")
        self.poison = {int(x) for x in os.environ.get("FAULTS_POISON", "").split(",")
                       if x.strip()}

    def start(self, message: Message, body: dict[str, Any]) -> int:
        cur = self.db.execute(
            "INSERT INTO work (instance, member, subject, i, n, seq, partition, deliveries,"
            " status, t_start) VALUES (?,?,?,?,?,?,?,?,'started',?)",
            (self.instance, self.member, message.subject, int(body["i"]), int(body["n"]),
             message.stream_sequence, message.partition, message.delivery_count,
             time.time()))
        return int(cur.lastrowid or 0)

    def mark(self, row: int, status: str, column: str, note: str | None = None) -> None:
        self.db.execute(f"UPDATE work SET status=?, {column}=?, note=? WHERE id=?",
                        (status, time.time(), note, row))

    def hold(self, body: dict[str, Any], kind: str = "hold") -> float:
        """Seconds to hold (or block on) this message: only the first handler to see it
        does."""
        seconds = float(body.get(kind) or 0)
        if not seconds or not self.hold_dir:
            return 0.0
        try:
            fd = os.open(os.path.join(self.hold_dir, f"{kind}-{body['n']}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return 0.0
        os.close(fd)
        return seconds


_store: _Store | None = None


def _get() -> _Store:
    global _store
    if _store is None:
        _store = _Store()
    return _store


async def _work(store: _Store, message: Message, body: dict[str, Any], row: int) -> None:
    block = store.hold(body, "block")
    if block:
        time.sleep(block)  # noqa: ASYNC251 - on purpose: the event loop stalls
    pause = store.delay + store.hold(body)
    if pause:
        await asyncio.sleep(pause)
    if int(body["n"]) in store.poison:
        store.mark(row, "failed", "t_end", "poison")
        raise PoisonMessage(f"poison message #{body['n']} ({message.subject})")


async def at_least_once(message: Message) -> None:
    """Record the work, then return: the runtime acks after the record is durable."""
    store = _get()
    body = json.loads(message.data)
    row = store.start(message, body)
    await _work(store, message, body, row)
    store.mark(row, "done", "t_end")


async def exactly_once(message: Message) -> None:
    """Prepare, double-ack, commit; roll back (and raise) when the ack is not confirmed."""
    store = _get()
    body = json.loads(message.data)
    row = store.start(message, body)
    await _work(store, message, body, row)
    store.mark(row, "prepared", "t_end")
    try:
        await message.double_ack()
    except AckOutcomeUnknown as exc:
        # In doubt: keep the prepared work; the checker resolves it like a transaction
        # manager (committed unless the message was committed elsewhere).
        store.mark(row, "prepared", "t_done", f"in doubt: {exc}"[:200])
        raise
    except AckNotConfirmed as exc:
        store.mark(row, "aborted", "t_done", str(exc)[:200])
        raise
    store.mark(row, "committed", "t_done")
