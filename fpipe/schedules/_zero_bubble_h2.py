"""ZB-H2: ZB-H1 with a longer warm-up, zero bubble in the steady state at twice 1F1B's memory (Qi et
al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1)."""

from __future__ import annotations

from dataclasses import dataclass

from .._plural import plural
from ._action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import BuiltinSchedule
from ._program import Program, ScheduleError


@dataclass(frozen=True)
class ZeroBubbleH2(BuiltinSchedule):
    """ZB-H2 (Qi et al., 2024): more forwards in the warm-up so that no rank waits, ``W`` deferred.

    One stage per rank (stage ``s`` on rank ``s``), backwards split into ``I`` (the input
    gradient the previous rank waits for) and ``W`` (the weight gradient, which can wait). The
    paper fills the idle time before the first ``I`` with extra forwards: rank ``r`` runs
    ``2(p - r) - 1`` of them, as many as fit before its first ``I`` arrives when
    ``T_F = T_I = T_W``. It then repeats ``I``, ``W``, ``F``, holding back its first ``2r``
    weight gradients for the tail, which turns 1F1B's trapezoid into a parallelogram: rank ``r``
    starts at ``r T_F`` and runs its ``3m`` actions without a gap, ending at ``(3m + r) T_F``.
    Every rank holds up to ``2p - 1`` microbatches' activations (1F1B: ``p`` on rank 0).

    Conceptually, rank ``r`` of ``p`` runs::

        warmup = 2(p - r) - 1                        # requires m >= 2p - 1
        for i in range(warmup): forward(r, i)
        for k in range(m):
            input_grad(r, k)
            if k >= 2r: weight_grad(r, k - 2r)
            if warmup + k < m: forward(r, warmup + k)
        for i in range(max(m - 2r, 0), m): weight_grad(r, i)

    What the end of the step still costs: the paper's zero bubble counts on the next step's
    forwards starting on rank ``r`` as soon as rank ``r`` is done (rank 0 at ``3m``, rank ``r``
    at ``3m + r``: the parallelograms tile), which its optimizer post-validation allows (the
    optimizer steps without waiting for the global gradient norm or inf/nan checks and rolls back
    when they fail). fpipe has no post-validation: a step ends when its last rank does, so each
    rank still idles ``(p - 1) T_F`` per step (``r`` before its first action, ``p - 1 - r``
    after its last), whatever the costs: at ``T_F = T_I = T_W`` a bubble of ``(p-1)/(3m+p-1)``,
    ZB-H1's.
    ZB-H2 keeps it where ZB-H1's ``(p - 1)(T_F + T_I - T_W)`` grows: with ``T_I = 2 T_F`` or
    with a message latency of ``T_F / 2`` it idles half as long as ZB-H1 (``simulate`` it).

    The warm-up needs ``m >= 2p - 1`` microbatches; fewer is a ``ScheduleError`` (ZB-H1 takes
    any ``m``).
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on as many ranks.

        Raises:
            ScheduleError: if ``num_ranks`` is given and differs from ``num_stages``, or
                ``num_microbatches < 2 * num_stages - 1``.
        """
        if num_ranks is not None and num_ranks != num_stages:
            raise ScheduleError(
                f"fpipe.schedules.ZeroBubbleH2: the schedule runs one stage per rank but was asked for "
                f"{plural(num_stages, 'stage')} on {plural(num_ranks, 'rank')} "
                f"(num_stages: {num_stages}, num_ranks: {num_ranks}). "
                "Use as many stages as ranks, or ZeroBubbleV for two stages per rank."
            )
        m, p = self.num_microbatches, num_stages
        if m < 2 * p - 1:
            raise ScheduleError(
                f"fpipe.schedules.ZeroBubbleH2: the warm-up of {plural(p, 'stage')} runs 2p - 1 = {2 * p - 1} "
                f"forwards on rank 0 but the step has {plural(m, 'microbatch')} (num_microbatches: {m}). "
                f"Use num_microbatches >= {2 * p - 1}, at most {plural((m + 1) // 2, 'stage')}, or ZeroBubbleH1, "
                "which takes any number of microbatches."
            )
        ranks = []
        for r in range(p):
            warmup = 2 * (p - r) - 1
            row = [Action(r, FORWARD, i) for i in range(warmup)]
            for k in range(m):
                row.append(Action(r, BACKWARD_INPUT, k))
                if k >= 2 * r:
                    row.append(Action(r, BACKWARD_WEIGHT, k - 2 * r))
                if warmup + k < m:
                    row.append(Action(r, FORWARD, warmup + k))
            row += [Action(r, BACKWARD_WEIGHT, i) for i in range(max(m - 2 * r, 0), m)]
            ranks.append(tuple(row))
        return Program(tuple(ranks), p, m)
