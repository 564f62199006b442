"""The planner's ranking: each candidate schedule predicted with the split of the units that is
fastest for it (NOTE [schedule-aware split] in ``_schedule_split.py``), fastest first, marked
against a memory limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._plural import plural
from ..schedules import Costs, Program, ScheduleError, Simulation, simulate
from ..schedules._action import BACKWARD, BACKWARD_WEIGHT, FORWARD
from ._cost_model import GIB, Unit
from ._partition import partition
from ._schedule_split import split_for


class PlanError(ValueError):
    """What ``plan`` cannot do: no schedule runs, none fits the memory limit, unknown schedules."""


@dataclass(frozen=True)
class Candidate:
    """A schedule the planner tries.

    Attributes:
        name: its name in the table.
        stages_per_rank: stages per rank of its placement.
        program: builds its program from the per-stage costs of a split (built-in schedules
            ignore them); raises ``ScheduleError`` when it cannot lay out the stages.
        adapts: whether ``program`` depends on the costs (a searched program): then the
            planner also tries it on every other candidate's split of the same stage count.
    """

    name: str
    stages_per_rank: int
    program: Callable[[tuple[Costs, ...]], Program]
    adapts: bool = False


@dataclass(frozen=True)
class PlanRow:
    """One schedule's prediction, or why there is none.

    Attributes:
        name: the candidate's name.
        stages: the units of each stage, as ranges (empty when ``error`` is set).
        simulation: the step simulated with those stages (``None`` when ``error`` is set).
        peak_bytes: per rank, parameters plus activations at their peak (``None`` for
            measured costs, or when ``error`` is set).
        error: why the schedule cannot run here, or ``None``.
        step: the predicted step: the simulation's makespan, or later where a rank's
            data-parallel reduction ends after it (NOTE [planner cost model]); 0 with ``error``.
    """

    name: str
    stages: tuple[range, ...] = ()
    simulation: Simulation | None = None
    peak_bytes: tuple[float, ...] | None = None
    error: str | None = None
    step: float = 0.0

    def peak(self) -> float | None:
        """The largest rank's peak memory: bytes, or for measured costs (no bytes) activations in
        microbatches of a rank's layers (NOTE [activation units]); ``None`` with ``error``."""
        if self.simulation is None:
            return None
        return max(self.peak_bytes) if self.peak_bytes is not None else max(self.simulation.peak_activations)

    def fits(self, memory: float | None) -> bool:
        """Whether it runs within ``memory`` per rank, in ``peak``'s unit (always, without a limit)."""
        peak = self.peak()
        return peak is not None and (memory is None or peak <= memory)


def ranked(
    units: Sequence[Unit], num_ranks: int, candidates: Sequence[Candidate], *, memory: float | None = None
) -> list[PlanRow]:
    """Each candidate's prediction with its fastest split of ``units`` (NOTE [schedule-aware split]
    in ``fpipe/planning/_schedule_split.py``), fastest first; those beyond ``memory`` per rank
    (bytes, or for measured units activations in microbatches of a rank's layers: ``PlanRow.peak``),
    then those that cannot run, after.

    A candidate's program is built for the min-max split's stage costs, split for, and rebuilt
    for the chosen split's costs (the same program, for a built-in schedule).

    Raises:
        PlanError: when no candidate can run (the message says what would: fewer ranks, more
            layers, or the first candidate's own error), or when ``memory`` is given and no
            candidate fits it (the message names the least memory any candidate needs).
    """
    rows = [_row(units, num_ranks, c) for c in candidates]
    rows = [_on_other_splits(units, c, row, rows) if c.adapts else row for c, row in zip(candidates, rows)]

    def key(row: PlanRow) -> tuple[int, float]:
        if row.simulation is None:
            return 2, 0.0
        return (0 if row.fits(memory) else 1), row.step

    rows.sort(key=key)
    if rows and all(r.simulation is None for r in rows):
        raise PlanError(_none_runs(units, num_ranks, candidates, rows))
    if memory is not None and rows and not rows[0].fits(memory):
        sized = [(peak, r.name) for r in rows if (peak := r.peak()) is not None]
        if sized:
            least, name = min(sized)
            measured = any(r.simulation is not None and r.peak_bytes is None for r in rows)
            scale, unit = (1.0, "microbatches of a rank's layers") if measured else (GIB, "GiB")
            raise PlanError(
                "python -m fpipe plan: no schedule fits in the memory of a rank "
                f"(memory: {memory / scale:.4g} {unit}); the least any needs is {least / scale:.4g} {unit} ({name}). "
                "Use more ranks, smaller or fewer microbatches, or more memory."
            )
    return rows


