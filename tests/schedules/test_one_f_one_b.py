"""1F1B: literal grids, validity over sizes, and its memory bound (rank ``r`` holds ``p - r``)."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Action, Interleaved1F1B, OneFOneB, ScheduleError, render, validate


def in_flight_peak(row: tuple[Action, ...]) -> int:
    """The most forwards a rank has run whose backward it has not run yet."""
    alive = peak = 0
    for a in row:
        alive += 1 if a.kind == "F" else -1 if a.kind in "BW" else 0
        peak = max(peak, alive)
    return peak


def test_grid_3_stages_5_microbatches() -> None:
    assert render(OneFOneB(5).program(3)) == dedent("""\
        rank 0 | 0F0 0F1 0F2  .   .  0B0 0F3 0B1 0F4 0B2  .  0B3  .  0B4
        rank 1 |  .  1F0 1F1  .  1B0 1F2 1B1 1F3 1B2 1F4 1B3  .  1B4  .
        rank 2 |  .   .  2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4  .   .""")


def test_grid_fewer_microbatches_than_stages() -> None:
    assert render(OneFOneB(2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1  .   .   .   .   .  0B0  .  0B1
        rank 1 |  .  1F0 1F1  .   .   .  1B0  .  1B1  .
        rank 2 |  .   .  2F0 2F1  .  2B0  .  2B1  .   .
        rank 3 |  .   .   .  3F0 3B0 3F1 3B1  .   .   .""")


def test_rank_order_follows_the_docstring_loop() -> None:
    p, m = 4, 6
    for r, row in enumerate(OneFOneB(m).program(p).ranks):
        warmup = min(p - r - 1, m)
        expected = [f"{r}F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            expected += [f"{r}F{warmup + i}", f"{r}B{i}"]
        expected += [f"{r}B{i}" for i in range(m - warmup, m)]
        assert [str(a) for a in row] == expected


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_valid_over_sizes(num_stages: int) -> None:
    for m in range(1, 17):
        validate(OneFOneB(m).program(num_stages))


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_rank_r_holds_at_most_p_minus_r(num_stages: int) -> None:
    p = num_stages
    for m in range(1, 17):
        peaks = [in_flight_peak(row) for row in OneFOneB(m).program(p).ranks]
        assert peaks == [min(p - r, m) for r in range(p)]


def test_placement_is_one_stage_per_rank() -> None:
    assert OneFOneB(3).program(5).placement() == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("bad", [0, -2, 2.0, False])
def test_rejects_bad_microbatches(bad: object) -> None:
    with pytest.raises(ScheduleError, match=r"OneFOneB: num_microbatches must be a positive int \(num_microbatches: "):
        OneFOneB(bad)  # type: ignore[arg-type]


def test_on_fewer_ranks_than_stages_is_interleaved() -> None:
    assert OneFOneB(4).program(6, 2) == Interleaved1F1B(4, stages_per_rank=3).program(6)
    assert OneFOneB(4).program(6, 2).placement() == (0, 1, 0, 1, 0, 1)
