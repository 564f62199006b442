"""Expert parallelism in the pipeline runtime: a ``"ep"`` mesh dimension whose ranks hold different
batches and each its block of experts (NOTE [experts are data-parallel for the dense weights] in
fpipe/_distributed/_topology.py; notes/experts.md), against the unsplit model with every expert in
one process, in float64.

The model here (tests/helpers.py, ``expert_layer``) routes each token to a fixed expert (token
``t`` to expert ``t % E``) and sends it there with the differentiable all-to-all of equal splits,
so these tests check the runtime's reductions (which group sums which gradient, and by how much
it divides) apart from routing; ``fpipe.moe``'s own layer under the pipeline:
tests/moe/test_in_a_pipeline.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import fpipe
from fpipe.schedules import GPipe, OneFOneB
from fpipe.schedules._registry import BUILTINS
from tests._multiprocess import run_ranks
from tests.conformance import built
from tests.distributed._faults import SLACK, rank_name, timed_failure
from tests.helpers import (
    EXPERT_TOKENS,
    EXPERTS,
    assert_bitwise,
    expert_batch,
    expert_layer,
    expert_loss,
    expert_params,
)

pytestmark = pytest.mark.timeout(240)

E, T = EXPERTS, EXPERT_TOKENS
params, batch, loss_fn = expert_params, expert_batch, expert_loss


def stages(num_stages, num_layers=4):
    per = num_layers // num_stages

    def stage(s):
        def run(p, x):
            h = x["x"] if s == 0 else x
            for layer in p:
                h = expert_layer(layer, h)
            return h

        return run

    return [stage(s) for s in range(num_stages)], per


def reference(replicas, num_layers=4, m=4):
    """The loss and gradients of the unsplit model, every expert in one process: the mean over the
    replicas of each one's mean over its microbatches."""
    full = params(num_layers)

    def total(ps):
        out = 0
        for r in range(replicas):
            b = batch(r, m)
            for i in range(m):
                mb = {k: v[i * T : (i + 1) * T] for k, v in b.items()}
                h = mb["x"]
                for p in ps:
                    h = expert_layer(p, h)
                out = out + loss_fn(h, mb) / (m * replicas)
        return out

    grads, loss = torch.func.grad_and_value(total)(full)
    return loss, grads


