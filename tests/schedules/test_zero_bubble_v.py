"""ZB-V: literal grids, V placement, validity over sizes, and its memory bound."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Action, ScheduleError, ZeroBubbleV, placement, render, validate


def in_flight_peak(row: tuple[Action, ...]) -> int:
    """The most stage activations a rank holds: forwards whose weight gradient has not run."""
    alive = peak = 0
    for a in row:
        alive += 1 if a.kind == "F" else -1 if a.kind == "W" else 0
        peak = max(peak, alive)
    return peak


def test_grid_2_ranks_4_microbatches() -> None:
    # With unit costs the only idle ticks are the first of rank 1 and the last of rank 0.
    assert render(ZeroBubbleV(4).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3  .
        rank 1 |  .  1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3""")


def test_grid_one_rank() -> None:
    assert render(ZeroBubbleV(3).program(2)) == (
        "rank 0 | 0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0F2 0I1 0W1 1F2 1I2 1W2 0I2 0W2"
    )


def test_grid_fewer_microbatches_than_the_v_fills() -> None:
    # n = max(m, 2p - 1) = 3 microbatches are laid out and microbatch 2's actions dropped.
    assert render(ZeroBubbleV(2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1  .  3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0  .  0I1 0W1
        rank 1 |  .  1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1  .""")


@pytest.mark.parametrize("num_ranks", range(1, 9))
def test_valid_over_sizes_with_v_placement(num_ranks: int) -> None:
    p = num_ranks
    for m in range(1, 17):
        program = ZeroBubbleV(m).program(2 * p)
        validate(program)
        assert program.num_ranks == p
        assert program.placement() == tuple(range(p)) + tuple(reversed(range(p)))
        assert all(program.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))
        # At most 2p chunk activations (each chunk is half a 1F1B stage: 1F1B's p).
        assert max(in_flight_peak(row) for row in program.ranks) == min(2 * p, 2 * m)


def test_placement_function() -> None:
    assert placement(ZeroBubbleV(8), 8) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement(ZeroBubbleV(8), 8, 4) == (0, 1, 2, 3, 3, 2, 1, 0)


@pytest.mark.parametrize("num_stages", [1, 3, 5, 7])
def test_rejects_odd_stage_count(num_stages: int) -> None:
    with pytest.raises(ScheduleError, match=rf"stage count must be even \(num_stages: {num_stages}\)"):
        ZeroBubbleV(8).program(num_stages)


def test_rejects_other_rank_count() -> None:
    with pytest.raises(ScheduleError, match=r"8 stages in a V need 4 ranks \(num_stages: 8, num_ranks: 2\)"):
        ZeroBubbleV(8).program(8, 2)


def test_rejects_bad_microbatches() -> None:
    with pytest.raises(ScheduleError, match="ZeroBubbleV: num_microbatches must be a positive int"):
        ZeroBubbleV(-1)
