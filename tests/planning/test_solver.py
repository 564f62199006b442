"""The constraint solver (fpipe/planning/_solver.py, NOTE [constraint solver]) against every
program on 2 ranks and 2 or 3 microbatches, against the branch and bound on random small
problems, where the branch and bound does not reach, with costs it must round, and its errors."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fpipe.planning._arguments as arguments_module
import fpipe.planning._search as search_module
from fpipe.planning import search
from fpipe.planning._arguments import checked_problem
from fpipe.planning._bound import lower_bound
from fpipe.planning._exact import exact
from fpipe.planning._improve import peak_memory
from fpipe.planning._problem import Problem
from fpipe.planning._solver import available, solve
from fpipe.schedules import Costs, Program, ScheduleError, simulate, validate
from tests.planning._programs import fastest_program, first_pass

pytestmark = pytest.mark.skipif(not available(), reason="OR-Tools is not installed (pip install 'fpipe[solver]')")

CASES = [  # (costs of stage 0, of stage 1, microbatches, memory limit per rank), as test_exact.py's
    (Costs(), Costs(), 2, math.inf),
    (
        Costs(backward_weight=0.3, send=1.0),
        Costs(forward=3, backward_input=3, backward_weight=0.9, send=1.0),
        2,
        math.inf,
    ),
    (Costs(backward_weight=2, send=0.3), Costs(forward=2, backward_input=2, backward_weight=4, send=0.3), 2, 1.0),
    (Costs(backward=1.5), Costs(backward=1.5, send=0.5), 2, 1.0),
    (Costs(backward=1.5), Costs(backward=1.5, send=0.5), 3, 1.0),
    (Costs(backward_weight=2, backward=2), Costs(backward_weight=2, backward=2), 3, math.inf),  # issue 34
]


def assert_the_engines_agree(problem: Problem, limit: float) -> None:
    """From a list-scheduled program, the solver proves the optimum the branch and bound proves,
    and its program (if it beats the hint) is valid and within ``limit`` on every rank."""
    hint, span = first_pass(problem)
    _, optimum, outcome = exact(problem, span, time.perf_counter() + 60)
    program, makespan, solved = solve(problem, hint, span, lower_bound(problem), time.perf_counter() + 60)
    assert outcome == solved == "optimal" and makespan == pytest.approx(optimum)
    if program is not None:
        validate(program)
        assert max(peak_memory(program, problem.sizes)) <= limit * (1 + 1e-9)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_program_found_is_the_fastest_of_every_program(case: tuple[Costs, Costs, int, float]) -> None:
    *costs, m, limit = case
    problem = Problem(m, (0, 1), (costs[0], costs[1]), (1.0, 1.0), (limit, limit))
    optimum, _ = fastest_program(problem, math.inf)
    hint, span = first_pass(problem)
    program, makespan, outcome = solve(problem, hint, span, lower_bound(problem), time.perf_counter() + 120)
    assert outcome == "optimal" and makespan == pytest.approx(optimum)
    if program is not None:  # None: the hint was already optimal
        validate(program)
        assert simulate(program, list(costs)).makespan == pytest.approx(makespan)
        assert max(peak_memory(program, problem.sizes)) <= limit


@settings(max_examples=12, deadline=None)
@given(
    placement=st.sampled_from(["looped", "v"]),
    m=st.integers(2, 4),
    heavy=st.sampled_from([1, 2, 3]),
    weight=st.sampled_from([0.3, 1.0, 2.0]),
    send=st.sampled_from([0.0, 0.3, 1.0]),
    fused=st.sampled_from([None, 0.8]),
    memory=st.sampled_from([None, 1.0, 1.5, 3.0]),
)
def test_the_optimum_is_the_branch_and_bound_s(
    placement: str, m: int, heavy: int, weight: float, send: float, fused: float | None, memory: float | None
) -> None:
    """Two ranks of two stages (looped or V), split or cheaper fused backwards: both engines
    prove the same optimum. (With a fused ``B`` between ``I`` and ``I + W`` every backward is a
    choice, and the branch and bound takes up to a second at ``m = 3``, up to a minute at ``m =
    4``: notes/search.md.)"""
    if fused is not None:
        m = min(m, 3)
    light = Costs(forward=0.5, backward_input=0.5, backward_weight=weight / 2, send=send)
    costs = [light] * 3 + [
        Costs(forward=heavy / 2, backward_input=heavy / 2, backward_weight=heavy * weight / 2, send=send)
    ]
    if fused is not None:
        costs = [
            Costs(c.forward, c.backward_input, c.backward_weight, fused * (c.backward_input + c.backward_weight), send)
            for c in costs
        ]
    problem = checked_problem(2, m, costs, placement, 2, memory, None)
    assert_the_engines_agree(problem, math.inf if memory is None else memory)


def test_it_proves_an_optimum_the_list_scheduler_misses_by_18_percent() -> None:
    """notes/search.md's third table: the V on 4 ranks, 8 microbatches, ``W = 0.3 I``, messages of
    one forward, memory ``p / 2``: the list scheduler and its moves end at 66.45, the optimum of
    the space is 56.35."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.15, send=1.0)] * 8
    listed = search(4, 8, costs, placement="v", memory=2, exact=False)
    found = search(4, 8, costs, placement="v", memory=2, solver="cp-sat", time_budget=300)
    validate(found.program)
    assert listed.makespan == pytest.approx(66.45)
    assert found.name == "exact (CP-SAT)" and found.optimal and found.makespan == pytest.approx(56.35)
    assert found.simulation.makespan == pytest.approx(56.35) and max(found.peak_memory) <= 2


