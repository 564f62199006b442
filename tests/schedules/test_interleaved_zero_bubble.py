"""Interleaved zero bubble: literal grids, looped placement, validity over sizes, and equality with
``torch.distributed.pipelining.ScheduleInterleavedZeroBubble``'s per-rank order."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from fpipe.schedules import InterleavedZeroBubble, ScheduleError, ZeroBubbleH1, load_csv, placement, render, validate
from tests.helpers import torch_csv, torch_stages  # rank 0's stand-in PipelineStages


def test_grid_2_ranks_2_stages_each_4_microbatches() -> None:
    # Rounds of 2 microbatches per stage; rank 1 defers one W, rank 0 none.
    assert render(InterleavedZeroBubble(4, stages_per_rank=2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 2F0 2F1  .  2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3
        rank 1 |  .  1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3""")


def test_grid_one_round_of_3_microbatches() -> None:
    # m // max(1, m // p) = 3 microbatches in one round: a round may hold more than p.
    assert render(InterleavedZeroBubble(3, stages_per_rank=2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 2F0 2F1  .  2I0 2W0 2F2 2I1 2W1 2I2 2W2 0I0 0W0 0I1 0W1 0I2 0W2
        rank 1 |  .  1F0 1F1 1F2 3F0 3I0 3F1 3I1 3W0 3F2 3I2 3W1 1I0 3W2 1I1 1W0 1I2 1W1 1W2""")


def test_grid_fewer_microbatches_than_ranks() -> None:
    assert render(InterleavedZeroBubble(2, stages_per_rank=2).program(6)) == dedent("""\
        rank 0 | 0F0 0F1  .  3F0 3F1  .   .   .  3I0 3W0 3I1 3W1 0I0 0W0 0I1 0W1
        rank 1 |  .  1F0 1F1  .  4F0 4F1  .  4I0  .  4I1 4W0 1I0 4W1 1I1 1W0 1W1
        rank 2 |  .   .  2F0 2F1  .  5F0 5I0 5F1 5I1 2I0 5W0 2I1 5W1 2W0 2W1  .""")


def test_one_stage_per_rank_is_zb_h1() -> None:
    for p in range(1, 6):
        for m in range(1, 13):
            assert InterleavedZeroBubble(m, stages_per_rank=1).program(p) == ZeroBubbleH1(m).program(p)


@pytest.mark.parametrize("stages_per_rank", [1, 2, 3, 4])
def test_valid_with_looped_placement(stages_per_rank: int) -> None:
    v = stages_per_rank
    for p in range(1, 7):
        for m in range(1, 17):
            program = InterleavedZeroBubble(m, stages_per_rank=v).program(p * v)
            validate(program)
            assert program.placement() == tuple(s % p for s in range(p * v))
            assert {a.kind for row in program.ranks for a in row} == {"F", "I", "W"}


def test_microbatches_torch_rejects_are_laid_out_as_the_next_it_accepts() -> None:
    # p = 4, m = 9: torch wants a multiple of 9 // 4 = 2 rounds; laid out as 10, microbatch 9 dropped.
    program = InterleavedZeroBubble(9, stages_per_rank=2).program(8)
    ten = InterleavedZeroBubble(10, stages_per_rank=2).program(8)
    assert program.ranks == tuple(tuple(a for a in row if a.microbatch < 9) for row in ten.ranks)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_torch_interleaved_zero_bubble_is_interleaved_zero_bubble(p: int, v: int, tmp_path: Path) -> None:
    accepted = [m for m in range(1, 13) if m % max(1, m // p) == 0]  # torch rejects the others
    for m in accepted:
        schedule = torch_schedules.ScheduleInterleavedZeroBubble(torch_stages(p, [c * p for c in range(v)], p * v), m)
        loaded = load_csv(torch_csv(tmp_path, schedule), num_stages=p * v, num_microbatches=m)
        assert loaded == InterleavedZeroBubble(m, stages_per_rank=v).program(p * v), f"p={p}, v={v}, m={m}"


def test_placement_function() -> None:
    assert placement(InterleavedZeroBubble(4, stages_per_rank=2), 6) == (0, 1, 2, 0, 1, 2)


def test_rejects_indivisible_stage_count() -> None:
    with pytest.raises(ScheduleError, match=r"InterleavedZeroBubble: 5 stages cannot be spread 2 per rank"):
        InterleavedZeroBubble(4, stages_per_rank=2).program(5)


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_rejects_bad_stages_per_rank(bad: object) -> None:
    with pytest.raises(ScheduleError, match="InterleavedZeroBubble: stages_per_rank must be a positive int"):
        InterleavedZeroBubble(4, stages_per_rank=bad)  # type: ignore[arg-type]


def test_rejects_bad_microbatches() -> None:
    with pytest.raises(ScheduleError, match="InterleavedZeroBubble: num_microbatches must be a positive int"):
        InterleavedZeroBubble(0)
