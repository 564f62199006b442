"""ZB-V: two stages per rank in a V, backward split into input and weight gradients (Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024, section 6)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import BuiltinSchedule, v_ranks
from ._program import Program


@dataclass(frozen=True)
class ZeroBubbleV(BuiltinSchedule):
    """ZB-V (Qi et al., 2024): two stages per rank placed in a V, near-zero bubble at 1F1B's memory.

    With ``p`` ranks and ``2p`` stages, rank ``r`` holds stage ``r`` (its chunk 0, on the way
    down) and stage ``2p - 1 - r`` (its chunk 1, on the way up), so rank ``p - 1`` holds the two
    middle stages and rank 0 the first and the last: a microbatch goes down the ranks and back::

        stage:   0   1   2   3   4   5          (p = 3)
        rank:    0   1   2   2   1   0

    Each rank alternates its two chunks; backwards are split into ``I`` (input gradient, which the
    previous stage waits for) and ``W`` (weight gradient, run where the rank would idle). With
    ``T_F = T_I = T_W`` the steady state has no bubble and, for ``m >= 3p // 2``, the only idle
    time is the fill and drain of one chunk, exactly ``p - 1`` chunk forwards per rank (more with
    fewer microbatches, or unequal costs: notes/schedules.md); a rank holds at most ``2p`` chunk
    activations (``min(2m, 2p)`` on the busiest), which with chunks half a 1F1B stage is 1F1B's
    peak.

    Rank ``r`` runs, with ``fN``/``iN``/``wN`` counting chunk ``N``'s forwards, input and weight
    gradients (the counters advance by one at each use)::

        f0 * (2(p - r) - 1)                          # warm-up: fill chunk 0 ...
        (f1, f0) * r                                 # ... then alternate
        (f1, i1, w1) * (p - r)                       # chunk 1's backwards start
        while f0 < n or f1 < f0:                     # steady state
            f0 (if f0 < n), i0, w0, f1, i1, w1
        (i0, i1) * r                                 # cool-down: weight gradients deferred ...
        (i0, w0) * (p - r)
        remaining w1, then remaining w0              # ... fill the drain

    over ``n = max(m, 2p - 1)`` microbatches, dropping the actions of microbatches ``>= m``: with
    fewer microbatches the program keeps the same shape and some idle time. This is the order of
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble``.
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_stages // 2`` ranks.

        Raises:
            ScheduleError: if ``num_stages`` is odd, or ``num_ranks`` is given and is not
                ``num_stages // 2``.
        """
        p = v_ranks("ZeroBubbleV", num_stages, num_ranks)
        m = self.num_microbatches
        ranks = tuple(tuple(a for a in _v_rank(r, p, max(m, 2 * p - 1)) if a.microbatch < m) for r in range(p))
        return Program(ranks, num_stages, m)


def _v_rank(r: int, p: int, n: int) -> list[Action]:
    """Rank ``r``'s actions for ``n`` microbatches, following the loop of the class docstring."""
    chunks = (r, 2 * p - 1 - r)
    counts = {(c, kind): 0 for c in (0, 1) for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}
    row: list[Action] = []

    def run(*steps: tuple[int, str]) -> None:
        for c, kind in steps:
            row.append(Action(chunks[c], kind, counts[c, kind]))
            counts[c, kind] += 1

    f, i, w = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    run(*[(0, f)] * (2 * (p - r) - 1))
    run(*[(1, f), (0, f)] * r)
    run(*[(1, f), (1, i), (1, w)] * (p - r))
    while counts[0, f] < n or counts[1, f] < counts[0, f]:
        if counts[0, f] < n:
            run((0, f))
        run((0, i), (0, w), (1, f), (1, i), (1, w))
    run(*[(0, i), (1, i)] * r)
    run(*[(0, i), (0, w)] * (p - r))
    run(*[(1, w)] * (counts[1, i] - counts[1, w]))
    run(*[(0, w)] * (counts[0, i] - counts[0, w]))
    return row
