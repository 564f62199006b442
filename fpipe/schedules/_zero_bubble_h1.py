"""ZB-H1: 1F1B with the backward split so that weight gradients fill the bubble (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR 2024, section 3.1)."""

from __future__ import annotations

from dataclasses import dataclass

from .._plural import plural
from ._action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import BuiltinSchedule
from ._program import Program, ScheduleError


@dataclass(frozen=True)
class ZeroBubbleH1(BuiltinSchedule):
    """ZB-H1 (Qi et al., 2024): 1F1B whose backward is split into ``I`` and ``W``, ``W`` deferred.

    One stage per rank (stage ``s`` on rank ``s``). The input-gradient pass ``I`` is all that
    the previous rank waits for, so it runs where 1F1B runs ``B``; the weight-gradient pass
    ``W`` can wait. Rank ``r`` holds back its first ``r`` weight gradients and runs them in
    the cool-down, where 1F1B idles. For ``m >= p`` and ``T_W <= T_F``, ``T_W <= T_I`` each
    rank's idle time shrinks from 1F1B's ``(p-1)(T_F + T_I + T_W)`` to ``(p-1)(T_F + T_I - T_W)``,
    a third of it at ``T_F = T_I = T_W`` (notes/schedules.md), while every rank holds
    ``min(m, p)`` microbatches' activations, 1F1B's peak (rank 0's).

    Conceptually, rank ``r`` of ``p`` runs::

        warmup = min(p - r - 1, m)
        for i in range(warmup): forward(r, i)
        for k in range(m):
            if warmup + k < m: forward(r, warmup + k)
            input_grad(r, k)
            if k >= r: weight_grad(r, k - r)
        for i in range(max(m - r, 0), m): weight_grad(r, i)

    This is also the order of ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble``
    with one stage per rank.
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on as many ranks.

        Raises:
            ScheduleError: if ``num_ranks`` is given and differs from ``num_stages``.
        """
        if num_ranks is not None and num_ranks != num_stages:
            raise ScheduleError(
                f"fpipe.schedules.ZeroBubbleH1: the schedule runs one stage per rank but was asked for "
                f"{plural(num_stages, 'stage')} on {plural(num_ranks, 'rank')} "
                f"(num_stages: {num_stages}, num_ranks: {num_ranks}). "
                "Use as many stages as ranks, or ZeroBubbleV for two stages per rank."
            )
        m, p = self.num_microbatches, num_stages
        ranks = []
        for r in range(p):
            warmup = min(p - r - 1, m)
            row = [Action(r, FORWARD, i) for i in range(warmup)]
            for k in range(m):
                if warmup + k < m:
                    row.append(Action(r, FORWARD, warmup + k))
                row.append(Action(r, BACKWARD_INPUT, k))
                if k >= r:
                    row.append(Action(r, BACKWARD_WEIGHT, k - r))
            row += [Action(r, BACKWARD_WEIGHT, i) for i in range(max(m - r, 0), m)]
            ranks.append(tuple(row))
        return Program(tuple(ranks), p, m)
