"""search's argument checks (fpipe/planning/_arguments.py): each wrong argument a clear error,
before any search runs."""

from __future__ import annotations

import math

import pytest

from fpipe.planning import search
from fpipe.schedules import Costs, ScheduleError


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"costs": {"forward": 1}}, TypeError, "costs must be a Costs or a sequence"),
        ({"costs": [Costs()] * 3}, ScheduleError, r"one Costs per stage, 4 for 4 ranks .*len\(costs\): 3"),
        ({"costs": [Costs()] * 3 + [1.0]}, TypeError, "costs must hold Costs only"),
        ({"placement": "zigzag"}, ScheduleError, r"unknown placement \(placement: 'zigzag'\)"),
        ({"placement": "v", "stages_per_rank": 3}, ScheduleError, r"the V places 2 stages .*stages_per_rank: 3"),
        ({"num_ranks": 0}, ScheduleError, r"num_ranks must be a positive int \(num_ranks: 0\)"),
        ({"num_microbatches": 2.5}, ScheduleError, r"num_microbatches must be a positive int"),
        ({"memory": 0.5}, ScheduleError, r"no program fits the memory limit: rank 0 needs 1 activation units"),
        ({"memory": math.nan}, ScheduleError, r"memory must be a positive finite number"),
        ({"memory": [4, 4]}, ScheduleError, r"or one per rank \(4 here\)"),
        ({"activation_sizes": [1.0, -1.0, 1.0, 1.0]}, ScheduleError, r"activation_sizes must hold one positive"),
        ({"time_budget": 0}, ScheduleError, r"time_budget must be a positive number of seconds"),
        ({"time_budget": float("inf")}, ScheduleError, r"time_budget must be a positive number of seconds"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs: dict, error: type, match: str) -> None:
    arguments = {"num_ranks": 4, "num_microbatches": 8, "costs": Costs(), **kwargs}
    with pytest.raises(error, match=match):
        search(arguments.pop("num_ranks"), arguments.pop("num_microbatches"), arguments.pop("costs"), **arguments)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_costs_that_are_not_finite_and_positive_are_refused_before_any_search(bad: float) -> None:
    with pytest.raises(ScheduleError, match=r"fpipe.schedules.Costs: forward must be a finite positive number"):
        search(2, 4, Costs(forward=bad))


def test_the_v_needs_a_full_microbatch_on_every_rank() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 needs 1 activation units .* Use memory >= 1"):
        search(3, 6, Costs(), placement="v", memory=[0.5, 2, 2])


@pytest.mark.parametrize("bad", [-0.01, math.inf, math.nan, True, "0.02"])
def test_a_slack_that_is_not_a_non_negative_fraction_is_refused(bad: object) -> None:
    with pytest.raises(ScheduleError, match=r"slack must be a non-negative finite fraction \(slack: "):
        search(2, 4, Costs(), slack=bad)  # type: ignore[arg-type]
