"""``Overlapped(schedule)``: a schedule's adjacent forward and backward run as overlapped pairs.

DualPipe (arXiv:2412.19437, section 3.2.1) runs a forward chunk and a backward chunk of two
microbatches together on a rank so that each one's all-to-all hides behind the other's compute;
Megatron-Core's Combined 1F1B does the same in 1F1B's steady state, where every rank alternates
``F(i + w)`` and ``B(i)``. Here a pair is data (``Program.pairs``) and the runtime interleaves its
halves at their stages' communication points (NOTE [overlapped pairs] in fpipe/_pairs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, BACKWARD_INPUT, FORWARD, Action
from ._program import Program, Schedule, as_soon_as_possible, dependencies, split_backwards, validate


@dataclass(frozen=True)
class Overlapped:
    """``schedule`` with each rank's adjacent forward and backward (``B`` or ``I``) paired.

    Walking each rank's row from the start, two adjacent actions become a pair when one is a
    forward and the other a backward of another microbatch (or stage) that does not need it, and
    the program with that pair still replays without a deadlock (``pair_adjacent``). The order
    of actions is the schedule's own; only the pairs are added.

    Examples:
        >>> from fpipe.schedules import OneFOneB, Overlapped
        >>> print(Overlapped(OneFOneB(num_microbatches=4)).program(2))  # Combined 1F1B
        rank 0 | 0F0  .   .  0F1 0B0  .   .  0F2 0B1  .   .  0F3 0B2  .   .  0B3
        rank 1 |  .  1F0 1B0  .   .  1F1 1B1  .   .  1F2 1B2  .   .  1F3 1B3  .
        pairs  | 0F1&0B0 0F2&0B1 0F3&0B2

    (Rank 1's ``1B0 1F1`` cannot be a pair as well: ``0F1&0B0`` waits for ``1B0``, which would wait
    for ``0F1``'s activation.) In the grid a pair spans two ticks and its results exist at its end.

    Attributes:
        schedule: the schedule whose programs get pairs (any schedule value).
    """

    schedule: Schedule

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        return pair_adjacent(self.schedule.program(num_stages, num_ranks))


def pair_adjacent(program: Program) -> Program:
    """``program`` with every adjacent forward and backward of a rank paired where it may be
    (``Overlapped``'s rule), greedily from the start of each row; the program is validated first."""
    validate(program)
    split = split_backwards(program)
    pairs: set[tuple[Action, Action]] = set(program.pairs)
    paired = {a for pair in pairs for a in pair}
    for row in program.ranks:
        k = 0
        while k + 1 < len(row):
            first, second = row[k], row[k + 1]
            kinds = {first.kind, second.kind}
            if (
                FORWARD in kinds
                and kinds & {BACKWARD, BACKWARD_INPUT}
                and not paired & {first, second}
                and first not in dependencies(second, program.num_stages, split)
                and _replays(program, pairs | {(first, second)})
            ):
                pairs.add((first, second))
                paired |= {first, second}
                k += 2
            else:
                k += 1
    return Program(program.ranks, program.num_stages, program.num_microbatches, frozenset(pairs))


def _replays(program: Program, pairs: set[tuple[Action, Action]]) -> bool:
    """Whether ``program`` with ``pairs`` replays to its end (no pair waits on another's results)."""
    trial = Program(program.ranks, program.num_stages, program.num_microbatches, frozenset(pairs))
    starts, _ = as_soon_as_possible(trial, lambda r, k, a: 1.0, lambda d: 0.0)
    return all(len(s) == len(row) for s, row in zip(starts, program.ranks))
