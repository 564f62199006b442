"""Simulation: when each action of a program runs, given what each kind of action costs.

``timeline`` replays a program with unit cost; ``simulate`` replays it with a cost per kind of
action and a latency per message between ranks, and measures the two figures that tell
schedules apart: the bubble (the fraction of the step a rank idles) and the peak number of
stage activations a rank holds.

The replay is "as soon as possible": each rank runs its actions in program order, and an action
starts when the rank is free and every action it depends on (see ``fpipe.schedules._program``)
has finished, plus ``send`` if that action ran on another rank::

    start(a) = max(end(previous action on the rank),
                   max(end(d) + (send if rank(d) != rank(a) else 0) for d in dependencies(a)))

This is how a rank with blocking receives behaves, and it is the model under which the papers'
bubble formulas are derived, e.g. GPipe's and 1F1B's ``(p-1)/(m+p-1)`` with ``T_B = 2 T_F``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._program import Program, ScheduleError, dependencies, split_backwards, validate


@dataclass(frozen=True)
class Costs:
    """How long each kind of action takes, and how long a message between ranks travels.

    Any time unit will do; only ratios matter for the bubble. The defaults are the zero-bubble
    paper's ``T_F = T_B = T_W = 1`` (its ``B`` is our ``I``), with a fused backward costing the
    sum of its two parts. For the classic ``T_B = 2 T_F`` use ``Costs(backward=2)``.

    Attributes:
        forward: one stage's forward on one microbatch (``F``).
        backward_input: the input-gradient part of its backward (``I``).
        backward_weight: the weight-gradient part (``W``).
        backward: the fused backward (``B``); ``None`` means ``backward_input + backward_weight``.
        send: latency of an activation or cotangent sent to another rank (``0`` on the same rank).
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    backward: float | None = None
    send: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "backward", "send"):
            value = getattr(self, name)
            if value is None and name == "backward":
                continue
            positive = name != "send"
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                raise ScheduleError(
                    f"fpipe.schedules.Costs: {name} must be a finite {'positive' if positive else 'non-negative'} "
                    f"number ({name}: {value!r})."
                )

    def of(self, kind: str) -> float:
        """The duration of an action of ``kind`` (``"F"``, ``"B"``, ``"I"`` or ``"W"``)."""
        if kind == FORWARD:
            return self.forward
        if kind == BACKWARD_INPUT:
            return self.backward_input
        if kind == BACKWARD_WEIGHT:
            return self.backward_weight
        if kind == BACKWARD:
            return self.backward_input + self.backward_weight if self.backward is None else self.backward
        raise ScheduleError(f"fpipe.schedules.Costs: unknown action kind {kind!r}. Kinds are F, B, I, W.")


@dataclass(frozen=True)
class Simulation:
    """A program replayed with costs: when each action starts and ends, and what that gives.

    ``starts[r][k]`` and ``ends[r][k]`` are the times of ``program.ranks[r][k]``; time 0 is when
    the first action starts.

    A timeline measured by ``fpipe.record()`` has this type too, with ``costs=None`` and times
    in seconds.

    Attributes:
        program: the simulated program.
        costs: the costs it was simulated with (``None`` for a measured timeline).
        starts: start time of each action, per rank, in program order.
        ends: end time of each action, per rank, in program order.
    """

    program: Program
    costs: Costs | None
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]

    @property
    def makespan(self) -> float:
        """The length of the step: when the last action on any rank ends."""
        return max((row[-1] for row in self.ends if row), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Per rank, the total time spent running actions."""
        return tuple(sum(e - s for s, e in zip(starts, ends)) for starts, ends in zip(self.starts, self.ends))

    @property
    def bubble_fractions(self) -> tuple[float, ...]:
        """Per rank, the fraction of the makespan the rank idles (leading and trailing idle included)."""
        span = self.makespan
        return tuple((span - b) / span for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The idle fraction of the whole pipeline: the mean of ``bubble_fractions``."""
        fractions = self.bubble_fractions
        return sum(fractions) / len(fractions)

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Per rank, the peak count of ``(stage, microbatch)`` activations alive at once.

        An activation is alive from the start of its forward ``F`` to the end of its ``B`` (or of
        its ``W``, which still needs it). Ranks run actions one at a time, so this depends only on
        the program's order, not on the costs. With ``v`` equal stages per rank, divide by ``v``
        to compare with a one-stage-per-rank schedule.
        """
        return tuple(peak_activations(row) for row in self.program.ranks)

    def intervals(self) -> list[tuple[int, Action, float, float]]:
        """Every action as ``(rank, action, start, end)``, sorted by start time, then rank."""
        rows = [
            (r, a, s, e)
            for r, (row, starts, ends) in enumerate(zip(self.program.ranks, self.starts, self.ends))
            for a, s, e in zip(row, starts, ends)
        ]
        return sorted(rows, key=lambda x: (x[2], x[0]))

    def summary(self) -> str:
        """Makespan, bubble and peak activations per rank, one line each, for printing under a grid."""
        lines = [f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%} (mean over ranks)"]
        for r, (bubble, peak) in enumerate(zip(self.bubble_fractions, self.peak_activations)):
            lines.append(f"rank {r}: bubble {bubble:.1%}, peak activations {peak}")
        return "\n".join(lines)


def peak_activations(row: tuple[Action, ...]) -> int:
    """The most ``(stage, microbatch)`` activations alive at once on a rank running ``row`` in order."""
    alive = peak = 0
    for a in row:
        if a.kind == FORWARD:
            alive += 1
            peak = max(peak, alive)
        elif a.kind in (BACKWARD, BACKWARD_WEIGHT):
            alive -= 1
    return peak


def simulate(program: Program, costs: Costs | None = None) -> Simulation:
    """Replay ``program`` with ``costs`` (default ``Costs()``) as soon as dependencies allow.

    Example:
        >>> from fpipe.schedules import Costs, OneFOneB, simulate
        >>> sim = simulate(OneFOneB(num_microbatches=8).program(4), Costs(backward=2))
        >>> sim.makespan, sim.bubble_fractions[0]  # (m+p-1)(T_F+T_B) and (p-1)/(m+p-1)
        (33.0, 0.2727272727272727)
        >>> sim.peak_activations
        (4, 3, 2, 1)

    Raises:
        ScheduleError: if the program does not validate.
    """
    costs = Costs() if costs is None else costs
    validate(program)
    split = split_backwards(program)
    rank_of = program.placement()
    ends: dict[Action, float] = {}
    starts_per_rank: list[list[float]] = [[] for _ in program.ranks]
    ends_per_rank: list[list[float]] = [[] for _ in program.ranks]
    free = [0.0] * program.num_ranks
    remaining = sum(len(row) for row in program.ranks)
    while remaining:
        moved = False
        for r, row in enumerate(program.ranks):
            while len(ends_per_rank[r]) < len(row):
                action = row[len(ends_per_rank[r])]
                deps = dependencies(action, program.num_stages, split)
                if any(d not in ends for d in deps):
                    break
                ready = max(
                    (ends[d] + (costs.send if rank_of[d.stage] != r else 0.0) for d in deps),
                    default=0.0,
                )
                start = max(free[r], ready)
                free[r] = ends[action] = start + costs.of(action.kind)
                starts_per_rank[r].append(start)
                ends_per_rank[r].append(free[r])
                remaining -= 1
                moved = True
        assert moved, "validate() guarantees that a valid program always makes progress"
    return Simulation(
        program,
        costs,
        tuple(tuple(row) for row in starts_per_rank),
        tuple(tuple(row) for row in ends_per_rank),
    )
