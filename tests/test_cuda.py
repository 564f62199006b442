"""The one-process battery on an accelerator (skipped without one; benchmarks/gpu_check.sh runs it).

``FPIPE_TEST_DEVICE`` names the device (default ``cuda``). For every schedule of the conformance
list, on that device: the step equals ``torch.func.grad_and_value`` of the unsplit model
(float64, relative error 1e-10) and GPipe bitwise; a step issues no device-to-host
synchronization (``torch.cuda.set_sync_debug_mode("error")``); ``fpipe.record`` times actions
with CUDA events and ``torch.profiler`` sees every action's range.
"""

from __future__ import annotations

import os

import pytest
import torch

import fpipe
from fpipe.schedules import GPipe
from tests.conformance import CONFORMANCE, Conformance
from tests.helpers import (
    assert_bitwise,
    assert_close,
    mse_loss,
    reference,
    some_stage_count,
    tanh_batch,
    tanh_layer,
    tanh_params,
)

DEVICE = torch.device(os.environ.get("FPIPE_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda" or not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh)"
)
MICROBATCHES = 4


def _params(num_stages: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(DEVICE) for k, v in p.items()} for p in tanh_params(num_stages)]


def _batch() -> torch.Tensor:
    return tanh_batch().to(DEVICE)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_equals_the_unsplit_model_and_gpipe_bitwise(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 2)
    params, batch = _params(num_stages), _batch()
    stages = [tanh_layer] * num_stages
    loss, grads = fpipe.pipeline(mse_loss, stages, entry.make(num_stages, MICROBATCHES))(params, batch)
    ref_loss, ref_grads = reference(mse_loss, stages, params, batch)
    assert loss.device.type == DEVICE.type
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert_bitwise((loss, grads), fpipe.pipeline(mse_loss, stages, GPipe(MICROBATCHES))(params, batch), entry.name)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_a_step_does_not_synchronize(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 2)
    step = fpipe.pipeline(mse_loss, [tanh_layer] * num_stages, entry.make(num_stages, MICROBATCHES))
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
    step = fpipe.pipeline(mse_loss, [tanh_layer] * 2, GPipe(MICROBATCHES))
    params, batch = _params(2), _batch()
    with fpipe.record() as recording:
        step(params, batch)
    timeline = recording.timeline
    flat = sorted((s, e) for starts, ends in zip(timeline.starts, timeline.ends) for s, e in zip(starts, ends))
    assert len(flat) == 4 * MICROBATCHES and all(0 <= s <= e for s, e in flat)


def test_profiler_ranges_on_cuda() -> None:
    step = fpipe.pipeline(mse_loss, [tanh_layer] * 2, GPipe(MICROBATCHES))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step(_params(2), _batch())
    names = sorted(e.name for e in profile.events() if e.name.startswith("fpipe "))
    assert names == sorted(f"fpipe {a}" for row in step.program.ranks for a in row)
