"""The exact search's space handed to a constraint solver: OR-Tools' CP-SAT, when installed.

NOTE [constraint solver]
    The space is the exact search's (NOTE [exact search] in ``_exact.py``): every stage runs its
    forwards, backwards and ``W`` each in microbatch order, each backward fused or split on its
    own where ``choices`` allows both, under the memory limit; no valid program is faster than
    its best (NOTE [microbatch order]). As a scheduling model:

    - per stage and microbatch, a forward, a backward and, where split, a ``W``, each an
      interval as long as the action; where both are allowed, a literal says fused, and the
      backward is a ``B`` interval or an ``I`` interval (optional intervals on one start),
      the ``W`` present only with the ``I``; the intervals of a rank never overlap;
    - an action starts after its inputs and their messages, the frontier's rule (``inputs``,
      NOTE [what may run next] in ``_frontier.py``): a forward after the previous stage's
      forward of its microbatch, a backward (``I`` or ``B``) after its forward and the next
      stage's backward, a ``W`` after its ``I``; and each kind of a stage after its previous
      microbatch's;
    - a rank's live activations, each from the start of its forward to the end of the ``W`` or
      ``B`` that frees it (``Simulation.peak_activations``), never take more than its limit (a
      cumulative constraint);
    - minimise the end of the last action.

    Sorting a solution's actions by start time per rank gives a program; ``simulate`` replays it
    to the same times or earlier, and the program is checked again (``validate``, the peak, the
    replayed makespan) before it is returned. CP-SAT wants integers: times and memory are scaled
    by the least common denominator of the costs (and of sizes and limits) when it is at most
    ``_DENOMINATOR`` (costs such as 0.15 or 1/3: the model is then the problem itself, and the
    solver's proof of optimality is one); otherwise by a scale that makes the step about
    ``_UNITS`` long, times rounded and memory rounded the safe way (sizes up, limits down), and
    nothing is claimed optimal. The solver starts from the best program the search had (a hint)
    and is told the lower bound (``_bound.py``).

    Why a solver and not only the branch and bound: at ``p = 4, m = 8`` with two stages per rank
    the branch and bound finishes for fewer than half of the cases of notes/search.md, and the
    list scheduler there lands up to 18% above the optimum; CP-SAT's portfolio (LNS and
    propagation over ``_WORKERS`` workers) proves most of those optima in seconds. With several
    workers the solver is not deterministic: two calls may return different programs of the
    same makespan when it proves the optimum, and may differ in makespan when the budget runs
    out first (notes/search.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from ..schedules import Action, Program, simulate, validate
from ..schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._exact import Outcome, choices
from ._frontier import Frontier
from ._improve import peak_memory
from ._problem import TOLERANCE, Problem

_DENOMINATOR = 1000  # the largest common denominator of costs (or of sizes and limits) taken exactly
_UNITS = 10**6  # otherwise, about how many integer units one step spans
_WORKERS = 8  # CP-SAT's portfolio of workers: on 2 cores 8 prove in seconds what 1 or 2 do not (notes/search.md)


def available() -> bool:
    """Whether OR-Tools' CP-SAT can be imported (``pip install 'fpipe[solver]'``)."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def solve(
    problem: Problem, hint: Program, best: float, bound: float, deadline: float
) -> tuple[Program | None, float, Outcome]:
    """The fastest program of ``problem``'s space faster than ``best`` (the makespan of ``hint``)
    that the solver finds by ``deadline`` (``time.perf_counter()``), NOTE [constraint solver];
    ``bound``: a makespan no program beats (``lower_bound``).

    Returns ``(program, makespan, outcome)``, as ``exact`` does: ``program`` is ``None`` when
    none beats ``best`` (``makespan`` is then ``best``); ``outcome`` is the solver's own status:
    ``"optimal"`` when it proved the better of the two the fastest of the space (CP-SAT's
    ``OPTIMAL``, or ``INFEASIBLE`` under the bound), ``"ended"`` when it did so on costs it had to
    round (nothing proven), ``"cut"`` when it stopped without a proof (``FEASIBLE``, ``UNKNOWN``),
    however much time was left.
    OR-Tools must be installed (``available()``).
    """
    from ortools.sat.python import cp_model

    S, m, p = problem.num_stages, problem.num_microbatches, problem.num_ranks
    costs = problem.costs
    ways = [choices(c) for c in costs]  # per stage, I (then W), B, or either
    kinds = [(FORWARD, *x, *([BACKWARD_WEIGHT] if BACKWARD_INPUT in x else [])) for x in ways]
    most = [
        c.forward + max(c.of(k) + (c.backward_weight if k == BACKWARD_INPUT else 0.0) for k in x)
        for c, x in zip(costs, ways)
    ]
    work = m * max(sum(most[s] for s in problem.stages_of(r)) for r in range(p))
    scale, exact = _scale([*(costs[s].of(k) for s in range(S) for k in kinds[s]), *(c.send for c in costs if c.send)])
    if not exact or scale * work * 4 > 2**40:  # the model's times must stay well inside CP-SAT's int64
        scale, exact = _UNITS / work, False
    length = {(s, k): max(1, round(costs[s].of(k) * scale)) for s in range(S) for k in kinds[s]}
    hop = {(a, b): round(problem.hop(a, b) * scale) for a in range(S) for b in (a - 1, a + 1) if 0 <= b < S}
    horizon = sum(length.values()) * m + sum(hop.values()) * m
    model = cp_model.CpModel()
    # per stage and microbatch: when its F, its backward (B or I) and its W start; whether it is fused
    start = {
        (s, k, i): model.new_int_var(0, horizon, "")
        for s in range(S)
        for k in (FORWARD, BACKWARD, *([BACKWARD_WEIGHT] if BACKWARD_INPUT in ways[s] else []))
        for i in range(m)
    }
    fused: dict[tuple[int, int], Any] = {}
    for s in range(S):
        for i in range(m):
            fused[s, i] = model.new_bool_var("") if len(ways[s]) > 1 else ways[s] == (BACKWARD,)
    end_f = {(s, i): start[s, FORWARD, i] + length[s, FORWARD] for s in range(S) for i in range(m)}
    end_b: dict[tuple[int, int], Any] = {}
    for s in range(S):
        for i in range(m):
            if len(ways[s]) > 1:
                grows = length[s, BACKWARD] - length[s, BACKWARD_INPUT]
                end_b[s, i] = start[s, BACKWARD, i] + length[s, BACKWARD_INPUT] + grows * fused[s, i]
            else:
                end_b[s, i] = start[s, BACKWARD, i] + length[s, ways[s][0]]
    ends = {FORWARD: end_f, BACKWARD: end_b}
    frontier = Frontier.of(problem)

    def inputs(s: int, kind: str, i: int) -> list[Any]:
        """What stage ``s``'s ``kind`` of ``i`` starts after: its inputs' ends, plus their messages
        (the frontier's rule, NOTE [what may run next])."""
        return [ends[k][t, i] + hop[t, s] if t != s else ends[k][t, i] for t, k, _ in frontier.inputs(s, kind)]

    # when each activation is freed: the end of its B, or of the W after its I
    freed = {}
    for s in range(S):
        for i in range(m):
            if BACKWARD_INPUT not in ways[s]:
                freed[s, i] = end_b[s, i]
                continue
            end_w = start[s, BACKWARD_WEIGHT, i] + length[s, BACKWARD_WEIGHT]
            for after in inputs(s, BACKWARD_WEIGHT, i):
                model.add(start[s, BACKWARD_WEIGHT, i] >= after)
            if i:  # the W in microbatch order (NOTE [microbatch order]: no program is faster otherwise)
                model.add(start[s, BACKWARD_WEIGHT, i] >= start[s, BACKWARD_WEIGHT, i - 1])
            if len(ways[s]) == 1:
                freed[s, i] = end_w
                continue
            freed[s, i] = model.new_int_var(0, horizon, "")
            model.add(freed[s, i] == end_b[s, i]).only_enforce_if(fused[s, i])
            model.add(freed[s, i] == end_w).only_enforce_if(~fused[s, i])
    for r in range(p):
        stages = problem.stages_of(r)
        intervals = []
        for s in stages:
            for i in range(m):
                intervals.append(model.new_fixed_size_interval_var(start[s, FORWARD, i], length[s, FORWARD], ""))
                backward = start[s, BACKWARD, i]
                if len(ways[s]) == 1:
                    intervals.append(model.new_fixed_size_interval_var(backward, length[s, ways[s][0]], ""))
                else:
                    f = fused[s, i]
                    intervals.append(model.new_optional_fixed_size_interval_var(backward, length[s, BACKWARD], f, ""))
                    intervals.append(
                        model.new_optional_fixed_size_interval_var(backward, length[s, BACKWARD_INPUT], ~f, "")
                    )
                if BACKWARD_INPUT in ways[s]:
                    weight = start[s, BACKWARD_WEIGHT, i], length[s, BACKWARD_WEIGHT]
                    if len(ways[s]) == 1:
                        intervals.append(model.new_fixed_size_interval_var(*weight, ""))
                    else:
                        intervals.append(model.new_optional_fixed_size_interval_var(*weight, ~fused[s, i], ""))
        model.add_no_overlap(intervals)
        if math.isinf(problem.limits[r]):
            continue
        sizes = [problem.sizes[s] for s in stages]
        unit, whole = _scale([*sizes, problem.limits[r]])
        alive = []
        for s in stages:
            for i in range(m):
                held = model.new_int_var(0, horizon, "")
                model.add(held == freed[s, i] - start[s, FORWARD, i])
                alive.append(model.new_interval_var(start[s, FORWARD, i], held, freed[s, i], ""))
        demands = [round(x * unit) if whole else math.ceil(x * unit) for s, x in zip(stages, sizes) for _ in range(m)]
        model.add_cumulative(
            alive, demands, round(problem.limits[r] * unit) if whole else math.floor(problem.limits[r] * unit)
        )
    for s in range(S):
        for i in range(m):
            if i:
                model.add(start[s, FORWARD, i] >= end_f[s, i - 1])
                model.add(start[s, BACKWARD, i] >= end_b[s, i - 1])
            for kind in (FORWARD, BACKWARD):
                for after in inputs(s, kind, i):
                    model.add(start[s, kind, i] >= after)
    makespan = model.new_int_var(0, horizon, "makespan")
    for x in freed.values():  # every action ends by its activation's free
        model.add(makespan >= x)
    if exact:
        model.add(makespan >= math.ceil(bound * scale - 1e-6))  # float error well below one unit
    model.minimize(makespan)
    for row, starts in zip(hint.ranks, simulate(hint, costs).starts):
        for a, t in zip(row, starts):
            key = (a.stage, BACKWARD if a.kind == BACKWARD_INPUT else a.kind, a.microbatch)
            if key in start:  # a hint of another space (a W where only B runs) is left out
                model.add_hint(start[key], round(t * scale))
            if a.kind in (BACKWARD, BACKWARD_INPUT) and len(ways[a.stage]) > 1:
                model.add_hint(fused[a.stage, a.microbatch], a.kind == BACKWARD)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.0, deadline - time.perf_counter())
    solver.parameters.num_workers = _WORKERS
    status = solver.solve(model)
    finished = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)  # the solver's proof, not the clock
    outcome: Outcome = ("optimal" if exact else "ended") if finished else "cut"
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, best, outcome
    program = _program(
        problem,
        lambda s, i: bool(solver.boolean_value(fused[s, i])) if len(ways[s]) > 1 else bool(fused[s, i]),
        lambda key: solver.value(start[key]),
    )
    replayed = simulate(program, costs).makespan
    fits = all(x <= limit * (1 + TOLERANCE) for x, limit in zip(peak_memory(program, problem.sizes), problem.limits))
    if not fits or replayed >= best * (1 - TOLERANCE):
        return None, best, outcome
    return program, replayed, outcome


