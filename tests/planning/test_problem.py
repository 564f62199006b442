"""The problem the engine lays out (fpipe/planning/_problem.py): stages on ranks, what a
microbatch holds on a rank at its peak, the messages between stages, the backward a stage waits for."""

from __future__ import annotations

import math

from fpipe.planning._problem import Problem
from fpipe.schedules import Costs


def test_a_v_of_two_ranks() -> None:
    costs = (Costs(send=0.5), Costs(backward=1.5, send=0.25), Costs(send=2.0), Costs(send=4.0))
    problem = Problem(3, (0, 1, 1, 0), costs, (1.0, 2.0, 3.0, 4.0), (5.0, math.inf))
    assert (problem.num_stages, problem.num_ranks) == (4, 2)
    assert problem.stages_of(0) == (0, 3) and problem.stages_of(1) == (1, 2)
    assert (problem.footprint(0), problem.footprint(1)) == (5.0, 5.0)  # every stage's activations at once
    assert problem.hop(0, 1) == 0.5 and problem.hop(1, 2) == 0.0 and problem.hop(2, 3) == 2.0  # 0 on one rank
    assert problem.hop(1, 0) == 0.25  # the sender's latency
    assert problem.backward(1, split=True) == 1.0 and problem.backward(1, split=False) == 1.5
