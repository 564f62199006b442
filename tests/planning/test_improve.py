"""Local improvement (fpipe/planning/_improve.py): its makespan is simulate's clock, and the swaps
and kicks it keeps give a valid, faster program within memory."""

from __future__ import annotations

import math
import time

import pytest

from fpipe.planning._arguments import checked_problem
from fpipe.planning._exact import exact
from fpipe.planning._improve import improve, kicked, makespan_of, peak_memory
from fpipe.planning._list_schedule import Policy, list_schedule
from fpipe.planning._policies import policies
from fpipe.planning._search import builtin_programs
from fpipe.schedules import Action, Costs, InterleavedZeroBubble, simulate, validate

SLOW = [Costs(backward_weight=0.3, send=1.0)] * 7 + [Costs(forward=2, backward_input=2, backward_weight=0.6, send=1.0)]


@pytest.mark.parametrize("placement, v", [("looped", 1), ("looped", 2), ("v", 2)])
def test_the_makespan_is_simulate_s(placement: str, v: int) -> None:
    p = 4 if placement == "v" or v == 2 else 8
    costs = SLOW[-2 * p :] if placement == "v" else SLOW[-p * v :]
    problem = checked_problem(p, 8, costs, placement, v, None, None)
    programs = [program for _, program in builtin_programs(problem, placement)]
    programs += [laid_out[0] for policy in policies(problem) if (laid_out := list_schedule(problem, policy))]
    for program in programs:
        assert makespan_of(problem, program.ranks) == pytest.approx(simulate(program, costs).makespan)


def test_the_makespan_of_rows_that_deadlock_is_infinite() -> None:
    problem = checked_problem(1, 1, Costs(), "looped", 1, None, None)
    assert makespan_of(problem, [[Action(0, "I", 0), Action(0, "F", 0), Action(0, "W", 0)]]) == math.inf


def test_swaps_make_a_list_scheduled_program_faster_within_memory() -> None:
    """Two stages per rank, p = 2, messages of 0.15, 1F1B's memory: the program of the list pass
    that reserves memory (14.4) loses 0.2 to swaps of neighbouring actions."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.5, send=0.15)] * 4
    problem = checked_problem(2, 4, costs, "looped", 2, 2, None)
    laid_out = list_schedule(problem, Policy(split=True, extra=None))
    assert laid_out is not None
    program, makespan, finished = improve(problem, *laid_out, sweeps=4, reach=1, deadline=time.perf_counter() + 60)
    assert program is not None and finished
    validate(program)
    assert laid_out[1] == pytest.approx(14.4) and makespan == pytest.approx(14.2)
    assert makespan == pytest.approx(simulate(program, costs).makespan)
    assert max(peak_memory(program, problem.sizes)) <= 2


def test_kicks_reach_the_optimum_where_single_moves_stop() -> None:
    """Two stages per rank, p = 2, m = 4, messages of 1, 1F1B's memory: no single move makes
    interleaved zero bubble's program (21) faster; kicks (NOTE [kicks]) reach 19.5, the exact
    search's optimum (notes/search.md's small cases), valid and within memory."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.5, send=1.0)] * 4
    problem = checked_problem(2, 4, costs, "looped", 2, 2, None)
    program = InterleavedZeroBubble(4, stages_per_rank=2).program(4, 2)
    assert simulate(program, costs).makespan == 21
    deadline = time.perf_counter() + 60
    assert improve(problem, program, 21, sweeps=4, reach=3, deadline=deadline) == (None, 21, True)
    kept, makespan, finished = kicked(problem, program, 21, kicks=20, bound=0.0, deadline=deadline)
    assert kept is not None and finished
    validate(kept)
    assert makespan == simulate(kept, costs).makespan == 19.5
    assert max(peak_memory(kept, problem.sizes)) <= 2
    assert exact(problem, math.inf, deadline)[1:] == (19.5, "optimal")


def test_moves_and_kicks_the_deadline_stops_say_so() -> None:
    """A sweep is never cut in the middle, but none starts after the deadline: the swaps of the
    test above keep a move in their first sweep, so a second was due and did not run
    (``finished`` False); kicks past the deadline run none."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.5, send=0.15)] * 4
    problem = checked_problem(2, 4, costs, "looped", 2, 2, None)
    laid_out = list_schedule(problem, Policy(split=True, extra=None))
    assert laid_out is not None
    program, makespan, finished = improve(problem, *laid_out, sweeps=4, reach=1, deadline=-math.inf)
    assert program is not None and makespan < laid_out[1] and not finished
    assert kicked(problem, *laid_out, kicks=20, bound=0.0, deadline=-math.inf) == (None, laid_out[1], False)
