"""Interleaved zero bubble: interleaved 1F1B in looped placement with the backward split so that
weight gradients fill the bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024: ZB-H1
on ``v`` stages per rank), as ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble``."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import BuiltinSchedule, looped_ranks
from ._program import Program


@dataclass(frozen=True)
class InterleavedZeroBubble(BuiltinSchedule):
    """Interleaved 1F1B whose backward is split into ``I`` and ``W``, rank ``r``'s first ``r`` ``W`` deferred.

    Looped placement as ``Interleaved1F1B``: with ``p`` ranks and ``v = stages_per_rank``, rank
    ``r`` holds stages ``r, r + p, ..., r + (v-1)p``. Microbatches go through in rounds of
    ``k = m // max(1, m // p)`` (at least ``p`` when ``m >= p``): a rank runs the forwards of its
    first stage on a round, then of its second, and so on; backwards (``I``, the input gradient)
    mirror the chunks; each weight gradient ``W`` follows its ``I`` by ``r`` steps (ZB-H1's
    deferral), so ranks that wait least in the warm-up fill the cool-down. The warm-up is
    ``(v-1)k + p - r - 1`` forwards, ZB-H1's ``p - r - 1`` when ``v = 1`` (then this is
    ``ZeroBubbleH1``). Conceptually, as ``_get_1f1b_rank_ops(enable_zero_bubble=True)`` of
    ``torch/distributed/pipelining/schedules.py`` builds it, with ``N = m * v`` and each stage's
    microbatch counter advancing by one at each use::

        warmup = min((v - 1) * k + p - r - 1, N)
        fwd_stage = lambda t: (t // k % v) * p + r
        bwd_stage = lambda t: (v - 1 - (t - warmup) // k % v) * p + r
        for t in range(warmup): forward(fwd_stage(t))
        for t in range(warmup, N + warmup):
            if t < N: forward(fwd_stage(t))
            input_grad(bwd_stage(t))
            if t - warmup >= r: weight_grad(bwd_stage(t - r))    # the I of r steps before
        the remaining weight_grad, in order of their I

    This is torch's per-rank order wherever torch accepts ``m`` (a multiple of ``max(1, m // p)``);
    other ``m`` (e.g. ``p = 4``, ``m = 9``) are laid out as the next count torch accepts, and the
    actions of microbatches ``>= m`` dropped, as ``ZeroBubbleV`` does.
    """

    stages_per_rank: int = 2

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_ranks`` ranks (default: ``num_stages // stages_per_rank``).

        Raises:
            ScheduleError: if the stages cannot be spread evenly over the ranks.
        """
        m = self.num_microbatches
        p = looped_ranks("InterleavedZeroBubble", num_stages, num_ranks, self.stages_per_rank)
        v = num_stages // p
        n = m
        while n % max(1, n // p):  # torch's condition: whole rounds
            n += 1
        ranks = tuple(tuple(a for a in _rank(r, p, v, n) if a.microbatch < m) for r in range(p))
        return Program(ranks, num_stages, m)


def _rank(r: int, p: int, v: int, n: int) -> list[Action]:
    """Rank ``r``'s actions for ``n`` microbatches, following the loop of the class docstring."""
    k = n // max(1, n // p)  # microbatches per round
    total = n * v
    warmup = min((v - 1) * k + p - r - 1, total)
    counts: dict[tuple[int, str], int] = {}
    row: list[Action] = []

    def run(stage: int, kind: str) -> None:
        i = counts.get((stage, kind), 0)
        counts[stage, kind] = i + 1
        row.append(Action(stage, kind, i))

    def fwd_stage(t: int) -> int:
        return (t // k % v) * p + r

    def bwd_stage(t: int) -> int:
        return (v - 1 - (t - warmup) // k % v) * p + r

    for t in range(warmup):
        run(fwd_stage(t), FORWARD)
    for t in range(warmup, total + warmup):
        if t < total:
            run(fwd_stage(t), FORWARD)
        run(bwd_stage(t), BACKWARD_INPUT)
        if t - warmup >= r:
            run(bwd_stage(t - r), BACKWARD_WEIGHT)
    for t in range(max(total + warmup - r, warmup), total + warmup):
        run(bwd_stage(t), BACKWARD_WEIGHT)
    return row
