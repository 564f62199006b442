"""DualPipe: DeepSeek's order (a transcription of ``DualPipe.step``), the literal grid, each stage on
two ranks, its own overlapped pairs, and the counts it refuses."""

from __future__ import annotations

from textwrap import dedent
from typing import Any

import pytest

from fpipe.schedules import Costs, DualPipe, Overlapped, Program, ScheduleError, render, simulate, validate
from tests.schedules._dual_pipe_reference import dual_pipe_order


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_the_order_and_pairs_of_deepseeks_dual_pipe(p: int) -> None:
    """Every even ``m`` from ``2p`` to ``4p + 2``: the rows equal DeepSeek's with its ``[F B]`` calls
    run in order, and ``Overlapped(DualPipe(m))`` pairs exactly the calls DeepSeek overlaps."""
    for m in range(2 * p, 4 * p + 3, 2):
        reference = Program.from_lists(dual_pipe_order(p, m))
        program = DualPipe(m).program(p)
        validate(program)
        assert program.ranks == reference.ranks and not program.pairs, (p, m)
        assert Overlapped(DualPipe(m)).program(p) == reference, (p, m)


def test_grid_4_ranks_8_microbatches() -> None:
    # Rank r runs stage r on microbatches 0-3 and stage 3-r on 4-7; each stage lives on two ranks.
    assert render(DualPipe(8).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 3F4 3I4 3W4 3F5 0F3 3B5 3F6 0B0 3B6 3F7 0B1 3B7 0I2 0W2 0I3 0W3
        rank 1 |  .  1F0 2F4 1F1 2F5 1F2 2B4 2F6 1B0 1F3 2B5 2F7 1B1 2B6 1B2 2I7 1I3 2W7 1W3
        rank 2 |  .  1F4 2F0 1F5 2F1 1F6 2B0 2F2 1B4 1F7 2B1 2F3 1B5 2B2 1B6 2I3 1I7 2W3 1W7
        rank 3 | 0F4 0F5 0F6 3F0 3I0 3W0 3F1 0F7 3B1 3F2 0B4 3B2 3F3 0B5 3B3 0I6 0W6 0I7 0W7""")


def test_each_stage_on_two_ranks_for_half_of_the_microbatches_each() -> None:
    program = DualPipe(12).program(6)
    assert program.shared() and program.placement() == (0, 1, 2, 3, 4, 5)
    for s in range(6):
        assert program.holders(s) == (s, 5 - s)
        assert program.microbatches_on(s, s) == tuple(range(6))
        assert program.microbatches_on(s, 5 - s) == tuple(range(6, 12))
    assert all(program.stages_of(r) == tuple(sorted({r, 5 - r})) for r in range(6))


def test_simulated_bubble_and_peak() -> None:
    """``(p-2)/(6m+p-2)`` with ``T_F = T_I = T_W`` (its pairs in turn), and ``p + 1`` stages'
    activations, DeepSeek's ``PP + 1`` (notes/schedules_table.py checks them over a grid)."""
    sim = simulate(DualPipe(16).program(8), Costs(forward=1, backward_input=1, backward_weight=1))
    assert sim.bubble_fraction == pytest.approx(6 / 102) and max(sim.peak_activations) == 9


@pytest.mark.parametrize("num_stages", [1, 3, 5])
def test_rejects_an_odd_stage_count(num_stages: int) -> None:
    with pytest.raises(ScheduleError, match=rf"DualPipe: .*stage count must be even \(num_stages: {num_stages}\)"):
        DualPipe(16).program(num_stages)


def test_rejects_another_rank_count() -> None:
    with pytest.raises(ScheduleError, match=r"4 stages need 4 ranks, each holding two \(num_stages: 4, num_ranks: 2\)"):
        DualPipe(8).program(4, 2)


@pytest.mark.parametrize("num_microbatches", [2, 6, 7, 9])
def test_rejects_odd_or_too_few_microbatches(num_microbatches: int) -> None:
    with pytest.raises(ScheduleError, match=rf"even and at least 2 x 4 = 8 \(num_microbatches: {num_microbatches}\)"):
        DualPipe(num_microbatches).program(4)


@pytest.mark.parametrize("num_microbatches", [0, -2, 8.0, True])
def test_rejects_bad_microbatches(num_microbatches: Any) -> None:
    with pytest.raises(ScheduleError, match="DualPipe: num_microbatches must be a positive int"):
        DualPipe(num_microbatches)
