"""``Overlapped``: a schedule's adjacent forward and backward of a rank paired where no pair waits
on another's results (fpipe/schedules/_overlapped.py)."""

from __future__ import annotations

import pytest

from fpipe.schedules import DualPipeV, OneFOneB, Overlapped, Program, ZeroBubbleV, validate
from fpipe.schedules import _overlapped as overlapped
from fpipe.schedules._action import Action
from fpipe.schedules._overlapped import pair_adjacent
from fpipe.schedules._program import as_soon_as_possible, checksum
from fpipe.schedules._registry import BUILTINS, Builtin


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


class _Replaying:
    """``_Order``'s answer by the plain way: the whole program replayed with the pairs so far."""

    def __init__(self, program: Program, split: frozenset[tuple[int, int]]) -> None:
        self.program, self.pairs = program, set(program.pairs)

    def pair(self, first: Action, second: Action) -> bool:
        p = self.program
        trial = Program(p.ranks, p.num_stages, p.num_microbatches, frozenset(self.pairs | {(first, second)}))
        starts, _ = as_soon_as_possible(trial, lambda r, k, a: 1.0, lambda d: 0.0)
        if any(len(s) < len(row) for s, row in zip(starts, p.ranks)):
            return False
        self.pairs.add((first, second))
        return True


@pytest.mark.parametrize("builtin", BUILTINS, ids=lambda b: b.name)
def test_pairing_in_a_kept_order_pairs_as_replaying_the_program_does(
    builtin: Builtin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [pairs as contracted edges]: the same pairs as a replay per pair, in near-linear time.
    v = 2 if builtin.field else builtin.stages_per_rank
    sizes = [(p, m) for p, m in [(2, 3), (3, 5), (2, 4), (4, 8)] if builtin.allows(p, m)]
    programs = [builtin.build(m, v).program(p * v, p) for p, m in sizes]
    kept = [pair_adjacent(program).pairs for program in programs]
    monkeypatch.setattr(overlapped, "_Order", _Replaying)
    assert [pair_adjacent(program).pairs for program in programs] == kept
