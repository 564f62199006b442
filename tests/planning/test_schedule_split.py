"""The schedule-aware split: exact against brute force, torch's expected split, the local search
that takes over for large inputs, and the lower bound that prunes the exact search."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpipe.planning import _schedule_split, partition, split_for
from fpipe.planning._schedule_split import _SplitClock
from fpipe.schedules import Costs, Interleaved1F1B, OneFOneB, Program, ZeroBubbleH1, ZeroBubbleV, simulate

# torch's test_optimize_partition_model_layers_rebalances_prefix_after_shift (test/distributed/
# pipelining/test_partition.py): forward costs, backward twice them, 4 ranks, 8 microbatches.
TORCH_FORWARD = [8, 11, 2, 1, 18, 5, 4, 11]
TORCH_LAYERS = [Costs(forward=c, backward_input=c, backward_weight=c) for c in TORCH_FORWARD]

PROGRAMS = {
    "1f1b": OneFOneB(4).program(3),
    "zbh1": ZeroBubbleH1(4).program(3),
    "interleaved": Interleaved1F1B(4, stages_per_rank=2).program(4, 2),
    "zbv": ZeroBubbleV(4).program(4),
}


def splits(n: int, k: int) -> list[tuple[int, ...]]:
    return list(itertools.combinations(range(1, n), k - 1))


def stage_costs(layers: list[Costs], cuts: tuple[int, ...]) -> list[Costs]:
    """What a stage of layers costs, written out with ``Costs`` (the clock's sums, independently)."""
    return [
        Costs(
            forward=sum(c.forward for c in layers[a:b]),
            backward_input=sum(c.backward_input for c in layers[a:b]),
            backward_weight=sum(c.backward_weight for c in layers[a:b]),
            backward=sum(c.of("B") for c in layers[a:b]),
            send=layers[b - 1].send,
        )
        for a, b in itertools.pairwise((0, *cuts, len(layers)))
    ]


def makespan(program: Program, layers: list[Costs], chosen: list[range]) -> float:
    return simulate(program, stage_costs(layers, tuple(r.start for r in chosen[1:]))).makespan


def test_torch_partition_expectation() -> None:
    """The min-max split is torch's base plan, the schedule-aware one its best plan, and faster."""
    program = OneFOneB(8).program(4)
    base = partition([3 * c for c in TORCH_FORWARD], 4)
    chosen = split_for(program, TORCH_LAYERS)
    assert [list(r) for r in base] == [[0], [1, 2, 3], [4], [5, 6, 7]]
    assert [list(r) for r in chosen] == [[0, 1, 2], [3, 4], [5], [6, 7]]
    assert (makespan(program, TORCH_LAYERS, base), makespan(program, TORCH_LAYERS, chosen)) == (600.0, 573.0)


def test_local_search_finds_torch_expectation(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the exact search switched off, the moves from the min-max split still reach it:
    three cuts move, one of them with the layers before it re-split."""
    monkeypatch.setattr(_schedule_split, "EXACT_LIMIT", 0)
    assert [list(r) for r in split_for(OneFOneB(8).program(4), TORCH_LAYERS)] == [[0, 1, 2], [3, 4], [5], [6, 7]]


layer_costs = st.builds(
    lambda f, i, w, send: Costs(forward=f, backward_input=i, backward_weight=w, send=send),
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(1, 9),
    st.sampled_from([0, 0.5, 2]),
)


@given(st.sampled_from(sorted(PROGRAMS)), st.lists(layer_costs, min_size=4, max_size=7))
def test_exact_against_brute_force(name: str, layers: list[Costs]) -> None:
    """The fastest split of all, simulated; the bound never exceeds a simulated step."""
    program = PROGRAMS[name]
    every = splits(len(layers), program.num_stages)
    steps = {cuts: simulate(program, stage_costs(layers, cuts)).makespan for cuts in every}
    chosen = split_for(program, layers)
    assert makespan(program, layers, chosen) == pytest.approx(min(steps.values()), rel=1e-9)
    clock = _SplitClock(program, layers)
    for cuts, step in steps.items():
        assert clock.step(cuts) == pytest.approx(step, rel=1e-12)
        assert clock.bound(cuts) <= step * (1 + 1e-12)


@given(st.sampled_from(sorted(PROGRAMS)), st.lists(layer_costs, min_size=5, max_size=9))
def test_local_search_never_slower_than_min_max(name: str, layers: list[Costs]) -> None:
    program = PROGRAMS[name]
    base = partition([c.forward + c.of("B") for c in layers], program.num_stages)
    exact = split_for(program, layers)
    _schedule_split.EXACT_LIMIT, limit = 0, _schedule_split.EXACT_LIMIT
    try:
        local = split_for(program, layers)
    finally:
        _schedule_split.EXACT_LIMIT = limit
    assert makespan(program, layers, exact) <= makespan(program, layers, local) * (1 + 1e-9)
    assert makespan(program, layers, local) <= makespan(program, layers, base) * (1 + 1e-9)
