"""ZB-H2: literal grids, the parallelogram (zero bubble inside the step), its 2p - 1 peak, and what it rejects."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import (
    Costs,
    ScheduleError,
    ZeroBubbleH1,
    ZeroBubbleH2,
    placement,
    render,
    simulate,
    validate,
)


def test_grid_3_stages_6_microbatches() -> None:
    # Rank r runs 2(p - r) - 1 forwards, then I, W, F with its first 2r weight gradients held back:
    # every rank ends 3m actions after it starts (a parallelogram).
    assert render(ZeroBubbleH2(6).program(3)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 0F3 0F4 0I0 0W0 0F5 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5  .   .
        rank 1 |  .  1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1F5 1I3 1W1 1I4 1W2 1I5 1W3 1W4 1W5  .
        rank 2 |  .   .  2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2F5 2I5 2W1 2W2 2W3 2W4 2W5""")


def test_grid_fewest_microbatches() -> None:
    assert render(ZeroBubbleH2(3).program(2)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2  .
        rank 1 |  .  1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2""")


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_zero_bubble_inside_the_step_and_peak_2p_minus_1(num_stages: int) -> None:
    # T_F = T_I = T_W: rank r starts at r and then never waits (busy 3m from r to 3m + r), so with
    # the paper's optimizer post-validation the next step's rank r would start right there. Without
    # it the step lasts 3m + p - 1: p - 1 idle per rank, r at the start and p - 1 - r at the end.
    p = num_stages
    for m in range(2 * p - 1, 2 * p + 10):
        program = ZeroBubbleH2(m).program(p)
        validate(program)
        sim = simulate(program)
        assert [starts[0] for starts in sim.starts] == list(range(p))
        assert [ends[-1] for ends in sim.ends] == [3 * m + r for r in range(p)]
        assert sim.busy == (3.0 * m,) * p
        assert sim.makespan == 3 * m + p - 1
        assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert sim.peak_activations == (2.0 * p - 1,) * p


def test_idle_stays_p_minus_1_hops_where_zb_h1_grows() -> None:
    p, m = 4, 12
    for costs, zb_h1_idle in [(Costs(), 3), (Costs(backward_input=2), 6), (Costs(send=0.5), 9)]:
        h2, h1 = simulate(ZeroBubbleH2(m).program(p), costs), simulate(ZeroBubbleH1(m).program(p), costs)
        assert max(h1.makespan - busy for busy in h1.busy) == zb_h1_idle
        assert max(h2.makespan - busy for busy in h2.busy) == (p - 1) * (1 + costs.send)  # (p - 1)(T_F + c)


def test_placement() -> None:
    assert placement(ZeroBubbleH2(8), 3) == (0, 1, 2)
    assert ZeroBubbleH2(8).program(3, 3).placement() == (0, 1, 2)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 2), (4, 6), (8, 1)])
def test_rejects_fewer_microbatches_than_the_warm_up(num_stages: int, num_microbatches: int) -> None:
    need = 2 * num_stages - 1
    with pytest.raises(
        ScheduleError,
        match=rf"ZeroBubbleH2: the warm-up of {num_stages} stages runs 2p - 1 = {need} forwards .*"
        rf"\(num_microbatches: {num_microbatches}\)\. Use num_microbatches >= {need}, at most "
        rf"{(num_microbatches + 1) // 2} stages?, or ZeroBubbleH1",
    ):
        ZeroBubbleH2(num_microbatches).program(num_stages)


def test_rejects_other_rank_count() -> None:
    with pytest.raises(ScheduleError, match=r"ZeroBubbleH2: the schedule runs one stage per rank .*num_ranks: 2"):
        ZeroBubbleH2(8).program(4, 2)


def test_rejects_bad_microbatches() -> None:
    with pytest.raises(ScheduleError, match="ZeroBubbleH2: num_microbatches must be a positive int"):
        ZeroBubbleH2(0)
