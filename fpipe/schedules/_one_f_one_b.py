"""1F1B, also called PipeDream-flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, FORWARD, Action
from ._interleaved import Interleaved1F1B
from ._placement import BuiltinSchedule, looped_ranks
from ._program import Program


@dataclass(frozen=True)
class OneFOneB(BuiltinSchedule):
    """1F1B / PipeDream-flush: after a short warm-up each rank alternates one forward, one backward.

    One stage per rank (stage ``s`` on rank ``s``). Same bubble as GPipe, ``(p-1)/(m+p-1)`` for
    every ``m``, but rank ``r`` holds ``min(m, p - r)`` microbatches' activations instead of ``m``.

    Conceptually, rank ``r`` of ``p`` runs::

        warmup = min(p - r - 1, m)
        for i in range(warmup): forward(r, i)
        for i in range(m - warmup): forward(r, warmup + i); backward(r, i)
        for i in range(m - warmup, m): backward(r, i)

    With more stages than ranks (``num_ranks`` given, e.g. by a smaller process group), the
    program is ``Interleaved1F1B``'s for that many stages per rank.
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_ranks`` ranks (default: one stage per rank)."""
        m = self.num_microbatches
        p = looped_ranks("OneFOneB", num_stages, num_ranks)
        if p != num_stages:
            return Interleaved1F1B(m, stages_per_rank=num_stages // p).program(num_stages, p)
        ranks = []
        for r in range(p):
            warmup = min(p - r - 1, m)
            row = [Action(r, FORWARD, i) for i in range(warmup)]
            for i in range(m - warmup):
                row += [Action(r, FORWARD, warmup + i), Action(r, BACKWARD, i)]
            row += [Action(r, BACKWARD, i) for i in range(m - warmup, m)]
            ranks.append(tuple(row))
        return Program(tuple(ranks), p, m)
