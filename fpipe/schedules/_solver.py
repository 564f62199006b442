"""The exact search's space handed to a constraint solver: OR-Tools' CP-SAT, when installed.

NOTE [constraint solver]
    The space is the exact search's (NOTE [exact search] in ``_exact.py``): every stage runs each
    kind of action on its microbatches in increasing order, backwards all split (``I`` then
    ``W``) or all fused (``B``), under the memory limit. As a scheduling model:

    - one interval per action, its length the action's cost; the intervals of a rank never
      overlap;
    - a forward starts after the previous stage's forward of its microbatch plus the message;
      a backward (``I`` or ``B``) after its forward and after the next stage's backward of its
      microbatch plus the message; a ``W`` after its ``I``; each kind of a stage after its
      previous microbatch's;
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

from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._exact import Outcome
from ._improve import peak_memory
from ._list_schedule import Problem
from ._program import Program, validate
from ._simulate import simulate

_DENOMINATOR = 1000  # the largest common denominator of costs (or of sizes and limits) taken exactly
_UNITS = 10**6  # otherwise, about how many integer units one step spans
_WORKERS = 8  # CP-SAT's portfolio of workers: on 2 cores 8 prove in seconds what 1 or 2 do not (notes/search.md)
_SLACK = 1e-9


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
    fused = any(c.of(BACKWARD) < c.backward_input + c.backward_weight for c in problem.costs)
    spaces = (True, False) if fused else (True,)
    program, outcomes = None, []
    for k, split in enumerate(spaces):
        share = time.perf_counter() + (deadline - time.perf_counter()) / (len(spaces) - k)
        found, makespan, outcome = _solve(problem, split, hint, best, bound, share)
        if found is not None:
            program, best = found, makespan
        outcomes.append(outcome)
    worst: Outcome = "cut" if "cut" in outcomes else "ended" if "ended" in outcomes else "optimal"
    return program, best, worst


def _scale(values: list[float]) -> tuple[float, bool]:
    """The least common denominator of ``values`` if at most ``_DENOMINATOR`` (exact: ``True``),
    else ``_UNITS`` over their largest."""
    denominator = 1
    for value in values:
        denominator = math.lcm(denominator, Fraction(value).limit_denominator(_DENOMINATOR).denominator)
        if denominator > _DENOMINATOR:
            break
    exact = denominator <= _DENOMINATOR and all(
        abs(round(x * denominator) - x * denominator) <= _SLACK * max(1.0, x * denominator) for x in values
    )
    return (float(denominator), True) if exact else (_UNITS / max(values), False)


def _solve(
    problem: Problem, split: bool, hint: Program, best: float, bound: float, deadline: float
) -> tuple[Program | None, float, Outcome]:
    """``solve`` in one space: split backwards, or fused."""
    from ortools.sat.python import cp_model

    S, m, p = problem.num_stages, problem.num_microbatches, problem.num_ranks
    costs = problem.costs
    backward = BACKWARD_INPUT if split else BACKWARD
    kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (FORWARD, BACKWARD)
    frees = BACKWARD_WEIGHT if split else BACKWARD
    work = max(sum(costs[s].of(k) for s in problem.stages_of(r) for k in kinds) for r in range(p)) * m
    scale, exact = _scale([*(costs[s].of(k) for s in range(S) for k in kinds), *(c.send for c in costs if c.send)])
    if not exact or scale * work * 4 > 2**40:  # the model's times must stay well inside CP-SAT's int64
        scale, exact = _UNITS / work, False
    length = {(s, k): max(1, round(costs[s].of(k) * scale)) for s in range(S) for k in kinds}
    hop = {(a, b): round(problem.hop(a, b) * scale) for a in range(S) for b in (a - 1, a + 1) if 0 <= b < S}
    horizon = sum(length.values()) * m + sum(hop.values()) * m
    model = cp_model.CpModel()
    start = {(s, k, i): model.new_int_var(0, horizon, "") for s in range(S) for k in kinds for i in range(m)}
    end = {key: start[key] + length[key[:2]] for key in start}
    for r in range(p):
        stages = problem.stages_of(r)
        model.add_no_overlap(
            [
                model.new_fixed_size_interval_var(start[s, k, i], length[s, k], "")
                for s in stages
                for k in kinds
                for i in range(m)
            ]
        )
        if math.isinf(problem.limits[r]):
            continue
        sizes = [problem.sizes[s] for s in stages]
        unit, whole = _scale([*sizes, problem.limits[r]])
        alive = []
        for s in stages:
            for i in range(m):
                held = model.new_int_var(0, horizon, "")
                model.add(held == end[s, frees, i] - start[s, FORWARD, i])
                alive.append(model.new_interval_var(start[s, FORWARD, i], held, end[s, frees, i], ""))
        demands = [round(x * unit) if whole else math.ceil(x * unit) for s, x in zip(stages, sizes) for _ in range(m)]
        model.add_cumulative(
            alive, demands, round(problem.limits[r] * unit) if whole else math.floor(problem.limits[r] * unit)
        )
    for s in range(S):
        for i in range(m):
            for k in kinds:
                if i:
                    model.add(start[s, k, i] >= end[s, k, i - 1])
            if s:
                model.add(start[s, FORWARD, i] >= end[s - 1, FORWARD, i] + hop[s - 1, s])
            model.add(start[s, backward, i] >= end[s, FORWARD, i])
            if s + 1 < S:
                model.add(start[s, backward, i] >= end[s + 1, backward, i] + hop[s + 1, s])
            if split:
                model.add(start[s, BACKWARD_WEIGHT, i] >= end[s, BACKWARD_INPUT, i])
    makespan = model.new_int_var(0, horizon, "makespan")
    model.add_max_equality(makespan, [end[s, frees, m - 1] for s in range(S)])
    if exact:
        model.add(makespan >= math.ceil(bound * scale - 1e-6))  # float error well below one unit
    model.minimize(makespan)
    for row, starts in zip(hint.ranks, simulate(hint, costs).starts):
        for a, t in zip(row, starts):
            if (a.stage, a.kind, a.microbatch) in start:
                model.add_hint(start[a.stage, a.kind, a.microbatch], round(t * scale))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.0, deadline - time.perf_counter())
    solver.parameters.num_workers = _WORKERS
    status = solver.solve(model)
    finished = status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)  # the solver's proof, not the clock
    outcome: Outcome = ("optimal" if exact else "ended") if finished else "cut"
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, best, outcome
    program = _program(problem, kinds, lambda key: solver.value(start[key]))
    replayed = simulate(program, costs).makespan
    fits = all(x <= limit * (1 + _SLACK) for x, limit in zip(peak_memory(program, problem.sizes), problem.limits))
    if not fits or replayed >= best * (1 - _SLACK):
        return None, best, outcome
    return program, replayed, outcome


def _program(problem: Problem, kinds: tuple[str, ...], value: Callable[[tuple[int, str, int]], int]) -> Program:
    """The program whose rows hold each rank's actions in the order of their solved starts."""
    m = problem.num_microbatches
    rows = tuple(
        tuple(
            Action(s, k, i)
            for _, s, k, i in sorted(
                (value((s, k, i)), s, k, i) for s in problem.stages_of(r) for k in kinds for i in range(m)
            )
        )
        for r in range(problem.num_ranks)
    )
    program = Program(rows, problem.num_stages, m)
    validate(program)
    return program
