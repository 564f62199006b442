"""Breadth-first pipeline parallelism with looped placement (Lamy-Poirier, "Breadth-First Pipeline
Parallelism", MLSys 2023, arXiv:2211.05953)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, FORWARD, Action
from ._placement import BuiltinSchedule, looped_ranks
from ._program import Program


@dataclass(frozen=True)
class LoopedBFS(BuiltinSchedule):
    """Looped breadth-first (Lamy-Poirier, 2023): every microbatch through a local stage, then the next.

    With ``p`` ranks and ``v = stages_per_rank``, stage ``s`` lives on rank ``s % p`` as in
    ``Interleaved1F1B``. Where interleaved 1F1B goes depth-first (a group of ``p`` microbatches
    through all of a rank's stages before the next group), breadth-first runs all ``m``
    microbatches through the rank's first stage, then all through its second, and so on, then
    the backwards in the mirror order. Every microbatch's activations are alive at once, as in
    GPipe, but for ``m >= p`` each rank idles GPipe's idle time divided by ``v`` (a bubble of
    ``(p-1)/(vm+p-1)``; fewer microbatches wait for the loop around) and each stage's weights are needed in one
    stretch, which suits sharded data parallelism (gather a stage's weights once per step).

    Conceptually, rank ``r`` runs::

        for s in stages_of(r):                  # r, r + p, ..., r + (v-1)p
            for i in range(m): forward(s, i)
        for s in reversed(stages_of(r)):
            for i in reversed(range(m)): backward(s, i)

    Backwards run the microbatches last first, so the last stage starts with the microbatch
    whose forward it just ran; this is ``torch.distributed.pipelining.ScheduleLoopedBFS``'s order.
    """

    stages_per_rank: int = 2

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_ranks`` ranks (default: ``num_stages // stages_per_rank``).

        Raises:
            ScheduleError: if the stages cannot be spread evenly over the ranks.
        """
        v, m = self.stages_per_rank, self.num_microbatches
        p = looped_ranks("LoopedBFS", num_stages, num_ranks, v)
        ranks = []
        for r in range(p):
            local = range(r, num_stages, p)
            forwards = [Action(s, FORWARD, i) for s in local for i in range(m)]
            backwards = [Action(s, BACKWARD, i) for s in reversed(local) for i in reversed(range(m))]
            ranks.append(tuple(forwards + backwards))
        return Program(tuple(ranks), num_stages, m)
