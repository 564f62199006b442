"""The search's argument checks: its arguments as a ``Problem``, or the error that says what is wrong."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._plural import plural
from ..schedules import Costs, ScheduleError
from ..schedules._simulate import charged, receiving_kinds
from ._problem import TOLERANCE, Problem
from ._solver import available as solver_available


def checked_search(
    p: int,
    m: int,
    costs: Costs | Sequence[Costs],
    placement: str,
    v: int,
    memory: float | Sequence[float] | None,
    sizes: Sequence[float] | None,
    time_budget: float,
    solver: str,
    slack: float,
) -> Problem:
    """``search``'s arguments checked in the order of its signature's meaning (``slack``, the
    problem, ``solver``, ``time_budget``), as the ``Problem`` to lay out."""
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < math.inf:
        raise ScheduleError(
            f"fpipe.planning.search: slack must be a non-negative finite fraction (slack: {slack!r}). "
            "Use 0 for the fastest simulated program, or e.g. 0.02."
        )
    problem = checked_problem(p, m, costs, placement, v, memory, sizes)
    if solver not in ("auto", "cp-sat", "branch-and-bound"):
        raise ScheduleError(
            f"fpipe.planning.search: unknown solver (solver: {solver!r}). Use 'auto', 'cp-sat' or 'branch-and-bound'."
        )
    if solver == "cp-sat" and not solver_available():
        raise ScheduleError(
            "fpipe.planning.search: solver='cp-sat' needs OR-Tools (pip install 'fpipe[solver]'). "
            "Install it, or pass solver='auto' or 'branch-and-bound'."
        )
    if isinstance(time_budget, bool) or not isinstance(time_budget, (int, float)) or not 0 < time_budget < math.inf:
        raise ScheduleError(
            f"fpipe.planning.search: time_budget must be a positive number of seconds (time_budget: {time_budget!r})."
        )
    return problem


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def checked_problem(
    p: int,
    m: int,
    costs: Costs | Sequence[Costs],
    placement: str,
    v: int,
    memory: float | Sequence[float] | None,
    sizes: Sequence[float] | None,
) -> Problem:
    """The search's arguments as a ``Problem``, or the ``ScheduleError`` that says what is wrong."""
    for name, value in (("num_ranks", p), ("num_microbatches", m), ("stages_per_rank", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"fpipe.planning.search: {name} must be a positive int ({name}: {value!r}).")
    if placement == "v":
        if v not in (1, 2):
            raise ScheduleError(
                f"fpipe.planning.search: the V places 2 stages on each rank (stages_per_rank: {v}). "
                "Leave stages_per_rank at 1 or 2, or use placement='looped'."
            )
        rank_of = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    elif placement == "looped":
        rank_of = tuple(s % p for s in range(p * v))
    else:
        raise ScheduleError(
            f"fpipe.planning.search: unknown placement (placement: {placement!r}). "
            "Use 'looped' (stage s on rank s % p) or 'v' (rank r holds stages r and 2p - 1 - r)."
        )
    S = len(rank_of)
    if isinstance(costs, Costs):
        per_stage = (costs,) * S
    elif isinstance(costs, Sequence) and not isinstance(costs, (str, bytes)):
        if not all(isinstance(c, Costs) for c in costs):
            raise TypeError(f"fpipe.planning.search: costs must hold Costs only (costs: {costs!r}).")
        if len(costs) != S:
            raise ScheduleError(
                f"fpipe.planning.search: costs must hold one Costs per stage, {S} for {plural(p, 'rank')} in "
                f"this placement (len(costs): {len(costs)}). Pass {S} Costs, or one Costs for every stage."
            )
        per_stage = tuple(costs)
    else:
        raise TypeError(
            f"fpipe.planning.search: costs must be a Costs or a sequence of one per stage (costs: {costs!r})."
        )
    held = [sum(1 for r in rank_of if r == rank_of[s]) for s in range(S)]
    stage_sizes = tuple(1 / held[s] for s in range(S)) if sizes is None else tuple(sizes)
    if len(stage_sizes) != S or not all(_positive(x) for x in stage_sizes):
        raise ScheduleError(
            f"fpipe.planning.search: activation_sizes must hold one positive finite number of bytes per stage, "
            f"{S} here (activation_sizes: {sizes!r})."
        )
    if memory is None:
        limits = (math.inf,) * p
    else:
        limits = (memory,) * p if not isinstance(memory, Sequence) else tuple(memory)  # type: ignore[assignment]
        if len(limits) != p or not all(_positive(x) for x in limits):
            raise ScheduleError(
                f"fpipe.planning.search: memory must be a positive finite number, or one per rank ({p} here) "
                f"(memory: {memory!r}). Pass None for no limit."
            )
    # The schedulers know durations only: each carries what comes before it (NOTE [per-action overhead]).
    charged_costs = tuple(charged(c, r) for c, r in zip(per_stage, receiving_kinds(rank_of)))
    problem = Problem(m, rank_of, charged_costs, stage_sizes, tuple(float(x) for x in limits))
    least = [problem.footprint(r) for r in range(p)]
    short = [r for r in range(p) if limits[r] < least[r] * (1 - TOLERANCE)]
    if short:
        r = short[0]
        unit = "bytes" if sizes is not None else "activation units"
        raise ScheduleError(
            f"fpipe.planning.search: no program fits the memory limit: rank {r} needs {least[r]:g} {unit} for one "
            f"microbatch through its stages, alive at once (memory: {memory!r}). Use memory >= {max(least):g}."
        )
    return problem
