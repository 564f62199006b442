"""The accumulation order (``fpipe._accumulate``): per-microbatch gradients summed in microbatch
order, whatever order they arrive in, in memory of their own."""

from __future__ import annotations

import itertools

import pytest
import torch

from fpipe._accumulate import HoldersSum, OrderedSum


@pytest.mark.parametrize("arrival", list(itertools.permutations(range(4))), ids=str)
def test_ordered_sum_adds_in_microbatch_order(arrival: tuple[int, ...]) -> None:
    """``1e16 + 1`` rounds to ``1e16``: only the order 0, 1, 2, 3 gives ``((1e16 + 1) - 1e16) + 1 = 1``."""
    values = [1e16, 1.0, -1e16, 1.0]
    contributions = {i: torch.tensor([values[i]]) for i in range(4)}
    total = OrderedSum(_leaves(1, (1,)))
    for i in arrival:
        total.add(i, [contributions[i]])
    assert total.total[0] is not None and total.total[0].item() == 1.0
    assert [c.item() for c in contributions.values()] == values  # contributions not written to


def _leaves(n: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Parameter leaves as a ``StageRun`` prepares them, for an ``OrderedSum`` to sum into."""
    return [torch.zeros(shape, requires_grad=True) for _ in range(n)]


def test_ordered_sum_mixes_engine_accumulation_and_late_additions() -> None:
    """Microbatch 0 and 2 come from the engine when next in order, 1 arrives early and waits:
    the sum is still ((g0 + g1) + g2) + g3, bitwise."""
    values = [1e16, 1.0, -1e16, 1.0]
    (leaf,) = leaves = _leaves(1, (1,))
    total = OrderedSum(leaves)

    def engine(i: int) -> None:
        assert total.engine_accumulates(i)
        (leaf * values[i]).sum().backward(inputs=[leaf])
        total.accumulated(i)

    assert not total.engine_accumulates(1)
    total.add(1, [torch.tensor([values[1]])])
    engine(0)  # flushes the waiting microbatch 1
    total.add(3, [torch.tensor([values[3]])])
    engine(2)
    assert total.total[0] is not None and total.total[0].item() == 1.0


def test_ordered_sum_waits_for_missing_microbatches() -> None:
    total = OrderedSum(_leaves(2, ()))
    total.add(1, [torch.ones(()), None])
    assert total.total == [None, None]
    total.add(0, [None, torch.ones(())])
    assert [t.item() if t is not None else None for t in total.total] == [1.0, 1.0]


def test_ordered_sum_owns_its_memory() -> None:
    """Autograd may return the same tensor, or an expanded view, for several gradients."""
    g = torch.ones(())
    shared, expanded = torch.ones(3), g.expand(3)
    first, second = OrderedSum(_leaves(2, (3,))), OrderedSum(_leaves(2, (3,)))
    for i in range(3):
        first.add(i, [shared, expanded])
        second.add(i, [shared, expanded])
    assert first.total[0] is not None and torch.equal(first.total[0], torch.full((3,), 3.0))
    assert second.total[1] is not None and torch.equal(second.total[1], torch.full((3,), 3.0))
    assert torch.equal(shared, torch.ones(3)) and g.item() == 1.0
    assert first.total[0] is not second.total[0]


@pytest.mark.parametrize("arrival", [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)], ids=str)
def test_a_holder_sums_its_own_microbatches_in_order(arrival: tuple[int, ...]) -> None:
    """NOTE [a stage on several ranks]: a holder of microbatches 1 and 3 adds ``g1 + g3``."""
    values = [5.0, 1e16, 7.0, 1.0]
    total = OrderedSum(_leaves(1, (1,)), order=(1, 3))
    for i in arrival:
        if i in (1, 3):
            total.add(i, [torch.tensor([values[i]])])
    assert total.total[0] is not None and total.total[0].item() == 1e16 + 1.0
    assert not total.engine_accumulates(0) and not total.engine_accumulates(3)


@pytest.mark.parametrize("arrival", list(itertools.permutations(range(4))), ids=str)
def test_holders_sums_are_added_in_holder_order(arrival: tuple[int, ...]) -> None:
    """Holders of (0, 1) and (2, 3) in one process: ``(g0 + g1) + (g2 + g3)``, whatever the arrival
    and with the engine accumulating the first holder's: ``(1 + 1e16) + (-1e16 + 1) = 0``, where
    microbatch order gives ``((1 + 1e16) - 1e16) + 1 = 1``; the many-rank exchange adds the same."""
    values = [1.0, 1e16, -1e16, 1.0]
    (leaf,) = leaves = _leaves(1, (1,))
    total = HoldersSum(leaves, None, [(0, 1), (2, 3)])
    for i in arrival:
        if total.engine_accumulates(i):
            (leaf * values[i]).sum().backward(inputs=[leaf])
            total.accumulated(i)
        else:
            total.add(i, [torch.tensor([values[i]])])
    first, second = torch.tensor([values[0]]) + values[1], torch.tensor([values[2]]) + values[3]
    assert total.total[0] is not None and total.total[0].item() == (first + second).item() == 0.0
    again = total.total[0]  # a second read adds nothing again
    assert again is not None and again.item() == 0.0
