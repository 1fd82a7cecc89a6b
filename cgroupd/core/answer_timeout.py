"""How long to wait for the server's answer to an API request, learnt from its answers.

A request that times out is not withdrawn: the server still queues and runs it, then
answers an inbox nobody reads. With a fixed timeout shorter than the server's queue, every
request of an overloaded server is wasted, and each retry adds to the queue (issue 27: a
mass start of 1,000 instances kept nats-server 2.15 answering consumer creates in 2.2-3 s
against our 2 s, so nearly nothing succeeded, and it dropped 10,000 queued requests at its
queue limit). As TCP's retransmission timer does (RFC 6298), a timeout doubles the next
wait (once: see :data:`ANSWER_TIMEOUT_CAP_FACTOR`), and answers bring it back: by one
doubling each, and never below four times the smoothed answer time (up to the cap). An
idle, healthy server's answers take milliseconds, so the wait stays at its base there.

Waiting longer is safe where a deadline matters: an owner's lease runs from the *sending*
of its check (:mod:`cgroupd.nats.lease`), however late the answer comes.
"""

from __future__ import annotations

#: The longest wait for one answer, as a multiple of the base, whatever the server's recent
#: record. One doubling: in a cluster an unanswered request may also mean a consumer leader
#: out of reach across a cut, where trying again soon (another name, another leader) is the
#: remedy; with 8x allowed, a standby's data consumer creates across a cut waited 2 s, then
#: 8 s, and it was not active 40 s after the cut (hog CI on 585a178:
#: test_cluster_node_cut_with_the_active_instance_on_it). Even one doubling coincided with
#: pinned rolling-restart failures in the next two CI runs (a 19.7 s stall, a per-key
#: reorder), so the default is no growth until that interplay is understood (issue 27's
#: note): the adapter's waits are the base, as before, and only a ``cap`` above it turns
#: learning on.
ANSWER_TIMEOUT_CAP_FACTOR = 1.0
#: Smoothing of the answer time (RFC 6298's alpha).
SMOOTHING = 0.125
#: How many smoothed answer times the wait is at least (RFC 6298's K, roughly).
ANSWER_TIME_MULTIPLE = 4.0


class AnswerTimeout:
    """The wait for the next answer on one connection: :attr:`seconds`, then tell it
    :meth:`answered` or :meth:`unanswered`."""

    def __init__(self, base: float, cap: float | None = None) -> None:
        if base <= 0:
            raise ValueError("base must be positive")
        self.base = base
        self.cap = max(cap if cap is not None else ANSWER_TIMEOUT_CAP_FACTOR * base, base)
        self._doublings = 0
        self._smoothed: float | None = None

    @property
    def seconds(self) -> float:
        """How long to wait for the next answer."""
        wait = self.base * 2.0 ** self._doublings
        if self._smoothed is not None:
            wait = max(wait, ANSWER_TIME_MULTIPLE * self._smoothed)
        return min(self.cap, wait)

    @property
    def raised(self) -> bool:
        """Whether the wait is above its base (the server answered slowly, or not)."""
        return self.seconds > self.base

    def answered(self, elapsed: float) -> None:
        """An answer came ``elapsed`` seconds after its request was sent."""
        elapsed = max(0.0, elapsed)
        self._smoothed = (elapsed if self._smoothed is None
                          else (1 - SMOOTHING) * self._smoothed + SMOOTHING * elapsed)
        self._doublings = max(0, self._doublings - 1)

    def unanswered(self, waited: float) -> None:
        """No answer came within ``waited`` seconds. Only a request that waited the current
        wait doubles it: the others were sent before the last doubling, and a burst of
        requests that time out together is one sign of congestion, not many."""
        if waited >= self.seconds and self.seconds < self.cap:
            self._doublings += 1
