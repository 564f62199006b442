"""Exact search: the fastest program of a small problem, by branch and bound over every order.

NOTE [exact search]
    The space: every stage runs its forwards, its backwards (``B`` or ``I``) and its ``W``
    each in microbatch order, each backward fused (``B``) or split (``I``, its ``W`` any time
    later) on its own (``choices``), within the memory limit (the actual peak, not the list
    scheduler's reservation). No valid program is faster than the fastest of these (NOTE
    [microbatch order]), so exhausting the space proves the best program found optimal among
    every program ``simulate`` can time. Replay one (``simulate``) and sort its actions by
    (start, rank): each action's inputs come earlier in that list, so the program is built by
    appending actions one at a time, each at the earliest time its rank and inputs allow, in
    non-decreasing (start, rank). The search enumerates exactly those sequences (one per
    program), depth first, best-looking action first. It prunes a branch when

    - a bound says it cannot beat the best program known: the release bound (NOTE [release
      bound] and NOTE [memory windows] in ``_bound.py``) of what is left, nothing starting
      before the last start (the order) or before its rank is free;
    - another branch reached the same counts of actions per stage (so the same memory) with
      every time that matters (when each rank is free, the last start, when each input still
      awaited by another stage arrived) no later: whatever follows one follows the other, no
      later. (A ``W`` waiting may run at once: its ``I`` ran on its rank, which is free later.)

    Dominance is checked first (a lookup, where the bound replays every action left), and the
    bound stops as soon as one of its terms reaches the best makespan known. Where a fused
    backward is a choice, each backward doubles the branches, and the search proves far fewer
    problems in seconds (notes/search.md); ``search`` runs it when ``p <= 4`` and ``m <= 8``
    without OR-Tools, under its time budget.

NOTE [microbatch order]
    Microbatches cost the same, so a program's times depend only on which action waits for
    which. Take any valid program and rename, on each stage, the microbatch of its ``k``-th
    forward ``k``, of its ``k``-th backward ``k`` (fused or split as that action was), and of
    its ``k``-th ``W`` the ``k``-th split one. The rows keep their kinds in their order, so
    the memory is the same. Each action waits no longer: the first ``k`` backwards of a
    stage needed ``k`` different forwards of it and ``k`` different backwards of the next
    stage, so the ``k``-th started after the ``k``-th of each ended (a rank ends its actions in
    row order, and the messages take the same time); so for forwards and ``W``. By induction
    over start times, every action of the renamed program starts no later. Within the order,
    a stage's backward need only be tried as (``choices``): ``I`` where ``B`` costs at least
    ``I + W`` (``I`` with its ``W`` right after ends no later and frees the same), ``B`` where
    it costs at most ``I`` (it ends no later, frees sooner, leaves no ``W``), else either.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..schedules import Action, Costs, Program
from ..schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._bound import Relaxation
from ._frontier import Frontier
from ._problem import TOLERANCE, Problem

Outcome = Literal["optimal", "ended", "cut"]
"""How an exact search ended, by its own account, not the clock's: ``"optimal"``, it ran to its
end and proved its answer the fastest of its space; ``"ended"``, it ran to its end on a model
rounded from the costs, which proves nothing about them (the constraint solver only, NOTE
[constraint solver]); ``"cut"``, the deadline stopped it first."""


class OutOfTime(Exception):
    """The exact search ran past its deadline (``exact`` catches it)."""


def choices(costs: Costs) -> tuple[str, ...]:
    """How a stage's backward may run in the exact search's space (NOTE [exact search]): ``I``
    (then ``W``) where a fused ``B`` is never cheaper than ``I + W``, ``B`` where it costs no
    more than ``I`` alone, else either, ``I`` first."""
    fused, split = costs.of(BACKWARD), costs.backward_input + costs.backward_weight
    if fused >= split:
        return (BACKWARD_INPUT,)
    if fused <= costs.backward_input:
        return (BACKWARD,)
    return BACKWARD_INPUT, BACKWARD


@dataclass
class _Search:
    problem: Problem
    best: float
    deadline: float
    program: Program | None = None
    seen: dict[tuple[int, ...], list[tuple[float, ...]]] = field(default_factory=dict)
    nodes: int = 0

    def __post_init__(self) -> None:
        problem, m = self.problem, self.problem.num_microbatches
        S, costs = problem.num_stages, problem.costs
        self.choices = [choices(c) for c in costs]
        self.done_f = [0] * S
        self.done_b = [0] * S  # backwards (B or I) run, microbatches 0 to done_b - 1
        self.waiting: list[list[int]] = [[] for _ in range(S)]  # microbatches whose I ran and W did not
        self.frontier = Frontier.of(problem)  # when each action's inputs are there (NOTE [what may run next])
        self.free = [0.0] * problem.num_ranks
        self.memory = [0.0] * problem.num_ranks
        self.rows: list[list[Action]] = [[] for _ in range(problem.num_ranks)]
        self.todo = 2 * m * S  # forwards and backwards not yet placed, and W waiting
        # per stage, the least a backward costs its rank, and what each kind takes off the rank's
        # work left (``left``: a lower bound on it; an I leaves its W)
        cheapest = [
            min(c.of(k) + (c.backward_weight if k == BACKWARD_INPUT else 0.0) for k in x)
            for c, x in zip(costs, self.choices)
        ]
        self.worth = [
            {
                FORWARD: c.forward,
                BACKWARD: cheapest[s],
                BACKWARD_INPUT: cheapest[s] - c.backward_weight,
                BACKWARD_WEIGHT: c.backward_weight,
            }
            for s, c in enumerate(costs)
        ]
        self.left = [
            m * sum(costs[s].forward + cheapest[s] for s in problem.stages_of(r)) for r in range(problem.num_ranks)
        ]
        back = [c.of(x[0]) for c, x in zip(costs, self.choices)]  # I where I may run, else B
        rest = [c - b for c, b in zip(cheapest, back)]
        self.relaxation = Relaxation(problem, back, rest, [c.backward_weight for c in costs])

    def options(self, last: tuple[float, int]) -> list[tuple[float, int, str, int]]:
        """``(start, rank, kind, stage)`` of every action that may come next in the order."""
        problem, m = self.problem, self.problem.num_microbatches
        done_f, done_b, free = self.done_f, self.done_b, self.free
        forward, backward = self.frontier.forward, self.frontier.backward
        found = []
        for s, r in enumerate(problem.rank_of):
            i = done_f[s]
            if i < m and self.memory[r] + problem.sizes[s] <= problem.limits[r] * (1 + TOLERANCE):
                ready = forward(s, i)
                if ready != math.inf:
                    found.append((max(free[r], ready), r, FORWARD, s))
            j = done_b[s]
            ready = backward(s, j) if j < m else math.inf
            if ready != math.inf:
                found += [(max(free[r], ready), r, kind, s) for kind in self.choices[s]]
            if self.waiting[s]:  # its I ran on this rank, so ``weight`` is at most when the rank is free
                found.append((free[r], r, BACKWARD_WEIGHT, s))
        order = {BACKWARD: 0, BACKWARD_INPUT: 0, FORWARD: 1, BACKWARD_WEIGHT: 2}
        kept = [o for o in found if o[0] > last[0] + TOLERANCE or (o[0] >= last[0] - TOLERANCE and o[1] >= last[1])]
        return sorted(kept, key=lambda o: (o[0], order[o[2]], o[1]))

    def bound(self, start: float, span: float) -> float:
        """A makespan no completion of the partial program can beat (NOTE [release bound] in
        ``_bound.py``), or one at least ``best``; ``start``: the last action's, before which no
        other action can start."""
        opens = [max(f, start) for f in self.free]
        ends = self.frontier.end_f, self.frontier.end_b
        done = self.done_f, self.done_b
        return max(span, self.relaxation.bound(done, self.waiting, ends, opens, self.best - TOLERANCE))

    def dominated(self, last: tuple[float, int]) -> bool:
        """Whether a branch already seen reached these counts with every time that matters no later
        (NOTE [exact search]); if not, remember this one."""
        done_f, done_b = self.done_f, self.done_b
        key = (*done_f, *done_b, *(len(w) for w in self.waiting))
        S = self.problem.num_stages
        times = [*self.free, last[0], float(last[1])]
        for s in range(S - 1):
            times += self.frontier.end_f[s][done_f[s + 1] : done_f[s]]
            times += self.frontier.end_b[s + 1][done_b[s] : done_b[s + 1]]
        vector = tuple(times)
        bucket = self.seen.setdefault(key, [])
        if any(all(a <= b + TOLERANCE for a, b in zip(other, vector)) for other in bucket):
            return True
        bucket[:] = [other for other in bucket if not all(b <= a + TOLERANCE for a, b in zip(other, vector))]
        bucket.append(vector)
        return False

    def descend(self, last: tuple[float, int], span: float) -> None:
        """Try every next action after ``last`` (start, rank) in the partial program of makespan ``span``."""
        self.nodes += 1
        if self.nodes % 1024 == 0 and time.perf_counter() > self.deadline:
            raise OutOfTime
        if not self.todo:
            if span < self.best - TOLERANCE:
                self.best = span
                self.program = Program(
                    tuple(tuple(row) for row in self.rows), self.problem.num_stages, self.problem.num_microbatches
                )
            return
        if self.dominated(last) or self.bound(last[0], span) >= self.best - TOLERANCE:
            return
        for start, r, kind, s in self.options(last):
            if max(start, last[0]) + self.left[r] >= self.best - TOLERANCE:
                continue
            undo = self.apply(start, r, kind, s)
            self.descend((start, r), max(span, self.free[r]))
            undo()

    def apply(self, start: float, r: int, kind: str, s: int) -> Callable[[], None]:
        """Append ``kind`` of stage ``s`` to rank ``r`` at ``start``; a function that takes it back."""
        problem = self.problem
        cost, worth = problem.costs[s].of(kind), self.worth[s][kind]
        saved = (self.free[r], self.memory[r])
        ends = self.frontier.end_f if kind == FORWARD else self.frontier.end_b  # Frontier.ran, inline
        if kind == FORWARD:
            i = self.done_f[s]
            self.done_f[s] += 1
            ends[s][i] = start + cost
            self.memory[r] += problem.sizes[s]
        elif kind == BACKWARD_WEIGHT:
            i = self.waiting[s].pop(0)
            self.memory[r] -= problem.sizes[s]
        else:
            i = self.done_b[s]
            self.done_b[s] += 1
            ends[s][i] = start + cost
            if kind == BACKWARD:
                self.memory[r] -= problem.sizes[s]
            else:
                self.waiting[s].append(i)
        todo = 0 if kind == BACKWARD_INPUT else 1  # an I leaves its W to do
        self.free[r] = start + cost
        self.left[r] -= worth
        self.todo -= todo
        self.rows[r].append(Action(s, kind, i))

        def undo() -> None:
            if kind == FORWARD:
                self.done_f[s] -= 1
                ends[s][i] = math.inf  # Frontier.forget, inline
            elif kind == BACKWARD_WEIGHT:
                self.waiting[s].insert(0, i)
            else:
                self.done_b[s] -= 1
                ends[s][i] = math.inf
                if kind == BACKWARD_INPUT:
                    self.waiting[s].pop()
            self.free[r], self.memory[r] = saved
            self.left[r] += worth
            self.todo += todo
            self.rows[r].pop()

        return undo


def exact(problem: Problem, best: float, deadline: float) -> tuple[Program | None, float, Outcome]:
    """The fastest program of ``problem`` faster than ``best`` (NOTE [exact search]).

    Returns ``(program, makespan, outcome)``: ``program`` is ``None`` when none beats ``best``
    (``makespan`` is then ``best``); ``outcome`` is ``"optimal"`` when the search ran to its end
    (no program of the space beats ``makespan``), ``"cut"`` when ``deadline``
    (``time.perf_counter()``) stopped it first, and the program is then the best found so far.
    """
    search = _Search(problem, best, deadline)
    try:
        search.descend((-math.inf, 0), 0.0)
    except OutOfTime:
        return search.program, search.best, "cut"
    return search.program, search.best, "optimal"
