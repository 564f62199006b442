"""The list scheduler and its bounds (fpipe/schedules/_list_schedule.py, NOTE [list scheduler]).

References: 1F1B's own program (a fused, backward-first pass admitting its fill on equal
costs lays out exactly that), a single rank's work (no program beats it, every pass meets it),
``simulate``'s makespan of the program a pass returns, and the memory limit it keeps. The
``search`` that tries the passes is tested in test_search.py.
"""

from __future__ import annotations

import math

import pytest

from fpipe.schedules import Costs, OneFOneB, simulate, validate
from fpipe.schedules._bound import lower_bound
from fpipe.schedules._list_schedule import Policy, Problem, fill, list_schedule

POLICIES = [
    Policy(split=True, extra=None),
    Policy(split=True, backward_first=False, extra=None),
    Policy(split=True, extra=1, patient=True),
    Policy(split=False, extra=0),
    Policy(split=False, deep_first=False, extra=2),
]


def problem(p: int, m: int, costs: Costs, limit: float = math.inf, v: int = 1) -> Problem:
    """``p`` ranks holding ``v`` stages each, looped (stage ``s`` on rank ``s % p``), sizes 1."""
    S = p * v
    return Problem(m, tuple(s % p for s in range(S)), (costs,) * S, (1.0,) * S, (limit,) * p)


def test_a_fused_backward_first_pass_on_equal_costs_is_1f1b() -> None:
    costs = Costs(backward=2)
    laid_out = list_schedule(problem(4, 8, costs), Policy(split=False, extra=0))
    assert laid_out is not None
    program, makespan = laid_out
    assert program == OneFOneB(8).program(4)
    assert makespan == simulate(program, costs).makespan == 33  # (m + p - 1) (F + B)


def test_fill_is_1f1b_s_warm_up_on_equal_costs() -> None:
    fused = problem(4, 8, Costs(backward=2))
    assert [fill(fused, r, split=False) for r in range(4)] == [4, 3, 2, 1]  # p - r
    split = problem(4, 8, Costs())  # I comes back after 1, the rank's work is 3: fewer in flight
    assert [fill(split, r, split=True) for r in range(4)] == [3, 2, 2, 1]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_one_rank_meets_its_work_which_is_the_bound(policy: Policy) -> None:
    costs = Costs(forward=1, backward_input=2, backward_weight=0.5)
    one = problem(1, 3, costs)
    laid_out = list_schedule(one, policy)
    assert laid_out is not None
    assert laid_out[1] == lower_bound(one) == 3 * (1 + 2 + 0.5)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize(
    ("p", "m", "costs", "limit", "v"),
    [
        (3, 5, Costs(backward_weight=0.3, send=0.5), math.inf, 1),
        (2, 6, Costs(forward=2, backward_input=1, backward_weight=2, send=1), 2.0, 1),
        (2, 4, Costs(send=0.2), 4.0, 2),
    ],
)
def test_every_pass_is_valid_keeps_simulate_s_clock_and_the_memory_limit(
    policy: Policy, p: int, m: int, costs: Costs, limit: float, v: int
) -> None:
    prob = problem(p, m, costs, limit, v)
    laid_out = list_schedule(prob, policy)
    assert laid_out is not None, policy
    program, makespan = laid_out
    validate(program)
    sim = simulate(program, costs)
    assert sim.makespan == pytest.approx(makespan)
    assert makespan >= lower_bound(prob) - 1e-9
    assert max(sim.peak_activations) <= limit + 1e-9


def test_the_bound_is_the_memory_bound_under_a_tight_limit() -> None:
    """One microbatch alive at a time on each rank: the limit times the makespan covers every
    microbatch's time alive, which is more than the work or the critical path here."""
    costs = Costs()
    free, tight = problem(2, 4, costs), problem(2, 4, costs, limit=1.0)
    assert lower_bound(tight) > lower_bound(free)
    # stage 0's activations live through its F, stage 1's F and I, then its own I and W: 5 per microbatch
    assert lower_bound(free) == 1 + 4 * 3 and lower_bound(tight) == 4 * 5
