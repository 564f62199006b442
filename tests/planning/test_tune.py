"""tune: the candidates it picks, the order it measures them in, the program it keeps, clear errors."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

import fpipe
from fpipe.planning import Searched, search, tune
from fpipe.schedules import Costs, Program, ScheduleError, simulate

SLOW_MESSAGES = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5, send=0.5)


@pytest.fixture(scope="module")
def found() -> Searched:
    """Built-ins ZB-V 32.5, DualPipeV 34, V-Half 39.5, V-Min 49.5, then two list programs 28.5 and 27."""
    found = search(4, 8, SLOW_MESSAGES, placement="v")
    assert found.candidates[found.builtins :] == (
        ("list(I/W, backward first, deep first, memory)", 28.5),
        ("list(I/W, forward first, deep first, memory)", 27.0),
    )
    assert [t for _, t in found.candidates[: found.builtins]] == [32.5, 34.0, 39.5, 49.5]
    return found


def scripted(found: Searched, times: dict[str, list[float]], calls: list[str]) -> Any:
    """A ``measure`` that returns, per candidate name, the next of its scripted times, logging the calls."""
    names = {id(program): name for (name, _), program in zip(found.candidates, found.programs)}

    def measure(program: Program) -> float:
        name = names[id(program)]
        calls.append(name)
        return times[name][sum(1 for c in calls if c == name) - 1]

    return measure


@pytest.mark.parametrize(
    ("margin", "least", "most", "expected"),
    [
        (0.06, 2, 5, [27.0, 32.5]),  # 27 and 28.5 within 6%; ZB-V, the best built-in, replaces 28.5
        (0.3, 2, 5, [27.0, 28.5, 32.5, 34.0]),  # within 30%: 4 programs, ZB-V among them
        (1.0, 2, 5, [27.0, 28.5, 32.5, 34.0, 39.5]),  # all 6 within 100%, at most 5
        (0.0, 3, 5, [27.0, 28.5, 32.5]),  # only 27 within 0%: at least 3
        (0.0, 1, 1, [32.5]),  # one only: the best built-in
    ],
)
def test_the_candidates_are_the_close_ones_at_least_least_at_most_most_with_the_best_builtin(
    found: Searched, margin: float, least: int, most: int, expected: list[float]
) -> None:
    tuned = tune(found, lambda program: 1.0, margin=margin, least=least, most=most, rounds=1)
    assert [c.makespan for c in tuned.candidates] == expected
    for c in tuned.candidates:
        assert c.program in found.programs and c.builtin == (c.name in dict(found.candidates[: found.builtins]))
        assert simulate(c.program, SLOW_MESSAGES).makespan == c.makespan == dict(found.candidates)[c.name]


def test_each_round_measures_every_candidate_once_in_an_order_rotated_by_one(found: Searched) -> None:
    calls: list[str] = []
    times = {name: [1.0] * 4 for name, _ in found.candidates}
    tuned = tune(found, scripted(found, times, calls), margin=0.3, most=3, rounds=4)
    a, b, c = (m.name for m in tuned.candidates)
    assert calls == [a, b, c, b, c, a, c, a, b, a, b, c]
    assert all(m.times == (1.0,) * 4 for m in tuned.candidates)


def test_it_keeps_the_lowest_median_deterministically(found: Searched) -> None:
    times = {
        "list(I/W, forward first, deep first, memory)": [1.0, 9.0, 1.0, 9.0, 9.0],  # median 9
        "list(I/W, backward first, deep first, memory)": [3.0, 3.0, 3.0, 3.0, 3.0],  # median 3
        "ZeroBubbleV": [2.0, 2.0, 50.0, 3.0, 3.0],  # median 3, a longer simulated step
        "DualPipeV": [4.0, 4.0, 4.0, 1.0, 1.0],  # median 4, though the fastest twice
    }
    runs = []
    for _ in range(2):
        calls: list[str] = []
        runs.append(tune(found, scripted(found, times, calls), margin=0.3, rounds=5))
    assert runs[0] == runs[1]
    tuned = runs[0]
    assert tuned.name == "list(I/W, backward first, deep first, memory)"  # a tie at 3: the shorter simulated step
    assert tuned.program is found.programs[[n for n, _ in found.candidates].index(tuned.name)]
    assert {m.name: m.median for m in tuned.candidates} == {name: sorted(t)[2] for name, t in times.items()}
    assert {m.name: m.times for m in tuned.candidates} == {name: tuple(t) for name, t in times.items()}


def test_the_candidates_of_several_searches_are_pooled() -> None:
    costs = [Costs()] * 3 + [Costs(forward=3, backward_input=3, backward_weight=3)]
    looped = search(2, 4, costs, stages_per_rank=2, exact=False)
    v = search(2, 4, costs, placement="v", exact=False)
    tuned = tune([looped, v], lambda program: 1.0, margin=100.0, most=100, rounds=1)
    pooled = sorted(zip(looped.candidates + v.candidates, looped.programs + v.programs), key=lambda c: c[0][1])
    once = [c for k, c in enumerate(pooled) if all(c[1] != d[1] for d in pooled[:k])]
    assert len(once) < len(pooled)  # two policies laid out the same program: it is timed once
    assert [(m.name, m.makespan, m.program) for m in tuned.candidates] == [(n, t, q) for (n, t), q in once]
    builtins = {n for n, _ in looped.candidates[: looped.builtins] + v.candidates[: v.builtins]}
    assert all(m.builtin == (m.name in builtins) for m in tuned.candidates)
    assert {m.name for m in tuned.candidates if m.builtin} == {n for (n, _), _ in once if n in builtins}
    assert tuned.name == tuned.candidates[0].name  # equal times: the shortest simulated step


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": -0.1}, r"margin must be a finite number >= 0 \(margin: -0.1, type float\)"),
        ({"margin": math.nan}, r"margin must be a finite number >= 0 \(margin: nan, type float\)"),
        ({"margin": math.inf}, r"margin must be a finite number >= 0 \(margin: inf, type float\)"),
        ({"margin": True}, r"margin must be a finite number >= 0 \(margin: True, type bool\)"),
        ({"least": 0}, r"least must be a positive int \(least: 0, type int\)"),
        ({"most": 1.5}, r"most must be a positive int \(most: 1.5, type float\)"),
        ({"rounds": 0}, r"rounds must be a positive int \(rounds: 0, type int\)"),
        ({"rounds": True}, r"rounds must be a positive int \(rounds: True, type bool\)"),
        ({"least": 3, "most": 2}, r"least must not exceed most \(least: 3, most: 2\)"),
    ],
)
def test_bad_arguments_are_a_clear_error_before_any_measure(found: Searched, kwargs: dict, match: str) -> None:
    calls: list[Program] = []
    with pytest.raises(ScheduleError, match=match):
        tune(found, lambda program: calls.append(program) or 1.0, **kwargs)
    assert calls == []


@pytest.mark.parametrize("found_value", [[], ["not a search"], "x", 5, None])
def test_found_must_be_searches(found_value: Any) -> None:
    with pytest.raises(ScheduleError, match="found must be what search returned"):
        tune(found_value, lambda program: 1.0)


def test_a_program_for_found_or_a_number_for_measure_names_the_fix_in_a_few_lines(found: Searched) -> None:
    """found.program instead of found, a number instead of measure: the argument, its type, the fix,
    and not the program's whole repr (4,094 characters at these sizes)."""
    calls: list[Program] = []
    for call, fragment, fix in [
        (lambda: tune(found.program, calls.append), "(found: type Program, repr of", "found, not found.program"),
        (lambda: tune([found, found.program], calls.append), "a sequence holding type Program", "not found.program"),
        (
            lambda: tune(found, 1.0),
            "measure must be a function measure(program) -> seconds (measure: 1.0, type float)",
            "Pass a function that runs one step",
        ),
    ]:
        with pytest.raises(ScheduleError) as raised:
            call()  # type: ignore[no-untyped-call]
        message = str(raised.value)
        assert message.startswith("fpipe.planning.tune: ") and fragment in message and fix in message, message
        assert len(message) < 400, message
    assert calls == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, None, "1", True])
