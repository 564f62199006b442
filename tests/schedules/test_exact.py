"""The exact search (fpipe/schedules/_exact.py, NOTE [exact search]) against every program of its space.

On 2 ranks and 2 microbatches the space (each stage runs each kind in microbatch order, all
backwards fused or all split, under the memory limit) is small enough to replay every program
with ``simulate``; ``exact`` must return the fastest, valid, with ``simulate``'s makespan, and
nothing when asked to beat that. ``search``, which runs it, is tested in test_search.py.
"""

from __future__ import annotations

import math
import time

import pytest

from fpipe.schedules import Costs, simulate, validate
from fpipe.schedules._exact import exact
from fpipe.schedules._list_schedule import Problem
from fpipe.schedules._search import checked_problem
from tests.schedules._programs import least_makespan

M = 2  # microbatches


CASES = [  # (costs of stage 0, of stage 1, memory limit per rank)
    (Costs(), Costs(), math.inf),
    (Costs(backward_weight=0.3, send=1.0), Costs(forward=3, backward_input=3, backward_weight=0.9, send=1.0), math.inf),
    (Costs(backward_weight=2, send=0.3), Costs(forward=2, backward_input=2, backward_weight=4, send=0.3), 1.0),
    (Costs(backward=1.5), Costs(backward=1.5, send=0.5), 1.0),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_program_found_is_the_fastest_of_the_space(case: tuple[Costs, Costs, float]) -> None:
    *costs, limit = case
    problem = Problem(M, (0, 1), tuple(costs), (1.0, 1.0), (limit, limit))
    optimum = least_makespan(problem.costs, M, limit, fifo=True)
    program, makespan, outcome = exact(problem, math.inf, time.perf_counter() + 600)
    assert outcome == "optimal" and program is not None
    validate(program)
    sim = simulate(program, list(costs))
    assert makespan == pytest.approx(optimum) and sim.makespan == pytest.approx(makespan)
    assert max(sim.peak_activations) <= limit
    # Asked to beat the optimum, it finds nothing and says the bound it was given.
    none, bound, outcome = exact(problem, makespan, time.perf_counter() + 600)
    assert none is None and bound == makespan and outcome == "optimal"


def test_a_search_the_deadline_stops_is_cut() -> None:
    """Past its deadline the branch and bound stops at its next check (every 1024 nodes) and says
    so: ``"cut"``, with the best program found so far, or none."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.15, send=1.0)] * 8
    problem = checked_problem(4, 8, costs, "v", 2, 2, None)
    program, makespan, outcome = exact(problem, math.inf, time.perf_counter() - 1)
    assert outcome == "cut"
    if program is not None:
        validate(program)
        assert simulate(program, costs).makespan == pytest.approx(makespan)
