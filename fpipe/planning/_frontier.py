"""What may run next, and from when: the one rule every part of the engine asks.

NOTE [what may run next]
    An action may start once the actions it needs have ended and their messages have arrived.
    The rule is ``dependencies`` in ``fpipe/schedules/_program.py``, which ``simulate`` replays::

        F(s, i)      after F(s-1, i) + its message                  (the first stage: at once)
        B/I(s, i)    after F(s, i) and B/I(s+1, i) + its message    (the last stage: after F only)
        W(s, i)      after I(s, i)

    and a message costs its sender's ``send`` between ranks, nothing within one. ``Frontier``
    compiles that rule once for a placement (which stage each stage's forward and backward take
    their input from, read off ``dependencies``, and each message's latency) and keeps when each
    forward and backward ended, ``math.inf`` until it has. Then ``forward(s, i)``,
    ``backward(s, i)`` and ``weight(s, i)`` are the earliest time the action's inputs are there,
    ``math.inf`` while one has not run: no question of "has it run?" apart from "when?". The
    list scheduler and the exact search ask it of the next action of each kind of each stage;
    ``makespan`` (local improvement, the schedule-aware split) of the next action of each rank's
    row; the constraint solver's precedences are ``inputs``. What a consumer adds is its own:
    that a rank runs one action at a time (``max(free, ready)``), memory, which microbatch
    comes next.

    Each time is the same sum of the same floats as ``simulate``'s (an input's end plus the
    latency, the largest of them), so every consumer's clock is ``simulate``'s to the bit
    (tests/planning/test_frontier.py checks it against ``simulate`` on random programs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..schedules import Action
from ..schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ..schedules._program import dependencies
from ._problem import Problem

_NONE = -1  # no stage: the first stage's forward takes the batch, the last stage's backward the loss


class Frontier:
    """When each action of a placement may start, as the actions before it end (NOTE [what may
    run next]).

    Args:
        num_microbatches: microbatches per step.
        rank_of: ``rank_of[s]`` is the rank that holds stage ``s``.
        send: per stage, the latency of a message it sends to another rank.
    """

    def __init__(self, num_microbatches: int, rank_of: Sequence[int], send: Sequence[float]) -> None:
        S = len(rank_of)
        self.num_microbatches = num_microbatches
        self.rank_of = tuple(rank_of)
        # Which stage each stage's forward and backward take their input from, read off the rule.
        self.feeds = [_NONE] * S  # the forward's: the previous stage's forward
        self.returns = [_NONE] * S  # the backward's: the next stage's backward (B or I alike)
        for s in range(S):
            for d in dependencies(Action(s, FORWARD, 0), S, frozenset()):
                assert d.kind == FORWARD and d.stage != s, d
                self.feeds[s] = d.stage
            for d in dependencies(Action(s, BACKWARD, 0), S, frozenset()):
                assert (d.stage, d.kind) == (s, FORWARD) or (d.stage != s and d.kind == BACKWARD), d
                if d.stage != s:
                    self.returns[s] = d.stage
            (d,) = dependencies(Action(s, BACKWARD_WEIGHT, 0), S, frozenset())
            assert (d.stage, d.kind) == (s, BACKWARD_INPUT), d
        self.fed = [_NONE] * S  # the stage whose forward takes this one's
        self.returned = [_NONE] * S  # the stage whose backward takes this one's
        for s in range(S):
            if self.feeds[s] != _NONE:
                self.fed[self.feeds[s]] = s
            if self.returns[s] != _NONE:
                self.returned[self.returns[s]] = s
        self.up: list[float] = []  # per stage, the latency of its forward's input
        self.down: list[float] = []  # per stage, the latency of its backward's cotangent
        self.end_f: list[list[float]] = []  # when each forward ended, per stage and microbatch
        self.end_b: list[list[float]] = []  # when each backward (B or I) ended
        self.retime(send)

    @classmethod
    def of(cls, problem: Problem) -> Frontier:
        """The frontier of ``problem``'s placement and messages."""
        return cls(problem.num_microbatches, problem.rank_of, [c.send for c in problem.costs])

    def retime(self, send: Sequence[float]) -> None:
        """Take these latencies (per sending stage), and start over: nothing has run."""
        rank_of = self.rank_of
        self.up = [0.0 if t == _NONE or rank_of[t] == rank_of[s] else send[t] for s, t in enumerate(self.feeds)]
        self.down = [0.0 if t == _NONE or rank_of[t] == rank_of[s] else send[t] for s, t in enumerate(self.returns)]
        self.reset()

    def reset(self) -> None:
        """Start over: nothing has run."""
        m = self.num_microbatches
        self.end_f = [[math.inf] * m for _ in self.rank_of]
        self.end_b = [[math.inf] * m for _ in self.rank_of]

    def forward(self, s: int, i: int) -> float:
        """When the input of stage ``s``'s forward of microbatch ``i`` is there (``math.inf``: not yet)."""
        t = self.feeds[s]
        return 0.0 if t == _NONE else self.end_f[t][i] + self.up[s]

    def backward(self, s: int, i: int) -> float:
        """When the inputs of stage ``s``'s backward (``B`` or ``I``) of ``i`` are there: its forward
        and the next stage's cotangent (``math.inf``: not yet)."""
        ready = self.end_f[s][i]
        t = self.returns[s]
        if t != _NONE:
            arrival = self.end_b[t][i] + self.down[s]
            if arrival > ready:
                ready = arrival
        return ready

    def weight(self, s: int, i: int) -> float:
        """When stage ``s``'s ``W`` of ``i`` may start: its ``I`` ended (``math.inf``: not yet)."""
        return self.end_b[s][i]

    def ready(self, kind: str, s: int, i: int) -> float:
        """``forward``, ``backward`` or ``weight`` by the action's kind."""
        if kind == FORWARD:
            return self.forward(s, i)
        return self.weight(s, i) if kind == BACKWARD_WEIGHT else self.backward(s, i)

    def ran(self, kind: str, s: int, i: int, end: float) -> None:
        """Stage ``s``'s ``kind`` of ``i`` ended at ``end`` (a ``W`` is no one's input)."""
        if kind == FORWARD:
            self.end_f[s][i] = end
        elif kind != BACKWARD_WEIGHT:
            self.end_b[s][i] = end

    def forget(self, kind: str, s: int, i: int) -> None:
        """Stage ``s``'s ``kind`` of ``i`` did not run after all (a search backtracking)."""
        if kind == FORWARD:
            self.end_f[s][i] = math.inf
        elif kind != BACKWARD_WEIGHT:
            self.end_b[s][i] = math.inf

    def taker(self, kind: str, s: int) -> int | None:
        """The stage whose action takes the output of stage ``s``'s ``kind`` as its input: the next
        stage's forward takes a forward's, the previous stage's backward a backward's (``None``:
        the last forward, the first backward, a ``W``, whose only taker is the same stage's)."""
        if kind == BACKWARD_WEIGHT:
            return None
        t = (self.fed if kind == FORWARD else self.returned)[s]
        return None if t == _NONE else t

    def inputs(self, s: int, kind: str) -> tuple[tuple[int, str, float], ...]:
        """``(stage, kind, latency)`` of each action that stage ``s``'s ``kind`` of a microbatch
        waits for, of the same microbatch: ``"F"`` a forward, ``"B"`` a backward (``B`` or ``I``)."""
        if kind == FORWARD:
            t = self.feeds[s]
            return () if t == _NONE else ((t, FORWARD, self.up[s]),)
        if kind == BACKWARD_WEIGHT:
            return ((s, BACKWARD, 0.0),)
        t = self.returns[s]
        return ((s, FORWARD, 0.0), *(() if t == _NONE else ((t, BACKWARD, self.down[s]),)))


