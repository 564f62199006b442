"""Programs: construction, placement, and every way ``validate`` rejects one."""

from __future__ import annotations

from collections.abc import Sequence
from textwrap import dedent

import pytest

from fpipe.schedules import Action, OneFOneB, Program, ScheduleError, execution_order, render, ticks_of, validate


def program(*ranks: Sequence[str], num_microbatches: int | None = None) -> Program:
    return Program.from_lists(ranks, num_microbatches=num_microbatches)


def test_from_lists_infers_sizes_and_parses_strings() -> None:
    p = program(["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"])
    assert (p.num_ranks, p.num_stages, p.num_microbatches) == (2, 2, 2)
    assert p.ranks[1][2] == Action(1, "B", 0)


def test_from_lists_rejects_a_flat_list() -> None:
    with pytest.raises(ScheduleError, match="one list of actions per rank"):
        Program.from_lists(["0F0", "0B0"])


def test_placement_and_stages_of() -> None:
    p = program(["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"])
    validate(p)
    assert p.placement() == (0, 1, 1, 0)
    assert p.stages_of(0) == (0, 3)
    assert p.stages_of(1) == (1, 2)


def test_str_is_the_grid() -> None:
    p = OneFOneB(2).program(2)
    assert str(p) == render(p)


def test_ticks_and_execution_order() -> None:
    p = program(["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"])
    assert ticks_of(p) == [[0, 1, 3, 5], [1, 2, 3, 4]]
    assert [f"{r}:{a}" for r, a in execution_order(p)] == [
        "0:0F0", "0:0F1", "1:1F0", "1:1B0", "0:0B0", "1:1F1", "1:1B1", "0:0B1",
    ]  # fmt: skip


def test_render_split_backward() -> None:
    p = program(["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"])
    assert render(p) == dedent("""\
        rank 0 | 0F0  .   .  0I0 0W0
        rank 1 |  .  1F0 1I0 1W0  .""")


def test_validate_accepts_split_backward() -> None:
    validate(program(["0F0", "0F1", "0I0", "0I1", "0W1", "0W0"], ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]))


def test_rejects_empty() -> None:
    with pytest.raises(ScheduleError, match="needs at least one rank, stage and microbatch"):
        validate(Program((), 0, 0))


def test_rejects_missing_action() -> None:
    with pytest.raises(ScheduleError, match="missing actions: 1B0"):
        validate(program(["0F0", "0B0"], ["1F0"]))


def test_rejects_missing_microbatch() -> None:
    with pytest.raises(ScheduleError, match="missing actions: 0F1, 0B1, 1F1, 1B1"):
        validate(program(["0F0", "0B0"], ["1F0", "1B0"], num_microbatches=2))


def test_rejects_i_without_w() -> None:
    with pytest.raises(ScheduleError, match="missing actions: 0W0"):
        validate(program(["0F0", "0I0"]))


def test_rejects_w_without_i() -> None:
    with pytest.raises(ScheduleError, match=r"missing actions: 0I0\. "):  # once
        validate(program(["0F0", "0W0"]))


def test_rejects_duplicated_action() -> None:
    with pytest.raises(ScheduleError, match=r"action 0F0 appears twice \(rank 0 position 0, rank 0 position 1\)"):
        validate(program(["0F0", "0F0", "0B0"]))


def test_rejects_a_stage_and_microbatch_on_two_ranks() -> None:
    with pytest.raises(ScheduleError, match=r"stage 0 runs microbatch 0 on rank 0 and on rank 1 \(action 0B0\)"):
        validate(program(["0F0"], ["0B0"]))


def test_a_stage_on_two_ranks_each_with_its_own_microbatches() -> None:
    """NOTE [a stage on several ranks]: DualPipe's placement, p = 2, m = 2."""
    dual = program(["0F0", "1F1", "1B1", "0B0"], ["1F0", "0F1", "1B0", "0B1"])
    validate(dual)
    assert dual.holders(0) == (0, 1) and dual.holders(1) == (1, 0)
    assert [dual.rank_of(s, i) for s in range(2) for i in range(2)] == [0, 1, 1, 0]
    assert dual.placement() == (0, 1) and dual.shared()
    assert not program(["0F0", "0B0"], ["1F0", "1B0"]).shared()


