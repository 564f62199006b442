"""``fpipe.moe``'s layer inside pipeline stages, with its balance losses and token counts carried
through the stages' outputs, equals the unsplit model under every schedule (the torchtitan #2061
case: a load-balancing loss that "works only with 1F1B"), in one process and on pp 2 x ep 2.

The unsplit model: the same layers, every expert in one process, on each replica's batch cut
into the same microbatches; the loss is the mean over replicas of each one's mean over its
microbatches of ``mse + ALPHA * (sum of the layers' balance losses)``. A balance loss is a
function of one call's tokens, so "per sequence" (``sequence_length``) and "per microbatch"
(one group: the microbatch's tokens) are both exact under microbatching; a loss over the whole
batch's tokens is not (notes/experts.md, "Load balancing").
"""

from __future__ import annotations

import pytest
import torch

import fpipe
from fpipe.schedules import DualPipeV, GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleV
from tests._multiprocess import run_ranks
from tests.helpers import (
    MOE_EXPERTS,
    MOE_MICROBATCHES,
    assert_bitwise,
    moe_batch,
    moe_loss,
    moe_params,
    moe_reference,
    moe_stages,
)

pytestmark = pytest.mark.timeout(240)

E, M = MOE_EXPERTS, MOE_MICROBATCHES
params, batch, stages, loss_fn, reference = moe_params, moe_batch, moe_stages, moe_loss, moe_reference


SCHEDULES = [(GPipe(M), 2), (OneFOneB(M), 4), (Interleaved1F1B(M), 4), (ZeroBubbleV(M), 4), (DualPipeV(M), 4)]


