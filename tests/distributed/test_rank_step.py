"""One step as one rank of many (fpipe/_distributed/_rank_step.py), the parts a test can call in one
process: which stages' parameters a rank must hold (whole distributed steps:
tests/test_distributed.py, tests/distributed/test_faults.py; a recorded timeline made of every
rank's own row: tests/distributed/test_transport.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fpipe._distributed import _rank_step


def test_a_rank_holds_exactly_its_stages_parameters() -> None:
    spec: Any = SimpleNamespace(num_stages=3, local_stages=(1,), rank=1)
    _rank_step._check_held(spec, [None, {"w": torch.ones(1)}, None], (0, 1, 2))
    with pytest.raises(ValueError, match=r"rank 1 holds stage 1 but params\[1\] is None"):
        _rank_step._check_held(spec, [None, None, None], (0, 1, 2))
    with pytest.raises(ValueError, match=r"params\[2\] is given on rank 1, but stage 2 lives on rank 2"):
        _rank_step._check_held(spec, [None, {"w": torch.ones(1)}, {"w": torch.ones(1)}], (0, 1, 2))
