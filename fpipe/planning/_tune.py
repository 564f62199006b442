"""Tuning by measurement: time the few programs ``search`` found fastest, keep the measured fastest.

NOTE [measured tuning]
    The simulation ranks programs by a model fitted from a few steps; where two programs are
    within the model's error of each other (on a loaded CPU a few percent, the per-action
    overhead and the switches between a rank's stages being fitted only on average), its choice
    can measure slower than a built-in (measured by benchmarks/bench_search.py: on a quiet machine
    the model's own choice 3.8-7.3% behind V-Half and DualPipeV; notes/search.md, "Tuning by
    measurement"). A user choosing a schedule for a long run times
    the few best candidates for some steps and keeps the fastest: ``tune`` does that, the timing
    being the user's ``measure`` (it needs the user's step, data and process group, which the
    library does not hold). The candidates are the programs within ``margin`` of the shortest
    simulated step (the model's error between two programs reaches 5%), at least ``least`` and
    at most ``most`` of them, the best built-in always among them, so the kept program is never
    measured slower than the best built-in by more than the noise of the median. Each round
    times every candidate once, the order rotated by one each round (A/B interleaved: a drift of
    the machine's speed lands on every candidate alike). benchmarks/bench_search.py tunes with
    rounds of its own, then compares the kept program with every built-in in separate rounds, so
    the comparison measures the kept program afresh rather than the luck that made it win.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._plural import brief
from ..schedules import Program, ScheduleError
from ._search import Searched


@dataclass(frozen=True)
class Measured:
    """One candidate of ``tune``.

    Attributes:
        name: where it came from, as in ``Searched.candidates`` (``"DualPipeV"``, ``"exact"``).
        program: the program timed.
        makespan: its simulated step time (``Searched.candidates``).
        times: what ``measure`` returned for it, one per round.
        builtin: whether it is a built-in schedule.
    """

    name: str
    program: Program
    makespan: float
    times: tuple[float, ...]
    builtin: bool

    @property
    def median(self) -> float:
        """The median of ``times``: what ``tune`` ranks candidates by."""
        return statistics.median(self.times)


@dataclass(frozen=True)
class Tuned:
    """What ``tune`` kept.

    Attributes:
        program: the candidate of the lowest median measured time (ties: the one of the shorter
            simulated step, then the first tried); pass it to ``fpipe.pipeline`` as the schedule.
        name: its name, as in ``Searched.candidates``.
        candidates: every candidate timed, by simulated step (ties: in the order ``search``
            tried them), with its times; a program equal to one before it is not timed again.
    """

    program: Program
    name: str
    candidates: tuple[Measured, ...]


def tune(
    found: Searched | Sequence[Searched],
    measure: Callable[[Program], float],
    *,
    margin: float = 0.05,
    least: int = 2,
    most: int = 5,
    rounds: int = 4,
) -> Tuned:
    """Time the programs ``search`` found fastest with ``measure`` and keep the measured fastest.

    Conceptually::

        ranked = sorted(found.candidates, key=makespan)                    # the programs search tried
        ranked = [c for c in ranked if c.program not in ranked_before_it]  # each program once
        picked = [c for c in ranked if c.makespan <= ranked[0].makespan * (1 + margin)]
        picked = ranked[:min(max(len(picked), least), most)]               # + the best built-in
        for r in range(rounds):
            for c in picked[r % n:] + picked[:r % n]:                      # rotated each round
                c.times.append(measure(c.program))
        kept = min(picked, key=median(times))

    (NOTE [measured tuning]). ``measure(program)`` is the caller's: e.g. it runs one step of
    ``fpipe.pipeline(loss_fn, stages, program, parallel=fpipe.Parallelism(group=group))`` on every rank, after a warm-up
    step the first time it sees the program, and returns the slowest rank's wall time (so every
    rank gets the same number). In a distributed job every rank must call ``tune`` with the same
    ``found`` (e.g. ``search`` on rank 0, broadcast) and a ``measure`` that agrees across ranks:
    ``tune`` calls ``measure`` with the same candidates in the same order on every rank, and the
    program it keeps depends only on the numbers ``measure`` returns.

    Args:
        found: what ``search`` returned, or several (e.g. one per placement: their candidates are
            pooled, in order).
        measure: the seconds (or any unit, the same for all) one step of a program takes.
        margin: the candidates are the programs whose simulated step is within this fraction of
            the shortest (``0.05``: 5% longer at most), ...
        least: ... at least this many of them (the next shortest where fewer are that close), ...
        most: ... at most this many, the best built-in always among them (it replaces the last
            where it is not), when any built-in fits.
        rounds: how many times each candidate is measured.

    Examples:
        >>> from fpipe.planning import search, tune
        >>> from fpipe.schedules import Costs
        >>> found = search(4, 8, Costs(0.5, 0.5, 0.5, send=0.5), placement="v")  # 27 to ZB-V's 32.5
        >>> def measure(program):  # a real one times a step; here the searched program is slower
        ...     return 2.0 if program is found.program else 1.0
        >>> tuned = tune(found, measure)  # the searched 27 and the list's 28.5; ZB-V replaces the 28.5
        >>> [(c.name, c.makespan, c.median) for c in tuned.candidates], tuned.name
        ([('list(I/W, forward first, deep first, memory)', 27.0, 2.0), ('ZeroBubbleV', 32.5, 1.0)], 'ZeroBubbleV')

    Raises:
        ScheduleError: for a ``margin`` that is not a finite number ``>= 0``, counts that are not
            positive ints or ``least > most``, ``found`` other than what ``search`` returned (a
            ``found.program`` among them), a ``measure`` that is not callable or returns something
            other than a finite number ``>= 0`` (the message names the candidate and the round).
    """
    several = isinstance(found, Sequence) and not isinstance(found, str)
    pooled = [found] if isinstance(found, Searched) else list(found) if several else []
    if not pooled or not all(isinstance(f, Searched) for f in pooled):
        wrong = next((f for f in pooled if not isinstance(f, Searched)), found)
        fix = (
            "Pass the Searched itself (found, not found.program): tune times its candidates"
            if isinstance(wrong, Program)
            else "Pass found = fpipe.planning.search(...)"
        )
        raise ScheduleError(
            f"fpipe.planning.tune: found must be what search returned, or a non-empty sequence of those "
            f"(found: {brief(found) if wrong is found else f'a sequence holding {brief(wrong)}'}). {fix}."
        )
    if not callable(measure):
        raise ScheduleError(
            "fpipe.planning.tune: measure must be a function measure(program) -> seconds "
            f"(measure: {brief(measure)}). "
            "Pass a function that runs one step of the program it is given and returns its time."
        )
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf:
        raise ScheduleError(
            f"fpipe.planning.tune: margin must be a finite number >= 0 (margin: {brief(margin)}). "
            "Pass a fraction of the shortest simulated step, e.g. 0.05."
        )
    for label, value in (("least", least), ("most", most), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(
                f"fpipe.planning.tune: {label} must be a positive int ({label}: {brief(value)}). Pass an int >= 1."
            )
    if least > most:
        raise ScheduleError(
            f"fpipe.planning.tune: least must not exceed most (least: {least}, most: {most}). Raise most."
        )
    tried = [
        (name, makespan, program, k < f.builtins)
        for f in pooled
        for k, ((name, makespan), program) in enumerate(zip(f.candidates, f.programs))
    ]
    ranked = []
    seen: set[Program] = set()  # equal programs (two policies laying out the same) are timed once
    for t in sorted(tried, key=lambda t: t[1]):  # stable: ties in the order tried
        if t[2] not in seen:
            seen.add(t[2])
            ranked.append(t)
    close = [t for t in ranked if t[1] <= ranked[0][1] * (1 + margin)]
    picked = ranked[: min(max(len(close), least), most)]
    best_builtin = next((t for t in ranked if t[3]), None)
    if best_builtin is not None and all(t is not best_builtin for t in picked):
        picked[-1] = best_builtin
    times: list[list[float]] = [[] for _ in picked]
    n = len(picked)
    for r in range(rounds):
        for k in [*range(r % n, n), *range(r % n)]:
            seconds = measure(picked[k][2])
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
                raise ScheduleError(
                    f"fpipe.planning.tune: measure must return a finite number >= 0 (candidate: {picked[k][0]!r}, "
                    f"round: {r}, returned: {brief(seconds)}). Return the step's time in seconds, e.g. a float."
                )
            times[k].append(float(seconds))
    candidates = tuple(
        Measured(name=name, program=program, makespan=makespan, times=tuple(t), builtin=builtin)
        for (name, makespan, program, builtin), t in zip(picked, times)
    )
    kept = min(candidates, key=lambda c: c.median)  # ties: the first, the shorter simulated step
    return Tuned(program=kept.program, name=kept.name, candidates=candidates)
