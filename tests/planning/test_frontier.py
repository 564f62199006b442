"""What may run next (fpipe/planning/_frontier.py, NOTE [what may run next]): the rule compiled from
``dependencies``, and every part of the engine that asks it agreeing with ``simulate`` to the bit:
the frontier's makespan of rows, local improvement's, the schedule-aware split's step, each list
pass and the exact search's program."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from fpipe.planning._arguments import checked_problem
from fpipe.planning._exact import exact
from fpipe.planning._frontier import Frontier, makespan
from fpipe.planning._improve import makespan_of
from fpipe.planning._list_schedule import list_schedule
from fpipe.planning._policies import policies
from fpipe.planning._schedule_split import _SplitClock
from fpipe.planning._search import builtin_programs
from fpipe.schedules import Action, Costs, GPipe, OneFOneB, Program, ScheduleError, simulate
from fpipe.schedules._program import dependencies


def test_the_rule_is_dependencies_compiled() -> None:
    """``inputs`` names, for every action of every stage, exactly what ``dependencies`` does (the
    backward's input from the next stage as a backward, ``B`` or ``I``), and ``taker`` inverts it."""
    for S in range(1, 6):
        frontier = Frontier(2, tuple(s % 2 for s in range(S)), [0.5] * S)
        for s in range(S):
            for kind in "FBIW":
                expected = [
                    (d.stage, "B" if d.kind in "BI" else d.kind)
                    for d in dependencies(Action(s, kind, 0), S, frozenset())
                ]
                assert [(t, k) for t, k, _ in frontier.inputs(s, kind)] == expected, (S, s, kind)
            for kind in "FB":
                for t, k, _ in frontier.inputs(s, kind):
                    assert t == s or frontier.taker(k, t) == s
        assert frontier.taker("W", 0) is None


def test_latencies_are_the_sender_s_between_ranks_only() -> None:
    frontier = Frontier(1, (0, 1, 1, 0), [0.5, 0.25, 2.0, 4.0])
    assert frontier.up == [0.0, 0.5, 0.0, 2.0] and frontier.down == [0.25, 0.0, 4.0, 0.0]
    assert frontier.forward(0, 0) == 0.0 and frontier.forward(1, 0) == math.inf  # nothing ran yet
    frontier.ran("F", 0, 0, 1.0)
    assert frontier.forward(1, 0) == 1.5 and frontier.backward(0, 0) == math.inf
    frontier.forget("F", 0, 0)
    assert frontier.forward(1, 0) == math.inf


def test_the_makespan_of_rows_out_of_microbatch_order_and_of_a_deadlock() -> None:
    """Rows need not run a stage's microbatches in order (a backward of microbatch 1 first)."""
    rows = [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 1), Action(0, "B", 0)]]
    rows += [[Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1), Action(1, "B", 0)]]
    costs = [Costs(backward=2, send=0.5), Costs(forward=2, backward=3, send=0.25)]
    frontier = Frontier(2, (0, 1), [c.send for c in costs])
    made = makespan(frontier, rows, lambda a: costs[a.stage].of(a.kind))
    assert made == simulate(Program.from_lists(rows), costs).makespan
    stuck = [[Action(0, "B", 0), Action(0, "F", 0)]]
    assert makespan(Frontier(1, (0,), [0.0]), stuck, lambda a: 1.0) == math.inf


def costs_of_a_stage(inputs: list[float], sends: list[float]) -> st.SearchStrategy[Costs]:
    """A stage's costs; the split's test takes dyadic ones, as its stage costs are differences of
    prefix sums where ``simulate``'s are the sums."""
    return st.builds(
        lambda f, i, w, fused, send: Costs(forward=f, backward_input=i, backward_weight=w, backward=fused, send=send),
        st.sampled_from([0.5, 1.0, 1.5, 3.0]),
        st.sampled_from(inputs),
        st.sampled_from([0.25, 1.0, 2.0]),
        st.sampled_from([None, 1.0, 2.5, 4.0]),
        st.sampled_from(sends),
    )


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([("looped", 1), ("looped", 2), ("v", 2)]),
    st.integers(1, 3),
    st.integers(1, 4),
    st.lists(costs_of_a_stage([0.5, 1.0, 0.7], [0.0, 0.3, 1.0]), min_size=6, max_size=6),
    st.sampled_from([None, 1.0, 1.5, 3.0]),
)
def test_every_part_that_asks_what_may_run_next_is_simulate_s_clock(
    placement: tuple[str, int], p: int, m: int, stage_costs: list[Costs], memory: float | None
) -> None:
    """The property: on random problems, every program the engine lays out or replays (the
    built-ins, each list pass, shaken ones, the exact search's) has, by each consumer's own
    clock, exactly ``simulate``'s makespan, and the frontier's rows end each action where
    ``simulate`` does."""
    kind, v = placement
    S = 2 * p if kind == "v" else p * v
    costs = stage_costs[:S]
    try:
        problem = checked_problem(p, m, costs, kind, v, memory, None)
    except ScheduleError:  # a memory limit below what one microbatch needs: no problem to lay out
        return
    programs = [program for _, program in builtin_programs(problem, kind)]
    for k, policy in enumerate(list(policies(problem))[:6]):
        for pass_ in (policy, replace(policy, seed=k)):
            laid_out = list_schedule(problem, pass_)
            assert laid_out is not None
            assert laid_out[1] == simulate(laid_out[0], costs).makespan, pass_  # the list scheduler's clock
            programs.append(laid_out[0])
    if S * m <= 8:
        found, span, outcome = exact(problem, math.inf, time.perf_counter() + 10)
        assert found is not None and outcome == "optimal"
        assert span == simulate(found, costs).makespan  # the exact search's clock
        programs.append(found)
    frontier = Frontier.of(problem)
    for program in programs:
        sim = simulate(program, costs)
        assert makespan_of(problem, program.ranks, frontier) == sim.makespan  # local improvement's clock
        makespan(frontier, program.ranks, lambda a: costs[a.stage].of(a.kind))
        for row, ends in zip(program.ranks, sim.ends):
            for a, end in zip(row, ends):
                if a.kind != "W":
                    assert (frontier.end_f if a.kind == "F" else frontier.end_b)[a.stage][a.microbatch] == end


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.lists(costs_of_a_stage([0.5, 1.0, 2.0], [0.0, 0.25, 1.0]), min_size=3, max_size=6),
)
def test_the_split_s_step_is_simulate_s_clock(name: str, layers: list[Costs]) -> None:
    """The schedule-aware split replays one program with each split's stage costs: its step is
    ``simulate``'s, to the bit, for every split."""
    program = (GPipe(3) if name == "gpipe" else OneFOneB(3)).program(3)
    clock = _SplitClock(program, layers)
    n = len(layers)
    for a in range(1, n - 1):
        for b in range(a + 1, n):
            stages = [layers[:a], layers[a:b], layers[b:]]
            per_stage = [
                Costs(
                    forward=sum(c.forward for c in group),
                    backward_input=sum(c.backward_input for c in group),
                    backward_weight=sum(c.backward_weight for c in group),
                    backward=sum(c.of("B") for c in group),
                    send=group[-1].send,
                )
                for group in stages
            ]
            assert clock.step((a, b)) == simulate(program, per_stage).makespan
