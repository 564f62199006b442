"""One step as one rank of many (fpipe/_distributed/_rank_step.py), the parts a test can call in one
process: which stages' parameters a rank must hold, and a recorded timeline made of every rank's
own row (whole distributed steps: tests/test_distributed.py, tests/test_faults.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fpipe._distributed import _rank_step
from fpipe.schedules import GPipe, simulate


def test_a_rank_holds_exactly_its_stages_parameters() -> None:
    spec: Any = SimpleNamespace(num_stages=3, local_stages=(1,), rank=1)
    _rank_step._check_held(spec, [None, {"w": torch.ones(1)}, None], (0, 1, 2))
    with pytest.raises(ValueError, match=r"rank 1 holds stage 1 but params\[1\] is None"):
        _rank_step._check_held(spec, [None, None, None], (0, 1, 2))
    with pytest.raises(ValueError, match=r"params\[2\] is given on rank 1, but stage 2 lives on rank 2"):
        _rank_step._check_held(spec, [None, {"w": torch.ones(1)}, {"w": torch.ones(1)}], (0, 1, 2))


def test_a_recorded_timeline_gathers_each_ranks_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    program = GPipe(2).program(2)
    mine = simulate(program)  # rank 1 measured its own row; rank 0's row here is not its measure
    theirs = [{"starts": [10.0, 11.0, 12.0, 13.0], "ends": [10.5, 11.5, 12.5, 13.5]}, None]
    calls = []

    def all_gather_json(topology: Any, group: Any, value: Any, timeout: float, what: str) -> list[Any]:
        calls.append((group, timeout, what))
        return [theirs[0], {"starts": list(value["starts"]), "ends": list(value["ends"])}]  # as JSON by name

    monkeypatch.setattr(_rank_step, "all_gather_json", all_gather_json)
    topology: Any = SimpleNamespace(rank=1, group="pp")
    timeline = _rank_step.gathered(mine, topology, 7.0)
    assert calls == [("pp", 7.0, "the other ranks' recorded timelines")]
    assert timeline.starts == ((10.0, 11.0, 12.0, 13.0), mine.starts[1])
    assert timeline.ends == ((10.5, 11.5, 12.5, 13.5), mine.ends[1])
    assert timeline.program is program and timeline.costs is None
