"""Per-stage costs on disk: a round trip (also the module's doctest) and files that are not costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fpipe.planning import load_costs, save_costs
from fpipe.schedules import Costs, ScheduleError


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    costs = (Costs(forward=0.5, backward_input=0.25, backward_weight=0.125, backward=0.375, send=1e-3), Costs())
    save_costs(tmp_path / "c.json", costs)
    assert load_costs(tmp_path / "c.json") == costs


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[1, 2", "is not JSON"),
        ("[1, 2]", "holds no fpipe.costs version 1 costs"),
        ('{"format": "fpipe.costs", "version": 2, "stages": [{"forward": 1}]}', "holds no fpipe.costs version 1"),
        ('{"format": "fpipe.costs", "version": 1, "stages": []}', "a non-empty list under 'stages'"),
        ('{"format": "fpipe.costs", "version": 1, "stages": [{"forwards": 1}]}', "stage 0 of .* is not a Costs"),
        ('{"format": "fpipe.costs", "version": 1, "stages": [{"forward": NaN}]}', "forward must be a finite positive"),
    ],
)
def test_files_that_are_not_costs(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(ScheduleError, match=fragment):
        load_costs(tmp_path / "c.json")


def test_save_takes_a_sequence_of_costs(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="costs must be a sequence of one Costs per stage"):
        save_costs(tmp_path / "c.json", Costs())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="costs must be a sequence of one Costs per stage"):
        save_costs(tmp_path / "c.json", iter([Costs()]))  # type: ignore[arg-type]  # would be used up by the check
    with pytest.raises(ValueError, match=r"costs is empty"):
        save_costs(tmp_path / "c.json", [])
    assert not (tmp_path / "c.json").exists()  # nothing written that load_costs would refuse