def test_rejects_out_of_range() -> None:
    p = Program((tuple(Action.parse(a) for a in ["0F0", "1F0", "1B0", "0B0"]),), 1, 1)
    with pytest.raises(ScheduleError, match=r"action 1F0 \(rank 0, position 1\) is out of range: stages are 0..0"):
        validate(p)


def test_rejects_unknown_kind() -> None:
    with pytest.raises(ScheduleError, match=r"out of range.*kinds F/B/I/W"):
        validate(Program(((Action(0, "F", 0), Action(0, "X", 0)),), 1, 1))


def test_rejects_fused_and_split_backward() -> None:
    with pytest.raises(ScheduleError, match=r"stage 0 microbatch 0 has both a fused backward \(0B0\) and a split one"):
        validate(program(["0F0", "0B0", "0I0", "0W0"]))


def test_rejects_backward_before_its_forward() -> None:
    with pytest.raises(ScheduleError, match=r"on rank 1, 1B0 \(position 0\) comes before 1F0 that it needs"):
        validate(program(["0F0", "0B0"], ["1B0", "1F0"]))


def test_rejects_weight_grad_before_input_grad() -> None:
    with pytest.raises(ScheduleError, match=r"on rank 0, 0W0 \(position 1\) comes before 0I0"):
        validate(program(["0F0", "0W0", "0I0"]))


def test_rejects_deadlock_with_grid() -> None:
    # Rank 0 wants 1B0 before it sends 0F1; rank 1 wants 0F1 before it runs 1B0.
    with pytest.raises(ScheduleError) as info:
        validate(program(["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]))
    message, grid = str(info.value).split("\n", 1)
    assert "deadlocks after 2 ticks: rank 0 waits at 0B0 for 1B0; rank 1 waits at 1F1 for 0F1." in message
    assert grid == dedent("""\
        rank 0 | 0F0  .  >0B0<
        rank 1 |  .  1F0 >1F1<""")


def test_rejects_cross_rank_cycle_on_three_ranks() -> None:
    # 0 -> 1 -> 2 -> 0: each rank waits for the next one's backward before forwarding microbatch 1.
    with pytest.raises(ScheduleError, match=r"deadlocks after \d+ ticks.*\n.*>0B0<"):
        validate(
            program(
                ["0F0", "0B0", "0F1", "0B1"],
                ["1F0", "1F1", "1B0", "1B1"],
                ["2F0", "2F1", "2B0", "2B1"],
            )
        )


def test_duplicate_action_is_marked_in_the_grid() -> None:
    with pytest.raises(ScheduleError) as info:
        validate(program(["0F0", "0B0", "0F0"], ["1F0", "1B0"]))
    message, grid = str(info.value).split("\n", 1)
    assert "action 0F0 appears twice (rank 0 position 0, rank 0 position 2)" in message
    assert grid == dedent("""\
        rank 0 | >0F0<  0B0  >0F0<
        rank 1 |  1F0   1B0    .""")


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        ([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], None),  # no pairs: fine
        ([["0F0", "0F1&0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], None),
        ([["0F0", "0F1&0B1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], "would deadlock"),  # 0B1 needs 0F1
        ([["0F0", "0F1&0B0", "0B1"], ["1F0", "1B0&1F1", "1B1"]], "deadlocks"),  # each waits on the other
        (
            [["0F0", "0F1&0F2", "0B0", "0B1", "0B2"], ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]],
            "forward and a backward",
        ),
    ],
)
def test_pairs_validate(rows, fragment):
    program = Program.from_lists(rows)
    if fragment is None:
        validate(program)
    else:
        with pytest.raises(ScheduleError, match=fragment):
            validate(program)


def test_a_pair_across_ranks_or_apart_is_refused():
    rows = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    base = Program.from_lists(rows)
    a = lambda text: Action.parse(text)  # noqa: E731
    for pairs, fragment in (({(a("0F1"), a("1B0"))}, "on two ranks"), ({(a("0F0"), a("0B0"))}, "not adjacent")):
        program = Program(base.ranks, base.num_stages, base.num_microbatches, frozenset(pairs))
        with pytest.raises(ScheduleError, match=fragment):
            validate(program)
