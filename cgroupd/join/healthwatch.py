"""What the NATS server refused this instance, kept for ``/healthz`` and the metrics.

A denied publish (an ack to ``$JS.ACK.…``, a presence answer, a dead letter) gets no
reply at all: the server only sends an asynchronous ``-ERR 'Permissions Violation for
Publish to "…"'`` on the connection, which nats-py hands to the error callback
(lower-cased, subject included). Without
this a member whose user may not ack keeps ``/healthz`` at 200 while every message it
handles is redelivered forever (issue 25 row 10). Pure bookkeeping, no I/O: the daemon
feeds it the error texts and asks it for problems.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: A denial makes ``/healthz`` fail until this long after the last one (seconds): long
#: enough to span the quiet between acks of a slow stream and presence probe rounds.
DENIAL_WINDOW = 60.0

_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "?([^"\s\']+)',
                        re.IGNORECASE)

#: What a kind of subject is for, said in the health problem.
CONSEQUENCE = {
    "ack": "acks are not applied: every handled message will be redelivered",
    "control": "cgroupd control subjects (presence, step-down, events): the instance cannot "
               "prove it is alive or see its peers, so it flaps between active and standby",
    "api": "JetStream API: consumers, group records or stream reads fail",
    "inbox": "replies to this instance's requests are lost",
    "dead_letter": "dead letters cannot be stored: given-up messages stay in the stream",
    "other": "this operation fails",
}


#: Subject prefixes by kind, as nats-py reports them (it lower-cases the server's error
#: text, subject included) and as a problem line names them.
_PREFIXES = (("$js.ack.", "$JS.ACK.", "ack"), ("_cgroupd.", "_CGROUPD.", "control"),
             ("$js.api.", "$JS.API.", "api"), ("$js.", "$JS.", "api"), ("$kv.", "$KV.", "api"),
             ("_inbox.", "_INBOX.", "inbox"))


def kind_of(subject: str, dead_letter_subject: str | None = None,
            inbox_prefix: str | None = None) -> str:
    """The kind of a denied subject: ack, control, api, inbox, dead_letter or other.
    ``inbox_prefix``: the connection's own (``--inbox-prefix``), if not ``_INBOX``."""
    lower = subject.lower()
    if dead_letter_subject is not None and lower == dead_letter_subject.lower():
        return "dead_letter"
    if inbox_prefix is not None and lower.startswith(inbox_prefix.lower() + "."):
        return "inbox"
    return next((kind for prefix, _, kind in _PREFIXES if lower.startswith(prefix)), "other")


def shown_subject(subject: str, kind: str, inbox_prefix: str | None = None) -> str:
    """The subject as one problem line names it: its well-known prefix in its own case,
    and an ack subject only up to its consumer (the sequence numbers after it would make
    every ack a problem of its own); every reply subject as one (each request, each
    prober has an inbox of its own)."""
    if kind == "inbox":
        return f"{inbox_prefix or '_INBOX'}.>"
    lower = subject.lower()
    for prefix, shown, _ in _PREFIXES:
        if lower.startswith(prefix):
            subject = shown + subject[len(prefix):]
            break
    tokens = subject.split(".")
    if kind == "ack" and len(tokens) > 4:
        return ".".join(tokens[:4]) + ".>"
    if kind in ("inbox", "control", "api") and len(tokens) > 3:
        return ".".join(tokens[:3]) + ".>"
    return subject


@dataclass
class _Seen:
    count: int
    last: float
    #: When it was last logged, and the count then.
    logged: float = -1e18
    logged_count: int = 0


#: Each denied operation is logged once, then at most this often (with a count): a
#: denied ack would otherwise log one warning per message.
LOG_EVERY = 60.0


class Denials:
    """The permission violations of one connection, by operation and subject."""

    def __init__(self, *, dead_letter_subject: str | None = None,
                 inbox_prefix: str | None = None, window: float = DENIAL_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._dead_letter = dead_letter_subject
        self._inbox = inbox_prefix
        self._window = window
        self._clock = clock
        self._seen: dict[tuple[str, str, str], _Seen] = {}
        self._latest: tuple[str, str, str] | None = None

    def record(self, error: str) -> tuple[str, str] | None:
        """Note a client error's text; ``(operation, kind)`` when it was a denial
        (:meth:`to_log` then says whether to log it)."""
        m = _VIOLATION.search(error)
        if m is None:
            return None
        operation = "publish" if m.group(1).lower() == "publish" else "subscribe"
        subject = m.group(2)
        kind = kind_of(subject, self._dead_letter, self._inbox)
        key = (operation, kind, shown_subject(subject, kind, self._inbox))
        seen = self._seen.get(key)
        now = self._clock()
        if seen is None:
            if len(self._seen) >= 32:  # bounded: drop the oldest
                del self._seen[min(self._seen, key=lambda k: self._seen[k].last)]
            self._seen[key] = _Seen(1, now)
        else:
            seen.count += 1
            seen.last = now
        self._latest = key
        return operation, kind

    def to_log(self) -> dict[str, object] | None:
        """The fields to log for the denial just recorded, or None when the same one was
        logged less than LOG_EVERY ago (``times``: how many since it was last logged)."""
        seen = self._seen.get(self._latest) if self._latest is not None else None
        if seen is None or seen.last - seen.logged < LOG_EVERY:
            return None
        operation, kind, subject = self._latest  # type: ignore[misc]
        fields: dict[str, object] = {"operation": operation, "subject": subject, "kind": kind,
                                     "times": seen.count - seen.logged_count}
        seen.logged, seen.logged_count = seen.last, seen.count
        return fields

    def reconnected(self) -> None:
        """The client subscribed again: denied subscriptions will say so again."""
        self._seen = {k: v for k, v in self._seen.items() if k[0] != "subscribe"}

    def problems(self) -> list[str]:
        """One line per denied operation: a publish within the window, a subscription
        until the next reconnect (the server refuses a subscription once; it stays
        missing, while a denied publish is refused each time it is tried)."""
        now = self._clock()
        out = []
        for (operation, kind, subject), seen in sorted(self._seen.items()):
            ago = now - seen.last
            if operation == "publish" and ago > self._window:
                continue
            out.append(f"NATS permission denied: {operation} to {subject} ({seen.count} "
                       f"times, last {ago:.0f}s ago): {CONSEQUENCE[kind]}; grant this "
                       f"user {operation} permission on it")
        return out


class AckWatch:
    """Acks that do not take effect, whatever the reason: messages delivered again after
    this instance acked them (the member runtime counts them, ``resettled``, and sends
    the ack again). One or two after a reconnect are normal; at least
    :attr:`MIN_LOST` in the window that are at least half as many as the messages handled
    to an ack in it mean the acks keep failing."""

    WINDOW = 300.0
    MIN_LOST = 3

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: (time, acked, resettled) samples: one at or before the window's start (the
        #: baseline), then at most one a second.
        self._samples: deque[tuple[float, int, int]] = deque([(clock(), 0, 0)])

    def problem(self, acked: int, resettled: int) -> str | None:
        """The problem line given the totals now (empty: none)."""
        now = self._clock()
        if now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, acked, resettled))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.WINDOW:
            self._samples.popleft()
        since, acked_before, lost_before = self._samples[0]
        lost, done = resettled - lost_before, acked - acked_before
        if lost < self.MIN_LOST or 2 * lost < done:
            return None
        return (f"acks are not taking effect: {lost} messages were delivered again after "
                f"this instance acked them in the last {now - since:.0f}s (for {done} "
                "handled): a user without publish permission on $JS.ACK.>, or acks lost "
                "on the way")
