"""The min-max split (fpipe/planning/_partition.py) against every contiguous split of small cost lists.

Costs are small integers, so every sum is exact and the brute force and the dynamic programs
agree on ties: the least largest stage, then the least sum of squares, then the latest cuts
(earlier stages get more layers; the last stage also computes the loss).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpipe.planning import partition


def best_split(costs: list[int], num_stages: int) -> list[range]:
    """Every way to cut ``costs`` into ``num_stages`` non-empty runs, the best by the module's order."""

    def key(cuts: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        bounds = (0, *cuts, len(costs))
        sums = [sum(costs[i:j]) for i, j in itertools.pairwise(bounds)]
        return max(sums), sum(s * s for s in sums), tuple(-c for c in reversed(cuts))

    cuts = min(itertools.combinations(range(1, len(costs)), num_stages - 1), key=key)
    return [range(i, j) for i, j in itertools.pairwise((0, *cuts, len(costs)))]


@given(st.lists(st.integers(0, 9), min_size=1, max_size=9), st.data())
def test_the_split_is_the_best_of_every_contiguous_split(costs: list[int], data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(1, len(costs)))
    assert partition([float(c) for c in costs], num_stages) == best_split(costs, num_stages)


@pytest.mark.parametrize(
    ("costs", "num_stages", "expected"),
    [
        ([1, 1, 1, 1], 2, [range(0, 2), range(2, 4)]),  # even
        ([1, 1, 1], 2, [range(0, 2), range(2, 3)]),  # a tie: the earlier stage takes more layers
        ([5, 1, 1, 1, 1, 1], 2, [range(0, 1), range(1, 6)]),  # the heavy layer alone
        ([0, 0, 0], 3, [range(0, 1), range(1, 2), range(2, 3)]),  # one layer each, however cheap
        ([2, 3], 1, [range(0, 2)]),
    ],
)
def test_known_splits(costs: list[int], num_stages: int, expected: list[range]) -> None:
    assert partition([float(c) for c in costs], num_stages) == expected