def test_costs_it_must_round_give_a_valid_program_never_claimed_optimal() -> None:
    """Costs of no small common denominator (fitted ones): the model is rounded, the program is
    checked by replaying it with the true costs, and nothing is claimed proven."""
    costs = [Costs(forward=0.0123457, backward_input=0.0134571, backward_weight=0.00456789, send=0.00314159)] * 4
    problem = checked_problem(2, 4, costs, "v", 2, 1.5, None)
    hint, span = first_pass(problem)
    program, makespan, outcome = solve(problem, hint, span, lower_bound(problem), time.perf_counter() + 60)
    assert outcome == "ended" and makespan <= span
    if program is not None:
        validate(program)
        assert simulate(program, costs).makespan == pytest.approx(makespan, rel=1e-12)
        assert max(peak_memory(program, problem.sizes)) <= 1.5 * (1 + 1e-9)


def test_a_solver_stopped_without_a_proof_is_cut_however_much_time_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """CP-SAT stopped before its proof (here at once, as it stops on its own a little before
    fpipe's deadline) reports ``FEASIBLE`` or ``UNKNOWN``: the outcome is ``"cut"`` and ``search``
    says ``complete=False``, with most of its budget left (issue 34: it said ``complete=True``
    whenever the clock had not run out). The case of the test above: proving it takes seconds."""
    from ortools.sat.python import cp_model

    statuses: list[int] = []

    class Stopped(cp_model.CpSolver):  # type: ignore[misc]
        def solve(self, model: cp_model.CpModel, *args: object) -> int:
            self.parameters.max_time_in_seconds = 0.0
            statuses.append(super().solve(model, *args))
            return statuses[-1]

    monkeypatch.setattr(cp_model, "CpSolver", Stopped)
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.15, send=1.0)] * 8
    problem = checked_problem(4, 8, costs, "v", 2, 2, None)
    hint, span = first_pass(problem)
    program, makespan, outcome = solve(problem, hint, span, lower_bound(problem), time.perf_counter() + 600)
    assert outcome == "cut" and statuses and all(x in (cp_model.FEASIBLE, cp_model.UNKNOWN) for x in statuses)
    assert makespan <= span and (program is None or simulate(program, costs).makespan == pytest.approx(makespan))
    found = search(4, 8, costs, placement="v", memory=2, solver="cp-sat", time_budget=600)
    assert not found.complete and not found.optimal and found.lower_bound < found.makespan
    validate(found.program)


