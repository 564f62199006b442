"""``Overlapped(schedule)``: a schedule's adjacent forward and backward run as overlapped pairs.

DualPipe (arXiv:2412.19437, section 3.2.1) runs a forward chunk and a backward chunk of two
microbatches together on a rank so that each one's all-to-all hides behind the other's compute;
Megatron-Core's Combined 1F1B does the same in 1F1B's steady state, where every rank alternates
``F(i + w)`` and ``B(i)``. Here a pair is data (``Program.pairs``) and the runtime interleaves its
halves at their stages' communication points (NOTE [overlapped pairs] in fpipe/_pairs.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from ._action import BACKWARD, BACKWARD_INPUT, FORWARD, Action
from ._program import Program, Schedule, dependencies, split_backwards, ticks_of, validate


@dataclass(frozen=True)
class Overlapped:
    """``schedule`` with each rank's adjacent forward and backward (``B`` or ``I``) paired.

    Walking each rank's row from the start, two adjacent actions become a pair when one is a
    forward and the other a backward of another microbatch (or stage) that does not need it
    (stage 0's forward first, as ``validate`` wants), and the program with that pair still
    replays without a deadlock (``pair_adjacent``). A schedule that names its own pairs
    (``paired_program``: ``DualPipe``) gets exactly those. The order of actions is the
    schedule's own; only the pairs are added.

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
        own = getattr(self.schedule, "paired_program", None)  # a schedule that names its pairs (DualPipe)
        if own is not None:
            program: Program = own(num_stages, num_ranks)
            validate(program)
            return program
        return pair_adjacent(self.schedule.program(num_stages, num_ranks))


def pair_adjacent(program: Program) -> Program:
    """``program`` with every adjacent forward and backward of a rank paired where it may be
    (``Overlapped``'s rule), greedily from the start of each row; the program is validated first.
    Whether the program still replays with a pair is asked of ``_Order`` (NOTE [pairs as contracted
    edges]), in time near the pair, not by a replay of the whole program per pair."""
    validate(program)
    split = split_backwards(program)
    pairs: set[tuple[Action, Action]] = set(program.pairs)
    paired = {a for pair in pairs for a in pair}
    order = _Order(program, split)
    for row in program.ranks:
        k = 0
        while k + 1 < len(row):
            first, second = row[k], row[k + 1]
            kinds = {first.kind, second.kind}
            if (
                FORWARD in kinds
                and kinds & {BACKWARD, BACKWARD_INPUT}
                and not (second.kind == FORWARD and second.stage == 0)  # (``validate_pairs``)
                and not paired & {first, second}
                and first not in dependencies(second, program.num_stages, split)
                and order.pair(first, second)
            ):
                pairs.add((first, second))
                paired |= {first, second}
                k += 2
            else:
                k += 1
    return Program(program.ranks, program.num_stages, program.num_microbatches, frozenset(pairs))


class _Order:
    """A program's actions as a graph, kept in a topological order while pairs are added.

    NOTE [pairs as contracted edges]
        A program replays to its end exactly when the graph of its units (a pair is one unit) has
        no cycle, its edges running along each row and from each action's dependencies to it
        (``as_soon_as_possible``). Pairing ``u`` with the next action ``v`` of its row contracts
        the edge ``u -> v``; for cycles that is the same as adding an edge ``x -> u`` for every
        other edge ``x -> v`` (``v``'s dependencies), and it makes one exactly when ``u`` already
        reaches such an ``x``. An order in which every edge runs forward (the unit replay's ticks
        to start) bounds that search to the actions between ``u`` and ``x``, and each added edge
        reorders only that stretch (Pearce and Kelly 2006, "A dynamic topological sort algorithm
        for directed acyclic graphs"). So pairing is near linear, where a replay per pair was
        quadratic (minutes for 16 ranks and 120 microbatches).
    """

    def __init__(self, program: Program, split: frozenset[tuple[int, int]]) -> None:
        ticks = ticks_of(program)
        every = sorted(
            (t, r, k, a) for r, row in enumerate(program.ranks) for k, (t, a) in enumerate(zip(ticks[r], row))
        )
        self.place = {a: n for n, (_, _, _, a) in enumerate(every)}  # the action's position in the order
        self.out: dict[Action, list[Action]] = {a: [] for a in self.place}
        self.into: dict[Action, list[Action]] = {a: [] for a in self.place}
        self.needs = {a: dependencies(a, program.num_stages, split) for a in self.place}
        for row in program.ranks:
            for a, b in itertools.pairwise(row):
                self._edge(a, b)
        for a, needs in self.needs.items():
            for d in needs:
                self._edge(d, a)
        for first, second in program.pairs:
            for d in self.needs[second]:
                if d != first:
                    self._insert(d, first)

    def pair(self, first: Action, second: Action) -> bool:
        """Pair ``first`` with ``second``, the next action of its row, unless the program would then
        deadlock (NOTE [pairs as contracted edges]); whether it did."""
        sources = [d for d in self.needs[second] if d != first and self.place[d] > self.place[first]]
        if sources:
            last = max(self.place[d] for d in sources)
            if self._reach(first, self.out, lambda n: n <= last) & set(sources):
                return False
        for d in self.needs[second]:
            if d != first:
                self._insert(d, first)
        return True

    def _edge(self, a: Action, b: Action) -> None:
        self.out[a].append(b)
        self.into[b].append(a)

    def _reach(self, start: Action, edges: dict[Action, list[Action]], inside: Callable[[int], bool]) -> set[Action]:
        """``start`` and what it reaches along ``edges`` through actions whose position is ``inside``."""
        seen, stack = {start}, [start]
        while stack:
            for b in edges[stack.pop()]:
                if b not in seen and inside(self.place[b]):
                    seen.add(b)
                    stack.append(b)
        return seen

    def _insert(self, a: Action, b: Action) -> None:
        """Add the edge ``a -> b``, which makes no cycle, moving what lies between them in the order."""
        self._edge(a, b)
        low, high = self.place[b], self.place[a]
        if high < low:
            return
        ahead = self._reach(b, self.out, lambda n: n <= high)
        behind = self._reach(a, self.into, lambda n: n >= low)
        moved = sorted(behind, key=self.place.__getitem__) + sorted(ahead, key=self.place.__getitem__)
        for action, n in zip(moved, sorted(self.place[x] for x in moved)):
            self.place[action] = n
