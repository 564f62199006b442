"""The one-process battery on an accelerator (skipped without one; benchmarks/gpu_check.sh runs it).

``FPIPE_TEST_DEVICE`` names the device (default ``cuda``). For every schedule of the conformance
list, on that device: the step equals ``torch.func.grad_and_value`` of the unsplit model
(float64, relative error 1e-10) and GPipe bitwise; a step issues no device-to-host
synchronization (``torch.cuda.set_sync_debug_mode("error")``); ``fpipe.record`` times actions
with CUDA events and ``torch.profiler`` sees every action's range.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import fpipe
from fpipe.schedules import GPipe
from tests.conformance import CONFORMANCE, Conformance

DEVICE = torch.device(os.environ.get("FPIPE_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda" or not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh)"
)
MICROBATCHES = 4


def _stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"])


def _loss(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return (y - batch).square().mean()


def _params(num_stages: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(DEVICE) for k, v in p.items()} for p in _host_params(num_stages)]


def _host_params(num_stages: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    return [
        {"w": torch.randn(8, 8, generator=g, dtype=f64), "b": torch.randn(8, generator=g, dtype=f64)}
        for _ in range(num_stages)
    ]


def _batch() -> torch.Tensor:
    return torch.randn(10, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)


def _stages(entry: Conformance) -> int:
    return min(s for s in entry.stage_counts if s >= 2)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_equals_the_unsplit_model_and_gpipe_bitwise(entry: Conformance) -> None:
    num_stages = _stages(entry)
    params, batch = _params(num_stages), _batch()
    loss, grads = fpipe.pipeline(_loss, [_stage] * num_stages, entry.make(num_stages, MICROBATCHES))(params, batch)

    def whole(ps: list[Any], b: torch.Tensor) -> torch.Tensor:
        x = b
        for p in ps:
            x = _stage(p, x)
        return _loss(x, b)

    ref_grads, ref_loss = torch.func.grad_and_value(whole)(params, batch)
    assert loss.device.type == DEVICE.type
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)
    for g, r in zip(grads, ref_grads):
        for k in g:
            assert torch.linalg.vector_norm(g[k] - r[k]) <= 1e-10 * torch.linalg.vector_norm(r[k])
    g_loss, g_grads = fpipe.pipeline(_loss, [_stage] * num_stages, GPipe(MICROBATCHES))(params, batch)
    assert torch.equal(loss, g_loss)
    assert all(torch.equal(g[k], h[k]) for g, h in zip(grads, g_grads) for k in g)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_a_step_does_not_synchronize(entry: Conformance) -> None:
    num_stages = _stages(entry)
    step = fpipe.pipeline(_loss, [_stage] * num_stages, entry.make(num_stages, MICROBATCHES))
    params, batch = _params(num_stages), _batch()
    step(params, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = step(params, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.device.type == "cuda"


def test_record_times_actions_with_cuda_events() -> None:
    step = fpipe.pipeline(_loss, [_stage] * 2, GPipe(MICROBATCHES))
    params, batch = _params(2), _batch()
    with fpipe.record() as recording:
        step(params, batch)
    timeline = recording.timeline
    flat = sorted((s, e) for starts, ends in zip(timeline.starts, timeline.ends) for s, e in zip(starts, ends))
    assert len(flat) == 4 * MICROBATCHES and all(0 <= s <= e for s, e in flat)


def test_profiler_ranges_on_cuda() -> None:
    step = fpipe.pipeline(_loss, [_stage] * 2, GPipe(MICROBATCHES))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step(_params(2), _batch())
    names = sorted(e.name for e in profile.events() if e.name.startswith("fpipe "))
    assert names == sorted(f"fpipe {a}" for row in step.program.ranks for a in row)
