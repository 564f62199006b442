"""Fitting: the per-stage costs that ``simulate`` reproduces a measured timeline with.

``fit_costs`` reads a timeline measured by ``fpipe.record()`` (or several) and estimates the
per-stage costs: median durations, message latency, and the runtime's per-action overhead and
receive cost (NOTE [per-action overhead] in ``fpipe/schedules/_simulate.py``), so that
``simulate(program, fit_costs(measured))`` predicts the measured step and can then be asked about
other schedules or microbatch counts with the same stages (``search`` takes them).

NOTE [fitting the overhead]
    ``fit_costs`` estimates the overhead and the receive cost per rank from the gaps ``start(a) - end(previous action)``
    (for all but a rank's first action), in three passes:

    1. ``overhead``: the median gap before the actions that take no message (all dependencies
       on the rank). In the model that gap is exactly the overhead.
    2. ``send`` of a stage, provisionally: the median of ``start(a) - end(d) - overhead`` over
       the actions ``a`` that waited for a message from ``d`` of that stage (``d`` ended after
       the rank's previous action did).
    3. ``receive``: the median gap, less the overhead, before the actions that take a message
       that was there in time, by that provisional latency (``end(d) + send <= end(previous
       action)``). In the model that gap is exactly ``overhead + receive``. Then ``send`` is
       refitted as ``start(a) - end(d) - overhead - receive`` over the actions that waited.

    A rank without the actions a pass needs gets the median over the other ranks' samples (or 0
    without any); negative medians count as 0. On a simulated timeline whose every rank has
    both kinds of samples this gives the costs back exactly (the tests check it).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..schedules import Costs, Simulation, validate
from ..schedules._action import KINDS
from ..schedules._program import dependencies, split_backwards
from ..schedules._simulate import checked

MIN_DURATION = 1e-9  # what fit_costs charges for a measured duration of zero (or less, clock skew)


def fit_costs(timeline: Simulation | Sequence[Simulation]) -> tuple[Costs, ...]:
    """Per-stage ``Costs`` estimated from measured timelines, so that ``simulate`` reproduces them.

    Conceptually, for each stage ``s``::

        forward  = median(end - start of every sF<i> recorded)      # and likewise B, I, W
        overhead = median(start(a) - end(action before a) for every action a on s's rank, but
                          its first, that takes no message from another rank)
        receive  = median(start(a) - end(action before a) - overhead, for every action a on
                          s's rank, but its first, whose message from another rank was there
                          before the action before a ended)
        send     = median(start(a) - end(d) - overhead - receive of a's rank, for every action
                          a that waited for a message from stage s: its dependency d ran on
                          another rank and ended after the action before a on a's rank did)

    The executor records an action's start once its inputs have arrived (see ``fpipe.record``),
    so ``start(a) - end(d)`` is how long the message took, whenever ``a``'s rank was already free
    when ``d`` ended. A mere gap before ``a`` does not show a wait: receiving a message that is
    already there takes time too, and that would charge the whole of ``d``'s head start as
    latency. A stage whose messages never made anyone wait gets the median latency over all
    stages, and ``send=0.0`` when no action waited at all. A negative median (a message received
    before its sender's action returned, or clocks that differ between machines) counts as 0.
    The overhead and the receive cost are the rank's, "there before" uses a provisional latency,
    and a rank without samples gets the median over all ranks: NOTE [fitting the overhead].

    Kinds the program does not run keep a value that ``Costs`` accepts and ``simulate`` never
    uses: a stage with only fused backwards gets ``backward`` = the median ``B`` and
    ``backward_input = backward_weight = backward / 2``; a stage with only split backwards gets
    the medians of ``I`` and ``W`` and ``backward=None``; a stage with both gets all three.
    Durations are clamped to at least ``MIN_DURATION`` (1e-9) so that an action too short for the
    clock still makes a valid ``Costs``.

    Args:
        timeline: a timeline from ``fpipe.record()`` (``recording.timeline``), or several
            (``recording.timelines``), whose durations and latencies are pooled. They may be of
            different programs of one placement: record a program with split backwards and one
            with fused ones to fit ``I``, ``W`` and ``B`` (a fused ``B`` often costs less than
            ``I + W``, which a program of split backwards alone cannot show).
            Simulated timelines work too: ``fit_costs(simulate(program, costs))`` gives ``costs``
            back when each stage sends some message that an action waits for, as defined above,
            and the stages of a rank share one overhead and one receive cost.

    Returns:
        One ``Costs`` per stage, in stage order, in the timeline's unit (seconds when measured).

    Examples:
        >>> from fpipe.planning import fit_costs
        >>> from fpipe.schedules import Costs, GPipe, simulate
        >>> costs = (Costs(forward=1, backward=2, send=0.5), Costs(forward=2, backward=4, send=0.25))
        >>> fitted = fit_costs(simulate(GPipe(num_microbatches=2).program(2), costs))
        >>> [(c.forward, c.of("B"), c.send) for c in fitted]
        [(1.0, 2.0, 0.5), (2.0, 4.0, 0.25)]

    Raises:
        ScheduleError: for no timeline, timelines of programs that place the stages on different
            ranks, or a timeline whose times do not match its program.
        TypeError: if ``timeline`` holds something other than ``Simulation`` objects.
    """
    timelines = checked("fpipe.planning.fit_costs", timeline)
    for program in {t.program for t in timelines}:
        validate(program)
    program = timelines[0].program  # every program places the stages as this one
    rank_of = program.placement()
    durations: dict[tuple[int, str], list[float]] = {}
    waits: list[tuple[int, int, float]] = []  # (waiting rank, sending stage, start(a) - end(d))
    local: dict[int, list[float]] = {}  # per rank, the gaps before actions that take no message
    early: list[tuple[int, int, float, float]] = []  # (rank, sending stage, free - end(d), gap): no wait
    for t in timelines:
        split = split_backwards(t.program)
        end_of = {a: end for _, a, _, end in t.intervals()}
        for _, a, start, end in t.intervals():  # the median does not depend on the order
            durations.setdefault((a.stage, a.kind), []).append(end - start)
        for r, (row, starts, ends) in enumerate(zip(t.program.ranks, t.starts, t.ends)):
            for pos, a in enumerate(row):
                free = ends[pos - 1] if pos else 0.0
                remote = [d for d in dependencies(a, program.num_stages, split) if rank_of[d.stage] != r]
                sender = max(remote, key=lambda d: end_of[d]) if remote else None
                if sender is not None and end_of[sender] > free:  # the rank was free before its input left
                    waits.append((r, sender.stage, starts[pos] - end_of[sender]))
                elif pos and sender is None:
                    local.setdefault(r, []).append(starts[pos] - free)
                elif pos and sender is not None:
                    early.append((r, sender.stage, free - end_of[sender], starts[pos] - free))
    num_ranks = len(program.ranks)
    overhead = _per_rank_medians(local, num_ranks)  # NOTE [per-action overhead], pass 1
    provisional = _latencies(waits, overhead, [0.0] * num_ranks, program.num_stages)  # pass 2
    there: dict[int, list[float]] = {}  # pass 3
    for r, stage, head_start, gap in early:
        if provisional[stage] <= head_start:
            there.setdefault(r, []).append(gap - overhead[r])
    receive = _per_rank_medians(there, num_ranks)
    latency = _latencies(waits, overhead, receive, program.num_stages)

    def median(s: int, kind: str) -> float | None:
        values = durations.get((s, kind))
        return max(statistics.median(values), MIN_DURATION) if values else None

    fitted = []
    for s in range(program.num_stages):
        forward, fused, inp, wgt = (median(s, kind) for kind in KINDS)
        assert forward is not None and (fused is not None or (inp is not None and wgt is not None)), "validated"
        if inp is None or wgt is None:
            assert fused is not None
            inp = wgt = max(fused / 2, MIN_DURATION)
        fitted.append(
            Costs(
                forward=forward,
                backward_input=inp,
                backward_weight=wgt,
                backward=fused,
                send=latency[s],
                overhead=overhead[rank_of[s]],
                receive=receive[rank_of[s]],
            )
        )
    return tuple(fitted)


def _per_rank_medians(samples: dict[int, list[float]], num_ranks: int) -> list[float]:
    """Each rank's median sample, the median over all ranks' for a rank without any (0 without
    any at all); negative medians count as 0."""
    pooled = [x for values in samples.values() for x in values]
    overall = max(statistics.median(pooled), 0.0) if pooled else 0.0
    return [max(statistics.median(samples[r]), 0.0) if r in samples else overall for r in range(num_ranks)]


def _latencies(
    waits: Sequence[tuple[int, int, float]], overhead: Sequence[float], receive: Sequence[float], num_stages: int
) -> list[float]:
    """Per sending stage, the median wait beyond the waiting rank's overhead and receive cost; the
    median over all stages for a stage that made no one wait (0 when none did); at least 0."""
    latencies: dict[int, list[float]] = {}
    for r, stage, waited in waits:
        latencies.setdefault(stage, []).append(waited - overhead[r] - receive[r])
    everywhere = [x for values in latencies.values() for x in values]
    fallback = max(statistics.median(everywhere), 0.0) if everywhere else 0.0
    return [max(statistics.median(latencies[s]), 0.0) if s in latencies else fallback for s in range(num_stages)]
