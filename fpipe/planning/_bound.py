"""Lower bounds on the makespan: what no program can beat (``lower_bound``) and what no completion
of a partial program can beat (``Relaxation.bound``, the exact search's pruning).

NOTE [release bound]
    Relax the pipeline in two ways. First, forget that a rank runs one action at a time and
    compute, microbatch by microbatch, the earliest each action can start (its *release*): after
    its stage's previous action of its kind (the ``k``-th forward of a stage starts after the
    ``k-1``-th ends), after its inputs and their messages (the previous stage's forward, the next
    stage's backward), and, for a forward, after the end of the ``W`` (or fused ``B``) that frees
    room for it: stage ``s`` alone keeps at most ``capacity[s] = floor(limit / size)``
    microbatches alive, so its ``k``-th forward waits for the ``k - capacity``-th to be freed;
    and on a rank holding several stages, a microbatch at the forward of the rank's last stage
    holds the rank's whole footprint, so at most ``(limit - footprint) / size`` others may hold
    the rank's first stage then: that forward's ``k``-th waits for the first stage to free its
    ``k - others``-th.
    Then put the one-action-at-a-time back, per rank only: the rank runs its remaining actions,
    each no earlier than its release, one at a time, and after each the step lasts at least its
    *tail* (after a forward, the trip through the later stages and back, its own backward and
    ``after``; after a backward, ``after``; after a ``W``, nothing): the least ``max(end +
    tail)`` of one machine allowed to interrupt its jobs (``jackson``) is a bound. So is the rank's remaining ``F`` and
    backward work, and the ``W`` that must free room before its stage's last forward (all but
    the last ``capacity`` of them), from the first of all their releases (a ``W`` whose ``I``
    already ran may be released before any forward or backward left), plus the least time any
    backward of its stages still needs after it (``after``: the backwards of the earlier stages,
    their messages, stage 0's ``W``): each action of that set is followed by at least that much;
    and the end of the last ``W`` (or fused ``B``) of each stage.

    Each inequality holds for the ``k``-th action of a kind in time order, whatever the program
    runs first: the ``k``-th smallest of values each at least its own lower bound is at least the
    ``k``-th smallest of the bounds. So with a backward costing the least of ``I`` and ``B`` (what
    the previous stage waits for) and the rest, ``min(B, I + W)`` minus that, freeing memory, the
    bound holds for every program (``lower_bound``). The exact search's partial programs run
    each kind in microbatch order but fuse or split each backward on its own, so their frees
    (a ``B``, or the ``W`` after an ``I``) need not come in microbatch order: the bound takes the
    frees in time order too, those that ran, then the ``W`` still waiting (released at the ends
    of their ``I``), then one per backward to come; and the search uses the costs of its space
    per stage (``I`` and ``W`` where a ``B`` is never cheaper, ``B`` and 0 where it costs no more
    than ``I``, else ``I`` and ``B - I``). The one-machine relaxation charges a ``W`` waiting its
    full cost: those have the earliest releases, and any program's frees have at least as many
    full ``W`` at or after each release, so what is released after any time is no less.

NOTE [memory windows]
    On a rank holding several stages, call microbatch ``i``'s *window* the stretch of the rank's
    row from the forward of its last stage on ``i`` (after which ``i`` holds the rank's whole
    footprint) to the first ``W`` or ``B`` that frees one of those stages' activations of ``i``.
    Memory is counted after each forward, so windows that overlap all hold the footprint at the
    forward of the latest: at most ``at_once = floor(limit / footprint)`` overlap at any time.
    Each lasts at least its *chain*: that forward, the trip through the later stages and back,
    the backwards from the last stage down to the freed one and its ``W`` (the least over the
    rank's stages). Intervals that never overlap more than ``at_once`` at a time split into
    ``at_once`` groups of disjoint ones (interval graphs are perfect), so the rank's windows
    still to come end no earlier than the first of them can start plus ``ceil(n / at_once)``
    chains: the *round trip per wave* that tight memory and slow messages force::

        rank 1 (stages 1, 2), limit = footprint:   |F2 ...F3 I3 on rank 0... I2 W2|F1 ...|F2 ...

    When not even the smallest of its stages' activations fits beside the footprint, nothing
    else is alive on the rank in a window, so no other microbatch's action runs there: the rank
    runs, one after another, the windows and every action outside them (the forwards of its
    earlier stages, and the ``W`` of all its stages but the one freed first). With one window
    at a time, one still open (its forward ran, nothing freed) ends before the next starts.
    Like the rest, this holds whatever order a program runs its microbatches in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..schedules._action import BACKWARD
from ._problem import TOLERANCE, Problem


class Relaxation:
    """The release bound of a problem for given backward costs (NOTE [release bound]).

    Args:
        problem: what is laid out.
        back: per stage, the cost of the backward the previous stage waits for.
        weight: per stage, the cost of the rest of its backward, at whose end its activations
            are freed (0 for a fused ``B``).
        waiting_weight: per stage, what a ``W`` whose ``I`` already ran costs (``weight`` if
            not given; the exact search's ``W``, where ``weight`` is a fused backward's rest).
    """

    def __init__(
        self,
        problem: Problem,
        back: Sequence[float],
        weight: Sequence[float],
        waiting_weight: Sequence[float] | None = None,
    ) -> None:
        S, m = problem.num_stages, problem.num_microbatches
        self.problem = problem
        self.forward = [c.forward for c in problem.costs]
        self.back = list(back)
        self.weight = list(weight)
        self.waiting_weight = list(weight if waiting_weight is None else waiting_weight)
        self.up = [problem.hop(s - 1, s) if s else 0.0 for s in range(S)]  # the message into stage s
        self.down = [problem.hop(s, s - 1) if s else 0.0 for s in range(S)]  # stage s's message back
        # after[s]: the least time from the end of a backward of stage s to the end of the step
        self.after = [weight[0]] * S
        for s in range(1, S):
            self.after[s] = self.after[s - 1] + self.back[s - 1] + self.down[s]
        # through[s]: the least time from the end of a forward of stage s to the end of the step
        self.through = [0.0] * S
        trip = 0.0
        for s in range(S - 1, -1, -1):
            self.through[s] = trip + self.back[s] + self.after[s]
            trip += self.up[s] + self.forward[s] + self.back[s] + self.down[s]
        alive = [problem.limits[r] / problem.sizes[s] for s, r in enumerate(problem.rank_of)]
        self.capacity = [m if math.isinf(x) else max(1, min(m, math.floor(x * (1 + TOLERANCE)))) for x in alive]
        self.held = [problem.stages_of(r) for r in range(problem.num_ranks)]
        # entry[s]: for the last stage s of a rank holding several, (the rank's first stage, how many
        # other microbatches can still hold that first stage's activations while one holds the
        # rank's whole footprint): its forward of microbatch i waits for the first stage to free
        # microbatch i - others - 1
        self.entry: dict[int, tuple[int, int]] = {}
        for r, stages in enumerate(self.held):
            spare = (problem.limits[r] - problem.footprint(r)) / problem.sizes[stages[0]]
            if len(stages) > 1 and not math.isinf(spare):
                self.entry[stages[-1]] = stages[0], math.floor(spare * (1 + TOLERANCE) + TOLERANCE)
        # window[s]: for the last stage s of a rank holding several under a limit below m footprints,
        # (at_once, chain, the work per microbatch outside its window if the rank is alone in its
        # windows, else NaN) (NOTE [memory windows])
        self.window: dict[int, tuple[int, float, float]] = {}
        for r, stages in enumerate(self.held):
            last, limit, footprint = stages[-1], problem.limits[r], problem.footprint(r)
            if len(stages) > 1 and limit < m * footprint:
                at_once = max(1, math.floor(limit / footprint * (1 + TOLERANCE)))
                trip = self.through[last] - self.back[last] - self.after[last]
                frees = min(self.after[last] - self.after[s] + self.weight[s] for s in stages)
                alone = footprint + min(problem.sizes[s] for s in stages) > limit * (1 + TOLERANCE)
                outside = sum(self.weight[s] for s in stages) - max(self.weight[s] for s in stages)
                self.window[last] = (
                    at_once,
                    self.forward[last] + trip + self.back[last] + frees,
                    outside if alone else math.nan,
                )

    def bound(
        self,
        done: tuple[Sequence[int], Sequence[int]],
        waiting: Sequence[Sequence[int]],
        ends: tuple[Sequence[Sequence[float]], Sequence[Sequence[float]]],
        opens: Sequence[float],
        enough: float = math.inf,
    ) -> float:
        """A makespan no completion of a partial program can beat, one whose stages run each kind
        in microbatch order, each backward fused or split (NOTE [release bound], NOTE [memory
        windows]).

        Args:
            done: per stage, how many forwards and backwards (``B`` or ``I``) it has run:
                microbatches ``0`` to ``done - 1``.
            waiting: per stage, the microbatches whose ``I`` ran and ``W`` did not, in increasing
                order (every other backward that ran has freed its activations).
            ends: when each forward and each backward that ran ended, per stage and microbatch.
            opens: per rank, the earliest its next action can start.
            enough: a bound at which to stop (the exact search's best makespan): the result is
                then at least ``enough``, not necessarily the largest bound.
        """
        problem, m, S = self.problem, self.problem.num_microbatches, self.problem.num_stages
        done_f, done_b = done
        done_w = [done_b[s] - len(waiting[s]) for s in range(S)]  # frees that ran (time order)
        known_f, known_b = ends
        rank_of, forward, back, weight = problem.rank_of, self.forward, self.back, self.weight
        up, down, capacity, entry = self.up, self.down, self.capacity, self.entry
        after, through = self.after, self.through
        # the ends of microbatch i's actions, per stage, and of the W that frees each earlier one
        end_f = [0.0] * S
        end_b = [0.0] * S
        end_w: list[list[float]] = [[] for _ in range(S)]
        work: list[list[tuple[float, float, float]]] = [[] for _ in opens]  # per rank, (release, cost, tail)
        firsts = [math.inf for _ in opens]  # per rank, the first release of an F, a backward or a counted W
        window = self.window
        windows = [0.0]  # when the memory windows still to come end, at the earliest
        alone: list[tuple[int, float, float]] = []  # (rank, open window's end, windows) of ranks alone in them
        for i in range(m):
            previous = 0.0  # the end of the previous stage's forward of i
            for s in range(S):
                r = rank_of[s]
                if i < done_f[s]:
                    previous = end_f[s] = known_f[s][i]
                    continue
                t = opens[r]
                if i > done_f[s] and end_f[s] > t:
                    t = end_f[s]
                if s and previous + up[s] > t:
                    t = previous + up[s]
                if i >= capacity[s] and end_w[s][i - capacity[s]] > t:
                    t = end_w[s][i - capacity[s]]
                if s in entry:
                    first, others = entry[s]
                    if i > others and end_w[first][i - others - 1] > t:
                        t = end_w[first][i - others - 1]
                if i == done_f[s] and s in window:
                    at_once, chain, outside = window[s]
                    opened = -math.inf  # the end of the window still open, if any
                    if at_once == 1 and i and all(i > done_b[x] or i - 1 in waiting[x] for x in self.held[r]):
                        opened = known_f[s][i - 1] - forward[s] + chain
                    windows.append(max(t, opened) + math.ceil((m - i) / at_once) * chain)
                    if not math.isnan(outside):
                        alone.append((r, opened, (m - i) * (chain + outside)))
                previous = end_f[s] = t + forward[s]
                work[r].append((t, forward[s], through[s]))
                if t < firsts[r]:
                    firsts[r] = t
            later = 0.0  # the end of the next stage's backward of i, plus its message
            for s in range(S - 1, -1, -1):
                r = rank_of[s]
                if i < done_b[s]:
                    end = end_b[s] = known_b[s][i]
                else:
                    t = opens[r]
                    if end_f[s] > t:
                        t = end_f[s]
                    if i > done_b[s] and end_b[s] > t:
                        t = end_b[s]
                    if later > t:
                        t = later
                    end = end_b[s] = t + back[s]
                    work[r].append((t, back[s], after[s]))
                    if t < firsts[r]:
                        firsts[r] = t
                later = end + down[s]
                if i < done_w[s]:
                    end_w[s].append(-math.inf)
                    continue
                if i < done_b[s]:  # the frees in time order: the W still waiting, then the backwards to come
                    end = known_b[s][waiting[s][i - done_w[s]]]
                t = opens[r]
                if end > t:
                    t = end
                if i > done_w[s] and end_w[s][i - 1] > t:
                    t = end_w[s][i - 1]
                end_w[s].append(t + weight[s])
                cost = self.waiting_weight[s] if i < done_b[s] else weight[s]  # a W waiting: its own
                if cost:
                    work[r].append((t, cost, 0.0))
                    if i < m - capacity[s] and t < firsts[r]:  # a W counted below may run before any F or backward
                        firsts[r] = t
        best = max(max(w[m - 1] for w in end_w), *windows)
        for r, opened, span in alone:
            start = max(opened, min(w[0] for w in work[r]))
            best = max(best, start + span + sum((m - done_f[s]) * forward[s] for s in self.held[r][:-1]))
        for r, stages in enumerate(self.held):
            tails = [self.after[s] for s in stages if done_b[s] < m]
            if tails:
                before = sum(
                    (m - done_f[s]) * forward[s]
                    + (m - done_b[s]) * back[s]
                    + max(0, m - capacity[s] - done_w[s]) * weight[s]
                    for s in stages
                )
                best = max(best, firsts[r] + before + min(tails))
        for r in range(len(opens)):
            if best >= enough:
                break
            best = max(best, jackson(work[r]))
        return best


def jackson(jobs: list[tuple[float, float, float]]) -> float:
    """The least ``max(end + tail)`` over ``(release, cost, tail)`` jobs on one machine that may
    interrupt a job and resume it later: Jackson's rule, always run the released job of the
    largest tail, is optimal for it, so no order without interruptions does better."""
    jobs.sort()
    waiting: list[tuple[float, float]] = []  # (-tail, cost left) of released jobs
    t = best = 0.0
    k = 0
    while k < len(jobs) or waiting:
        if not waiting and jobs[k][0] > t:
            t = jobs[k][0]
        while k < len(jobs) and jobs[k][0] <= t:
            heapq.heappush(waiting, (-jobs[k][2], jobs[k][1]))
            k += 1
        tail, cost = heapq.heappop(waiting)
        release = jobs[k][0] if k < len(jobs) else math.inf
        if t + cost <= release:
            t += cost
            best = max(best, t - tail)
        else:
            heapq.heappush(waiting, (tail, cost - (release - t)))
            t = release
    return best


def lower_bound(problem: Problem) -> float:
    """A makespan no program for ``problem`` can beat, whatever its order.

    The larger of two bounds:

    - the release bound (NOTE [release bound]) with a backward costing the least of ``I`` and
      ``B`` and the rest of ``min(B, I + W)`` after it: among others, every rank's work after the
      forwards before its first action, and the last microbatch's trip through the pipeline after
      the ``m - 1`` forwards before it; and on a rank of several stages under a tight limit,
      its memory windows (NOTE [memory windows]);
    - per rank, its memory: stage ``s``'s activations of a microbatch live at least from its
      forward through the rest of the pipeline and back to the end of its own backward
      (``alive(s)``), and the rank never holds more than its limit, so
      ``limit * makespan >= m * sum(size(s) * alive(s) for s on the rank)``.
    """
    S, m = problem.num_stages, problem.num_microbatches
    costs = problem.costs
    back = [min(c.backward_input, c.of(BACKWARD)) for c in costs]
    own = [c.forward + min(c.of(BACKWARD), c.backward_input + c.backward_weight) for c in costs]
    relaxation = Relaxation(problem, back, [o - c.forward - b for o, c, b in zip(own, costs, back)])
    zeros = [0] * S
    released = relaxation.bound((zeros, zeros), [()] * S, ([], []), [0.0] * problem.num_ranks)
    trip = [0.0] * S  # trip[s]: the least time from the end of F(s, i) to the start of stage s's backward on i
    for s in range(S - 2, -1, -1):
        c = costs[s + 1]
        trip[s] = trip[s + 1] + c.forward + back[s + 1] + problem.hop(s, s + 1) + problem.hop(s + 1, s)
    memory = 0.0
    for r in range(problem.num_ranks):
        held = sum(problem.sizes[s] * (own[s] + trip[s]) for s in problem.stages_of(r))
        memory = max(memory, m * held / problem.limits[r])
    return max(released, memory)
