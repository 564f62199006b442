"""DualPipeV: literal grids, V placement, validity over sizes, and equality with torch's own."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent
from typing import Any

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from fpipe.schedules import DualPipeV, ScheduleError, ZeroBubbleV, load_csv, placement, render, validate
from tests.helpers import torch_stages  # rank 0's stand-in PipelineStages


def test_grid_2_ranks_4_microbatches() -> None:
    # Step 4's overlapped pairs [F B] run as F then B: 0F3 3B1 and 3F2 0B0 on rank 0.
    assert render(DualPipeV(4).program(4)) == dedent("""\
        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
        rank 1 |  .  1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3""")


def test_grid_one_rank() -> None:
    assert render(DualPipeV(3).program(2)) == "rank 0 | 0F0 1F0 0F1 1B0 1F1 0B0 0F2 1B1 1F2 0B1 1B2 0I2 0W2"


def test_grid_fewer_microbatches_than_the_construction_needs() -> None:
    # Laid out for n = 2p = 4 microbatches; the actions of microbatches 2 and 3 are dropped.
    assert render(DualPipeV(2).program(4)) == dedent("""\
        rank 0 | 0F0 0F1  .  3F0 3I0 3W0 3F1 3B1 0B0  .  0B1
        rank 1 |  .  1F0 2F0 1F1 2F1 2B0 1B0  .  2B1 1B1  .""")


@pytest.mark.parametrize("num_ranks", range(1, 7))
def test_valid_over_sizes_with_v_placement(num_ranks: int) -> None:
    p = num_ranks
    for m in range(1, 25):
        program = DualPipeV(m).program(2 * p)
        validate(program)
        assert program.num_ranks == p
        assert program.placement() == tuple(range(p)) + tuple(reversed(range(p)))
        assert all(program.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))


@pytest.mark.parametrize("num_ranks", range(1, 7))
def test_split_backward_where_the_original_splits(num_ranks: int) -> None:
    # I/W in steps 3, 6 (second half) and 7; the overlapped steady state uses fused B.
    p = num_ranks
    program = DualPipeV(4 * p).program(2 * p)
    assert {a.kind for row in program.ranks for a in row} == {"F", "B", "I", "W"}
    for row in program.ranks:
        assert sum(a.kind == "I" for a in row) == sum(a.kind == "W" for a in row)


def test_placement_function() -> None:
    assert placement(DualPipeV(8), 8) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement(DualPipeV(8), 8) == placement(ZeroBubbleV(8), 8)


@pytest.mark.parametrize("num_stages", [1, 3, 5, 7])
def test_rejects_odd_stage_count(num_stages: int) -> None:
    with pytest.raises(ScheduleError, match=rf"DualPipeV: .*stage count must be even \(num_stages: {num_stages}\)"):
        DualPipeV(8).program(num_stages)


def test_rejects_other_rank_count() -> None:
    with pytest.raises(ScheduleError, match=r"8 stages in a V need 4 ranks \(num_stages: 8, num_ranks: 2\)"):
        DualPipeV(8).program(8, 2)


@pytest.mark.parametrize("num_microbatches", [0, -1, 2.0, True])
def test_rejects_bad_microbatches(num_microbatches: Any) -> None:
    with pytest.raises(ScheduleError, match="DualPipeV: num_microbatches must be a positive int"):
        DualPipeV(num_microbatches)


# --- torch writes, fpipe reads ------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 7))
def test_torch_dual_pipe_v_is_dual_pipe_v(p: int, tmp_path: Path) -> None:
    # Torch writes overlapped pairs as (F;B)OVERLAP_F_B cells, which load_csv runs F then B.
    path = tmp_path / "dualpipev.csv"
    for m in range(2 * p, 25):  # torch rejects m < 2p
        schedule = torch_schedules.ScheduleDualPipeV(torch_stages(p, [0, 2 * p - 1], 2 * p), m)
        schedule._dump_csv(str(path), format="compute_only")
        assert "OVERLAP_F_B" in path.read_text()
        assert load_csv(path, num_stages=2 * p, num_microbatches=m) == DualPipeV(m).program(2 * p)
