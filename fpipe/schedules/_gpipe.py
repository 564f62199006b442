"""GPipe: all forwards, then all backwards (Huang et al., "GPipe", NeurIPS 2019)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, FORWARD, Action
from ._placement import BuiltinSchedule, looped_ranks
from ._program import Program


@dataclass(frozen=True)
class GPipe(BuiltinSchedule):
    """GPipe (Huang et al., 2019): every rank runs all its forwards, then all its backwards.

    By default one stage per rank (stage ``s`` on rank ``s``). Bubble fraction ``(p-1)/(m+p-1)``
    for ``p`` stages on ``p`` ranks, every ``m`` and any ``T_F``, ``T_B`` of equal stages
    (notes/schedules.md); every microbatch's activations are alive at once.
    With more stages than ranks, placement is looped (stage ``s`` on rank ``s % p``).

    Conceptually, rank ``r`` runs::

        for s in stages_of(r):            for s in reversed(stages_of(r)):
            for i in range(m):                for i in range(m):
                forward(s, i)                     backward(s, i)
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_ranks`` ranks (default: one stage per rank)."""
        m = self.num_microbatches
        p = looped_ranks("GPipe", num_stages, num_ranks)
        ranks = []
        for r in range(p):
            local = range(r, num_stages, p)
            forwards = [Action(s, FORWARD, i) for s in local for i in range(m)]
            backwards = [Action(s, BACKWARD, i) for s in reversed(local) for i in range(m)]
            ranks.append(tuple(forwards + backwards))
        return Program(tuple(ranks), num_stages, m)
