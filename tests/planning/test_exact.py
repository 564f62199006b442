"""The exact search (fpipe/planning/_exact.py, NOTE [exact search]) against every program.

On 2 ranks and 2 or 3 microbatches, and 3 ranks and 2, every valid program (each rank's actions
in any order, microbatches in any order, each backward fused or split on its own, within the
memory limit) is enumerated (``fastest_program``); ``exact`` must return the fastest, valid,
with ``simulate``'s makespan, and nothing when asked to beat that. ``search``, which runs it,
is tested in test_search.py.
"""

from __future__ import annotations

import math
import time

import pytest

from fpipe.planning._arguments import checked_problem
from fpipe.planning._exact import choices, exact
from fpipe.planning._problem import Problem
from fpipe.schedules import Costs, simulate, validate
from tests.planning._programs import fastest_program, replayed_one_by_one

CASES = [  # (costs per stage, microbatches, memory limit per rank)
    ([Costs(), Costs()], 2, math.inf),
    (
        [Costs(backward_weight=0.3, send=1.0), Costs(forward=3, backward_input=3, backward_weight=0.9, send=1.0)],
        2,
        math.inf,
    ),
    ([Costs(backward_weight=2, send=0.3), Costs(forward=2, backward_input=2, backward_weight=4, send=0.3)], 2, 1.0),
    ([Costs(backward=1.5), Costs(backward=1.5, send=0.5)], 2, 1.0),
    ([Costs(forward=1, backward_input=1, backward_weight=2, backward=2)] * 2, 2, math.inf),  # issue 34: 8, not 9
    ([Costs(forward=1, backward_input=1, backward_weight=2, backward=2)] * 2, 3, math.inf),
    ([Costs(backward=1.5), Costs(backward=1.5, send=0.5)], 3, 1.0),
    (
        [Costs(backward=0.8, send=0.3)] * 2 + [Costs(forward=2, backward_input=2, backward_weight=2, backward=3.5)],
        2,
        1.0,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_program_found_is_the_fastest_of_every_program(case: tuple[list[Costs], int, float]) -> None:
    costs, m, limit = case
    S = len(costs)
    problem = Problem(m, tuple(range(S)), tuple(costs), (1.0,) * S, (limit,) * S)
    program, makespan, outcome = exact(problem, math.inf, time.perf_counter() + 600)
    assert outcome == "optimal" and program is not None
    validate(program)
    sim = simulate(program, list(costs))
    assert sim.makespan == pytest.approx(makespan) and max(sim.peak_activations) <= limit
    assert fastest_program(problem, makespan)[0] == pytest.approx(makespan)  # none faster, and it is one
    # Asked to beat the optimum, it finds nothing and says the bound it was given.
    none, bound, outcome = exact(problem, makespan, time.perf_counter() + 600)
    assert none is None and bound == makespan and outcome == "optimal"


@pytest.mark.parametrize("case", [case for case in CASES if case[1] == 2 and len(case[0]) == 2][-3:], ids=str)
def test_the_enumeration_of_every_program_is_every_pair_of_rows_replayed(case: tuple[list[Costs], int, float]) -> None:
    """The reference itself: ``fastest_program`` against ``simulate`` replaying every pair of
    rows (46 a rank at ``m = 2``: actions in any order, each backward fused or split)."""
    costs, m, limit = case
    problem = Problem(m, (0, 1), tuple(costs), (1.0, 1.0), (limit, limit))
    assert fastest_program(problem, math.inf)[0] == pytest.approx(replayed_one_by_one(costs, m, limit))


def test_a_fused_backward_is_tried_where_it_may_help() -> None:
    """Per stage: ``I`` then ``W`` where a ``B`` costs no less than both (it ends no earlier and
    frees no sooner), ``B`` where it costs no more than ``I`` alone, else either."""
    assert choices(Costs()) == ("I",) and choices(Costs(backward=2.5)) == ("I",)
    assert choices(Costs(backward=1.5)) == ("I", "B") and choices(Costs(backward_input=2, backward=1.5)) == ("B",)


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
