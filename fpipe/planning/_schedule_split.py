"""The schedule-aware split: contiguous cut points minimizing the simulated step time of a program.

NOTE [schedule-aware split]
    The min-max split (``fpipe.balance`` without a schedule, ``partition``) evens out the stages'
    costs, but a step is not only its slowest stage. Under 1F1B, rank ``r``'s work cannot start
    before the forwards of the stages in front of it and cannot end before the backwards behind
    it have run, so a heavy stage costs least at the front of the pipeline. torch's
    ``test_optimize_partition_model_layers_rebalances_prefix_after_shift`` shows it: forward
    costs ``[8, 11, 2, 1, 18, 5, 4, 11]`` (backward twice the forward) over 4 ranks and 8
    microbatches. The min-max split ``[0], [1, 2, 3], [4], [5, 6, 7]`` (stages 8, 14, 18, 20)
    takes 600; ``[0, 1, 2], [3, 4], [5], [6, 7]`` (21, 19, 5, 15) takes 573, although its
    largest stage is larger.

    ``split_for`` replays ``program`` (``fpipe.schedules.simulate``'s model) for candidate splits:

    1. Exact, when there are at most ``EXACT_LIMIT`` splits (``C(n - 1, S - 1)`` for ``n``
       layers and ``S`` stages): every split gets a lower bound (below) in ``O(S + R)``; they
       are replayed in increasing order of bound until the bound exceeds the best step found.
       Worst case ``O(C(n - 1, S - 1) * A)`` for ``A`` actions, usually a few replays.
    2. Otherwise, a local search from the min-max split: shift the cuts ``i..j`` by one layer
       (one layer moves from stage ``i`` to stage ``j + 1`` or back, the stages between keep
       their sizes); keep the best shift that shortens the step, repeat. ``O(S^2 * A)`` per
       round; never slower than the min-max split, not always the optimum.

    Ties (steps within the relative ``TOLERANCE``) go to the split that moves the fewest layers away
    from the min-max split (the sum of the cut points' distances), then to the first in
    lexicographic order of cut points. That is what keeps torch's expected
    ``[0, 1, 2], [3, 4], [5], [6, 7]`` over the equally fast ``[0, 1, 2], [3, 4], [5, 6], [7]``.

    The lower bound of rank ``r``, whose lowest stage is ``s``: its first action waits for one
    microbatch's forwards through stages ``0..s-1``; every one of its actions but the ``W``s
    precedes its last backward of stage ``s``, after which one microbatch's input gradient still
    crosses stages ``s-1..0``. Messages only add to this, so::

        step >= F(0..s-1) + max(work(r), work(r) - W(r) + min(B, I)(0..s-1))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ..schedules import Costs, Program, validate
from ..schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._frontier import Frontier, makespan
from ._partition import partition
from ._problem import TOLERANCE

EXACT_LIMIT = 20_000  # splits enumerated exactly; beyond, a local search (NOTE [schedule-aware split])

Cuts = tuple[int, ...]


def split_for(program: Program, layers: Sequence[Costs]) -> list[range]:
    """The contiguous split of ``layers`` into ``program.num_stages`` stages that minimizes the
    simulated step time of ``program`` (NOTE [schedule-aware split]).

    A stage costs the sum of its layers' ``forward``, ``backward_input``, ``backward_weight`` and
    fused ``backward``; its messages cost the ``send`` of its last layer.
    """
    validate(program)
    n, stages = len(layers), program.num_stages
    base = _cuts(partition([c.forward + c.of(BACKWARD) for c in layers], stages))
    clock = _SplitClock(program, layers)

    def moved(cuts: Cuts) -> int:
        return sum(abs(a - b) for a, b in zip(cuts, base))

    best = (clock.step(base), 0, base)

    def consider(cuts: Cuts) -> None:
        nonlocal best
        step = clock.step(cuts)
        if step < best[0] * (1 - TOLERANCE) or (step <= best[0] * (1 + TOLERANCE) and (moved(cuts), cuts) < best[1:]):
            best = (step, moved(cuts), cuts)

    if math.comb(n - 1, stages - 1) <= EXACT_LIMIT:
        ordered = sorted((clock.bound(c), c) for c in itertools.combinations(range(1, n), stages - 1))
        for bound, cuts in ordered:
            if bound > best[0] * (1 + TOLERANCE):
                break
            consider(cuts)
    else:
        current = None
        while current != best[2]:
            current = best[2]
            for i, j, delta in itertools.product(range(stages - 1), range(stages - 1), (-1, 1)):
                cuts = (*current[:i], *(c + delta for c in current[i : j + 1]), *current[j + 1 :])
                if i <= j and all(a < b for a, b in itertools.pairwise((0, *cuts, n))):
                    consider(cuts)
    bounds = (0, *best[2], n)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _cuts(ranges: Sequence[range]) -> Cuts:
    return tuple(r.start for r in ranges[1:])


class _SplitClock:
    """``program`` compiled once for the simulated step of many splits of ``layers``: its rows
    replayed on one frontier (NOTE [what may run next]), retimed with each split's messages."""

    def __init__(self, program: Program, layers: Sequence[Costs]) -> None:
        self.rows = program.ranks
        self.frontier = Frontier(program.num_microbatches, program.placement(), [0.0] * program.num_stages)
        self.lowest = [min(program.stages_of(r), default=0) for r in range(program.num_ranks)]
        self.counts = [
            {(a.stage, a.kind): sum(1 for b in row if (b.stage, b.kind) == (a.stage, a.kind)) for a in row}
            for row in program.ranks
        ]
        self.prefix = [
            tuple(itertools.accumulate((getattr(c, field) for c in layers), initial=0.0))
            for field in ("forward", "backward_input", "backward_weight", "send")
        ]
        self.prefix.append(tuple(itertools.accumulate((c.of(BACKWARD) for c in layers), initial=0.0)))

    def stage_costs(self, cuts: Cuts) -> list[dict[str, float]]:
        """Per stage, the duration of each kind of action and its messages' latency."""
        forward, inp, weight, send, fused = self.prefix
        bounds = (0, *cuts, len(forward) - 1)
        return [
            {
                FORWARD: forward[b] - forward[a],
                BACKWARD_INPUT: inp[b] - inp[a],
                BACKWARD_WEIGHT: weight[b] - weight[a],
                BACKWARD: fused[b] - fused[a],
                "send": send[b] - send[b - 1],
            }
            for a, b in itertools.pairwise(bounds)
        ]

    def step(self, cuts: Cuts) -> float:
        """The simulated step time of the split at ``cuts``."""
        costs = self.stage_costs(cuts)
        self.frontier.retime([c["send"] for c in costs])
        return makespan(self.frontier, self.rows, lambda a: costs[a.stage][a.kind])

    def bound(self, cuts: Cuts) -> float:
        """A lower bound on ``step(cuts)`` (NOTE [schedule-aware split])."""
        costs = self.stage_costs(cuts)
        before = list(itertools.accumulate((c[FORWARD] for c in costs), initial=0.0))
        after = list(itertools.accumulate((min(c[BACKWARD], c[BACKWARD_INPUT]) for c in costs), initial=0.0))
        best = 0.0
        for s, counts in zip(self.lowest, self.counts):
            work = sum(n * costs[stage][kind] for (stage, kind), n in counts.items())
            weights = sum(n * costs[stage][kind] for (stage, kind), n in counts.items() if kind == BACKWARD_WEIGHT)
            best = max(best, before[s] + max(work, work - weights + after[s]))
        return best
