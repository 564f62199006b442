"""Interleaved 1F1B with looped placement (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021), with Megatron-Core's microbatch groups."""

from __future__ import annotations

from dataclasses import dataclass

from .._plural import plural
from ._action import BACKWARD, FORWARD, Action
from ._placement import BuiltinSchedule, looped_ranks
from ._program import Program, ScheduleError, as_soon_as_possible


@dataclass(frozen=True)
class Interleaved1F1B(BuiltinSchedule):
    """Megatron's interleaved 1F1B: ``stages_per_rank`` stages per rank in looped placement.

    With ``p`` ranks and ``v = stages_per_rank``, stage ``s`` lives on rank ``s % p`` (rank ``r``
    holds stages ``r, r + p, ..., r + (v-1)p``). ``stages_per_rank`` sets the number of ranks
    when the program is built without one (in one process); a process group of ``p`` ranks
    gives ``v = num_stages / p``. When ``p`` divides ``m``, each rank idles 1F1B's idle time
    divided by ``v``, ``(p-1)(T_F+T_B)/v`` (a bubble of ``(p-1)/(vm+p-1)``; other ``m`` idle
    longer, notes/schedules.md), at the cost of ``v`` times more point-to-point messages.

    Microbatches go through in groups of ``g = microbatch_group`` (default ``p``; Megatron-Core's
    ``microbatch_group_size_per_vp_stage``, at least ``p``): rank ``r`` runs the forward of its
    first stage on a group, then of its second stage on that group, and so on, and backwards in
    the mirror order. Conceptually, as ``get_schedule_table`` and ``get_pp_rank_microbatches`` in
    Megatron-LM's ``megatron/core/pipeline_parallel/schedules.py`` build it, over ``n``
    microbatches::

        table = []                                   # (stage, microbatch), N = n * v long
        for start in range(0, n, g):
            group = range(start, n if start + g >= n else start + g)  # the last takes the rest
            table += [(c * p + r, i) for c in range(v) for i in group]
        fwd = table
        bwd = [((v - 1 - s // p) * p + r, i) for s, i in table]  # chunks mirrored
        warmup = min(2 * (p - r - 1) + (v - 1) * g, N)
        for k in range(warmup): forward(*fwd[k])
        for k in range(N - warmup): forward(*fwd[warmup + k]); backward(*bwd[k])
        for k in range(N - warmup, N): backward(*bwd[k])

    and then drops the actions of microbatches ``>= m``. ``n`` is ``m`` (Megatron-Core's order
    exactly) unless the last group would hold fewer than ``p`` microbatches, which Megatron-Core
    rejects at run time; then that group is padded to ``p`` microbatches, since a last group
    that small, laid out as it comes, can reach rank 0's next stage before it has left rank
    ``p - 1`` and deadlock. With ``g > p`` Megatron-Core's order is kept wherever it still runs
    (as in its unit tests, e.g. ``p = 4``, ``g = 5``, ``m = 8``). ``g = p`` pads whenever ``m``
    is not a multiple of ``p``; that default is the order of ``ScheduleInterleaved1F1B`` in
    ``torch.distributed.pipelining`` when ``m`` is a multiple of ``p``.
    """

    stages_per_rank: int = 2
    microbatch_group: int | None = None

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_ranks`` ranks (default: ``num_stages // stages_per_rank``).

        Raises:
            ScheduleError: if the stages cannot be spread evenly over the ranks, or
                ``microbatch_group`` is smaller than the number of ranks.
        """
        m = self.num_microbatches
        p = looped_ranks("Interleaved1F1B", num_stages, num_ranks, self.stages_per_rank)
        v = num_stages // p
        g = p if self.microbatch_group is None else self.microbatch_group
        if g < p:
            raise ScheduleError(
                f"fpipe.schedules.Interleaved1F1B: a microbatch group must hold at least one microbatch per rank, "
                f"but {plural(g, 'microbatch')} go through each stage together on {plural(p, 'rank')} "
                f"(microbatch_group: {g}, num_ranks: {p}). Use microbatch_group >= {p}, or leave it unset for {p}."
            )
        last = m % g
        if 0 < last < p and g > p:  # Megatron-Core's order, if it runs (it does for most of these)
            program = _interleaved(p, v, m, g, m)
            if _runs(program):
                return program
        n = m - last + p if 0 < last < p else m  # pad a last group of fewer than p to p
        return _interleaved(p, v, m, g, n)


def _interleaved(p: int, v: int, m: int, g: int, n: int) -> Program:
    """The order of the class docstring over ``n >= m`` microbatches, those ``>= m`` dropped."""
    ranks = []
    for r in range(p):
        table: list[tuple[int, int]] = []  # (chunk, microbatch)
        for start in range(0, n, g):
            group = range(start, n if start + g >= n else start + g)
            table += [(c, i) for c in range(v) for i in group]
        fwd = [(c * p + r, i) for c, i in table]
        bwd = [((v - 1 - c) * p + r, i) for c, i in table]
        warmup = min(2 * (p - r - 1) + (v - 1) * g, n * v)
        row = [Action(s, FORWARD, i) for s, i in fwd[:warmup]]
        for (fs, fi), (bs, bi) in zip(fwd[warmup:], bwd):
            row += [Action(fs, FORWARD, fi), Action(bs, BACKWARD, bi)]
        row += [Action(s, BACKWARD, i) for s, i in bwd[n * v - warmup :]]
        ranks.append(tuple(a for a in row if a.microbatch < m))
    return Program(tuple(ranks), p * v, m)


def _runs(program: Program) -> bool:
    """Whether every rank of ``program`` gets to its end (no dependency cycle across ranks)."""
    _, ends = as_soon_as_possible(program, lambda r, k, a: 1.0, lambda a: 0.0)
    return all(len(done) == len(row) for done, row in zip(ends, program.ranks))
