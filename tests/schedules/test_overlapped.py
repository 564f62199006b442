"""``Overlapped``: a schedule's adjacent forward and backward of a rank paired where no pair waits
on another's results (fpipe/schedules/_overlapped.py)."""

from __future__ import annotations

import pytest

from fpipe.schedules import DualPipeV, OneFOneB, Overlapped, Program, ZeroBubbleV, validate
from fpipe.schedules._program import checksum


def test_combined_1f1b_pairs_the_steady_state():
    program = Overlapped(OneFOneB(num_microbatches=4)).program(2)
    assert str(program) == "\n".join(
        [
            "rank 0 | 0F0  .   .  0F1 0B0  .   .  0F2 0B1  .   .  0F3 0B2  .   .  0B3",
            "rank 1 |  .  1F0 1B0  .   .  1F1 1B1  .   .  1F2 1B2  .   .  1F3 1B3  .",
            "pairs  | 0F1&0B0 0F2&0B1 0F3&0B2",
        ]
    )
    assert program.ranks == OneFOneB(num_microbatches=4).program(2).ranks  # the order is the schedule's


@pytest.mark.parametrize("schedule", [OneFOneB(8), DualPipeV(8), ZeroBubbleV(8)], ids=str)
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_every_pair_is_a_forward_and_a_backward_of_one_rank_and_the_program_replays(schedule, num_ranks):
    stages = num_ranks * (1 if isinstance(schedule, OneFOneB) else 2)
    program = Overlapped(schedule).program(stages, num_ranks)
    validate(program)  # pairs and replay
    assert program.pairs
    for first, second in program.pairs:
        assert {first.kind, second.kind} & {"B", "I"} and "F" in {first.kind, second.kind}
        assert first.microbatch != second.microbatch or first.stage != second.stage
    assert checksum(program) != checksum(schedule.program(stages, num_ranks))  # ranks must agree on pairs


def test_pairs_are_written_with_an_ampersand():
    program = Program.from_lists([["0F0", "0F1", "0F2&0B0", "0B1", "0B2"], ["1F0", "1B0", "1F1&1B1"]])
    assert set(map(str, (a for pair in sorted(program.pairs) for a in pair))) == {"0F2", "0B0", "1F1", "1B1"}
