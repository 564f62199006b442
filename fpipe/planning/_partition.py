"""The min-max split: contiguous runs of costs whose largest sum is as small as possible.

The layers ``0..n-1`` are cut into ``num_stages`` contiguous runs minimizing the largest run's
cost (the "linear partition" problem), what a pipeline running at the pace of its slowest stage
needs. Two dynamic programs over prefix sums, ``O(num_stages * n^2)``:

1. ``best[k][i]``: the least possible maximum when layers ``0..i-1`` form ``k`` stages;
   the optimum ``M = best[num_stages][n]``.
2. Among the partitions whose every stage costs at most ``M``, the one with the smallest sum of
   squared stage costs (the most even); remaining ties give earlier stages more layers, since
   the last stage also computes the loss.

Stage costs are always computed as ``prefix[j] - prefix[i]``, so comparing them with ``M`` in
the second pass is exact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """The contiguous partition of ``costs`` into ``num_stages`` non-empty runs (module docstring)."""
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]

    def cost(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # 1. best[k][i]: least maximum over k stages covering layers 0..i-1.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], cost(j, i)) for j in range(k - 1, i))
    limit = best[num_stages][n]
    # 2. even[k][i]: least sum of squares with every stage at most `limit`; cut[k][i] the last cut.
    even = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    even[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                c = cost(j, i)
                if (
                    c <= limit and even[k - 1][j] < inf and even[k - 1][j] + c * c <= even[k][i]
                ):  # <=: the latest cut wins ties
                    even[k][i], cut[k][i] = even[k - 1][j] + c * c, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):  # back from the last stage, which ends at n
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]
