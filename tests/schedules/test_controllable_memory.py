"""V-Half and V-Min: literal grids, the repository's order over sizes, their peaks of (p+2)//2 and
(p+4)//3, their bubble against 1F1B's, and what they reject."""

from __future__ import annotations

import zlib
from textwrap import dedent

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fpipe.schedules import Costs, OneFOneB, ScheduleError, VHalf, VMin, placement, render, simulate, validate
from fpipe.schedules._controllable_memory import _Walk

EQUAL = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)  # T_F = T_I = T_W, chunks half a stage


def test_v_half_grid_3_ranks_3_microbatches() -> None:
    # Rank r holds stages r and 5 - r; at most 4 chunk activations alive on a rank (2 microbatches'
    # worth, 1F1B's rank 0 holds 3), W in the slots the block leaves free.
    assert render(VHalf(3).program(6)) == dedent("""\
        rank 0 | 0F0 0F1 0F2  .   .  5F0 5I0 5W0 5F1 5I1 5W1  .  0I0 0W0  .  5F2 5I2 0I1 5W2 0W1  .  0I2 0W2
        rank 1 |  .  1F0 1F1  .  4F0  .  4F1 4I0 4W0 1F2 4I1 1I0 4W1 1W0 4F2  .  1I1 4I2 4W2 1W1 1I2 1W2  .
        rank 2 |  .   .  2F0 3F0 2F1 3F1  .   .  3I0 3W0 2I0 2W0 2F2 3F2 3I1 2I1 3W1 2W1 3I2 2I2 3W2 2W2  .""")


def test_v_min_grid_3_ranks_3_microbatches() -> None:
    # The same peak as V-Half on 3 ranks ((p+4)//3 = (p+2)//2 = 2), a different block: more idle slots.
    expected = dedent("""\
        rank 0 | 0F0 0F1 0F2  .   .  5F0 5I0 5W0 5F1 5I1 5W1 0I0 0W0  .   .   .   .  5F2 0I1 5I2 5W2 0W1  .   .  0I2 0W2
        rank 1 |  .  1F0 1F1  .  4F0  .  4F1 4I0 4W0  .  1I0 1W0 4I1 1F2 4W1  .  4F2 1I1 1W1  .  4I2 4W2  .  1I2 1W2  .
        rank 2 |  .   .  2F0 3F0 2F1 3F1  .   .  3I0 2I0 3W0 2W0  .  3I1 2F2 3F2 2I1 3W1 2W1  .   .  3I2 2I2 3W2 2W2  .""")  # noqa: E501
    assert render(VMin(3).program(6)) == expected


def test_grids_fewer_microbatches_than_ranks() -> None:
    assert render(VHalf(2).program(8)) == dedent("""\
        rank 0 | 0F0 0F1  .   .   .   .   .  7F0 7I0 7W0 7F1 7I1 7W1  .   .   .  0I0 0W0  .   .  0I1 0W1
        rank 1 |  .  1F0 1F1  .   .   .  6F0  .  6F1 6I0 6W0  .  6I1 6W1  .  1I0 1W0  .   .  1I1 1W1  .
        rank 2 |  .   .  2F0 2F1  .  5F0  .  5F1  .   .  5I0 5W0  .  5I1 2I0 5W1 2W0  .  2I1 2W1  .   .
        rank 3 |  .   .   .  3F0 4F0 3F1 4F1  .   .   .   .  4I0 4W0 3I0 3W0 4I1 4W1 3I1 3W1  .   .   .""")
    assert render(VMin(2).program(8)) == dedent("""\
        rank 0 | 0F0 0F1  .   .   .   .   .  7F0 7I0 7W0 7F1 7I1 7W1  .   .  0I0 0W0  .   .   .   .  0I1 0W1
        rank 1 |  .  1F0 1F1  .   .   .  6F0  .  6F1 6I0 6W0  .   .   .  1I0 6I1 6W1 1W0  .   .  1I1 1W1  .
        rank 2 |  .   .  2F0 2F1  .  5F0  .  5F1  .   .  5I0 5W0  .  2I0 2W0  .  5I1 5W1  .  2I1 2W1  .   .
        rank 3 |  .   .   .  3F0 4F0 3F1 4F1  .   .   .   .  4I0 3I0 4W0 3W0  .   .  4I1 3I1 4W1 3W1  .   .""")


