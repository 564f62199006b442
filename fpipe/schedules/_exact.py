"""Exact search: the fastest program of a small problem, by branch and bound over every order.

NOTE [exact search]
    The space: programs in which every stage runs each kind of action on its microbatches in
    increasing order (as every built-in schedule but ``LoopedBFS`` does) and whose backwards are
    all fused (``B``) or all split (``I`` and ``W``), under the memory limit (the actual peak,
    not the list scheduler's reservation). Replay any such program (``simulate``) and sort its
    actions by (start, rank): each action's inputs come earlier in that list, so the program is
    built by appending actions one at a time, each at the earliest time its rank and inputs
    allow, in non-decreasing (start, rank). The search enumerates exactly those sequences (one
    per program), depth first, best-looking action first. It prunes a branch when

    - a bound says it cannot beat the best program known: the release bound (NOTE [release
      bound] and NOTE [memory windows] in ``_bound.py``) of what is left, nothing starting
      before the last start (the order) or before its rank is free;
    - another branch reached the same counts of actions per stage (so the same memory) with
      every time that matters (when each rank is free, the last start, when each input still
      awaited by another stage arrived) no later: whatever follows one follows the other, no
      later.

    Dominance is checked first (a lookup, where the bound replays every action left), and the
    bound stops as soon as one of its terms reaches the best makespan known: at ``p = 3, m =
    4`` with two stages per rank that halves the search's time (notes/search.md).

    The fused programs are searched only where some stage's ``B`` costs less than ``I + W``:
    otherwise each ``B`` split into ``I`` then ``W`` at once keeps the memory and no action ends
    later, so the split space holds a program as fast as any fused one.

    Exhausting the space proves the best program found optimal within it. The sizes this
    finishes for in seconds are small (notes/search.md); ``search`` runs it when
    ``p <= 4`` and ``m <= 8``, under its time budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._bound import Relaxation
from ._list_schedule import Problem
from ._program import Program

_EPSILON = 1e-9

Outcome = Literal["optimal", "ended", "cut"]
"""How an exact search ended, by its own account, not the clock's: ``"optimal"``, it ran to its
end and proved its answer the fastest of its space; ``"ended"``, it ran to its end on a model
rounded from the costs, which proves nothing about them (the constraint solver only, NOTE
[constraint solver]); ``"cut"``, the deadline stopped it first."""


class OutOfTime(Exception):
    """The exact search ran past its deadline (``exact`` catches it)."""


@dataclass
class _Search:
    problem: Problem
    split: bool
    best: float
    deadline: float
    program: Program | None = None
    seen: dict[tuple[int, ...], list[tuple[float, ...]]] = field(default_factory=dict)
    nodes: int = 0

    def __post_init__(self) -> None:
        problem, m = self.problem, self.problem.num_microbatches
        S = problem.num_stages
        self.kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if self.split else (FORWARD, BACKWARD)
        self.done = {kind: [0] * S for kind in self.kinds}
        self.ends = {FORWARD: [[0.0] * m for _ in range(S)], BACKWARD: [[0.0] * m for _ in range(S)]}
        self.free = [0.0] * problem.num_ranks
        self.memory = [0.0] * problem.num_ranks
        self.rows: list[list[Action]] = [[] for _ in range(problem.num_ranks)]
        self.todo = m * problem.num_stages * len(self.kinds)  # actions not yet placed
        self.left = [
            m * sum(sum(problem.costs[s].of(k) for k in self.kinds) for s in problem.stages_of(r))
            for r in range(problem.num_ranks)
        ]
        costs = problem.costs
        back = [problem.backward(s, self.split) for s in range(S)]
        self.relaxation = Relaxation(problem, back, [c.backward_weight if self.split else 0.0 for c in costs])

    def options(self, last: tuple[float, int]) -> list[tuple[float, int, str, int]]:
        """``(start, rank, kind, stage)`` of every action that may come next in the order."""
        problem, done, ends, m = self.problem, self.done, self.ends, self.problem.num_microbatches
        backward = BACKWARD_INPUT if self.split else BACKWARD
        found = []
        for s, r in enumerate(problem.rank_of):
            i = done[FORWARD][s]
            fits = self.memory[r] + problem.sizes[s] <= problem.limits[r] * (1 + _EPSILON)
            if i < m and (s == 0 or done[FORWARD][s - 1] > i) and fits:
                ready = ends[FORWARD][s - 1][i] + problem.hop(s - 1, s) if s else 0.0
                found.append((max(self.free[r], ready), r, FORWARD, s))
            j = done[backward][s]
            if j < done[FORWARD][s] and (s == problem.num_stages - 1 or done[backward][s + 1] > j):
                ready = ends[FORWARD][s][j]
                if s + 1 < problem.num_stages:
                    ready = max(ready, ends[BACKWARD][s + 1][j] + problem.hop(s + 1, s))
                found.append((max(self.free[r], ready), r, backward, s))
            if self.split and done[BACKWARD_WEIGHT][s] < j:
                found.append((max(self.free[r], ends[BACKWARD][s][done[BACKWARD_WEIGHT][s]]), r, BACKWARD_WEIGHT, s))
        order = {BACKWARD: 0, BACKWARD_INPUT: 0, FORWARD: 1, BACKWARD_WEIGHT: 2}
        kept = [o for o in found if o[0] > last[0] + _EPSILON or (o[0] >= last[0] - _EPSILON and o[1] >= last[1])]
        return sorted(kept, key=lambda o: (o[0], order[o[2]], o[1]))

    def bound(self, start: float, span: float) -> float:
        """A makespan no completion of the partial program can beat (NOTE [release bound] in
        ``_bound.py``), or one at least ``best``; ``start``: the last action's, before which no
        other action can start."""
        backward = BACKWARD_INPUT if self.split else BACKWARD
        done = self.done[FORWARD], self.done[backward], self.done[BACKWARD_WEIGHT if self.split else backward]
        opens = [max(f, start) for f in self.free]
        ends = self.ends[FORWARD], self.ends[BACKWARD]
        return max(span, self.relaxation.bound(done, ends, opens, self.best - _EPSILON))

    def dominated(self, last: tuple[float, int]) -> bool:
        """Whether a branch already seen reached these counts with every time that matters no later
        (NOTE [exact search]); if not, remember this one."""
        done = self.done
        key = tuple(n for kind in self.kinds for n in done[kind])
        backward = BACKWARD_INPUT if self.split else BACKWARD
        S = self.problem.num_stages
        times = [*self.free, last[0], float(last[1])]
        for s in range(S - 1):
            times += self.ends[FORWARD][s][done[FORWARD][s + 1] : done[FORWARD][s]]
            times += self.ends[BACKWARD][s + 1][done[backward][s] : done[backward][s + 1]]
        vector = tuple(times)
        bucket = self.seen.setdefault(key, [])
        if any(all(a <= b + _EPSILON for a, b in zip(other, vector)) for other in bucket):
            return True
        bucket[:] = [other for other in bucket if not all(b <= a + _EPSILON for a, b in zip(other, vector))]
        bucket.append(vector)
        return False

    def descend(self, last: tuple[float, int], span: float) -> None:
        """Try every next action after ``last`` (start, rank) in the partial program of makespan ``span``."""
        self.nodes += 1
        if self.nodes % 1024 == 0 and time.perf_counter() > self.deadline:
            raise OutOfTime
        if not self.todo:
            if span < self.best - _EPSILON:
                self.best = span
                self.program = Program(
                    tuple(tuple(row) for row in self.rows), self.problem.num_stages, self.problem.num_microbatches
                )
            return
        if self.dominated(last) or self.bound(last[0], span) >= self.best - _EPSILON:
            return
        for start, r, kind, s in self.options(last):
            if max(start, last[0]) + self.left[r] >= self.best - _EPSILON:
                continue
            undo = self.apply(start, r, kind, s)
            self.descend((start, r), max(span, self.free[r]))
            undo()

    def apply(self, start: float, r: int, kind: str, s: int) -> Callable[[], None]:
        """Append ``kind`` of stage ``s`` to rank ``r`` at ``start``; a function that takes it back."""
        problem = self.problem
        i = self.done[kind][s]
        cost = problem.costs[s].of(kind)
        saved = (self.free[r], self.memory[r])
        self.done[kind][s] = i + 1
        self.free[r] = start + cost
        self.left[r] -= cost
        self.todo -= 1
        self.rows[r].append(Action(s, kind, i))
        if kind == FORWARD:
            self.ends[FORWARD][s][i] = start + cost
            self.memory[r] += problem.sizes[s]
        elif kind != BACKWARD_WEIGHT:
            self.ends[BACKWARD][s][i] = start + cost
        if kind in (BACKWARD, BACKWARD_WEIGHT):
            self.memory[r] -= problem.sizes[s]

        def undo() -> None:
            self.done[kind][s] = i
            self.free[r], self.memory[r] = saved
            self.left[r] += cost
            self.todo += 1
            self.rows[r].pop()

        return undo


def exact(problem: Problem, best: float, deadline: float) -> tuple[Program | None, float, Outcome]:
    """The fastest program of ``problem`` faster than ``best`` (NOTE [exact search]).

    Returns ``(program, makespan, outcome)``: ``program`` is ``None`` when none beats ``best``
    (``makespan`` is then ``best``); ``outcome`` is ``"optimal"`` when the search ran to its end
    (no program of the space beats ``makespan``), ``"cut"`` when ``deadline``
    (``time.perf_counter()``) stopped it first, and the program is then the best found so far.
    """
    program = None
    fused = any(c.of(BACKWARD) < c.backward_input + c.backward_weight for c in problem.costs)
    for split in (True, False) if fused else (True,):
        search = _Search(problem, split, best, deadline)
        try:
            search.descend((-math.inf, 0), 0.0)
        except OutOfTime:
            return search.program or program, min(search.best, best), "cut"
        if search.program is not None:
            program, best = search.program, search.best
    return program, best, "optimal"
