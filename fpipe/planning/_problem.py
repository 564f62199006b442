"""The problem every part of the engine lays out: stages on ranks, their costs, and each rank's memory.

``search`` builds one from its arguments (``_arguments.py``); the list scheduler, local
improvement, the exact search, the constraint solver and the lower bound all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import Costs
from ..schedules._action import BACKWARD

TOLERANCE = 1e-9
"""The engine's one tolerance on times and memory, which are sums of floats: two that are equal in
exact arithmetic may differ in their last bits. Compared relatively, ``a`` fits under ``b`` when
``a <= b * (1 + TOLERANCE)`` and is faster when ``a < b * (1 - TOLERANCE)``; the exact search
compares its times absolutely (``a <= b + TOLERANCE``), its costs being of the order of 1. A
count read off a ratio (``floor(x * (1 + TOLERANCE))``) is not cut short by a rounding below it.
Not a tolerance: ``fit_costs``'s ``MIN_DURATION``, the least duration it charges."""


@dataclass(frozen=True)
class Problem:
    """What to lay out: stages on ranks, their costs, and what memory each rank may use.

    Attributes:
        num_microbatches: microbatches per step.
        rank_of: ``rank_of[s]`` is the rank that holds stage ``s``.
        costs: one ``Costs`` per stage.
        sizes: per stage, the memory one microbatch's activations take (activation units or bytes).
        limits: per rank, the most memory its live activations may take (``math.inf``: no limit).
    """

    num_microbatches: int
    rank_of: tuple[int, ...]
    costs: tuple[Costs, ...]
    sizes: tuple[float, ...]
    limits: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.rank_of)

    @property
    def num_ranks(self) -> int:
        return len(self.limits)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.rank_of) if r == rank)

    def footprint(self, rank: int) -> float:
        """The memory one microbatch takes on ``rank`` at its peak: every stage's activations at once.

        A microbatch's forward on the rank's last stage comes before its backward on the first,
        so whatever the program, all of them are alive together: no limit below this can be met.
        """
        return sum(self.sizes[s] for s in self.stages_of(rank))

    def hop(self, stage: int, to: int) -> float:
        """The latency of a message from ``stage`` to stage ``to``: its ``send``, 0 on one rank."""
        return self.costs[stage].send if self.rank_of[stage] != self.rank_of[to] else 0.0

    def backward(self, stage: int, split: bool) -> float:
        """What the backward the previous stage waits for costs: ``I`` when split, else ``B``."""
        return self.costs[stage].backward_input if split else self.costs[stage].of(BACKWARD)
