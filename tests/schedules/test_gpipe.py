"""GPipe: the staircase, laid out literally, and validity over a range of sizes."""

from __future__ import annotations

from textwrap import dedent

import pytest

from fpipe.schedules import Action, GPipe, ScheduleError, render, validate


def test_grid_3_stages_4_microbatches() -> None:
    assert render(GPipe(4).program(3)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 0F3  .   .   .   .  0B0 0B1 0B2 0B3
        rank 1 |  .  1F0 1F1 1F2 1F3  .   .  1B0 1B1 1B2 1B3  .
        rank 2 |  .   .  2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3  .   .""")


def test_grid_one_stage() -> None:
    assert render(GPipe(3).program(1)) == "rank 0 | 0F0 0F1 0F2 0B0 0B1 0B2"


def test_every_forward_before_any_backward() -> None:
    for row in GPipe(5).program(3).ranks:
        assert [a.kind for a in row] == ["F"] * 5 + ["B"] * 5
        assert [a.microbatch for a in row] == [0, 1, 2, 3, 4] * 2


def test_program_fields() -> None:
    p = GPipe(2).program(3)
    assert (p.num_ranks, p.num_stages, p.num_microbatches) == (3, 3, 2)
    assert p.ranks[1] == (Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1))


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_valid_over_sizes(num_stages: int) -> None:
    for m in range(1, 17):
        p = GPipe(m).program(num_stages)
        validate(p)
        assert p.placement() == tuple(range(num_stages))
        # Makespan with unit cost: m forwards and m backwards, plus 2(p-1) ticks of fill and drain.
        assert len(render(p).splitlines()[0].split("|")[1].split()) == 2 * (m + num_stages - 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_rejects_bad_microbatches(bad: object) -> None:
    with pytest.raises(ScheduleError, match="GPipe: num_microbatches must be a positive int"):
        GPipe(bad)  # type: ignore[arg-type]


def test_is_a_frozen_value() -> None:
    assert GPipe(4) == GPipe(num_microbatches=4)
    assert hash(GPipe(4)) == hash(GPipe(4))
    with pytest.raises(AttributeError):
        GPipe(4).num_microbatches = 5  # type: ignore[misc]


def test_grid_on_fewer_ranks_than_stages_is_looped() -> None:
    assert render(GPipe(2).program(4, 2)) == dedent("""\
        rank 0 | 0F0 0F1 2F0 2F1  .   .  2B0 2B1 0B0 0B1
        rank 1 |  .  1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1  .""")


def test_rejects_stages_not_a_multiple_of_ranks() -> None:
    with pytest.raises(ScheduleError, match=r"GPipe: 5 stages cannot be laid out on 2 ranks"):
        GPipe(2).program(5, 2)
