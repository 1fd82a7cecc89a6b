"""States of a member instance, why an active one steps down, and small helpers the
runtime shares (see :mod:`cgroupd.member`)."""

from __future__ import annotations

import asyncio
import inspect
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

ActiveCallback = Callable[[tuple[int, ...]], Awaitable[None] | None]
StandbyCallback = Callable[[str], Awaitable[None] | None]
#: Called with (partitions now owned, seconds the move took) after an in-place rebalance.
RebalanceCallback = Callable[[tuple[tuple[int, ...], float]], Awaitable[None] | None]


class MemberState(Enum):
    """The public state of a member instance; :class:`Phase` says what it does within."""

    JOINING = "joining"  # reading the group config for the first time
    STANDBY = "standby"  # not consuming: competing, waiting to compete, or not a member
    ACTIVE = "active"  # owns this member's consumers and delivers messages
    STEPPING_DOWN = "stepping-down"  # finishing in-flight handlers, releasing consumers
    STOPPED = "stopped"  # done for good


class Phase(Enum):
    """What an instance does within its state (a sub-state; before issue 26 each was a
    flag). JOINING and STOPPED have none."""

    WAITING = "waiting"  # STANDBY: competing, waiting to compete, or not a member
    CLAIMING = "claiming"  # STANDBY: holds the claim (sync: checking it, creating its data
    #                        consumer; pinned: pulling on the member consumer until pinned)
    TAKING_OVER = "taking-over"  # ACTIVE, pinned: nothing starts until a previous
    #                              holder's messages are back or the consumer is reset
    RUNNING = "running"  # ACTIVE: delivering
    MOVING = "moving"  # ACTIVE: an incremental rebalance moves partitions in place
    RELEASING = "releasing"  # STEPPING_DOWN: draining, then standing by again
    STOPPING = "stopping"  # STEPPING_DOWN: draining, then stopped (stop(), group deleted)


#: Where an instance is: a state and, within it, a phase (None: JOINING, STOPPED; in a
#: transition's source, None means any phase of that state).
Where = tuple[MemberState, Phase | None]


@dataclass(frozen=True)
class Transition:
    """One row of :data:`TRANSITIONS`: ``src`` may move to ``dst``, ``when`` says why."""

    src: Where
    dst: Where
    when: str


_J, _SB, _A, _SD, _X = (MemberState.JOINING, MemberState.STANDBY, MemberState.ACTIVE,
                        MemberState.STEPPING_DOWN, MemberState.STOPPED)

#: The one transition table: every move of ``Member.state`` and ``Member.phase``;
#: ``MemberCore._transition`` raises on anything else. docs/architecture.md shows it,
#: rendered by :func:`render_transitions`, and the supervisor's docstring its moves between
#: states, rendered by :func:`render_moves` (``tests/unit/test_state_table.py`` fails when
#: either drifts).
TRANSITIONS: tuple[Transition, ...] = (
    Transition((_J, None), (_SB, Phase.WAITING), "the group config was read (start())"),
    Transition((_J, None), (_X, None), "stop() before the start completed"),
    Transition((_SB, Phase.WAITING), (_SB, Phase.WAITING), "looked again: still standby"),
    Transition((_SB, Phase.WAITING), (_SB, Phase.CLAIMING),
               "competes for the claim (sync: from sending the synchronization "
               "consumer's create, answering \"claiming\" to probes; pinned: created or "
               "shared the member consumer)"),
    Transition((_SB, Phase.CLAIMING), (_SB, Phase.WAITING),
               "the claim did not become a generation (its create refused, contested, "
               "data consumer refused, "
               "stop() meanwhile, not pinned before it ended)"),
    Transition((_SB, Phase.CLAIMING), (_A, Phase.RUNNING), "sync: the data consumer is ours"),
    Transition((_SB, Phase.CLAIMING), (_A, Phase.TAKING_OVER), "pinned: the server pinned us"),
    Transition((_SB, None), (_X, None), "stop() or the group's deletion while standby"),
    Transition((_A, Phase.TAKING_OVER), (_A, Phase.RUNNING),
               "a previous holder's messages are back (or the consumer reset) and the "
               "member consumer has this config's filters"),
    Transition((_A, Phase.RUNNING), (_A, Phase.TAKING_OVER),
               "pinned: pinned again only after our lease ran out (taken over in place)"),
    Transition((_A, Phase.RUNNING), (_A, Phase.MOVING), "a membership change, applied in place"),
    Transition((_A, Phase.MOVING), (_A, Phase.RUNNING), "the move is done or given up"),
    Transition((_A, None), (_SD, Phase.RELEASING), "the generation ended (a StepDown reason)"),
    Transition((_A, None), (_SD, Phase.STOPPING),
               "the generation ended by stop() or the group's deletion"),
    Transition((_SD, Phase.RELEASING), (_SD, Phase.STOPPING),
               "stop() or the group's deletion during the release"),
    Transition((_SD, Phase.RELEASING), (_SB, Phase.WAITING), "released: compete again"),
    Transition((_SD, None), (_X, None), "released for good"),
)