@pytest.mark.parametrize("per_sequence", [True, False], ids=["per-sequence", "per-microbatch"])
def test_balance_losses_and_counts_in_one_process_equal_the_unsplit_model(per_sequence):
    """GPipe, 1F1B, interleaved, ZB-V and DualPipeV (2 ranks, virtual): loss, every gradient and
    the counts equal the unsplit model's, the schedules bitwise equal to each other."""
    full = params()
    loss, grads, counts = reference(full, 1, per_sequence)
    first = None
    for schedule, num_stages in SCHEDULES:
        fns, per = stages(num_stages, per_sequence)
        step = fpipe.pipeline(loss_fn, fns, schedule, has_aux=True)
        (d_loss, d_counts), d_grads = step([full[s * per : (s + 1) * per] for s in range(num_stages)], batch())
        flat = [g for stage in d_grads for g in stage]
        torch.testing.assert_close(d_loss, loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(flat, grads, rtol=1e-10, atol=1e-12)
        assert torch.equal(d_counts.sum(0), counts), (schedule, d_counts.sum(0), counts)
        first = first or (d_loss, flat)
        assert_bitwise((d_loss, flat), first, str(schedule))


def test_the_selection_bias_moves_between_steps_from_the_counts():
    """DeepSeek-V3's auxiliary-loss-free balancing: a bias in the params (its gradient zero) is
    moved against the step's counts, and the next step equals the unsplit model with that bias."""
    full = params(bias=True)
    fns, per = stages(2, True)
    step = fpipe.pipeline(loss_fn, fns, OneFOneB(M), has_aux=True)
    for gamma in (0.1, 0.05):
        (loss, counts), grads = step([full[:per], full[per:]], batch())
        ref_loss, ref_grads, ref_counts = reference(full, 1, True)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        torch.testing.assert_close([g for stage in grads for g in stage], ref_grads, rtol=1e-10, atol=1e-12)
        assert all(torch.count_nonzero(g["bias"]) == 0 for stage in grads for g in stage)
        assert torch.equal(counts.sum(0), ref_counts)
        step_counts = counts.sum(0).double()
        for q in full:  # the update rule of DeepSeek-V3, section 2.1.2
            q["bias"] = q["bias"] + gamma * torch.sign(step_counts.mean() - step_counts)
    assert any(torch.count_nonzero(q["bias"]) > 0 for q in full)


@pytest.mark.parametrize("per_sequence", [True, False], ids=["per-sequence", "per-microbatch"])
def test_balance_losses_and_counts_on_pp_times_ep_equal_the_unsplit_model(per_sequence):
    """pp 2 x ep 2 on 4 gloo ranks, the experts split over ``mesh["ep"]``, each ep rank its own
    batch: the same schedules, against the unsplit model over both batches; the counts summed
    over microbatches and replicas (``step.replica_sum``) equal the unsplit model's."""
    results = run_ranks(4, _pp_times_ep, per_sequence, timeout=180)
    loss, grads, counts = reference(params(), 2, per_sequence)
    first = {}
    for ep, per_schedule in results:
        block = slice(ep * E // 2, (ep + 1) * E // 2)
        for name, d_loss, held, d_counts in per_schedule:
            torch.testing.assert_close(d_loss, loss, rtol=1e-12, atol=0)
            assert torch.equal(d_counts, counts), (name, d_counts, counts)
            for index, g in held.items():
                expected = {k: (v[block] if k in ("w1", "w2", "w3") else v) for k, v in grads[index].items()}
                torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-12)
                first.setdefault((ep, index), g)
                assert_bitwise(g, first[ep, index], f"{name}, layer {index}, ep {ep}")


def _pp_times_ep(rank, world, per_sequence):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    ep = mesh.get_coordinate()[1]
    out = []
    for schedule, num_stages in SCHEDULES:
        fns, per = stages(num_stages, per_sequence)
        parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
        step = fpipe.pipeline(loss_fn, fns, schedule, has_aux=True, parallel=parallel)
        full = [fpipe.moe.distribute_experts(p, mesh["ep"]) for p in params()]
        ps = [full[s * per : (s + 1) * per] if s in step.local_stages else None for s in range(num_stages)]
        (loss, counts), grads = step(ps, batch(ep) if 0 in step.local_stages else None)
        held = {
            s * per + j: {k: (v.to_local() if k in ("w1", "w2", "w3") else v) for k, v in g.items()}
            for s in step.local_stages
            for j, g in enumerate(grads[s])
        }
        out.append((str(schedule), loss, held, step.replica_sum(counts.sum(0))))
    return ep, out


def test_one_pipeline_rank_of_two_expert_ranks_equals_the_unsplit_model():
    """pp 1 x ep 2 on 2 gloo ranks, both stages on the one pipeline rank (1F1B looped): experts
    only, as DeepSeek-V3's expert groups without a pipeline."""
    results = run_ranks(2, _experts_only, timeout=120)
    loss, grads, counts = reference(params(), 2, True)
    for ep, (d_loss, held, d_counts) in results:
        block = slice(ep * E // 2, (ep + 1) * E // 2)
        torch.testing.assert_close(d_loss, loss, rtol=1e-12, atol=0)
        assert torch.equal(d_counts, counts)
        for index, g in held.items():
            expected = {k: (v[block] if k in ("w1", "w2", "w3") else v) for k, v in grads[index].items()}
            torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-12)


def _experts_only(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "ep"))
    fns, per = stages(2, True)
    step = fpipe.pipeline(loss_fn, fns, OneFOneB(M), has_aux=True, parallel=fpipe.Parallelism(mesh=mesh, timeout=60))
    full = [fpipe.moe.distribute_experts(p, mesh["ep"]) for p in params()]
    (loss, counts), grads = step([full[:per], full[per:]], batch(rank))
    held = {
        s * per + j: {k: (v.to_local() if k in ("w1", "w2", "w3") else v) for k, v in g.items()}
        for s in range(2)
        for j, g in enumerate(grads[s])
    }
    return rank, (loss, held, step.replica_sum(counts.sum(0)))


def test_nan_router_logits_fail_the_step_naming_the_stage_and_microbatch():
    full = params()
    full[2]["router"] = full[2]["router"].clone()
    full[2]["router"][0, 1] = float("nan")
    fns, per = stages(2, True)
    step = fpipe.pipeline(loss_fn, fns, OneFOneB(M), has_aux=True)
    with pytest.raises(fpipe.PipelineError, match=r"(?s)stage 1.*microbatch 0.*NaN") as caught:
        step([full[:per], full[per:]], batch())
    assert "router" in str(caught.value) or "logits" in str(caught.value)