# zlib.crc32 of "|".join(" ".join(rank's actions)) as the repository's generator orders them: its
# zbv_greedy.py (sail-sg/zero-bubble-pipeline-parallelism at 39f2c186, megatron imports stubbed),
# PipelineGraph(p, m, "half" or "min", 1000, 1000, 1000, 1).create_schedule(...), each node written
# <stage><F|I|W><microbatch> with stage its layer_group_idx, its B our I. Rows p = 1..6, columns m = 1..10.
REPOSITORY = {
    VHalf: [
        [3787422054, 3091425297, 2200754105, 405801715, 3069019680,
         3243269696, 3116409507, 177364255, 3196933618, 5521575],
        [3845916530, 2172126273, 1042760918, 2604165450, 186559172,
         2505435338, 369086806, 1265797497, 2846734439, 3270274550],
        [895165507, 2866746829, 4243822413, 3684634139, 250492818,
         2093978639, 2178501067, 1995018568, 2133081346, 1615309613],
        [1197573070, 4169539775, 2808662443, 3062235639, 1686876276,
         2532662020, 3075865174, 2264439722, 2953815616, 3203000893],
        [2277495520, 3734562501, 4033703736, 1398847730, 1008492768,
         2123924514, 1705567358, 3185605881, 726882744, 2219716866],
        [3776980507, 3169040996, 1712415564, 2847519993, 4229502320,
         417652619, 2313687518, 3276949696, 4283957598, 1248155269],
    ],
    VMin: [
        [2264760226, 3107622877, 4071495734, 420581968, 1456947523,
         3745211677, 4096447478, 3780010490, 131478484, 303476266],
        [1301129566, 1383981826, 4248566325, 1106698234, 1175292128,
         62159924, 2237949901, 129773653, 2489369832, 4107198054],
        [1377378951, 395857728, 1149317448, 537877242, 2758811624,
         1678554583, 1418495006, 2469775524, 594646571, 600995040],
        [2873522803, 2242111919, 3404896961, 1273997845, 546646318,
         1755722128, 1628354538, 3743696245, 1845301985, 1797518907],
        [3774731300, 812559074, 2211665117, 520715873, 1192348812,
         38650745, 2386633351, 3513531135, 711760083, 3018904390],
        [1234274359, 2964745492, 3156554629, 815096860, 3073089764,
         914130488, 196648330, 2217939308, 706445609, 3626528009],
    ],
}  # fmt: skip


@pytest.mark.parametrize("schedule", [VHalf, VMin], ids=lambda s: s.__name__)
def test_the_repository_order_for_every_size_up_to_6_ranks_10_microbatches(schedule: type[VHalf | VMin]) -> None:
    for p, row in enumerate(REPOSITORY[schedule], start=1):
        for m, expected in enumerate(row, start=1):
            program = schedule(m).program(2 * p)
            validate(program)
            text = "|".join(" ".join(map(str, actions)) for actions in program.ranks)
            assert zlib.crc32(text.encode()) == expected, f"{schedule.__name__}({m}) on {p} ranks"


# The same checksum of larger programs, as fpipe laid them out before its layout walked only the
# slots a move changes (NOTE [controllable-memory building blocks]): (p, m): (VHalf, VMin).
LARGER = {
    (7, 5): (1712242785, 2852232420), (7, 13): (1186627235, 2179489063), (7, 22): (1845498341, 4273922835),
    (8, 5): (2676078324, 3003316329), (8, 15): (305529744, 2180940441), (8, 25): (2370794364, 2093560894),
    (8, 64): (4149224553, 1166322579), (9, 5): (2335613308, 4231003875), (9, 17): (1297347864, 4263298455),
    (9, 28): (2710801268, 2580813992), (16, 49): (1871660567, 2593991471), (32, 63): (108399400, 1282960203),
    (32, 256): (1959071694, 3717565576),
}  # fmt: skip


@pytest.mark.parametrize(("p", "m"), LARGER)
def test_the_same_order_as_before_at_larger_sizes(p: int, m: int) -> None:
    for schedule, expected in zip((VHalf, VMin), LARGER[p, m]):
        program = schedule(m).program(2 * p)
        text = "|".join(" ".join(map(str, actions)) for actions in program.ranks)
        assert zlib.crc32(text.encode()) == expected, f"{schedule.__name__}({m}) on {p} ranks"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_walk_moves_an_action_as_a_recount_would(data: st.DataObject) -> None:
    # The squeeze's incremental count (NOTE [controllable-memory building blocks]): after each move
    # tried, the same answer and the same state as counting the moved rank afresh, with W slots
    # (5 types) or without (4: free slots run pending Ws).
    types = data.draw(st.sampled_from([4, 5]))
    slots = data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=24, unique=True))
    kinds = data.draw(st.lists(st.integers(0, types - 1), min_size=len(slots), max_size=len(slots)))
    rank = [sorted(s for s, k in zip(slots, kinds) if k == t) for t in range(types)]
    walk = _Walk(rank)
    limit = walk.peak() + data.draw(st.integers(0, 1))
    for _ in range(data.draw(st.integers(1, 16))):
        t = data.draw(st.sampled_from([t for t in range(types) if rank[t]]))
        time = data.draw(st.sampled_from(rank[t]))
        free = [s for s in range(time) if all(s not in times for times in rank)]
        if not free:
            continue
        to = data.draw(st.sampled_from(free))
        moved = [sorted(to if (u, s) == (t, time) else s for s in times) for u, times in enumerate(rank)]
        fits = _Walk(moved).peak() <= limit
        assert walk.move(time, t, to, limit) == fits
        rank = moved if fits else rank
        fresh = _Walk(rank)
        assert (walk.events, walk.states) == (fresh.events, fresh.states)


