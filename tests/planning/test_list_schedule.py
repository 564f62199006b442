"""The list scheduler and its bounds (fpipe/planning/_list_schedule.py, NOTE [list scheduler]).

References: 1F1B's own program (a fused, backward-first pass admitting its fill on equal
costs lays out exactly that), a single rank's work (no program beats it, every pass meets it),
``simulate``'s makespan of the program a pass returns, and the memory limit it keeps. The
``search`` that tries the passes is tested in test_search.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fpipe.planning._bound import lower_bound
from fpipe.planning._improve import peak_memory
from fpipe.planning._list_schedule import Policy, fill, list_schedule
from fpipe.planning._problem import Problem
from fpipe.schedules import Costs, OneFOneB, simulate, validate

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


def test_a_pass_that_does_not_reserve_runs_the_forward_that_fits_as_the_optimum_does() -> None:
    """Two stages per rank, ``p = 2``, ``m = 4``, messages of 1, a limit of 3 microbatches'
    footprint (NOTE [unreserved memory]): reserving, rank 0 admits 3 microbatches and waits for
    the first backward before the fourth (19.5); without, it runs all 4 first-stage forwards, as
    the exact search's optimum does (16.5, notes/search.md's small cases)."""
    costs = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5, send=1.0)
    prob = Problem(4, (0, 1, 0, 1), (costs,) * 4, (0.5,) * 4, (3.0, 3.0))
    reserving = list_schedule(prob, Policy(split=True, extra=None))
    unreserved = list_schedule(prob, Policy(split=True, extra=None, reserve=False))
    assert reserving is not None and unreserved is not None
    assert reserving[1] == 19.5 and unreserved[1] == 16.5
    assert [str(a) for a in unreserved[0].ranks[0][:4]] == ["0F0", "0F1", "0F2", "0F3"]
    assert max(simulate(unreserved[0], costs).peak_activations) <= 6  # in stage units (0.5 each): 3.0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    p=st.integers(1, 3),
    m=st.integers(1, 6),
    layout=st.sampled_from(["looped 1", "looped 2", "looped 3", "v"]),
    data=st.data(),
)
def test_a_pass_that_does_not_reserve_never_deadlocks_and_keeps_the_limit(
    p: int, m: int, layout: str, data: st.DataObject
) -> None:
    """Random per-stage costs and activation sizes, limits from one microbatch's footprint up:
    every policy without reservation finishes (NOTE [unreserved memory]) within the limit."""
    v = 2 if layout == "v" else int(layout.split()[1])
    S = p * v
    rank_of = tuple(min(s, 2 * p - 1 - s) if layout == "v" else s % p for s in range(S))
    number = st.floats(0.1, 3.0)
    costs = tuple(
        Costs(forward=data.draw(number), backward_input=data.draw(number), backward_weight=data.draw(number))
        for _ in range(S)
    )
    sizes = tuple(data.draw(st.floats(0.1, 2.0)) for _ in range(S))
    footprints = [sum(sizes[s] for s in range(S) if rank_of[s] == r) for r in range(p)]
    limits = tuple(f * data.draw(st.floats(1.0, 3.0)) for f in footprints)
    prob = Problem(m, rank_of, costs, sizes, limits)
    for policy in POLICIES:
        laid_out = list_schedule(prob, replace(policy, reserve=False))
        assert laid_out is not None, policy
        program, makespan = laid_out
        validate(program)
        assert simulate(program, costs).makespan == pytest.approx(makespan)
        assert all(peak <= limit * (1 + 1e-9) for peak, limit in zip(peak_memory(program, sizes), limits))
