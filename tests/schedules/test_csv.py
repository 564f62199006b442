"""CSV in ``torch.distributed.pipelining``'s format: round trips, and CSVs that torch itself writes and reads.

The torch half drives torch's private ``_dump_csv``/``_load_csv`` on schedules built over stand-in
stages (only the attributes the schedule constructors read), as torch's own schedule tests do
with ``_PipelineScheduleRuntime``; no process group is needed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from fpipe.schedules import (
    GPipe,
    Interleaved1F1B,
    LoopedBFS,
    OneFOneB,
    Program,
    ScheduleError,
    ZeroBubbleH1,
    ZeroBubbleV,
    dump_csv,
    load_csv,
    validate,
)
from tests.helpers import torch_csv, torch_stages


def text_of(program: Program) -> str:
    out = io.StringIO(newline="")
    dump_csv(program, out)
    return out.getvalue()


def from_text(text: str, **kwargs: Any) -> Program:
    return load_csv(io.StringIO(text, newline=""), **kwargs)


def test_literal_csv() -> None:
    assert text_of(OneFOneB(2).program(2)) == "0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n"


PROGRAMS = [
    GPipe(3).program(2),
    OneFOneB(5).program(4),
    Interleaved1F1B(4, stages_per_rank=2).program(6),
    ZeroBubbleH1(6).program(3),
    ZeroBubbleV(5).program(6),
    LoopedBFS(3, stages_per_rank=3).program(6),
]


@pytest.mark.parametrize("program", PROGRAMS)
def test_round_trip_through_text(program: Program) -> None:
    assert from_text(text_of(program)) == program


@pytest.mark.parametrize("program", PROGRAMS)
def test_round_trip_through_a_file(program: Program, tmp_path: Path) -> None:
    path = tmp_path / "schedule.csv"
    dump_csv(program, path)
    assert load_csv(path) == program
    assert load_csv(str(path)) == program


def test_idle_cells_and_spaces_are_skipped() -> None:
    program = from_text("0F0, ,,0B0\r\n,1F0 ,1B0\r\n")
    assert program == Program.from_lists([["0F0", "0B0"], ["1F0", "1B0"]])


def test_sizes_can_be_given() -> None:
    program = from_text("0F0,0B0\r\n", num_stages=1, num_microbatches=3)
    assert (program.num_stages, program.num_microbatches) == (1, 3)
    with pytest.raises(ScheduleError, match="missing actions: 0F1"):
        validate(program)


def test_overlapped_pairs_run_in_order() -> None:
    program = from_text("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\r\n")
    assert [str(a) for a in program.ranks[0]] == ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]


def test_communication_is_rejected_or_skipped() -> None:
    text = "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\r\n1RECV_F0,1F0,1B0,1SEND_B0\r\n"
    with pytest.raises(ScheduleError, match=r"rank 0, column 0 holds the communication action '0UNSHARD'.*skip_comm"):
        from_text(text)
    assert from_text(text, skip_communication=True) == OneFOneB(1).program(2)


@pytest.mark.parametrize("cell", ["0WAIT_SEND_F0", "1WAIT_SEND_B2", "0WAIT_REDUCE_GRAD"])
def test_waits_are_communication(cell: str) -> None:
    # torch 2.15's lowered form closes each send and each gradient reduction with a wait.
    text = f"0F0,{cell},0B0\r\n"
    with pytest.raises(ScheduleError, match=rf"rank 0, column 1 holds the communication action '{cell}'"):
        from_text(text)
    assert from_text(text, skip_communication=True) == OneFOneB(1).program(1)


@pytest.mark.parametrize("cell", ["0X0", "F0", "0F", "0F0x", "(0F0;1X0)OVERLAP_F_B"])
def test_rejects_what_is_not_an_action(cell: str) -> None:
    with pytest.raises(ScheduleError, match=r"rank 1, column 1 holds '.*', which is not an action"):
        from_text(f"0F0,0B0\r\n1F0,{cell}\r\n")


# --- torch writes, fpipe reads; fpipe writes, torch reads --------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_torch_zbv_is_zero_bubble_v(p: int, tmp_path: Path) -> None:
    for m in range(1, 9):
        schedule = torch_schedules.ScheduleZBVZeroBubble(torch_stages(p, [0, 2 * p - 1], 2 * p), m)
        loaded = load_csv(torch_csv(tmp_path, schedule), num_stages=2 * p, num_microbatches=m)
        assert loaded == ZeroBubbleV(m).program(2 * p)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_torch_looped_bfs_is_looped_bfs(p: int, tmp_path: Path) -> None:
    for m in range(1, 7):
        schedule = torch_schedules.ScheduleLoopedBFS(torch_stages(p, [0, p], 2 * p), m)
        loaded = load_csv(torch_csv(tmp_path, schedule), num_stages=2 * p, num_microbatches=m)
        assert loaded == LoopedBFS(m, stages_per_rank=2).program(2 * p)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_torch_interleaved_zero_bubble_on_one_stage_per_rank_is_zb_h1(p: int, tmp_path: Path) -> None:
    for m in [*range(1, p + 1), 2 * p, 3 * p]:  # torch wants m a multiple of max(1, m // p)
        schedule = torch_schedules.ScheduleInterleavedZeroBubble(torch_stages(p, [0], p), m)
        loaded = load_csv(torch_csv(tmp_path, schedule), num_stages=p, num_microbatches=m)
        assert loaded == ZeroBubbleH1(m).program(p)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_torch_interleaved_1f1b_is_interleaved_1f1b(p: int, tmp_path: Path) -> None:
    # Equal when microbatches come in whole groups of p; otherwise torch groups them differently.
    for m in (p, 2 * p, 3 * p):
        schedule = torch_schedules.ScheduleInterleaved1F1B(torch_stages(p, [0, p], 2 * p), m)
        loaded = load_csv(torch_csv(tmp_path, schedule), num_stages=2 * p, num_microbatches=m)
        assert loaded == Interleaved1F1B(m, stages_per_rank=2).program(2 * p)


def test_torch_dual_pipe_v_loads_and_validates(tmp_path: Path) -> None:
    schedule = torch_schedules.ScheduleDualPipeV(torch_stages(2, [0, 3], 4), 6)
    program = load_csv(torch_csv(tmp_path, schedule))
    validate(program)
    assert program.placement() == (0, 1, 1, 0)
    assert {a.kind for row in program.ranks for a in row} == {"F", "B", "I", "W"}


@pytest.mark.parametrize(
    ("program", "stages"),
    [
        (ZeroBubbleH1(4).program(3), [0]),
        (ZeroBubbleV(5).program(6), [0, 5]),
        (LoopedBFS(3).program(4), [0, 2]),
        (OneFOneB(4).program(2), [0]),
    ],
)
def test_torch_reads_ours_and_lowers_it(program: Program, stages: list[int], tmp_path: Path) -> None:
    path = tmp_path / "ours.csv"
    dump_csv(program, path)
    p, m = program.num_ranks, program.num_microbatches
    runtime = torch_schedules._PipelineScheduleRuntime(torch_stages(p, stages, program.num_stages), m)
    runtime._load_csv(str(path), format="compute_only")  # validates, then adds sends and receives
    theirs = {r: [str(a) for a in row] for r, row in runtime.pipeline_order.items()}
    assert theirs == {r: [str(a) for a in row] for r, row in enumerate(program.ranks)}
    assert runtime.stage_index_to_group_rank == dict(enumerate(program.placement()))
    lowered = torch_csv(tmp_path, runtime, format="compute_comms")
    assert "SEND_F" in lowered.read_text()
    assert load_csv(lowered, skip_communication=True, num_stages=program.num_stages) == program