@pytest.mark.parametrize(
    ("schedule", "peak"),
    [(VHalf, lambda p: (p + 2) // 2), (VMin, lambda p: (p + 4) // 3)],
    ids=["VHalf", "VMin"],
)
def test_peak_activations_half_and_a_third_of_1f1b(schedule: type[VHalf | VMin], peak: object) -> None:
    # In microbatches of a rank's layers (each chunk 1/2): 1F1B's rank 0 holds p. The repository's
    # figures hold for every m (fewer microbatches: all of them), whatever the costs (an order's peak
    # does not depend on them).
    assert callable(peak)
    for p in range(1, 9):
        for m in sorted({1, max(1, p - 1), p, p + 1, 2 * p + 1, 3 * p}):
            program = schedule(m).program(2 * p)
            assert max(simulate(program).peak_activations) == min(m, peak(p)), f"{schedule.__name__}({m}), p = {p}"


@pytest.mark.parametrize("num_ranks", range(2, 9))
def test_bubble_at_equal_costs(num_ranks: int) -> None:
    # T_F = T_I = T_W (1F1B: T_B = 2 T_F, the same work: 3m per rank). The repository's table gives
    # B/2 for V-Half and 2B/3 for V-Min, B = 1F1B's (p-1)/(m+p-1), idle 3(p-1) per rank. From m = 2p
    # on every rank idles a fixed time (below 0.6 B and 0.75 B), and for fewer still less than B.
    p = num_ranks
    idle = {
        VHalf: 3 * ((p - 1) // 2) - 0.5 if p > 2 else 0.5,
        VMin: 2 * (p - 1) - 0.5 - (p % 3 == 0),
    }
    for m in (p, 2 * p, 2 * p + 1, 3 * p + 2):
        one_f_one_b = (p - 1) / (m + p - 1)
        assert simulate(OneFOneB(m).program(p), Costs(forward=1, backward=2)).bubble_fraction == pytest.approx(
            one_f_one_b
        )
        for schedule in (VHalf, VMin):
            sim = simulate(schedule(m).program(2 * p), EQUAL)
            assert sim.bubble_fraction < 0.8 * one_f_one_b
            if m >= 2 * p:
                assert {sim.makespan - busy for busy in sim.busy} == {idle[schedule]}
                assert sim.bubble_fraction == pytest.approx(idle[schedule] / (3 * m + idle[schedule]))
                assert sim.bubble_fraction < (0.6 if schedule is VHalf else 0.75) * one_f_one_b


def test_unequal_costs_cost_v_min_most() -> None:
    # The order is built for T_F = T_I = T_W; with T_I = 2 T_F (1F1B: 0.18) V-Min loses most (0.39), V-Half
    # a little (0.20).
    p, m = 8, 32
    one_f_one_b = simulate(OneFOneB(m).program(p), Costs(forward=1, backward=3)).bubble_fraction
    slow_i = Costs(forward=0.5, backward_input=1, backward_weight=0.5)
    half = simulate(VHalf(m).program(2 * p), slow_i).bubble_fraction
    least = simulate(VMin(m).program(2 * p), slow_i).bubble_fraction
    assert one_f_one_b < half < 0.25 < 0.35 < least


def test_placement() -> None:
    assert placement(VHalf(4), 6) == (0, 1, 2, 2, 1, 0)
    assert placement(VMin(4), 8, 4) == (0, 1, 2, 3, 3, 2, 1, 0)


@pytest.mark.parametrize("schedule", [VHalf, VMin], ids=lambda s: s.__name__)
def test_rejects_odd_stage_count(schedule: type[VHalf | VMin]) -> None:
    with pytest.raises(
        ScheduleError,
        match=rf"{schedule.__name__}: the V places two stages on each rank, so the stage count must be even "
        r"\(num_stages: 5\)\. Split the model into 2 x \(number of ranks\) stages",
    ):
        schedule(4).program(5)


@pytest.mark.parametrize("schedule", [VHalf, VMin], ids=lambda s: s.__name__)
def test_rejects_other_than_2_stages_per_rank(schedule: type[VHalf | VMin]) -> None:
    with pytest.raises(
        ScheduleError,
        match=rf"{schedule.__name__}: 6 stages in a V need 3 ranks \(num_stages: 6, num_ranks: 2\)\. "
        r"Use 2 x 2 = 4 stages",
    ):
        schedule(4).program(6, 2)


@pytest.mark.parametrize("schedule", [VHalf, VMin], ids=lambda s: s.__name__)
def test_rejects_bad_microbatches(schedule: type[VHalf | VMin]) -> None:
    with pytest.raises(ScheduleError, match=rf"{schedule.__name__}: num_microbatches must be a positive int"):
        schedule(0)