def test_a_bad_measure_names_the_candidate_and_the_round(found: Searched, bad: Any) -> None:
    returned = iter([1.0, 1.0, 1.0, bad])
    with pytest.raises(ScheduleError, match="measure must return a finite number >= 0") as raised:
        tune(found, lambda program: next(returned), margin=0.06)
    # round 0: the 27 and ZB-V; round 1, rotated: ZB-V, then the 27 returns the bad value
    assert (
        "(candidate: 'list(I/W, forward first, deep first, memory)', round: 1, "
        f"returned: {bad!r}, type {type(bad).__name__})" in str(raised.value)
    )


def test_a_real_step_timed_keeps_a_candidate_that_computes_the_true_gradients() -> None:
    """One process, 4 tiny stages in a V on 2 ranks: ``measure`` times a real step of each candidate."""
    torch.manual_seed(0)
    params = [torch.randn(3, 3, dtype=torch.float64) for _ in range(4)]
    batch = torch.randn(8, 3, dtype=torch.float64)
    stages = [lambda p, x: torch.tanh(x @ p)] * 4

    def loss_fn(y: torch.Tensor, microbatch: torch.Tensor) -> torch.Tensor:
        return (y**2).mean()

    def measure(program: Program) -> float:
        step = fpipe.pipeline(loss_fn, stages, program)
        started = time.perf_counter()
        step(params, batch)
        return time.perf_counter() - started

    costs = [Costs(send=0.3)] * 3 + [Costs(forward=3, backward_input=3, backward_weight=3, send=0.3)]
    found = search(2, 4, costs, placement="v", exact=False)
    tuned = tune(found, measure, margin=0.5, rounds=2)
    assert any(tuned.program is m.program for m in tuned.candidates) and tuned.name in dict(found.candidates)
    assert len(tuned.candidates) >= 2 and all(len(m.times) == 2 for m in tuned.candidates)
    loss, grads = fpipe.pipeline(loss_fn, stages, tuned.program)(params, batch)

    def whole(p: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
        for stage, q in zip(stages, p):
            b = stage(q, b)
        return loss_fn(b, b)

    expected_grads, expected_loss = torch.func.grad_and_value(whole)(params, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=0)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