def makespan(frontier: Frontier, rows: Sequence[Sequence[Action]], duration: Callable[[Action], float]) -> float:
    """The makespan of the program of ``rows`` replayed as soon as possible: each rank runs its
    row in order, each action when the rank is free and the frontier says its inputs are there,
    for ``duration(action)`` (``simulate``'s clock); ``math.inf`` if the rows deadlock. The
    frontier starts over (``reset``), and holds each action's end after (a ``W``'s aside)."""
    frontier.reset()
    forward, backward, weight = frontier.forward, frontier.backward, frontier.weight
    end_f, end_b = frontier.end_f, frontier.end_b
    position = [0] * len(rows)
    free = [0.0] * len(rows)
    left = sum(len(row) for row in rows)
    while left:
        moved = False
        for r, row in enumerate(rows):
            k = position[r]
            while k < len(row):
                a = row[k]
                kind, s, i = a.kind, a.stage, a.microbatch
                ready = (
                    forward(s, i) if kind == FORWARD else weight(s, i) if kind == BACKWARD_WEIGHT else backward(s, i)
                )
                if ready == math.inf:
                    break
                end = (free[r] if free[r] > ready else ready) + duration(a)
                free[r] = end
                if kind == FORWARD:  # frontier.ran, inline: the inner loop
                    end_f[s][i] = end
                elif kind != BACKWARD_WEIGHT:
                    end_b[s][i] = end
                k += 1
                moved = True
            left -= k - position[r]
            position[r] = k
        if not moved:
            return math.inf
    return max(free)
