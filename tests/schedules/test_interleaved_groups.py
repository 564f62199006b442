"""Interleaved 1F1B with Megatron-Core's microbatch groups (``microbatch_group``): literal grids,
literal orders from Megatron-Core's algorithm, equality with it over its unit tests' sizes, validity.

Megatron-Core builds the order in ``megatron/core/pipeline_parallel/schedules.py``
(``get_pp_rank_microbatches``, ``get_schedule_table``) and writes it as in
``megatron/core/transformer/cuda_graphs.py`` (``convert_schedule_table_to_order``): one signed
chunk number per action, ``+c`` the forward of chunk ``c - 1`` and ``-c`` the backward of chunk
``c - 1``. Its unit test ``tests/unit_tests/pipeline_parallel/test_schedules.py``
(``test_get_pipeline_parallel_order``) runs ``(pp, g)`` in ``(2, 2), (2, 4), (4, 4), (4, 5), (8, 9),
(8, 11)`` with ``m`` in ``8, 32`` and ``vp`` in ``2, 4, 8``.
"""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Action, Interleaved1F1B, Program, ScheduleError, render, validate


def megatron_order(row: tuple[Action, ...], num_ranks: int) -> list[int]:
    """A rank's actions in ``convert_schedule_table_to_order``'s notation: ``+c``/``-c`` for chunk ``c - 1``."""
    return [(a.stage // num_ranks + 1) * (1 if a.kind == "F" else -1) for a in row]


def megatron_reference(pp: int, rank: int, vp: int, m: int, g: int) -> tuple[list[int], list[int]]:
    """Megatron-Core's order for one rank, transliterated: its chunk order and its forwards' microbatches."""
    # get_schedule_table
    schedule_table = []
    for lo in range(0, m, g):
        hi = m if lo + g >= m else lo + g
        schedule_table += [(i, c) for c in range(vp) for i in range(lo, hi)]
    # get_pp_rank_microbatches (interleaved branch)
    total = m * vp
    warmup = min((pp - rank - 1) * 2 + (vp - 1) * g, total)
    # convert_schedule_table_to_order
    chunks = [c for _, c in schedule_table]
    forward_order = [c + 1 for c in chunks]
    backward_order = [c - vp for c in chunks]
    order = forward_order[:warmup]
    for k in range(warmup, len(forward_order)):
        order += [forward_order[k], backward_order[k - warmup]]
    if warmup > 0:
        order += backward_order[-warmup:]
    return order, [i for i, _ in schedule_table]


def test_grid_2_ranks_groups_of_3() -> None:
    # Three microbatches go through each of a rank's stages before it moves to the next.
    expected = """\
        rank 0 | 0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 0F5 0B0 2F3 0B1 2F4 0B2 2F5 2B3  .  2B4  .  2B5 0B3 0B4 0B5
        rank 1 |  .  1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 1F5 1B2 3F3 3B3 3F4 3B4 3F5 3B5 1B3 1B4 1B5  ."""  # noqa: E501
    assert render(Interleaved1F1B(6, stages_per_rank=2, microbatch_group=3).program(4)) == dedent(expected)


def test_grid_last_group_smaller() -> None:
    # Groups [0, 1, 2] and [3, 4]: the last takes what is left, as in get_schedule_table.
    assert render(Interleaved1F1B(5, stages_per_rank=2, microbatch_group=3).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1  .  0B2  .  2B3 2B4 0B3 0B4
        rank 1 |  .  1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4  .""")


def test_literal_megatron_order_pp4_vp2_m8_g5() -> None:
    # Megatron-Core's convert_schedule_table_to_order for pp=4, vp=2, 8 microbatches, groups of 5
    # (groups [0..4] and [5..7]), rank by rank: warm-ups of 2(pp - rank - 1) + (vp - 1) * 5.
    expected = {
        0: "+1 +1 +1 +1 +1 +2 +2 +2 +2 +2 +1 +1 -2 +1 -2 +2 -2 +2 -2 +2 -2 -1 -1 -1 -1 -1 -2 -2 -2 -1 -1 -1",
        1: "+1 +1 +1 +1 +1 +2 +2 +2 +2 +2 -2 +1 -2 +1 -2 +1 -2 +2 -2 +2 -1 +2 -1 -1 -1 -1 -2 -2 -2 -1 -1 -1",
        2: "+1 +1 +1 +1 +1 +2 +2 +2 -2 +2 -2 +2 -2 +1 -2 +1 -2 +1 -1 +2 -1 +2 -1 +2 -1 -1 -2 -2 -2 -1 -1 -1",
        3: "+1 +1 +1 +1 +1 +2 -2 +2 -2 +2 -2 +2 -2 +2 -2 +1 -1 +1 -1 +1 -1 +2 -1 +2 -1 +2 -2 -2 -2 -1 -1 -1",
    }
    program = Interleaved1F1B(8, stages_per_rank=2, microbatch_group=5).program(8)
    for r, row in enumerate(program.ranks):
        assert " ".join(f"{o:+d}" for o in megatron_order(row, 4)) == expected[r]
        forwards = [a.microbatch for a in row if a.kind == "F"]
        assert forwards == [0, 1, 2, 3, 4] * 2 + [5, 6, 7] * 2


def test_literal_megatron_order_pp8_vp2_m8_g9() -> None:
    # A group larger than m: one group of all 8 microbatches; the warm-up (2(pp - rank - 1) + 9)
    # covers every forward on ranks 0-4.
    program = Interleaved1F1B(8, stages_per_rank=2, microbatch_group=9).program(16)
    all_forwards_first = "+1 " * 8 + "+2 " * 8 + "-2 " * 8 + "-1 " * 7 + "-1"
    for r in range(5):
        assert " ".join(f"{o:+d}" for o in megatron_order(program.ranks[r], 8)) == all_forwards_first
    expected_rank_7 = "+1 " * 8 + "+2 +2 " + "-2 +2 " * 6 + "-2 -2 " + "-1 " * 7 + "-1"
    assert " ".join(f"{o:+d}" for o in megatron_order(program.ranks[7], 8)) == expected_rank_7


@pytest.mark.parametrize(("pp", "g"), [(2, 2), (2, 4), (4, 4), (4, 5), (8, 9), (8, 11)])
@pytest.mark.parametrize("m", [8, 32])
@pytest.mark.parametrize("vp", [2, 4, 8])
def test_megatron_unit_test_sizes(pp: int, g: int, m: int, vp: int) -> None:
    program = Interleaved1F1B(m, stages_per_rank=vp, microbatch_group=g).program(pp * vp)
    for r, row in enumerate(program.ranks):
        order, microbatches = megatron_reference(pp, r, vp, m, g)
        assert megatron_order(row, pp) == order
        assert [a.microbatch for a in row if a.kind == "F"] == microbatches
        assert all(a.stage % pp == r for a in row)
    validate(program)


def test_default_group_is_the_number_of_ranks() -> None:
    for p, v in [(1, 2), (2, 2), (3, 2), (4, 3)]:
        for m in range(1, 13):
            default = Interleaved1F1B(m, stages_per_rank=v).program(p * v)
            assert Interleaved1F1B(m, stages_per_rank=v, microbatch_group=p).program(p * v) == default


def megatron_program(pp: int, vp: int, m: int, g: int) -> Program:
    """Megatron-Core's order as a program: chunk ``c`` of rank ``r`` is stage ``c * pp + r``."""
    ranks = []
    for r in range(pp):
        order, microbatches = megatron_reference(pp, r, vp, m, g)
        table = list(zip(microbatches, [o - 1 for o in order if o > 0]))
        forwards, backwards = iter(table), iter(table)
        row = []
        for o in order:
            i, c = next(forwards) if o > 0 else next(backwards)
            row.append(Action(c * pp + r, "F", i) if o > 0 else Action((vp - 1 - c) * pp + r, "B", i))
        ranks.append(row)
    return Program.from_lists(ranks, num_stages=pp * vp, num_microbatches=m)


def test_megatron_program_is_megatrons_order() -> None:
    assert megatron_program(4, 2, 8, 5) == Interleaved1F1B(8, stages_per_rank=2, microbatch_group=5).program(8)


def test_last_group_padded_where_megatrons_order_would_deadlock() -> None:
    # 6 ranks, groups of 7, 9 microbatches: Megatron-Core's last group [7, 8] deadlocks (its
    # runtime rejects any last group smaller than pp), so it is laid out as [7..12] and
    # microbatches 9-12 are dropped.
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(megatron_program(6, 2, 9, 7))
    program = Interleaved1F1B(9, stages_per_rank=2, microbatch_group=7).program(12)
    validate(program)
    padded = megatron_program(6, 2, 13, 7)
    assert program.ranks == tuple(tuple(a for a in row if a.microbatch < 9) for row in padded.ranks)


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 5])
def test_valid_over_groups_and_sizes(num_ranks: int) -> None:
    p = num_ranks
    for v in (2, 3):
        for g in range(p, p + 4):
            for m in range(1, 3 * g + 2):
                program = Interleaved1F1B(m, stages_per_rank=v, microbatch_group=g).program(p * v)
                validate(program)
                assert program.placement() == tuple(s % p for s in range(p * v))


def test_rejects_group_smaller_than_ranks() -> None:
    match = r"Interleaved1F1B: .*\(microbatch_group: 3, num_ranks: 4\)\. Use microbatch_group >= 4"
    with pytest.raises(ScheduleError, match=match):
        Interleaved1F1B(8, stages_per_rank=2, microbatch_group=3).program(8)


@pytest.mark.parametrize("bad", [0, -2, 4.0, True])
def test_rejects_bad_group(bad: object) -> None:
    with pytest.raises(ScheduleError, match="Interleaved1F1B: microbatch_group must be a positive int"):
        Interleaved1F1B(8, microbatch_group=bad)  # type: ignore[arg-type]
