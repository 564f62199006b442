"""Looped breadth-first: literal grids, looped placement, and validity over sizes."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import GPipe, LoopedBFS, ScheduleError, placement, render, validate


def test_grid_2_ranks_2_stages_each_3_microbatches() -> None:
    # All microbatches through stage 0, then stage 2 on rank 0; backwards mirror, last microbatch first.
    assert render(LoopedBFS(3).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 2F0 2F1 2F2  .   .  2B2 2B1 2B0 0B2 0B1 0B0
        rank 1 |  .  1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0  .""")


def test_grid_3_ranks_fewer_microbatches_than_ranks() -> None:
    assert render(LoopedBFS(2, stages_per_rank=2).program(6)) == dedent("""\
        rank 0 | 0F0 0F1  .  3F0 3F1  .   .   .   .  3B1 3B0  .  0B1 0B0
        rank 1 |  .  1F0 1F1  .  4F0 4F1  .   .  4B1 4B0  .  1B1 1B0  .
        rank 2 |  .   .  2F0 2F1  .  5F0 5F1 5B1 5B0  .  2B1 2B0  .   .""")


def test_breadth_first_order() -> None:
    for r, row in enumerate(LoopedBFS(4, stages_per_rank=3).program(6).ranks):
        forwards = [(a.stage, a.microbatch) for a in row if a.kind == "F"]
        backwards = [(a.stage, a.microbatch) for a in row if a.kind == "B"]
        assert forwards == [(s, i) for s in (r, r + 2, r + 4) for i in range(4)]
        assert backwards == list(reversed(forwards))


def test_same_actions_as_looped_gpipe() -> None:
    # GPipe on fewer ranks than stages is also breadth-first; only the backward microbatch order differs.
    bfs, gpipe = LoopedBFS(3, stages_per_rank=2).program(6), GPipe(3).program(6, 3)
    assert [sorted(row) for row in bfs.ranks] == [sorted(row) for row in gpipe.ranks]


@pytest.mark.parametrize("stages_per_rank", [1, 2, 3, 4])
def test_valid_with_looped_placement(stages_per_rank: int) -> None:
    v = stages_per_rank
    for num_ranks in range(1, 9):
        num_stages = v * num_ranks
        for m in range(1, 17):
            program = LoopedBFS(m, stages_per_rank=v).program(num_stages)
            validate(program)
            assert program.placement() == tuple(s % num_ranks for s in range(num_stages))


def test_num_ranks_overrides_stages_per_rank() -> None:
    assert placement(LoopedBFS(4, stages_per_rank=2), 6, 2) == (0, 1, 0, 1, 0, 1)
    assert LoopedBFS(4).program(6, 2).stages_of(1) == (1, 3, 5)


def test_rejects_indivisible_stage_count() -> None:
    with pytest.raises(ScheduleError, match=r"LoopedBFS: 5 stages cannot be spread 2 per rank"):
        LoopedBFS(4).program(5)
    with pytest.raises(ScheduleError, match=r"LoopedBFS: 5 stages cannot be laid out on 2 ranks"):
        LoopedBFS(4).program(5, 2)


@pytest.mark.parametrize("bad", [0, 2.5, True])
def test_rejects_bad_stages_per_rank(bad: object) -> None:
    with pytest.raises(ScheduleError, match=r"LoopedBFS: stages_per_rank must be a positive int"):
        LoopedBFS(4, stages_per_rank=bad)  # type: ignore[arg-type]
