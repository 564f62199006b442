"""Interleaved 1F1B: literal grids, looped placement, and validity over sizes."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Interleaved1F1B, ScheduleError, render, validate


def test_grid_2_ranks_2_stages_each_4_microbatches() -> None:
    assert render(Interleaved1F1B(4, stages_per_rank=2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1  .  2B2  .  2B3 0B2 0B3
        rank 1 |  .  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3  .""")


def test_grid_microbatches_not_a_multiple_of_ranks() -> None:
    # The last group holds one microbatch: it goes through both of a rank's stages alone.
    assert render(Interleaved1F1B(3, stages_per_rank=2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0  .   .  2F2 2B1 0B0 0B1 2B2  .  0B2
        rank 1 |  .  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 3F2 1B1 3B2  .  1B2  .""")


def test_grid_three_stages_per_rank() -> None:
    expected = """\
        rank 0 | 0F0 0F1 2F0 2F1 4F0 4F1 0F2 4B0 0F3 4B1 2F2 2B0 2F3 2B1 4F2 0B0 4F3 0B1  .  4B2  .  4B3 2B2 2B3 0B2 0B3
        rank 1 |  .  1F0 1F1 3F0 3F1 5F0 5B0 5F1 5B1 1F2 3B0 1F3 3B1 3F2 1B0 3F3 1B1 5F2 5B2 5F3 5B3 3B2 3B3 1B2 1B3  ."""  # noqa: E501
    assert render(Interleaved1F1B(4, stages_per_rank=3).program(6)) == dedent(expected)


@pytest.mark.parametrize("stages_per_rank", [1, 2, 3, 4])
def test_valid_with_looped_placement(stages_per_rank: int) -> None:
    v = stages_per_rank
    for num_stages in range(v, 9, v):
        p = num_stages // v
        for m in range(1, 17):
            program = Interleaved1F1B(m, stages_per_rank=v).program(num_stages)
            validate(program)
            assert program.num_ranks == p
            assert program.placement() == tuple(s % p for s in range(num_stages))
            assert program.stages_of(0) == tuple(range(0, num_stages, p))


def test_rejects_indivisible_stage_count() -> None:
    with pytest.raises(ScheduleError, match=r"5 stages cannot be spread 2 per rank \(stages_per_rank: 2\)"):
        Interleaved1F1B(4, stages_per_rank=2).program(5)


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_rejects_bad_stages_per_rank(bad: object) -> None:
    with pytest.raises(ScheduleError, match="stages_per_rank must be a positive int"):
        Interleaved1F1B(4, stages_per_rank=bad)  # type: ignore[arg-type]


def test_rejects_bad_microbatches() -> None:
    with pytest.raises(ScheduleError, match="Interleaved1F1B: num_microbatches must be a positive int"):
        Interleaved1F1B(0)
