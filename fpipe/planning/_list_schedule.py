"""List scheduling: a program built action by action by simulating it.

``search`` (``fpipe.planning._search``) needs programs laid out for particular costs, not for the
unit costs the papers draw. This module builds them the way the Zero Bubble authors' automatic
scheduler does (``Graph.manual_order`` in ``megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py``
of sail-sg/zero-bubble-pipeline-parallelism: a greedy pass over warm-up counts under a memory cap,
tried with a few flags, the best kept): a *list scheduler* replays the pipeline with the costs and,
each time a rank is free, appends to its row the action that a ``Policy`` prefers among those whose
inputs have arrived. Since it starts each action when ``simulate`` would (when the rank is free and
the inputs are there), the makespan it computes is ``simulate``'s for the program it returns.

NOTE [list scheduler]
    Every stage runs each kind of action on its microbatches in increasing order (FIFO), so the
    candidates of a rank are, per stage it holds, the next ``F``, the next backward (``B``, or
    ``I`` when split) and the next ``W``. A rank decides at ``t = max(free, earliest arrival among
    its candidates)``; actions on other ranks can only start at or after the smallest such ``t``
    over all ranks, so deciding the rank with the smallest ``t`` first never misses an input that
    would have arrived by then. Memory is a reservation: a microbatch enters a rank (the forward of
    the rank's first stage) only if the activations of all the rank's stages for it still fit under
    the limit, and each backward (``B``, or ``W`` when split) hands its stage's share back. Every
    microbatch a rank admitted can therefore finish on it, so no choice deadlocks on memory.
    With several stages per rank that is cautious (NOTE [unreserved memory]).

NOTE [unreserved memory]
    A reservation charges a microbatch the activations of every stage of the rank when it enters,
    so a rank of two stages under a limit of 3 microbatches' footprint runs at most 3 first-stage
    forwards ahead, though 4 fit until the later stage's forwards start; the optimum often runs
    them (the small cases of notes/search.md). A pass with ``reserve=False`` charges only the
    memory in use, and runs a forward only if, after it, the microbatches still going forward
    through the rank could each finish there, one after the other, oldest first:

        held + size <= limit, and
        sum over the rank's stages s of size[s] * max(1, forwards[s] - oldest) <= limit

    where ``forwards[s]`` counts the forwards stage ``s`` has run (this one included) and
    ``oldest = min(forwards)`` is the oldest microbatch that has a forward left on the rank: the
    sum is the memory the microbatches from ``oldest`` on hold, plus what ``oldest`` still needs.
    Microbatches before ``oldest`` hold the rest; their backwards need no memory and free theirs.
    Why this never deadlocks: take the oldest microbatch ``g`` not yet finished. On a rank where
    it still has forwards, it is ``oldest`` and nothing older holds memory, so the condition
    says its forwards fit; elsewhere it needs only backwards. Its next action is therefore
    possible once its inputs arrive, and running it keeps the condition (when ``g`` takes its
    last forward on a rank, the sum loses ``g``'s footprint and gains at most the next one's
    need, which is no larger). Every other action a pass runs keeps the condition by the check,
    so ``g`` always finishes, and then the next oldest. With one stage per rank the condition is
    the reservation's.

NOTE [shaken passes]
    A pass decides greedily, and with two stages per rank the small cases' optima (notes/search.md)
    often depart from every policy's rule at a few decisions only: a rank runs its other stage's
    ``W`` before a ready backward, or idles for a backward about to arrive instead of starting a
    forward. A pass with a ``seed`` draws a number at each decision: below ``_WAIT`` it waits for
    one of its candidates (ready or not) chosen at random, up to ``_WAIT + _SWAP`` it runs one of
    the ready ones at random, else it follows its policy. Any candidate is a legal choice (the
    memory rules above hold whatever is chosen), so a shaken pass finishes as any pass does;
    ``search`` runs a few dozen of them on small problems and improves the best (local moves in
    ``_improve.py`` undo the worst of their accidents).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ..schedules import Action, Costs, Program
from ..schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._frontier import Frontier
from ._problem import TOLERANCE, Problem

_WAIT, _SWAP = 0.1, 0.27  # how often a shaken pass waits for any action, or runs any ready one


@dataclass(frozen=True)
class Policy:
    """The preferences of one list-scheduling pass (NOTE [list scheduler]).

    Attributes:
        split: backwards as ``I`` then ``W`` (``W`` fills idle time), or fused ``B``.
        backward_first: between a ready backward and a ready forward, run the backward (1F1B's
            steady state); else the forward (GPipe's order when memory allows).
        deep_first: between two stages of a rank, prefer the one further along the pipeline (a
            later forward, an earlier backward); else the other.
        extra: microbatches a rank admits beyond its fill estimate (``fill``; negative: fewer, at
            least 1), ``None``: as many as memory allows.
        patient: do not start a ``W`` that would delay a backward or forward known to arrive
            before the ``W`` would end; wait for it instead.
        reserve: a microbatch enters a rank only if the activations of all the rank's stages
            for it fit (NOTE [list scheduler]); else each forward runs if it fits with room left
            for the microbatches ahead to finish (NOTE [unreserved memory]).
        seed: ``None``: every decision is the policy's; else the pass departs from it at random
            (NOTE [shaken passes]), the same way for the same seed.
    """

    split: bool
    backward_first: bool = True
    deep_first: bool = True
    extra: int | None = 0
    patient: bool = False
    reserve: bool = True
    seed: int | None = None

    def __str__(self) -> str:
        admits = "memory" if self.extra is None else f"fill+{self.extra}"
        return (
            f"list({'I/W' if self.split else 'B'}, {'backward' if self.backward_first else 'forward'} first, "
            f"{'deep' if self.deep_first else 'shallow'} first, {admits}{', patient' if self.patient else ''}"
            f"{'' if self.reserve else ', unreserved'}{'' if self.seed is None else f', shaken {self.seed}'})"
        )


def fill(problem: Problem, rank: int, split: bool) -> int:
    """How many microbatches ``rank`` must admit to stay busy until its first backward comes back.

    The round trip of one microbatch from the forward of the rank's first stage to the end of
    its backward there, through an empty pipeline, over the rank's own work per microbatch
    (at least 1): 1F1B's ``p - r`` with equal costs.
    """
    first = problem.stages_of(rank)[0]
    trip = problem.costs[first].forward
    for s in range(first + 1, problem.num_stages):
        trip += problem.hop(s - 1, s) + problem.costs[s].forward
    for s in range(problem.num_stages - 1, first - 1, -1):
        trip += problem.backward(s, split) + (problem.hop(s + 1, s) if s + 1 < problem.num_stages else 0.0)
    work = sum(_work(problem.costs[s]) for s in problem.stages_of(rank))
    return max(1, math.ceil(trip / work - TOLERANCE))


def _work(costs: Costs) -> float:
    """One microbatch's work on a stage, its backward fused or split, whichever is cheaper."""
    return costs.forward + min(costs.of(BACKWARD), costs.backward_input + costs.backward_weight)


@dataclass
class _Pass:
    """The state of one list-scheduling pass: what each stage and rank has run, and when."""

    problem: Problem
    policy: Policy

    def __post_init__(self) -> None:
        p, S, m = self.problem.num_ranks, self.problem.num_stages, self.problem.num_microbatches
        self.done = {FORWARD: [0] * S, BACKWARD: [0] * S, BACKWARD_WEIGHT: [0] * S}  # B counts I too
        self.frontier = Frontier.of(self.problem)  # when each action's inputs are there (NOTE [what may run next])
        self.free = [0.0] * p
        self.reserved = [0.0] * p
        self.held = [0.0] * p
        self.inside = [0] * p  # microbatches admitted and not yet back through the rank's first stage
        self.rows: list[list[Action]] = [[] for _ in range(p)]
        self.stages = [self.problem.stages_of(r) for r in range(p)]
        forward = 1 if self.policy.backward_first else -1
        self.order = {BACKWARD: 0, BACKWARD_INPUT: 0, FORWARD: forward, BACKWARD_WEIGHT: 2}
        self.footprints = [self.problem.footprint(r) for r in range(p)]
        split = self.policy.split
        extra = self.policy.extra
        self.admits = [m if extra is None else max(1, fill(self.problem, r, split) + extra) for r in range(p)]
        self.shaker = None if self.policy.seed is None else random.Random(self.policy.seed)

    def candidates(self, r: int) -> Iterator[tuple[float, str, int]]:
        """``(ready, kind, stage)`` of every action rank ``r`` may run next (NOTE [list scheduler])."""
        problem, done, frontier, m = self.problem, self.done, self.frontier, self.problem.num_microbatches
        for s in self.stages[r]:
            i = done[FORWARD][s]
            ready = frontier.forward(s, i) if i < m else math.inf
            if ready != math.inf:
                entering = s == self.stages[r][0]
                if self.policy.reserve:
                    fits = not entering or self.reserved[r] + self.footprints[r] <= problem.limits[r] * (1 + TOLERANCE)
                else:
                    fits = self.safe(r, s)
                if fits and (not entering or self.inside[r] < self.admits[r]):
                    yield ready, FORWARD, s
            j = done[BACKWARD][s]
            ready = frontier.backward(s, j) if j < m else math.inf
            if ready != math.inf:
                yield ready, (BACKWARD_INPUT if self.policy.split else BACKWARD), s
            k = done[BACKWARD_WEIGHT][s]
            if self.policy.split and k < j:
                yield frontier.weight(s, k), BACKWARD_WEIGHT, s

    def safe(self, r: int, stage: int) -> bool:
        """Whether rank ``r`` may run the next forward of ``stage`` without its memory limit ever
        blocking the oldest microbatch still going forward through it (NOTE [unreserved memory])."""
        sizes, done, stages = self.problem.sizes, self.done[FORWARD], self.stages[r]
        limit = self.problem.limits[r] * (1 + TOLERANCE)
        if self.held[r] + sizes[stage] > limit:
            return False
        oldest = done[stages[-1]] + (stage == stages[-1])  # a rank's later stages have run fewer forwards
        if oldest == self.problem.num_microbatches:
            return True
        young = 0.0
        for s in stages:
            ahead = done[s] + (s == stage) - oldest
            young += sizes[s] * (ahead if ahead > 1 else 1)
        return young <= limit

    def rank(self, kind: str, stage: int) -> tuple[int, int]:
        """The policy's preference (smaller first) among ready actions."""
        further = stage if kind == FORWARD else -stage
        return self.order[kind], -further if self.policy.deep_first else further

    def decide(self, r: int) -> tuple[float, str, int] | None:
        """When rank ``r`` starts its next action and which, or ``None`` while it has none."""
        options = list(self.candidates(r))
        if not options:
            return None
        t = max(self.free[r], min(ready for ready, _, _ in options))
        ready_now = [o for o in options if o[0] <= t * (1 + TOLERANCE)]
        if self.shaker is not None:  # NOTE [shaken passes]
            draw = self.shaker.random()
            if draw < _WAIT and len(options) > 1:
                ready, kind, stage = self.shaker.choice(options)
                return max(t, ready), kind, stage
            if draw < _WAIT + _SWAP and len(ready_now) > 1:
                _, kind, stage = self.shaker.choice(ready_now)
                return t, kind, stage
        _, kind, stage = min(ready_now, key=lambda o: self.rank(o[1], o[2]))
        if self.policy.patient and kind == BACKWARD_WEIGHT:
            end = t + self.problem.costs[stage].backward_weight
            sooner = [o for o in options if o[1] != BACKWARD_WEIGHT and t < o[0] < end]
            if sooner:
                return min(sooner, key=lambda o: (o[0], self.rank(o[1], o[2])))
        return t, kind, stage

    def run(self, r: int, start: float, kind: str, stage: int) -> list[int]:
        """Append ``kind`` of ``stage`` on its next microbatch to rank ``r`` at ``start``; the ranks
        whose candidates that changes."""
        problem = self.problem
        counter = BACKWARD if kind in (BACKWARD, BACKWARD_INPUT) else kind
        i = self.done[counter][stage]
        self.done[counter][stage] = i + 1
        end = start + problem.costs[stage].of(kind)
        self.free[r] = end
        self.rows[r].append(Action(stage, kind, i))
        touched = [r]
        self.frontier.ran(kind, stage, i, end)
        taker = self.frontier.taker(kind, stage)  # whose next action may now be ready
        if taker is not None:
            touched.append(problem.rank_of[taker])
        if kind == FORWARD:
            self.held[r] += problem.sizes[stage]
            if stage == self.stages[r][0]:
                self.reserved[r] += self.footprints[r]
                self.inside[r] += 1
        else:
            if kind != BACKWARD_WEIGHT and stage == self.stages[r][0]:
                self.inside[r] -= 1
            if kind != BACKWARD_INPUT:
                self.reserved[r] -= problem.sizes[stage]
                self.held[r] -= problem.sizes[stage]
        return touched


def list_schedule(problem: Problem, policy: Policy) -> tuple[Program, float] | None:
    """The program one pass of ``policy`` lays out, and its makespan (``simulate``'s), or ``None``
    if the pass gets stuck (NOTE [list scheduler])."""
    state = _Pass(problem, policy)
    p = problem.num_ranks
    decisions: list[tuple[float, str, int] | None] = [state.decide(r) for r in range(p)]
    left = sum(len(problem.stages_of(r)) for r in range(p)) * problem.num_microbatches * (3 if policy.split else 2)
    while left:
        times = [math.inf if d is None else d[0] for d in decisions]
        r = times.index(min(times))
        decision = decisions[r]
        if decision is None:
            return None
        start, kind, stage = decision
        for q in set(state.run(r, start, kind, stage)):
            decisions[q] = state.decide(q)
        left -= 1
    program = Program(tuple(tuple(row) for row in state.rows), problem.num_stages, problem.num_microbatches)
    return program, max(state.free)
