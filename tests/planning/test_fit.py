"""fit_costs (fpipe/planning/_fit.py): the costs of a simulation read back exactly, the overhead
and latency of a noisy or recorded timeline estimated, and clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fpipe
from fpipe.planning import fit_costs
from fpipe.schedules import (
    Costs,
    DualPipeV,
    GPipe,
    Interleaved1F1B,
    InterleavedZeroBubble,
    OneFOneB,
    Program,
    ScheduleError,
    Simulation,
    ZeroBubbleH1,
    ZeroBubbleV,
    simulate,
)

LIGHT = Costs(forward=1, backward_input=1, backward_weight=1, backward=2, send=0.5)
HEAVY = Costs(forward=2, backward_input=2, backward_weight=2, backward=4, send=0.25)


@pytest.mark.parametrize(
    ("program", "costs"),
    [
        (GPipe(2).program(2), (LIGHT, HEAVY)),
        (OneFOneB(4).program(3), (LIGHT, HEAVY, Costs(forward=4, backward_input=4, backward_weight=4, backward=8))),
        (
            ZeroBubbleH1(4).program(3),  # split backwards only: backward stays None
            (
                Costs(forward=1, backward_input=1, backward_weight=0.5, send=0.5),
                Costs(forward=2, backward_input=1.5, backward_weight=0.25, send=0.25),
                Costs(forward=0.5, backward_input=4, backward_weight=2, send=0.125),
            ),
        ),
        (
            DualPipeV(4).program(4),  # stages 0 and 3 run both fused and split backwards
            (
                Costs(forward=1, backward_input=1, backward_weight=0.5, backward=2, send=0.5),
                Costs(forward=2, backward_input=1.5, backward_weight=0.25, backward=1.75, send=0.25),
                Costs(forward=0.5, backward_input=4, backward_weight=2, backward=5, send=0.125),
                Costs(forward=3, backward_input=2, backward_weight=2, backward=4, send=0.75),
            ),
        ),
    ],
    ids=["gpipe", "1f1b", "zbh1", "dualpipev"],
)
def test_fit_costs_recovers_the_costs_of_a_simulation(program: Program, costs: tuple[Costs, ...]) -> None:
    assert fit_costs(simulate(program, costs)) == costs


@pytest.mark.parametrize(
    ("program", "costs"),
    [
        (
            # Rank 1's actions all take a message, and rank 0 waits for each of its backwards'
            # cotangents: their overhead and receive cost are the other ranks', shared here.
            OneFOneB(4).program(3),
            (
                Costs(
                    forward=1, backward=2, backward_input=1, backward_weight=1, send=0.5, overhead=0.25, receive=0.125
                ),
                Costs(
                    forward=2, backward=4, backward_input=2, backward_weight=2, send=0.25, overhead=0.25, receive=0.125
                ),
                Costs(forward=4, backward=8, backward_input=4, backward_weight=4, overhead=0.25, receive=0.125),
            ),
        ),
        (
            ZeroBubbleV(4).program(4),  # the stages of a rank share its overhead and receive cost
            tuple(
                Costs(
                    forward=1 + s / 4,
                    backward_input=1.5,
                    backward_weight=0.75,
                    send=0.5,
                    overhead=0.125 * (1 + r),
                    receive=0.0625 * (2 - r),
                )
                for s, r in enumerate((0, 1, 1, 0))
            ),
        ),
    ],
    ids=["1f1b", "zbv"],
)
def test_fit_costs_recovers_the_overhead_of_a_simulation(program: Program, costs: tuple[Costs, ...]) -> None:
    assert fit_costs(simulate(program, costs)) == costs


def test_fit_costs_estimates_the_overhead_of_a_noisy_timeline() -> None:
    # A synthetic recording: 1F1B on 4 ranks, overhead 0.1 per action, every start and end
    # jittered by up to 2% of an action, so no gap is exactly the overhead.
    program = OneFOneB(8).program(4)
    costs = Costs(forward=1, backward=2, send=0.05, overhead=0.1)
    exact = simulate(program, costs)
    noise = torch.Generator().manual_seed(0)

    def jittered(times: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(t + 0.02 * (2 * torch.rand((), generator=noise).item() - 1) for t in row) for row in times)

    fitted = fit_costs(Simulation(program, None, jittered(exact.starts), jittered(exact.ends)))
    assert all(c.overhead == pytest.approx(0.1, abs=0.03) for c in fitted)
    assert all(c.forward == pytest.approx(1, abs=0.04) and c.of("B") == pytest.approx(2, abs=0.04) for c in fitted)
    predicted = simulate(program, fitted).makespan
    assert predicted == pytest.approx(exact.makespan, rel=0.03)
    assert simulate(program, [replace(c, overhead=0.0) for c in fitted]).makespan < exact.makespan - 1  # it matters


def test_fit_costs_pools_timelines_by_median() -> None:
    program = OneFOneB(4).program(2)
    slow = Costs(forward=3, backward_input=3, backward_weight=3, backward=6, send=1.5)
    fast = Costs(forward=1, backward_input=1, backward_weight=1, backward=2, send=0.5)
    assert (
        fit_costs([simulate(program, slow), simulate(program, fast)])
        == (Costs(forward=2, backward_input=2, backward_weight=2, backward=4, send=1),) * 2
    )


def test_fit_costs_of_two_programs_of_one_placement_fits_split_and_fused_backwards() -> None:
    """Split backwards from one program, fused ones from another: all three kinds fitted, and a
    fused B cheaper than I + W, which the split program alone cannot show."""
    costs = [Costs(forward=1, backward_input=1.5, backward_weight=1, backward=2, send=0.5)] * 3
    costs += [Costs(forward=2, backward_input=3, backward_weight=2, backward=4, send=0.5)]
    split = simulate(InterleavedZeroBubble(4, stages_per_rank=2).program(4, 2), costs)
    fused = simulate(Interleaved1F1B(4, stages_per_rank=2).program(4, 2), costs)
    assert [c.backward for c in fit_costs(split)] == [None] * 4
    assert [c.backward for c in fit_costs(fused)] == [2, 2, 2, 4]
    assert fit_costs([split, fused]) == fit_costs([fused, split]) == tuple(costs)


def test_fit_costs_clamps_durations_and_falls_back_on_latency() -> None:
    # One rank, every action measured as lasting 0: no message, durations clamped.
    program = GPipe(1).program(1)
    measured = Simulation(program, None, ((0.0, 0.0),), ((0.0, 0.0),))
    assert fit_costs(measured) == (Costs(forward=1e-9, backward_input=1e-9, backward_weight=1e-9, backward=1e-9),)
    # rank 0 | 0F0 0F1 0B0 0B1: stage 0 is so slow that stage 1's cotangents are always there
    # rank 1 | 1F0 1B0 1F1 1B1   in time, so stage 1's latency is not seen: it gets stage 0's.
    sim = simulate(OneFOneB(2).program(2), [Costs(forward=8, backward=4, send=0.5), Costs(backward=1, send=0.25)])
    assert [c.send for c in fit_costs(sim)] == [0.5, 0.5]


def test_fit_costs_errors() -> None:
    sim = simulate(GPipe(2).program(2))
    with pytest.raises(ScheduleError, match=r"fit_costs: no timeline \(timelines: 0\)"):
        fit_costs([])
    with pytest.raises(ScheduleError, match=r"timeline 1 places its stages otherwise than timeline 0 .*\(1, 1\)"):
        fit_costs([sim, simulate(DualPipeV(2).program(4, 2))])
    with pytest.raises(ScheduleError, match=r"timeline 0 does not have one start and one end per action"):
        fit_costs(Simulation(sim.program, None, sim.starts, ((1.0,), (2.0,))))
    with pytest.raises(TypeError, match=r"timeline 1 is not a Simulation \(timeline 1: type Program, repr of"):
        fit_costs([sim, sim.program])  # type: ignore[list-item]


def test_fit_costs_of_what_holds_timelines_names_recording_timeline() -> None:
    """A recording, a step's program or a step is not a timeline: the message says which to pass,
    shows the value's type and not its whole repr."""
    step = fpipe.pipeline(lambda y, b: y.sum(), [lambda p, x: x * p] * 2, GPipe(8))
    with fpipe.record() as recording:
        step([torch.ones(())] * 2, torch.ones(8))
    for wrong, kind in [(recording, "Recording"), (step.program, "Program"), (step, "Step"), ("timeline", "str")]:
        with pytest.raises(TypeError) as raised:
            fit_costs(wrong)  # type: ignore[arg-type]
        message = str(raised.value)
        assert message.startswith("fpipe.planning.fit_costs: timeline must be a Simulation or a sequence of them")
        assert f"type {kind}" in message and "Pass recording.timeline or recording.timelines" in message
        assert len(message) < 300, message
    fit_costs(recording.timelines)  # what the message says to pass


def test_fit_costs_of_a_recorded_step() -> None:
    def stage(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p)

    step = fpipe.pipeline(lambda y, batch: y.square().mean(), [stage] * 2, OneFOneB(2))
    with fpipe.record() as recording:
        step([torch.randn(4, 4), torch.randn(4, 4)], torch.randn(4, 4))
    costs = fit_costs(recording.timelines)
    assert len(costs) == 2
    assert all(c.forward > 0 and c.of("B") > 0 and c.send >= 0 for c in costs)
    assert simulate(step.program, costs).makespan > 0
