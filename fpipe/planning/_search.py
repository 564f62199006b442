"""Search: the fastest program for measured costs and a memory limit, never slower than a built-in.

``search`` puts four sources of programs side by side and keeps the one ``simulate`` finds
fastest (ties: the first found), or with a ``slack`` the one holding the least memory within it
(NOTE [memory within the slack]):

1. every built-in schedule that lays out the placement and fits the memory limit;
2. list-scheduled programs (``fpipe.planning._list_schedule``, after the Zero Bubble authors'
   automatic scheduler), one per ``Policy`` of a grid over split or fused backwards, the order
   of kinds and of a rank's stages, how many microbatches a rank admits and whether ``W`` waits;
3. for programs of at most ``LOCAL_ACTIONS`` actions, the fastest of ``SHAKEN_PASSES`` passes
   that depart from their policy at random (NOTE [shaken passes]), and the best of those and of
   the above with actions of a rank moved a few places while it gets faster
   (``fpipe.planning._improve``), then on programs of at most ``KICKED_ACTIONS`` actions
   kicked out of where moves stop and improved again (NOTE [kicks]);
4. for small problems (``p <= 4``, ``m <= 8``), an exact search seeded with the best of the
   above: OR-Tools' CP-SAT when installed (``fpipe.planning._solver``, NOTE [constraint
   solver]), else a branch and bound (``fpipe.planning._exact``, NOTE [exact search]).

Then it compares the winner with ``lower_bound`` (``fpipe.planning._bound``, NOTE [release
bound]: every rank's work from when its inputs can first arrive, the trips through the
pipeline, the ``W`` that must free memory, ...): a program that meets it is optimal. So is one
the exact search ran to its end without beating: its space holds a program as fast as any valid
one (NOTE [microbatch order] in ``_exact.py``).

With ``overlap=True`` and costs with communication, each program tried is tried again with its
adjacent forwards and backwards paired (``pair_adjacent``, NOTE [overlapped time] in
``fpipe/schedules/_simulate.py``). The list scheduler, local improvement and the exact search do
not know pairs (they lay out orders; pairs are added to what they found), so the result is then
optimal only when it meets the bound of compute alone (NOTE [overlapped bound]).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ..schedules import Costs, Program, ScheduleError, Simulation, simulate
from ..schedules._action import BACKWARD
from ..schedules._overlapped import pair_adjacent
from ..schedules._registry import builtins_for
from ._arguments import checked_search
from ._bound import lower_bound
from ._exact import exact as branch_and_bound
from ._improve import improve, kicked, peak_memory
from ._list_schedule import list_schedule
from ._policies import LOCAL_ACTIONS, policies
from ._problem import TOLERANCE, Problem
from ._solver import available as solver_available
from ._solver import solve

EXACT_RANKS, EXACT_MICROBATCHES = 4, 8  # the largest problems the exact search is tried on
LOCAL_SWEEPS, LOCAL_REACH = 4, 3  # its most sweeps over the rows, and how far it moves an action
SHAKEN_PASSES, SHAKEN_POLICIES = 60, 4  # shaken passes tried on those programs, of the likeliest policies
KICKED_ACTIONS, KICKS = 100, 20  # the largest programs iterated local search is tried on, and its kicks


@dataclass(frozen=True)
class Searched:
    """What ``search`` found.

    Attributes:
        program: the fastest program found, or with a ``slack`` the leanest within it (pass it
            to ``fpipe.pipeline`` as the schedule).
        simulation: ``simulate(program, costs)``.
        name: where it came from: a built-in schedule (``"ZeroBubbleH1"``), a list-scheduling
            policy (``"list(I/W, backward first, ...)"``, ``"..., shaken 7)"`` for a shaken
            pass), the best of those improved by moving actions a few places (``"list swaps of
            ZeroBubbleH1"``) and kicked (``"list kicks of ..."``), or the exact search (``"exact"``,
            ``"exact (CP-SAT)"``); with ``overlap``, any of them with its pairs
            (``"Overlapped(OneFOneB)"``).
        lower_bound: a makespan no program can beat (``makespan / lower_bound - 1`` is how far
            from it the program may be); never above ``makespan`` (where the two differ by
            rounding only, the bound is the makespan).
        complete: ``True`` only when every part of the search that runs for this problem ran
            to its end: every list pass, shaken pass, sweep and kick, and the exact search by
            its own account (the branch and bound exhausted its space; CP-SAT reported
            ``OPTIMAL`` or ``INFEASIBLE``, not ``FEASIBLE`` or ``UNKNOWN``), however much of the
            budget is left; ``False`` when the budget cut any of them short.
        optimal: ``True`` when no valid program is faster: none that ``validate`` accepts
            (actions and microbatches in any order, each backward fused or split on its own)
            takes less time under ``simulate`` with these costs within the memory limit. It is
            proven one of two ways: the program meets ``lower_bound``, or the exact search ran
            to its end without beating it or proved it optimal (NOTE [exact search] and NOTE
            [microbatch order] in ``_exact.py``). ``False`` when neither happened: the budget
            cut the search, the problem is beyond the exact search's sizes (or
            ``exact=False``), CP-SAT had to round the costs (NOTE [constraint solver]), or
            ``slack`` kept a slower program. With ``overlap`` and communication, only the first
            way counts, against the bound of compute alone (NOTE [overlapped bound]).
        peak_memory: per rank, the most memory its live activations take, in the unit of
            ``memory`` (activation units, or bytes with ``activation_sizes``).
        candidates: ``(name, makespan)`` of every program tried that fits the memory limit, in
            the order tried: the built-ins first.
        programs: the program of each of ``candidates``, in the same order (``tune`` times the
            fastest few of them, NOTE [measured tuning] in ``_tune.py``).
        builtins: how many of ``candidates`` (the first ones) are built-in schedules.
    """

    program: Program
    simulation: Simulation
    name: str
    lower_bound: float
    complete: bool
    optimal: bool
    peak_memory: tuple[float, ...]
    candidates: tuple[tuple[str, float], ...]
    programs: tuple[Program, ...]
    builtins: int

    @property
    def makespan(self) -> float:
        """The simulated step time of ``program``."""
        return self.simulation.makespan


def search(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | Sequence[Costs],
    *,
    placement: Literal["looped", "v"] = "looped",
    stages_per_rank: int = 1,
    memory: float | Sequence[float] | None = None,
    activation_sizes: Sequence[float] | None = None,
    time_budget: float = 10.0,
    exact: bool = True,
    solver: Literal["auto", "cp-sat", "branch-and-bound"] = "auto",
    slack: float = 0.0,
    overlap: bool = False,
) -> Searched:
    """The fastest program found for these ranks, microbatches, costs and memory limit.

    Conceptually::

        tried = [s.program(num_stages, num_ranks) for s in built_in_schedules]   # fitting memory
        tried += [list_schedule(problem, policy) for policy in policies]         # until the budget
        tried += [min(shaken_list_schedule(problem, seed) for seed in range(60))]  # if small
        tried += [improve(min(tried[:-1])), improve(tried[-1])]                   # moves, if small
        tried += [kicked(min(tried))]                                             # if smaller
        if small or solver == "cp-sat": tried += [exact(problem)]  # CP-SAT or branch and bound
                                                                   # (small: p <= 4 and m <= 8)
        best = min(tried, key=lambda program: simulate(program, costs).makespan)
        if slack: best = min(within(tried + passes_under_lower_limits, slack), key=peak_memory)

    so its simulated step time is never above any built-in's that fits the same placement and
    memory (notes/search.md shows by how much it is below, and how far above ``lower_bound``).
    The program is plain data: ``fpipe.pipeline(loss_fn, stages, searched.program)`` runs it.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``.
        costs: one ``Costs`` for every stage, or one per stage (``p * stages_per_rank`` of them,
            ``2p`` for the V): e.g. ``fit_costs(recording.timeline)``.
        placement: ``"looped"`` (stage ``s`` on rank ``s % p``) or ``"v"`` (two stages per
            rank, rank ``r`` holding ``r`` and ``2p - 1 - r``, as ``ZeroBubbleV``).
        stages_per_rank: stages per rank of the looped placement (the V has 2).
        memory: the most activations a rank may hold at once: one number for every rank or one
            per rank, in activation units (NOTE [activation units] in ``_simulate.py``: 1F1B's
            rank 0 holds ``p``), or in bytes with ``activation_sizes``; ``None``: no limit.
        activation_sizes: per stage, the bytes of activations one microbatch leaves in it; then
            ``memory`` is in bytes.
        time_budget: seconds to spend; when they run out the best program so far is returned
            with ``complete=False`` (at least one list-scheduled program is built, unless a
            built-in already meets ``lower_bound``). The policies tried, the shaken passes
            and the swaps and kicks kept (fixed seeds) depend on the clock only when it runs out.
        exact: run the exact search on problems of at most 4 ranks and 8 microbatches (on any
            size with ``solver="cp-sat"``), for the rest of the budget, unless the program
            already meets ``lower_bound``; ``False``: never (then only a budget that runs out
            makes the result depend on the machine's speed).
        solver: the exact search's engine. ``"cp-sat"``: OR-Tools' constraint solver (``pip
            install 'fpipe[solver]'``; NOTE [constraint solver] in ``_solver.py``), which proves
            in seconds optima the branch and bound does not reach, and asked for by name runs on
            problems of any size for the rest of the budget (at ``p = 8, m = 16`` with slow
            messages it finds programs 20% faster than the list scheduler's in 30 s), but may
            return another program of the same makespan on another call: in a distributed job,
            search on one rank and share the program (the runtime refuses ranks that run
            different programs).
            ``"branch-and-bound"``: fpipe's own (NOTE [exact search] in ``_exact.py``), the same
            program every call unless the budget runs out. ``"auto"``: CP-SAT when OR-Tools is
            installed, else the branch and bound.
        slack: how much longer than the shortest simulated step a program may be and still count
            as fast: of the programs tried within ``(1 + slack)`` of the shortest, ``search``
            keeps the one that holds the least memory (its busiest rank's peak), ties to the
            shorter step; so it may be up to ``slack`` slower in simulation than a built-in that
            fits. ``0`` keeps the fastest simulated program. With costs fitted from a recording,
            ``slack=0.02`` is the better choice (NOTE [memory within the slack]).
        overlap: also try each program with its adjacent forwards and backwards paired
            (``pair_adjacent``: the order kept, pairs added), which hides the stages'
            ``communication`` behind the other half's compute (NOTE [overlapped time]), and keep
            the faster under ``simulate``: the fastest programs first, while the budget lasts.
            Only costs with communication gain from pairs (without, a pair is never faster than
            its halves in sequence, and none is tried).

    Examples:
        >>> from fpipe.planning import search
        >>> from fpipe.schedules import Costs
        >>> slow_messages = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5, send=0.5)
        >>> found = search(4, 8, slow_messages, placement="v")
        >>> found.makespan, dict(found.candidates)["ZeroBubbleV"], found.lower_bound, found.optimal
        (27.0, 32.5, 27.0, True)
        >>> heavy_last = [Costs()] * 3 + [Costs(forward=2, backward_input=2, backward_weight=2)]
        >>> found = search(4, 8, heavy_last, memory=2)  # half of 1F1B's: no built-in fits
        >>> found.name, found.makespan, found.lower_bound, max(found.peak_memory)
        ('list(I/W, backward first, deep first, memory)', 51.0, 51.0, 2.0)

    Raises:
        ScheduleError: for counts that are not positive ints, costs of the wrong number of stages,
            an unknown placement, sizes, limits or a budget that are not positive finite numbers, or
            a memory limit below what one microbatch needs on some rank (the message says the least),
            an unknown ``solver``, or ``solver="cp-sat"`` without OR-Tools installed.
        TypeError: if ``costs`` is neither a ``Costs`` nor a sequence of them.
    """
    started = time.perf_counter()
    if not isinstance(overlap, bool):
        raise ScheduleError(f"fpipe.planning.search: overlap must be True or False (overlap: {overlap!r}).")
    problem = checked_search(
        num_ranks,
        num_microbatches,
        costs,
        placement,
        stages_per_rank,
        memory,
        activation_sizes,
        time_budget,
        solver,
        slack,
    )
    deadline = started + float(time_budget)
    bound = lower_bound(problem)
    given = costs if isinstance(costs, Costs) else tuple(costs)
    tried: list[tuple[str, float, Program]] = []
    # The built-ins' simulations, by program: the makespan of problem.costs (charged), and the one
    # to return should a built-in win (NOTE [per-action overhead]: the same ends).
    simulations: dict[int, Simulation] = {}
    for name, program in builtin_programs(problem, placement):
        if all(
            peak <= limit * (1 + TOLERANCE) for peak, limit in zip(peak_memory(program, problem.sizes), problem.limits)
        ):
            simulations[id(program)] = simulate(program, given)
            tried.append((name, simulations[id(program)].makespan, program))
    builtins = len(tried)
    reserving = list(tried)
    complete = True
    met = any(t <= bound * (1 + TOLERANCE) for _, t, _ in tried)
    for k, policy in enumerate(policies(problem)):
        if met:
            break
        if k and time.perf_counter() > deadline:
            complete = False
            break
        laid_out = list_schedule(problem, policy)
        assert laid_out is not None, "a list-scheduling pass admits only what it can finish (NOTE [list scheduler])"
        tried.append((str(policy), laid_out[1], laid_out[0]))
        reserving += [tried[-1]] if policy.reserve else []
        met = laid_out[1] <= bound * (1 + TOLERANCE)
    name, best, program = min(tried, key=lambda t: t[1])
    optimal = best <= bound * (1 + TOLERANCE)
    actions = problem.num_stages * num_microbatches * 3
    if complete and not optimal and actions <= LOCAL_ACTIONS:
        # Each part says whether it ran to its end (the deadline cut nothing): complete is their
        # conjunction, never the clock read afterwards.
        # improved from each of: the best of the built-ins and reserving passes, the best of all, the best shaken
        shaken, complete = _shaken(problem, deadline)
        tried += [shaken] if shaken is not None else []
        starts = [*([min(reserving, key=lambda t: t[1])] if reserving else []), (name, best, program)]
        starts += [shaken] if shaken is not None else []
        starts = [start for k, start in enumerate(starts) if all(start[2] != other[2] for other in starts[:k])]
        for start, span, started_from in starts:
            improved = started_from
            for reach in (1, LOCAL_REACH):  # swaps first: moves from where they end are never worse
                better, span, finished = improve(problem, improved, span, LOCAL_SWEEPS, reach, deadline)
                improved = improved if better is None else better
                complete = complete and finished
            if improved is not started_from:
                tried.append((f"list swaps of {start}", span, improved))
            if span < best:
                name, best, program = tried[-1] if improved is not started_from else (start, span, started_from)
            if best <= bound * (1 + TOLERANCE):
                break
        if best > bound * (1 + TOLERANCE) and actions <= KICKED_ACTIONS:
            better, span, finished = kicked(problem, program, best, KICKS, bound, deadline)
            complete = complete and finished
            if better is not None:
                name, program, best = f"list kicks of {name}", better, span
                tried.append((name, best, program))
        optimal = best <= bound * (1 + TOLERANCE)
    small = num_ranks <= EXACT_RANKS and num_microbatches <= EXACT_MICROBATCHES
    if exact and complete and not optimal and (small or solver == "cp-sat"):
        solving = solver == "cp-sat" or (solver == "auto" and solver_available())
        if solving:
            found, makespan, outcome = solve(problem, program, best, bound, deadline)
        else:
            found, makespan, outcome = branch_and_bound(problem, best, deadline)
        if found is not None:
            tried.append(("exact (CP-SAT)" if solving else "exact", makespan, found))
            name, best, program = tried[-1]
        optimal = outcome == "optimal"
        complete = outcome != "cut"  # the engine's own status: a solver stopped without a proof is cut
    if slack:
        lean, finished = leaner(problem, tried, slack, deadline)
        tried += lean
        complete = complete and finished
    if overlap and any(c.communication for c in problem.costs):
        paired, finished = _paired(tried, given, deadline)
        tried += paired
        complete = complete and finished
        name, best, program = min(tried, key=lambda t: t[1])
        bound = lower_bound(_computing(problem))  # NOTE [overlapped bound]
        optimal = best <= bound * (1 + TOLERANCE)
    kept = leanest(tried, slack, problem.sizes) if slack else (name, best, program)
    optimal = optimal and kept[1] <= best * (1 + TOLERANCE)  # a leaner program within the slack may be slower
    simulation = simulations.get(id(kept[2]))
    return Searched(
        program=kept[2],
        simulation=simulate(kept[2], given) if simulation is None else simulation,
        name=kept[0],
        lower_bound=min(bound, best),
        complete=complete,
        optimal=optimal,
        peak_memory=peak_memory(kept[2], problem.sizes),
        candidates=tuple((n, t) for n, t, _ in tried),
        programs=tuple(program for _, _, program in tried),
        builtins=builtins,
    )


def leanest(
    tried: Sequence[tuple[str, float, Program]], slack: float, sizes: Sequence[float]
) -> tuple[str, float, Program]:
    """Of ``tried`` (``(name, makespan, program)``), the program that holds the least memory (its
    busiest rank's peak) among those within ``slack`` of the shortest step, ties to the shorter
    step, then to the first tried.

    NOTE [memory within the slack]
        ``simulate`` charges an action the same time whatever else its rank holds, but on a
        real device a program that keeps more activations alive runs its actions slower (on a
        CPU, a larger working set and more fresh allocations) and leaves less memory for the
        model. With costs fitted from a recording, programs within a few percent of each other
        are within the fit's error, and the leanest of them is the safer choice: on a 2-core CPU
        (measured by benchmarks/bench_search.py), list-scheduled programs holding
        3 to 4 times ZB-V's activations for a simulated gain of 0.05 to 1.5% measured slower
        than the lean programs beside them. ``slack=0`` keeps the fastest simulated program
        (``search`` does not call this then).
    """
    ceiling = min(t for _, t, _ in tried) * (1 + slack)
    within = [t for t in tried if t[1] <= ceiling * (1 + TOLERANCE)]
    return min(within, key=lambda t: (max(peak_memory(t[2], sizes)), t[1]))


def leaner(
    problem: Problem, tried: Sequence[tuple[str, float, Program]], slack: float, deadline: float
) -> tuple[list[tuple[str, float, Program]], bool]:
    """List passes under lower memory limits, for ``leanest`` (NOTE [memory within the slack]):
    each peak that a program of ``tried`` holds, below the least that one within ``slack`` of the
    shortest step holds, in increasing order, until a limit gives programs within the slack (all
    of that limit's passes, named ``"<policy> under <limit>"``) or ``deadline`` passes; and
    whether it ran to its end (``False``: the deadline stopped it)."""
    ceiling = min(t for _, t, _ in tried) * (1 + slack)
    peaks = {id(q): max(peak_memory(q, problem.sizes)) for _, _, q in tried}
    lean = min(peaks[id(q)] for _, t, q in tried if t <= ceiling * (1 + TOLERANCE))
    least = max(problem.footprint(r) for r in range(problem.num_ranks))
    for limit in sorted({x for x in peaks.values() if least <= x < lean * (1 - TOLERANCE)}):
        limited = replace(problem, limits=tuple(min(x, limit) for x in problem.limits))
        found: list[tuple[str, float, Program]] = []
        for policy in policies(limited):
            if time.perf_counter() > deadline:
                return found, False
            laid_out = list_schedule(limited, policy)
            assert laid_out is not None, "a list-scheduling pass admits only what it can finish (NOTE [list scheduler])"
            if laid_out[1] <= ceiling * (1 + TOLERANCE):
                found.append((f"{policy} under {limit:g}", laid_out[1], laid_out[0]))
        if found:
            return found, True
    return [], True


def _shaken(problem: Problem, deadline: float) -> tuple[tuple[str, float, Program] | None, bool]:
    """The fastest of ``SHAKEN_PASSES`` shaken passes (NOTE [shaken passes] in
    ``_list_schedule.py``) of the first ``SHAKEN_POLICIES`` policies in turn, seeds 0, 1, ...
    (``None`` if ``deadline`` passed before the first), and whether all of them ran."""
    likeliest = list(itertools.islice(policies(problem), SHAKEN_POLICIES))
    best: tuple[str, float, Program] | None = None
    for seed in range(SHAKEN_PASSES):
        if time.perf_counter() > deadline:
            return best, False
        policy = replace(likeliest[seed % len(likeliest)], seed=seed)
        laid_out = list_schedule(problem, policy)
        assert laid_out is not None, "a shaken pass makes choices a pass may make (NOTE [shaken passes])"
        if best is None or laid_out[1] < best[1]:
            best = str(policy), laid_out[1], laid_out[0]
    return best, True


def _paired(
    tried: Sequence[tuple[str, float, Program]], costs: Costs | tuple[Costs, ...], deadline: float
) -> tuple[list[tuple[str, float, Program]], bool]:
    """``tried``'s programs with their adjacent forwards and backwards paired (``pair_adjacent``),
    named ``"Overlapped(<name>)"``, fastest first, the first whatever the clock; and whether all
    were (``False``: ``deadline`` passed)."""
    found: list[tuple[str, float, Program]] = []
    seen: list[Program] = []
    for k, (name, _, program) in enumerate(sorted(tried, key=lambda t: t[1])):
        if k and time.perf_counter() > deadline:
            return found, False
        if program in seen:
            continue
        seen.append(program)
        paired = pair_adjacent(program)
        if paired.pairs != program.pairs:
            found.append((f"Overlapped({name})", simulate(paired, costs).makespan, paired))
    return found, True


def _computing(problem: Problem) -> Problem:
    """``problem`` with each ``F``, ``B`` and ``I`` shortened by its communication.

    NOTE [overlapped bound]
        A pair lasts at least its halves' compute, ``sum(d - c)`` (NOTE [overlapped time] in
        ``fpipe/schedules/_simulate.py``), and an action alone its duration ``d``; drawing a
        pair's halves one after the other in ``d - c`` each ends every action no later, so a
        program with pairs takes at least as long as the same order without pairs whose
        actions last ``d - c``, and ``lower_bound`` of these costs bounds every program, paired
        or not. (An action all communication is given ``TOLERANCE`` of its duration, as
        ``Costs`` wants it positive.)
    """
    return replace(
        problem,
        costs=tuple(
            replace(
                c,
                forward=max(c.forward - c.communication, c.forward * TOLERANCE),
                backward_input=max(c.backward_input - c.communication, c.backward_input * TOLERANCE),
                backward=max(c.of(BACKWARD) - c.communication, c.of(BACKWARD) * TOLERANCE),
                communication=0.0,
            )
            for c in problem.costs
        ),
    )


def builtin_programs(problem: Problem, placement: str) -> Iterator[tuple[str, Program]]:
    """``(name, program)`` of every built-in schedule that lays out ``problem``'s placement
    (``fpipe/schedules/_registry.py``), in the registry's order."""
    p, m, S = problem.num_ranks, problem.num_microbatches, problem.num_stages
    v = S // p
    for builtin in builtins_for(placement, v, p, m):
        yield builtin.name, builtin.build(m, v).program(S, p)
