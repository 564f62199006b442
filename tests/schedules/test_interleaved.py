"""Interleaved 1F1B: literal grids, looped placement, and validity over sizes."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Interleaved1F1B, Program, ScheduleError, render, validate


def test_grid_2_ranks_2_stages_each_4_microbatches() -> None:
    assert render(Interleaved1F1B(4, stages_per_rank=2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1  .  2B2  .  2B3 0B2 0B3
        rank 1 |  .  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3  .""")


def test_grid_microbatches_not_a_multiple_of_ranks() -> None:
    # Laid out as 4 microbatches (a multiple of the 2 ranks) with microbatch 3's actions dropped.
    assert render(Interleaved1F1B(3, stages_per_rank=2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0  .  2B1 2F2 0B0 0B1  .  2B2  .  0B2
        rank 1 |  .  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1B1 3F2 3B2  .  1B2  .""")
    assert render(Interleaved1F1B(3, stages_per_rank=2).program(4)) == render(
        Program.from_lists(
            [[a for a in row if a.microbatch < 3] for row in Interleaved1F1B(4, stages_per_rank=2).program(4).ranks],
            num_stages=4,
            num_microbatches=3,
        )
    )


@pytest.mark.parametrize(("num_ranks", "stages_per_rank", "num_microbatches"), [(4, 3, 5), (5, 2, 7), (6, 2, 9)])
def test_valid_when_the_last_group_is_partial(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> None:
    # A last group of fewer than p microbatches used to come back to rank 0 before the previous
    # chunk had left rank p-1, and deadlocked (5 ranks, 2 stages each, 7 microbatches: rank 0
    # waited at 5F6 for 4F6, which rank 4 runs after 4B0, which needs 5B0, behind 5F6 on rank 0).
    program = Interleaved1F1B(num_microbatches, stages_per_rank=stages_per_rank).program(num_ranks * stages_per_rank)
    validate(program)


def test_grid_three_stages_per_rank() -> None:
    expected = """\
        rank 0 | 0F0 0F1 2F0 2F1 4F0 4F1 0F2 4B0 0F3 4B1 2F2 2B0 2F3 2B1 4F2 0B0 4F3 0B1  .  4B2  .  4B3 2B2 2B3 0B2 0B3
        rank 1 |  .  1F0 1F1 3F0 3F1 5F0 5B0 5F1 5B1 1F2 3B0 1F3 3B1 3F2 1B0 3F3 1B1 5F2 5B2 5F3 5B3 3B2 3B3 1B2 1B3  ."""  # noqa: E501
    assert render(Interleaved1F1B(4, stages_per_rank=3).program(6)) == dedent(expected)


@pytest.mark.parametrize("stages_per_rank", [1, 2, 3, 4])
def test_valid_with_looped_placement(stages_per_rank: int) -> None:
    v = stages_per_rank
    for num_stages in range(v, 8 * v + 1, v):
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
