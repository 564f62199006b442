"""Interleaved 1F1B with looped placement (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, FORWARD, Action
from ._placement import BuiltinSchedule, looped_ranks
from ._program import Program


@dataclass(frozen=True)
class Interleaved1F1B(BuiltinSchedule):
    """Megatron's interleaved 1F1B: ``stages_per_rank`` stages per rank in looped placement.

    With ``p`` ranks and ``v = stages_per_rank``, stage ``s`` lives on rank ``s % p`` (rank ``r``
    holds stages ``r, r + p, ..., r + (v-1)p``). ``stages_per_rank`` sets the number of ranks
    when the program is built without one (in one process); a process group of ``p`` ranks
    gives ``v = num_stages / p``. The bubble
    is the 1F1B bubble divided by ``v``, at the cost of ``v`` times more point-to-point messages.

    Microbatches go through in groups of ``p``: rank ``r`` runs the forward of its first stage on
    a group, then of its second stage on that group, and so on, and backwards in the mirror
    order. Conceptually, with ``fwd``/``bwd`` those (stage, microbatch) sequences of length
    ``N = n * v``, for ``n`` the multiple of ``p`` at or above ``m``::

        warmup = min(2 * (p - r - 1) + (v - 1) * p, N)
        for k in range(warmup): forward(*fwd[k])
        for k in range(N - warmup): forward(*fwd[warmup + k]); backward(*bwd[k])
        for k in range(N - warmup, N): backward(*bwd[k])

    and then drops the actions of microbatches ``>= m``, as ``ZeroBubbleV`` does: a last group
    of fewer than ``p`` microbatches laid out as it comes would reach rank 0's next stage before
    it has left rank ``p - 1``, and deadlock.
    """

    stages_per_rank: int = 2

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_ranks`` ranks (default: ``num_stages // stages_per_rank``)."""
        m = self.num_microbatches
        p = looped_ranks("Interleaved1F1B", num_stages, num_ranks, self.stages_per_rank)
        v = num_stages // p
        n = -(-m // p) * p  # laid out in full groups; the actions of microbatches >= m are dropped
        ranks = []
        for r in range(p):
            groups = [range(start, start + p) for start in range(0, n, p)]
            fwd = [(c * p + r, i) for group in groups for c in range(v) for i in group]
            bwd = [(c * p + r, i) for group in groups for c in reversed(range(v)) for i in group]
            warmup = min(2 * (p - r - 1) + (v - 1) * p, n * v)
            row = [Action(s, FORWARD, i) for s, i in fwd[:warmup]]
            for (fs, fi), (bs, bi) in zip(fwd[warmup:], bwd):
                row += [Action(fs, FORWARD, fi), Action(bs, BACKWARD, bi)]
            row += [Action(s, BACKWARD, i) for s, i in bwd[n * v - warmup :]]
            ranks.append(tuple(a for a in row if a.microbatch < m))
        return Program(tuple(ranks), num_stages, m)