def _none_runs(units: Sequence[Unit], num_ranks: int, candidates: Sequence[Candidate], rows: Sequence[PlanRow]) -> str:
    """One line: why no candidate runs, and what would (fewer ranks or more layers, when every
    candidate needs more stages than there are units; else the first candidate's own error)."""
    fewest = min(candidates, key=lambda c: c.stages_per_rank)
    need = num_ranks * fewest.stages_per_rank
    if need <= len(units):  # some candidate had the units it needs and refused for its own reason
        row = next(r for r in rows if not (r.error or "").startswith("needs "))
        return f"python -m fpipe plan: no schedule can run here ({row.name}: {row.error})"
    head = 1 if units and units[-1].name == "head" else 0
    have = f"{plural(len(units) - head, 'layer')} and the head" if head else plural(len(units), "measured stage")
    more = f"a model of at least {plural(need - head, 'layer')}" if head else f"the costs of {need} stages"
    ranks = len(units) // fewest.stages_per_rank
    fewer = f"at most {plural(ranks, 'rank')}, or " if ranks else ""
    return (
        f"python -m fpipe plan: no schedule can run: on {plural(num_ranks, 'rank')} each needs at least "
        f"{need} stages ({fewest.name}: {fewest.stages_per_rank} per rank) and there are "
        f"{plural(len(units), 'unit')} to split ({have}). Use {fewer}{more}."
    )


def _row(units: Sequence[Unit], num_ranks: int, candidate: Candidate) -> PlanRow:
    num_stages = num_ranks * candidate.stages_per_rank
    if num_stages > len(units):
        return PlanRow(candidate.name, error=f"needs {num_stages} stages, has {len(units)} units to split")
    layers = [u.costs for u in units]
    try:
        base = partition([c.forward + c.of(BACKWARD) for c in layers], num_stages)
        stages = split_for(candidate.program(_stage_costs(units, base)), layers)
        costs = _stage_costs(units, stages)
        program = candidate.program(costs)
    except ScheduleError as error:
        return PlanRow(candidate.name, error=str(error))
    return _predicted(units, candidate.name, tuple(stages), program, costs)


def _predicted(
    units: Sequence[Unit], name: str, stages: tuple[range, ...], program: Program, costs: tuple[Costs, ...]
) -> PlanRow:
    """The row of ``program`` run on ``stages``: simulated, its step extended by the ranks'
    data-parallel reductions (NOTE [planner cost model])."""
    simulation = simulate(program, costs)
    step = simulation.makespan
    if any(u.reduce_seconds for u in units):
        reduce = [
            sum(units[k].reduce_seconds for s in program.stages_of(r) for k in stages[s])
            for r in range(len(program.ranks))
        ]
        step = max(max(ends, default=0.0) + seconds for ends, seconds in zip(simulation.ends, reduce))
    return PlanRow(name, stages, simulation, _peak_bytes(units, stages, program), step=step)


def _on_other_splits(units: Sequence[Unit], candidate: Candidate, row: PlanRow, rows: Sequence[PlanRow]) -> PlanRow:
    """``row``, or ``candidate`` built for another row's split of as many stages where that is
    faster: a program searched for a split's costs is never slower than a built-in on that split
    (NOTE [searched candidates] in ``_plan.py``)."""
    best = row
    for other in rows:
        if other.simulation is None or best.simulation is None or len(other.stages) != len(best.stages):
            continue
        costs = _stage_costs(units, other.stages)
        try:
            program = candidate.program(costs)
        except ScheduleError:
            continue
        row = _predicted(units, candidate.name, other.stages, program, costs)
        if row.step < best.step:
            best = row
    return best


def _stage_costs(units: Sequence[Unit], stages: Sequence[range]) -> tuple[Costs, ...]:
    """Each stage's ``Costs``: its units' durations and communication summed (with their
    communication points), the last unit's message, and the largest of their overheads and
    receive costs (a stage's action is one dispatch and takes at most one message, whatever
    units it runs)."""
    return tuple(
        Costs(
            forward=sum(units[k].costs.forward for k in r),
            backward_input=sum(units[k].costs.backward_input for k in r),
            backward_weight=sum(units[k].costs.backward_weight for k in r),
            backward=sum(units[k].costs.of(BACKWARD) for k in r),
            send=units[r.stop - 1].costs.send,
            overhead=max(units[k].costs.overhead for k in r),
            receive=max(units[k].costs.receive for k in r),
            communication=sum(units[k].costs.communication for k in r),
            communication_points=max(
                1, sum(units[k].costs.communication_points for k in r if units[k].costs.communication)
            ),
        )
        for r in stages
    )


def _peak_bytes(units: Sequence[Unit], stages: Sequence[range], program: Program) -> tuple[float, ...] | None:
    """Per rank, its stages' parameters plus the most activation bytes alive at once (an
    activation lives from its ``F`` to its ``B`` or ``W``, as ``Simulation.peak_activations``)."""
    activations, params = [], []
    for r in stages:
        a, p = [units[k].activation_bytes for k in r], [units[k].param_bytes for k in r]
        if any(x is None for x in (*a, *p)):
            return None
        activations.append(sum(x for x in a if x is not None))
        params.append(sum(x for x in p if x is not None))
    peaks = []
    for rank, row in enumerate(program.ranks):
        alive, peak = 0.0, 0.0
        for action in row:
            if action.kind == FORWARD:
                alive += activations[action.stage]
                peak = max(peak, alive)
            elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
                alive -= activations[action.stage]
        peaks.append(sum(params[s] for s in program.stages_of(rank)) + peak)
    return tuple(peaks)
