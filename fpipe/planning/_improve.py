"""Local improvement: move actions of a rank a few places while the program gets faster.

The list scheduler decides greedily, one action at a time; a decision that looked best when it
was made can cost time later (a forward that delays a backward the next rank waits for). The
pass below tries, for each action of a rank's row, moving it 1, 2, ... ``reach`` places later or
earlier (a swap of neighbours first) past actions it may trade places with (each stage's actions
of one kind stay in microbatch order), replays the program (``makespan_of``: ``simulate``'s clock
for the problem's costs) and keeps the first move that makes it faster within the memory limit; it
sweeps the rows until a sweep keeps nothing or ``sweeps`` sweeps are done.

NOTE [kicks]
    Moves one at a time stop at a program that no single move makes faster, while the optimum
    is often a few moves away that each alone changes nothing or costs a little (a rank's other
    stage's ``W`` brought before a backward and a forward sent after it). ``kicked`` is an
    iterated local search: it moves 1 to 3 actions of the best program so far to random places
    up to 4 away (each stage's kinds staying in microbatch order), improves the result by
    ``improve``'s moves, and keeps it if it is no slower (equal: it drifts along a plateau
    where the next kick may find the way down); a fixed number of kicks from a fixed seed, so
    the same problem gets the same program.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

from ..schedules import Action, Program
from ..schedules._action import BACKWARD, BACKWARD_WEIGHT, FORWARD
from ._frontier import Frontier, makespan
from ._problem import TOLERANCE, Problem


def peak_memory(program: Program, sizes: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the most memory live activations take: stage ``s``'s ``sizes[s]`` per microbatch,
    alive from its ``F`` to its ``B`` (or ``W``), as ``Simulation.peak_activations`` counts them."""
    peaks = []
    for row in program.ranks:
        alive = peak = 0.0
        for a in row:
            if a.kind in (FORWARD, BACKWARD, BACKWARD_WEIGHT):
                alive += sizes[a.stage] if a.kind == FORWARD else -sizes[a.stage]
                peak = max(peak, alive)
        peaks.append(peak)
    return tuple(peaks)


def makespan_of(problem: Problem, rows: Sequence[Sequence[Action]], frontier: Frontier | None = None) -> float:
    """The makespan ``simulate`` gives the program of these rows with the problem's costs: each
    action when its rank is free and its inputs are there (``makespan`` in ``_frontier.py``, NOTE [what may run next]);
    ``math.inf`` if the rows deadlock. ``frontier``: the problem's, to reuse (it starts over)."""
    costs = problem.costs
    return makespan(Frontier.of(problem) if frontier is None else frontier, rows, lambda a: costs[a.stage].of(a.kind))


def _swappable(a: Action, b: Action) -> bool:
    """Whether neighbours ``a``, ``b`` may trade places: different stages, or one stage's
    different kinds on different microbatches (each kind of a stage stays in microbatch order)."""
    return a.stage != b.stage or (a.kind != b.kind and a.microbatch != b.microbatch)


def improve(
    problem: Problem, program: Program, makespan: float, sweeps: int, reach: int, deadline: float
) -> tuple[Program | None, float, bool]:
    """A faster program than ``program`` (of ``makespan``) by moves of one action at a time up to
    ``reach`` places along its row, within the memory limit; at most ``sweeps`` sweeps over the
    rows, none started after ``deadline`` (``time.perf_counter()``).

    Returns ``(program, makespan, finished)``, as the exact search does: ``program`` is ``None``
    when no move helps (``makespan`` is then the one given); ``finished`` is ``False`` when
    ``deadline`` stopped the sweeps before a sweep kept nothing or ``sweeps`` were done.
    """
    rows = [list(row) for row in program.ranks]
    frontier = Frontier.of(problem)
    best, improved, finished = makespan, False, True
    moves = [1, *(d for x in range(2, reach + 1) for d in (x, -x)), *([-1] if reach > 1 else [])]
    for sweep in range(sweeps):
        if sweep and time.perf_counter() > deadline:
            finished = False
            break
        kept = False
        for row in rows:
            for k in range(len(row)):
                for d in moves:  # the first move that helps is kept
                    j = k + d
                    passed = row[k + 1 : j + 1] if d > 0 else row[max(j, 0) : k]
                    if not 0 <= j < len(row) or not all(_swappable(row[k], b) for b in passed):
                        continue
                    a = row.pop(k)
                    row.insert(j, a)
                    t = makespan_of(problem, rows, frontier)
                    if t < best * (1 - TOLERANCE) and _fits(problem, rows):
                        best, kept = t, True
                        break
                    row.pop(j)
                    row.insert(k, a)
        improved |= kept
        if not kept:
            break
    if not improved:
        return None, makespan, finished
    return Program(tuple(tuple(row) for row in rows), problem.num_stages, problem.num_microbatches), best, finished


def _fits(problem: Problem, rows: Sequence[Sequence[Action]]) -> bool:
    peaks = peak_memory(
        Program(tuple(tuple(row) for row in rows), problem.num_stages, problem.num_microbatches), problem.sizes
    )
    return all(peak <= limit * (1 + TOLERANCE) for peak, limit in zip(peaks, problem.limits))


def kicked(
    problem: Problem, program: Program, makespan: float, kicks: int, bound: float, deadline: float
) -> tuple[Program | None, float, bool]:
    """A faster program than ``program`` (of ``makespan``) by ``kicks`` kicks of iterated local
    search (NOTE [kicks]), within the memory limit; it stops early at ``bound`` (no program is
    faster) or after ``deadline`` (``time.perf_counter()``).

    Returns ``(program, makespan, finished)`` as ``improve`` does: ``program`` is ``None`` when
    none is faster; ``finished`` is ``False`` when ``deadline`` stopped a kick or the kicks left.
    """
    shaker = random.Random(0)
    frontier = Frontier.of(problem)
    best, kept, finished = makespan, program, True
    for kick in range(kicks):
        if best <= bound * (1 + TOLERANCE):
            break
        if time.perf_counter() > deadline:
            finished = False
            break
        rows = [list(row) for row in kept.ranks]
        for _ in range(1 + kick % 3):
            _move_at_random(rows[shaker.randrange(len(rows))], shaker)
        t = makespan_of(problem, rows, frontier)
        if t == math.inf or not _fits(problem, rows):
            continue
        moved = Program(tuple(tuple(row) for row in rows), problem.num_stages, problem.num_microbatches)
        better, t, done = improve(problem, moved, t, 2, 3, deadline)
        moved = moved if better is None else better
        finished = finished and done
        if t <= best * (1 + TOLERANCE):
            best, kept = t, moved
    return (kept, best, finished) if best < makespan * (1 - TOLERANCE) else (None, makespan, finished)


def _move_at_random(row: list[Action], shaker: random.Random) -> None:
    """Move one action of ``row`` 1 to 4 places, to a place it may go (``_swappable``), if one of
    20 draws finds one."""
    for _ in range(20):
        k = shaker.randrange(len(row))
        j = k + shaker.choice((-4, -3, -2, -1, 1, 2, 3, 4))
        passed = row[k + 1 : j + 1] if j > k else row[max(j, 0) : k]
        if 0 <= j < len(row) and all(_swappable(row[k], b) for b in passed):
            row.insert(j, row.pop(k))
            return