def _scale(values: list[float]) -> tuple[float, bool]:
    """The least common denominator of ``values`` if at most ``_DENOMINATOR`` (exact: ``True``),
    else ``_UNITS`` over their largest."""
    denominator = 1
    for value in values:
        denominator = math.lcm(denominator, Fraction(value).limit_denominator(_DENOMINATOR).denominator)
        if denominator > _DENOMINATOR:
            break
    exact = denominator <= _DENOMINATOR and all(
        abs(round(x * denominator) - x * denominator) <= TOLERANCE * max(1.0, x * denominator) for x in values
    )
    return (float(denominator), True) if exact else (_UNITS / max(values), False)


def _program(
    problem: Problem, fused: Callable[[int, int], bool], value: Callable[[tuple[int, str, int]], int]
) -> Program:
    """The program whose rows hold each rank's actions in the order of their solved starts:
    ``value((stage, kind, microbatch))``, ``kind`` ``F``, ``B`` (the backward, fused or ``I``) or
    ``W``; ``fused(stage, microbatch)``: whether that backward is a ``B``."""
    m = problem.num_microbatches
    rows = []
    for r in range(problem.num_ranks):
        timed = []
        for s in problem.stages_of(r):
            for i in range(m):
                timed.append((value((s, FORWARD, i)), s, FORWARD, i))
                if fused(s, i):
                    timed.append((value((s, BACKWARD, i)), s, BACKWARD, i))
                else:
                    timed.append((value((s, BACKWARD, i)), s, BACKWARD_INPUT, i))
                    timed.append((value((s, BACKWARD_WEIGHT, i)), s, BACKWARD_WEIGHT, i))
        rows.append(tuple(Action(s, k, i) for _, s, k, i in sorted(timed)))
    program = Program(tuple(rows), problem.num_stages, m)
    validate(program)
    return program
