"""ZB-H1: literal grids, its split backward, validity over sizes, and 1F1B's peak memory."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Action, OneFOneB, ScheduleError, ZeroBubbleH1, placement, render, validate


def in_flight_peak(row: tuple[Action, ...]) -> int:
    """The most forwards a rank has run whose weight gradient (or fused backward) it has not run."""
    alive = peak = 0
    for a in row:
        alive += 1 if a.kind == "F" else -1 if a.kind in "BW" else 0
        peak = max(peak, alive)
    return peak


def test_grid_4_stages_6_microbatches() -> None:
    # Rank r holds back r weight gradients and runs them where 1F1B drains.
    assert render(ZeroBubbleH1(6).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 0F3  .   .   .  0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5
        rank 1 |  .  1F0 1F1 1F2  .   .  1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5
        rank 2 |  .   .  2F0 2F1  .  2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5
        rank 3 |  .   .   .  3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5""")


def test_grid_fewer_microbatches_than_stages() -> None:
    assert render(ZeroBubbleH1(2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1  .   .   .   .   .  0I0 0W0 0I1 0W1
        rank 1 |  .  1F0 1F1  .   .   .  1I0  .  1I1 1W0 1W1
        rank 2 |  .   .  2F0 2F1  .  2I0  .  2I1 2W0 2W1  .
        rank 3 |  .   .   .  3F0 3I0 3F1 3I1 3W0 3W1  .   .""")


def test_forwards_and_input_grads_are_1f1b() -> None:
    # Dropping W and renaming I to B gives back 1F1B, action for action.
    for p in range(1, 6):
        for m in range(1, 9):
            zb = ZeroBubbleH1(m).program(p)
            as_1f1b = tuple(
                tuple(Action(a.stage, "B" if a.kind == "I" else a.kind, a.microbatch) for a in row if a.kind != "W")
                for row in zb.ranks
            )
            assert as_1f1b == OneFOneB(m).program(p).ranks


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_valid_over_sizes(num_stages: int) -> None:
    for m in range(1, 17):
        program = ZeroBubbleH1(m).program(num_stages)
        validate(program)
        assert {a.kind for row in program.ranks for a in row} == ({"F", "I", "W"})


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_peak_memory_is_1f1b_peak(num_stages: int) -> None:
    p = num_stages
    for m in range(1, 17):
        zb = [in_flight_peak(row) for row in ZeroBubbleH1(m).program(p).ranks]
        one_f_one_b = [in_flight_peak(row) for row in OneFOneB(m).program(p).ranks]
        assert max(zb) == max(one_f_one_b) == min(p, m)


def test_placement() -> None:
    assert placement(ZeroBubbleH1(4), 3) == (0, 1, 2)
    assert ZeroBubbleH1(4).program(3, 3).placement() == (0, 1, 2)


def test_rejects_other_rank_count() -> None:
    with pytest.raises(ScheduleError, match=r"ZeroBubbleH1: the schedule runs one stage per rank .*num_ranks: 2"):
        ZeroBubbleH1(4).program(4, 2)


def test_rejects_bad_microbatches() -> None:
    with pytest.raises(ScheduleError, match="ZeroBubbleH1: num_microbatches must be a positive int"):
        ZeroBubbleH1(0)
