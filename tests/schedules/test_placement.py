"""What every built-in schedule checks (fpipe/schedules/_placement.py): counts that are positive
ints, and the rank counts of the looped and the V placements, or an error naming both counts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fpipe.schedules import ScheduleError
from fpipe.schedules._placement import BuiltinSchedule, looped_ranks, v_ranks


@dataclass(frozen=True)
class Counted(BuiltinSchedule):
    stages_per_rank: int | None = None


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "2"])
def test_a_count_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(ScheduleError, match=r"fpipe\.schedules\.Counted: num_microbatches must be a positive int"):
        Counted(value)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"stages_per_rank must be a positive int"):
        Counted(2, stages_per_rank=value)  # type: ignore[arg-type]


def test_a_count_left_at_its_none_default_is_allowed() -> None:
    assert Counted(3).stages_per_rank is None
    assert Counted(3, stages_per_rank=2).stages_per_rank == 2


@pytest.mark.parametrize(
    ("num_stages", "num_ranks", "stages_per_rank", "ranks"),
    [(4, None, 1, 4), (8, None, 2, 4), (8, 2, 1, 2), (6, 3, 2, 3), (1, None, 1, 1)],
)
def test_looped_ranks(num_stages: int, num_ranks: int | None, stages_per_rank: int, ranks: int) -> None:
    assert looped_ranks("S", num_stages, num_ranks, stages_per_rank) == ranks


@pytest.mark.parametrize(
    ("num_stages", "num_ranks", "stages_per_rank", "fragment"),
    [
        (5, None, 2, "5 stages cannot be spread 2 per rank (stages_per_rank: 2)"),
        (6, 4, 1, "6 stages cannot be laid out on 4 ranks (num_stages: 6, num_ranks: 4)"),
        (0, None, 1, "0 stages cannot be laid out on 0 ranks"),
    ],
)
def test_looped_ranks_refusals(num_stages: int, num_ranks: int | None, stages_per_rank: int, fragment: str) -> None:
    with pytest.raises(ScheduleError) as raised:
        looped_ranks("S", num_stages, num_ranks, stages_per_rank)
    assert str(raised.value).startswith("fpipe.schedules.S: ") and fragment in str(raised.value)


def test_v_ranks() -> None:
    assert v_ranks("V", 4, None) == v_ranks("V", 4, 2) == 2
    with pytest.raises(ScheduleError, match=r"the stage count must be even \(num_stages: 3\)"):
        v_ranks("V", 3, None)
    with pytest.raises(ScheduleError, match=r"4 stages in a V need 2 ranks \(num_stages: 4, num_ranks: 3\)"):
        v_ranks("V", 4, 3)