def _run(rank, world, dims, shape, schedules, num_stages_list, check_norm=True):
    """One step per schedule on a ``dims`` mesh; per schedule the loss, each held layer's dense
    gradient and expert gradient (this rank's block), and the global norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    coordinate = dict(zip(dims, mesh.get_coordinate()))
    ep, dp = mesh["ep"].size(), (mesh["dp"].size() if "dp" in dims else 1)
    replica = coordinate.get("dp", 0) * ep + coordinate["ep"]
    out = []
    for schedule, num_stages in zip(schedules, num_stages_list):
        fns, per = stages(num_stages)
        step = fpipe.pipeline(loss_fn, fns, schedule, parallel=fpipe.Parallelism(mesh=mesh, timeout=60))
        full = params(4)
        ps = [None] * num_stages
        for s in step.local_stages:
            ps[s] = [
                {"dense": p["dense"], "w": distribute_tensor(p["w"], mesh["ep"], [Shard(0)])}
                for p in full[s * per : (s + 1) * per]
            ]
        loss, grads = step(ps, batch(replica) if 0 in step.local_stages else None)
        held = {
            s * per + j: (g["dense"], g["w"].to_local(), type(g["w"]).__name__, g["w"].placements)
            for s in step.local_stages
            for j, g in enumerate(grads[s])
        }
        out.append((loss, held, step.global_norm(grads) if check_norm else None))
    return coordinate, dp * ep, out


def check(results, replicas):
    loss, grads = reference(replicas)
    norm = torch.cat([g.reshape(-1) for p in grads for g in p.values()]).norm()
    first = {}
    for coordinate, _, per_schedule in results:
        ep, block = coordinate["ep"], slice(coordinate["ep"] * 2, coordinate["ep"] * 2 + 2)
        for j, (d_loss, held, d_norm) in enumerate(per_schedule):
            torch.testing.assert_close(d_loss, loss, rtol=1e-13, atol=0)
            if d_norm is not None:
                torch.testing.assert_close(d_norm, norm, rtol=1e-13, atol=0)
            for layer, (dense, w, kind, placements) in held.items():
                assert kind == "DTensor" and str(placements) == "(Shard(dim=0),)", (kind, placements)
                torch.testing.assert_close(dense, grads[layer]["dense"], rtol=1e-12, atol=1e-14)
                torch.testing.assert_close(w, grads[layer]["w"][block], rtol=1e-12, atol=1e-14)
                key = (tuple(sorted(coordinate.items())), layer)
                first.setdefault(key, (dense, w))
                assert_bitwise((dense, w), first[key], f"schedule {j}, layer {layer}, {coordinate} ({ep})")


def test_pipeline_times_experts_equals_the_unsplit_model():
    """pp 2 x ep 2: every built-in schedule at its own stages per rank (2 or 4 stages of the same
    4 layers), bitwise equal to each other; then, on the
    same processes, dp 2 x pp 1 x ep 2 (expert gradients summed over dp only) and pp 1 x ep 2 x
    tp 2 (every tp rank runs its ep index's experts on the same tokens); then the bad inputs."""
    results = run_ranks(4, _every_mesh, timeout=180)
    check([r[0] for r in results], 2)
    check([r[1] for r in results], 4)
    check([r[2] for r in results], 2)
    for messages in (r[3] for r in results):
        assert "is an expert weight on mesh['ep'] but is not sharded along its first" in messages[0]
        assert "shard_params=True with an expert-parallel dimension is not supported" in messages[1]
        assert "has no tensor-parallel dimension" in messages[2] and "'ep' one for expert weights" in messages[2]


def _every_mesh(rank, world):
    # (DualPipe's gradients equal the others' within rounding, not bitwise: tests/distributed/test_shared_stages.py)
    builtins = [b for b in BUILTINS if b.placement != "dual"]
    schedules = [built(b)(2 * b.stages_per_rank, 4) for b in builtins]
    a = _run(rank, world, ("pp", "ep"), (2, 2), schedules, [2 * b.stages_per_rank for b in builtins])
    b = _run(rank, world, ("dp", "pp", "ep"), (2, 1, 2), [OneFOneB(4), GPipe(4)], [1, 1])  # (two pipelines: one mesh)
    c = _run(rank, world, ("pp", "ep", "tp"), (1, 2, 2), [OneFOneB(4)], [1])
    return a, b, c, _bad_inputs()


def _bad_inputs():
    """The messages of: an expert DTensor replicated over mesh["ep"]; shard_params with an ep
    dimension; an expert DTensor given to a pipeline whose mesh has no ep dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "ep"))
    fns, _ = stages(1)
    step = fpipe.pipeline(loss_fn, fns, OneFOneB(4), parallel=fpipe.Parallelism(mesh=mesh, timeout=30))
    full, messages = params(4), []
    for placement, parallel in ((Replicate(), None), (Shard(0), "shard"), (Shard(0), "no ep")):
        try:
            if parallel == "shard":
                fpipe.Parallelism(mesh=mesh, shard_params=True)
            if parallel == "no ep":
                other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "dp"))
                step = fpipe.pipeline(loss_fn, fns, OneFOneB(4), parallel=fpipe.Parallelism(mesh=other, timeout=30))
            ps = [[{"dense": p["dense"], "w": distribute_tensor(p["w"], mesh["ep"], [placement])} for p in full]]
            step(ps, batch(0))
        except ValueError as error:
            messages.append(str(error))
    return messages


PP_EP = (("pp", 2), ("ep", 2))


@pytest.mark.parametrize(("sig", "timeout"), [(signal.SIGKILL, None), (signal.SIGSTOP, 4)])
def test_a_rank_lost_inside_an_all_to_all_fails_every_survivor_fast(sig, timeout):
    """Global rank 3 (pp 1, ep 1) dies or freezes in its stage, just before its dispatch
    all-to-all: its expert partner (rank 2) waits inside the all-to-all, ranks 0 and 1 for the
    pipeline's messages; each raises fpipe's error naming the victim's mesh coordinates."""
    results = run_ranks(4, _lost_in_all_to_all, sig, timeout, timeout=90, may_die=frozenset({3}))
    limit = SLACK if timeout is None else timeout + SLACK
    for rank, (seconds, kind, message) in enumerate(results[:3]):
        assert seconds < limit, (rank, seconds, message)
        if sig == signal.SIGKILL:
            assert kind == "PipelineError" and f"because {rank_name(PP_EP, 3)} died" in message, (rank, message)
        else:
            assert kind == "PipelineTimeoutError" and f"{rank_name(PP_EP, 3)} stopped answering" in message, message


def _lost_in_all_to_all(rank, world, sig, timeout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    names, shape = zip(*PP_EP)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    armed = [False]

    def layer(p, h):
        if armed[0] and rank == 3:
            os.kill(os.getpid(), sig)
        return expert_layer(p, h)

    def stage(p, x):
        return layer(p, x["x"] if isinstance(x, dict) else x)

    options = {} if timeout is None else {"timeout": timeout}
    step = fpipe.pipeline(loss_fn, [stage, stage], OneFOneB(4), parallel=fpipe.Parallelism(mesh=mesh, **options))
    full = params(2)
    experts = [distribute_tensor(p["w"], mesh["ep"], [Shard(0)]) for p in full]
    ps = [{"dense": p["dense"], "w": w} for p, w in zip(full, experts)]
    ps = [p if s in step.local_stages else None for s, p in enumerate(ps)]
    b = batch(rank % 2) if step.rank == 0 else None
    step(ps, b)
    armed[0] = True
    return timed_failure(step, ps, b)