#: The phase a state begins in unless a transition names another.
FIRST_PHASE: dict[MemberState, Phase] = {
    MemberState.STANDBY: Phase.WAITING, MemberState.ACTIVE: Phase.RUNNING,
    MemberState.STEPPING_DOWN: Phase.RELEASING}

#: The states each state may move to (derived from :data:`TRANSITIONS`; a move between
#: two phases of one state is not a move of the state).
ALLOWED: dict[MemberState, set[MemberState]] = {state: set() for state in MemberState}
for _t in TRANSITIONS:
    if _t.src[0] is not _t.dst[0] or _t.src[1] is _t.dst[1]:
        ALLOWED[_t.src[0]].add(_t.dst[0])


def allowed(src: Where, dst: Where) -> bool:
    """Whether :data:`TRANSITIONS` lets an instance move from ``src`` to ``dst``."""
    return any(t.dst == dst and t.src[0] is src[0] and t.src[1] in (None, src[1])
               for t in TRANSITIONS)


def where_name(where: Where) -> str:
    """``state`` or ``state: phase``, as logs and the docs name it."""
    state, phase = where
    return state.value if phase is None else f"{state.value}: {phase.value}"


def render_transitions() -> str:
    """The transition table as Markdown (``from``, ``to``, ``when``)."""
    rows = ["| from | to | when |", "| --- | --- | --- |"]
    for t in TRANSITIONS:
        src = where_name(t.src) if t.src[1] is not None or t.src[0] in (_J, _X) \
            else f"{t.src[0].value} (any)"
        rows.append(f"| {src} | {where_name(t.dst)} | {t.when} |")
    return "\n".join(rows) + "\n"


def render_moves() -> str:
    """The moves between states (phases in brackets), one line per state, as the
    supervisor's docstring draws them."""
    lines = []
    for state in MemberState:
        phases = [p.value for p in Phase
                  if any(t.dst == (state, p) for t in TRANSITIONS)]
        name = state.value.upper() + (f" ({', '.join(phases)})" if phases else "")
        others = [s.value.upper() for s in MemberState if s in ALLOWED[state] and s is not state]
        lines.append(f"    {name} ──► {', '.join(others)}" if others else f"    {name}")
    return "\n".join(lines) + "\n"


class StepDown(Enum):
    """Why an active instance stopped being active (metric label, callback argument)."""

    CONFIG_CHANGED = "config-changed"
    SYNC_LOST = "sync-consumer-lost"
    DATA_LOST = "data-consumer-lost"
    PIN_LOST = "pin-lost"
    REQUESTED = "step-down-requested"  # pinned mode: asked on its step-down subject
    STALLED = "stalled"
    GROUP_DELETED = "group-deleted"
    STOPPING = "stopping"
    ERROR = "error"


def new_instance_id() -> str:
    """A short random id, unique per running instance."""
    return secrets.token_hex(6)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Wake(asyncio.Event):
    """An event that can be waited on with a timeout cheaply (a future and a timer, not
    ``wait_for``'s extra task): a standby waits on it several times a second."""

    def __init__(self) -> None:
        super().__init__()
        self._naps: set[asyncio.Future[None]] = set()

    def set(self) -> None:
        super().set()
        for fut in list(self._naps):
            _resolve(fut)

    async def nap(self, timeout: float) -> None:
        """Return when set, or after ``timeout`` seconds (yielding to the loop either way)."""
        if self.is_set():
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._naps.add(fut)
        timer = loop.call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._naps.discard(fut)


async def maybe_await(value: Awaitable[None] | None) -> None:
    if inspect.isawaitable(value):
        await value
