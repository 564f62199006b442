"""``fpipe.record`` measures what a step ran, in the shape of a simulation, exportable alike."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import fpipe
from fpipe.schedules import OneFOneB, ZeroBubbleH1, chrome_trace, simulate, svg, terminal_grid


def stage(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p)


def loss_fn(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


@pytest.mark.parametrize("schedule", [OneFOneB(4), ZeroBubbleH1(4)], ids=str)
def test_recorded_timeline_follows_the_program(schedule: object) -> None:
    step = fpipe.pipeline(loss_fn, [stage] * 3, schedule)
    params = [torch.randn(8, 8) for _ in range(3)]
    with fpipe.record() as recording:
        step(params, torch.randn(16, 8))
        step(params, torch.randn(16, 8))
    assert len(recording.timelines) == 2
    timeline = recording.timeline
    assert timeline.program == step.program and timeline.costs is None
    flat = sorted((s, e) for starts, ends in zip(timeline.starts, timeline.ends) for s, e in zip(starts, ends))
    assert len(flat) == sum(len(row) for row in step.program.ranks)
    assert flat[0][0] >= 0 and all(s < e for s, e in flat)
    # one process: the virtual ranks take turns, in the order the executor interprets the program
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(flat))
    # the same pictures as a simulation, side by side
    predicted = simulate(step.program)
    assert len(predicted.intervals()) == len(timeline.intervals())
    trace = chrome_trace(timeline, microseconds_per_unit=1e6)
    json.dumps(trace)
    assert "<svg" in svg(timeline) and "rank 0" in terminal_grid(timeline, color=False)


def test_nothing_is_recorded_outside_the_block() -> None:
    step = fpipe.pipeline(loss_fn, [stage] * 2, OneFOneB(2))
    params = [torch.randn(8, 8) for _ in range(2)]
    with fpipe.record() as recording:
        pass
    step(params, torch.randn(4, 8))
    assert recording.timelines == []
    with pytest.raises(LookupError, match="no step ran inside the block"):
        _ = recording.timeline


@pytest.mark.parametrize("schedule", [OneFOneB(4), ZeroBubbleH1(4)], ids=str)
def test_a_profiler_trace_has_a_range_per_action(schedule: object) -> None:
    step = fpipe.pipeline(loss_fn, [stage] * 3, schedule)
    params = [torch.randn(8, 8) for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step(params, torch.randn(16, 8))
    ranges = sorted(e.name for e in profile.events() if e.name.startswith("fpipe "))
    expected = sorted(f"fpipe {a}" for row in step.program.ranks for a in row)
    assert ranges == expected
    # the ranges hold the action's work
    inside = next(e for e in profile.events() if e.name == "fpipe 0F0")
    assert any(child.name == "aten::tanh" for child in _descendants(inside))


def test_no_range_is_opened_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    step = fpipe.pipeline(loss_fn, [stage] * 2, OneFOneB(2))
    opened: list[str] = []
    real = torch.profiler.record_function

    def spy(name: str, *args: object) -> object:
        opened.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", spy)
    step([torch.randn(8, 8) for _ in range(2)], torch.randn(4, 8))
    assert opened == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        step([torch.randn(8, 8) for _ in range(2)], torch.randn(4, 8))
    assert len(opened) == 8


def _descendants(event: object) -> list[object]:
    out: list[object] = []
    for child in getattr(event, "cpu_children", []):
        out += [child, *_descendants(child)]
    return out
