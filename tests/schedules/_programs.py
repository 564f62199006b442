"""Every program of a tiny two-rank problem, replayed one by one: the reference the lower bound,
the exact search and ``search`` are checked against (tests/schedules/test_bound.py,
test_exact.py, test_search.py); and the list-scheduled hint the constraint solver's tests start
from."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from fpipe.schedules import Action, Costs, Program, ScheduleError, simulate
from fpipe.schedules._list_schedule import Policy, Problem, list_schedule


def stage_rows(stage: int, m: int, kinds: str, *, fifo: bool) -> list[tuple[Action, ...]]:
    """Every order of one stage's actions in which each microbatch runs ``kinds`` in order, and,
    with ``fifo``, each kind runs its microbatches in order (else in any order)."""
    actions = [Action(stage, k, i) for k in kinds for i in range(m)]
    rows = []
    for perm in itertools.permutations(actions):
        at = {a: n for n, a in enumerate(perm)}
        chained = all(
            at[Action(stage, a, i)] < at[Action(stage, b, i)] for a, b in itertools.pairwise(kinds) for i in range(m)
        )
        ordered = all(at[Action(stage, k, i)] < at[Action(stage, k, i + 1)] for k in kinds for i in range(m - 1))
        if chained and (ordered or not fifo):
            rows.append(perm)
    return rows


def least_makespan(costs: Sequence[Costs], m: int, memory: float | None, *, fifo: bool) -> float:
    """The least makespan of every program of 2 stages on 2 ranks and ``m`` microbatches, all
    backwards split or all fused, that runs (no deadlock) within ``memory`` activations per rank."""
    best = math.inf
    for kinds in ("FIW", "FB"):
        for rows in itertools.product(stage_rows(0, m, kinds, fifo=fifo), stage_rows(1, m, kinds, fifo=fifo)):
            try:
                sim = simulate(Program(rows, 2, m), list(costs))
            except ScheduleError:  # a deadlock
                continue
            if max(sim.peak_activations) <= (math.inf if memory is None else memory):
                best = min(best, sim.makespan)
    return best


def first_pass(problem: Problem) -> tuple[Program, float]:
    """A list-scheduled program of ``problem`` and its makespan: a hint for the constraint solver
    (tests/schedules/test_solver.py, tests/conformance.py)."""
    laid_out = list_schedule(problem, Policy(split=True, backward_first=True, deep_first=True))
    assert laid_out is not None
    return laid_out
