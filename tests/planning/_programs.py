"""Every program of a tiny problem: the reference the lower bound, the exact search and ``search``
are checked against (tests/planning/test_bound.py, test_exact.py, test_solver.py,
test_search.py); and the list-scheduled hint the constraint solver's tests start from.

"Every program" is every one ``validate`` accepts: each rank's actions in any order, microbatches
in any order on every stage, each backward fused (``B``) or split (``I`` then ``W``) on its own,
within the memory limit. ``fastest_program`` enumerates them without the exact search's
arguments (no microbatch order, no rule on which backwards to fuse, no dominance, no release
bound): only the symmetry of microbatches (they cost the same, so renaming them changes no time)
and each rank's work left.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from fpipe.planning._list_schedule import Policy, list_schedule
from fpipe.planning._problem import TOLERANCE, Problem
from fpipe.schedules import Action, Costs, Program, ScheduleError, simulate


def fastest_program(problem: Problem, at_most: float) -> tuple[float, Program | None]:
    """The least makespan of every valid program of ``problem`` within its memory limits, and one
    program of it, among those of makespan at most ``at_most`` (``(math.inf, None)`` if none).

    Depth first over the program's actions in order of (start, rank), each started when
    ``simulate`` starts it (its rank free, its inputs arrived): sorting any program's actions so
    lists them with every action's inputs before it, so each program is reached once. Stage 0
    takes microbatches in increasing order (a renaming of microbatches changes no time); a branch
    stops when some rank's work left, each backward at its cheaper of ``B`` and ``I + W``, cannot
    end within the best makespan known.
    """
    S, m, p = problem.num_stages, problem.num_microbatches, problem.num_ranks
    costs, rank_of = problem.costs, problem.rank_of
    cheapest = [min(c.of("B"), c.backward_input + c.backward_weight) for c in costs]
    worth = {"F": [c.forward for c in costs], "B": cheapest, "W": [c.backward_weight for c in costs]}
    worth["I"] = [x - c.backward_weight for x, c in zip(cheapest, costs)]  # an I leaves its W
    ends_f: list[list[float | None]] = [[None] * m for _ in range(S)]
    ends_b: list[list[float | None]] = [[None] * m for _ in range(S)]  # of its B or I
    state = [["start"] * m for _ in range(S)]  # "start", "forward" done, "weight" (its W due), "freed"
    free, held = [0.0] * p, [0.0] * p
    left = [m * sum(costs[s].forward + cheapest[s] for s in problem.stages_of(r)) for r in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    best_span, best_program = at_most * (1 + TOLERANCE), None

    def next_actions(last: tuple[float, int]) -> list[tuple[float, int, str, int, int]]:
        found = []
        for s, r in enumerate(rank_of):
            for i in range(m):
                f, b = ends_f[s - 1][i] if s else 0.0, ends_b[s + 1][i] if s + 1 < S else ends_f[s][i]
                if state[s][i] == "start" and f is not None and (s or i == sum(x != "start" for x in state[0])):
                    if held[r] + problem.sizes[s] <= problem.limits[r] * (1 + TOLERANCE):
                        found.append((max(free[r], f + (problem.hop(s - 1, s) if s else 0.0)), r, "F", s, i))
                elif state[s][i] == "forward" and b is not None:
                    ready = max(free[r], ends_f[s][i] or 0.0, b + (problem.hop(s + 1, s) if s + 1 < S else 0.0))
                    found += [(ready, r, "B", s, i), (ready, r, "I", s, i)]
                elif state[s][i] == "weight":
                    found.append((max(free[r], ends_b[s][i] or 0.0), r, "W", s, i))
        return [a for a in found if a[0] > last[0] + TOLERANCE or (a[0] >= last[0] - TOLERANCE and a[1] >= last[1])]

    def descend(last: tuple[float, int]) -> None:
        nonlocal best_span, best_program
        if all(x == "freed" for row in state for x in row):
            span = max(free)
            if best_program is None or span < best_span * (1 - TOLERANCE):
                best_span, best_program = span, Program(tuple(tuple(row) for row in rows), S, m)
            return
        for start, r, kind, s, i in next_actions(last):
            saved = free[r], held[r], state[s][i]
            free[r] = start + costs[s].of(kind)
            left[r] -= worth[kind][s]
            limit = best_span * (1 + TOLERANCE if best_program is None else 1 - TOLERANCE)
            if all(max(free[q], start) + left[q] <= limit for q in range(p)):
                if kind == "F":
                    ends_f[s][i], held[r], state[s][i] = free[r], held[r] + problem.sizes[s], "forward"
                elif kind == "W":
                    held[r], state[s][i] = held[r] - problem.sizes[s], "freed"
                else:
                    ends_b[s][i], state[s][i] = free[r], "weight" if kind == "I" else "freed"
                    held[r] -= problem.sizes[s] if kind == "B" else 0.0
                rows[r].append(Action(s, kind, i))
                descend((start, r))
                rows[r].pop()
                ends_f[s][i] = None if kind == "F" else ends_f[s][i]
                ends_b[s][i] = None if kind in ("B", "I") else ends_b[s][i]
            free[r], held[r], state[s][i] = saved
            left[r] += worth[kind][s]

    descend((-math.inf, 0))
    return (best_span, best_program) if best_program is not None else (math.inf, None)


def every_row(stage: int, m: int) -> list[tuple[Action, ...]]:
    """Every order of one stage's actions, each backward ``B`` or ``I`` then ``W``, microbatches
    in any order: for ``replayed_one_by_one``."""
    rows = []
    for fused in itertools.product((True, False), repeat=m):
        chains = [("F", "B") if f else ("F", "I", "W") for f in fused]
        actions = [Action(stage, k, i) for i, chain in enumerate(chains) for k in chain]
        for perm in itertools.permutations(actions):
            at = {a: n for n, a in enumerate(perm)}
            if all(
                at[Action(stage, a, i)] < at[Action(stage, b, i)]
                for i, c in enumerate(chains)
                for a, b in itertools.pairwise(c)
            ):
                rows.append(perm)
    return rows


def replayed_one_by_one(costs: Sequence[Costs], m: int, memory: float) -> float:
    """The least makespan of every program of 2 stages on 2 ranks, every pair of rows replayed by
    ``simulate`` (a deadlock is no program): ``fastest_program``'s reference where that is small
    enough (``m = 2``: 46 rows a stage)."""
    best = math.inf
    for rows in itertools.product(every_row(0, m), every_row(1, m)):
        try:
            sim = simulate(Program(rows, 2, m), list(costs))
        except ScheduleError:  # a deadlock
            continue
        if max(sim.peak_activations) <= memory * (1 + TOLERANCE):
            best = min(best, sim.makespan)
    return best


def first_pass(problem: Problem) -> tuple[Program, float]:
    """A list-scheduled program of ``problem`` and its makespan: a hint for the constraint solver
    (tests/planning/test_solver.py, tests/conformance.py)."""
    laid_out = list_schedule(problem, Policy(split=True, backward_first=True, deep_first=True))
    assert laid_out is not None
    return laid_out