def test_memory_in_bytes_is_taken_exactly() -> None:
    """Sizes and limits in bytes (a rank holds 3 MB a microbatch under a limit of 7 MB): the
    solver proves the optimum the branch and bound proves, within the limit."""
    costs = [Costs(backward_weight=0.5, send=0.3)] * 4
    problem = checked_problem(2, 4, costs, "v", 2, 7e6, [1e6, 2e6, 2e6, 1e6])
    assert_the_engines_agree(problem, 7e6)


def test_a_solver_that_is_not_installed_or_unknown_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ScheduleError, match=r"unknown solver .*'gurobi'.*Use 'auto', 'cp-sat' or 'branch-and-bound'"):
        search(2, 4, Costs(), solver="gurobi")  # type: ignore[arg-type]
    monkeypatch.setattr(search_module, "solver_available", lambda: False)
    monkeypatch.setattr(arguments_module, "solver_available", lambda: False)
    with pytest.raises(ScheduleError, match=r"needs OR-Tools \(pip install 'fpipe\[solver\]'\)"):
        search(2, 4, Costs(), solver="cp-sat")
    engines: list[str] = []

    def branch_and_bound(*args: object) -> tuple[Program | None, float, bool]:
        engines.append("branch and bound")
        return exact(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(search_module, "branch_and_bound", branch_and_bound)
    monkeypatch.setattr(search_module, "solve", lambda *args: pytest.fail("the solver ran"))
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.15, send=1.0)] * 4
    found = search(2, 4, costs, placement="v", memory=1)  # auto, OR-Tools missing: the branch and bound
    assert engines == ["branch and bound"] and found.optimal


def test_asked_for_by_name_it_runs_beyond_the_small_problems() -> None:
    """The V on 5 ranks, 4 microbatches, ``W = 0.3 I``, messages of one forward, memory ``p / 2``:
    past ``p <= 4`` ``search`` runs no exact search unless told ``solver="cp-sat"``; then CP-SAT
    proves 41.6 optimal where the list scheduler and its moves end at 49.45."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.15, send=1.0)] * 10
    listed = search(5, 4, costs, placement="v", memory=2.5)
    found = search(5, 4, costs, placement="v", memory=2.5, solver="cp-sat", time_budget=300)
    validate(found.program)
    assert not listed.optimal and listed.makespan == pytest.approx(49.45)
    assert found.name == "exact (CP-SAT)" and found.optimal and found.makespan == pytest.approx(41.6)
    assert max(found.peak_memory) <= 2.5


def test_it_charges_each_action_its_overhead_and_receive_cost() -> None:
    """Per-action costs (NOTE [per-action overhead]) reach the model through the charged
    durations: the kept program's simulation with the given costs is the makespan ``search``
    reports, and no slower than without the solver. A fused ``B`` pays the overhead once where
    ``I`` and ``W`` pay it twice (0.8 against 0.85 here, with the receive cost), so some
    backwards are fused: 40.3 (40.5 when all had to be split or all fused)."""
    costs = [Costs(forward=0.5, backward_input=0.5, backward_weight=0.15, send=1.0, overhead=0.05, receive=0.1)] * 6
    listed = search(3, 4, costs, placement="v", memory=1.5, exact=False)
    found = search(3, 4, costs, placement="v", memory=1.5, solver="cp-sat", time_budget=300)
    validate(found.program)
    assert found.name == "exact (CP-SAT)" and found.optimal
    assert found.makespan == pytest.approx(simulate(found.program, costs).makespan) == pytest.approx(40.3)
    assert found.makespan < listed.makespan and max(found.peak_memory) <= 1.5
