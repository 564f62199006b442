"""Tensor-parallel stages (DTensor) on a pipeline x tensor (and data) mesh equal the unsplit model,
end to end: the step, the schedules, mixed precision and ``shard_params=True`` together (the model
and the checks: tests/_tensor_parallel_llama.py; one DTensor leaf's handling in one process:
test_dtensor.py)."""

from __future__ import annotations

import pytest

from fpipe.schedules import DualPipe, GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV
from tests._multiprocess import run_ranks
from tests._tensor_parallel_llama import MIXED, check_mixed, check_sharded, check_trained, sharded_ranks, train_ranks

pytestmark = pytest.mark.timeout(240)


def _plain_and_mixed(rank, world, dims, shape, schedules, num_stages):
    """``train_ranks`` in float64, then the first two schedules again under ``MIXED``."""
    return train_ranks(rank, world, dims, shape, schedules, num_stages), train_ranks(
        rank, world, dims, shape, schedules[:2], num_stages, precision=MIXED
    )


def test_pipeline_times_tensor_parallel_equals_the_unsplit_model():
    """pp 2 x tp 2 (mesh declared tp-first); GPipe, 1F1B and ZB-H1 (split backward), 2 stages; then
    GPipe and 1F1B with bfloat16 compute on float32 master weights, float32 sums (``MIXED``)."""
    schedules = [GPipe(3), OneFOneB(3), ZeroBubbleH1(3)]
    results = run_ranks(4, _plain_and_mixed, ("tp", "pp"), (2, 2), schedules, 2, timeout=180)
    check_trained([r[0] for r in results], 2)
    check_mixed([r[1] for r in results], 2)


def test_two_stages_per_rank_with_tensor_parallel():
    """pp 2 x tp 2, 4 stages: looped (interleaved 1F1B) and in a V (ZB-V, split backward)."""
    results = run_ranks(4, train_ranks, ("pp", "tp"), (2, 2), [OneFOneB(4), ZeroBubbleV(4)], 4, timeout=180)
    check_trained(results, 4)


def test_dual_pipe_with_tensor_parallel():
    """pp 2 x tp 2, DualPipe (each stage on both pipeline ranks, NOTE [a stage on several ranks] in
    fpipe/schedules/_program.py): the holders' sums travel as local pieces and come back as
    DTensors with their placements, equal to the unsplit model; the norm counts each stage once."""
    results = run_ranks(4, train_ranks, ("pp", "tp"), (2, 2), [DualPipe(4)], 2, timeout=180)
    check_trained(results, 2)


def _both(rank, world, dims, shape, schedule, num_stages):
    return train_ranks(rank, world, dims, shape, [schedule], num_stages), sharded_ranks(
        rank, world, dims, shape, schedule, num_stages
    )


@pytest.mark.slow
def test_data_times_pipeline_times_tensor_parallel():
    """dp 2 x pp 2 x tp 2 on 8 processes: equal to the average of the replicas' references,
    replicated and with shard_params=True."""
    results = run_ranks(8, _both, ("dp", "pp", "tp"), (2, 2, 2), OneFOneB(2), 2, timeout=400)
    check_trained([r[0] for r in results], 2, replicas=2)
    check_sharded([r[1] for r in results], 2, replicas=2)
