"""DualPipe on gloo ranks: each stage on two ranks, its holders' gradient sums exchanged after the
row and then reduced over replicas like any other stage's (NOTE [a stage on several ranks] in
fpipe/schedules/_program.py). The conformance battery runs it on 2 and 4 ranks against one process
(tests/test_distributed.py); here, on one spawn of 4 ranks: its overlapped pairs with recompute
and dropout and a save, data-parallel replicas (replicated and sharded), and experts with their
all-to-alls overlapped."""

from __future__ import annotations

import warnings
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fpipe
from fpipe.schedules import DualPipe, Overlapped
from tests._multiprocess import run_ranks
from tests.helpers import (
    MOE_EXPERTS,
    assert_bitwise,
    moe_batch,
    moe_loss,
    moe_params,
    moe_reference,
    moe_stages,
)

WIDTH, M = 4, 8


def _stage(p: dict[str, dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    ((layer),) = p.values()  # {"layer<s>": {"w", "b"}}: each stage's names its own (saved under them)
    return F.dropout(torch.tanh(x @ layer["w"] + layer["b"]), p=0.25, training=True)


def _plain_stage(p: dict[str, dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    ((layer),) = p.values()
    return torch.tanh(x @ layer["w"] + layer["b"])


def _loss(y: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    return ((y - mb) ** 2).mean()


def _model(num_stages: int, seed: int = 0) -> tuple[list[Any], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = [
        {f"layer{s}": {"w": torch.randn(WIDTH, WIDTH, generator=g), "b": torch.randn(WIDTH, generator=g)}}
        for s in range(num_stages)
    ]
    return params, torch.randn(2 * M, WIDTH, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def _ranks(rank: int, world: int, directory: Any) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    out: dict[str, Any] = {}
    # 1. pp 4: the pairs with recompute and dropout, the batch on rank 0 only (it sends rank 3 its
    # microbatches); a save of the step's parameters, loaded back.
    params, batch = _model(world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the pairs run in sequence: these stages have no communication points)
        step = fpipe.pipeline(
            _loss, [_stage] * world, Overlapped(DualPipe(M)), recompute=True,
            parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
        )  # fmt: skip
        mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
        out["pp"] = (step.local_stages, step(mine, batch if rank == 0 else None, key=3))
    fpipe.save(directory, mine, parallel=step)
    template = [None if p is None else optree.tree_map(torch.zeros_like, p) for p in mine]
    out["saved"] = (fpipe.load(directory, template, parallel=step).params, mine)
    # 2. dp 2 x pp 2: each replica its own batch; the holders' sum, then the replicas' mean.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, params = mesh.get_coordinate()[0], _model(2)[0]
    step = fpipe.pipeline(_loss, [_plain_stage] * 2, DualPipe(4), parallel=fpipe.Parallelism(mesh=mesh, timeout=30))
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    out["dp"] = (step.local_stages, step(mine, _model(2, seed=1 + replica)[1]))
    sharded = fpipe.pipeline(
        _loss, [_plain_stage] * 2, DualPipe(4), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30)
    )
    shards = sharded.shard(params)
    loss, grads = sharded(shards, _model(2, seed=1 + replica)[1])
    full = [None if g is None else fpipe.gather(g, params[s], sharded) for s, g in enumerate(grads)]
    out["sharded"] = (loss, full, sharded.global_norm(grads), step.global_norm(out["dp"][1][1]))
    # 3. pp 2 x ep 2 with fpipe.moe: DualPipe and its pairs, which overlap the all-to-alls (a pair
    # run in sequence would warn: an error here).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    ep = mesh.get_coordinate()[1]
    fns, per = moe_stages(2, True)
    full = [fpipe.moe.distribute_experts(p, mesh["ep"]) for p in moe_params()]
    out["ep"] = []
    for schedule in (DualPipe(4), Overlapped(DualPipe(4))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step = fpipe.pipeline(
                moe_loss, fns, schedule, has_aux=True, parallel=fpipe.Parallelism(mesh=mesh, timeout=60)
            )
            ps = [full[s * per : (s + 1) * per] if s in step.local_stages else None for s in range(2)]
            (loss, counts), grads = step(ps, moe_batch(ep))
        local = {s: optree.tree_map(_local, grads[s]) for s in step.local_stages}
        kinds = {s: optree.tree_map(lambda t: hasattr(t, "to_local"), grads[s]) for s in step.local_stages}
        out["ep"].append((ep, loss, step.replica_sum(counts.sum(0)), local, kinds))
    return out


@pytest.mark.timeout(200)
def test_dual_pipe_on_ranks_with_pairs_saves_replicas_and_experts(tmp_path: Any) -> None:
    """4 gloo ranks, one spawn:

    - pp 4, ``Overlapped(DualPipe(8))``, recompute and dropout: loss and every gradient bitwise
      those of one process (the same key: the same draws), each stage's on both its holders; the
      saved parameters load back bitwise on every rank;
    - dp 2 x pp 2: bitwise ``(g_a + g_b) / 2`` of the two replicas' one-process steps;
    - pp 2 x ep 2 with ``fpipe.moe``: with and without pairs bitwise, the pairs overlapping (no
      warning), and equal to the unsplit model with every expert in one process;
    - ``shard_params=True`` on dp 2 x pp 2: the gathered gradients bitwise the replicated ones, and
      the same global norm."""
    torch.set_default_dtype(torch.float64)  # (the test's default dtype, restored by conftest)
    params, batch = _model(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = fpipe.pipeline(_loss, [_stage] * 4, Overlapped(DualPipe(M)), recompute=True)
        loss, grads = step(params, batch, key=3)
    plain_loss, plain_grads = fpipe.pipeline(_loss, [_stage] * 4, DualPipe(M))(params, batch, key=3)
    assert_bitwise((loss, grads), (plain_loss, plain_grads), "pairs and recompute against DualPipe")
    two, _ = _model(2)
    one = fpipe.pipeline(_loss, [_plain_stage] * 2, DualPipe(4))
    replicas = [one(two, _model(2, seed=1 + r)[1]) for r in range(2)]
    dp_loss = (replicas[0][0] + replicas[1][0]) / 2
    dp_grads = optree.tree_map(lambda a, b: (a + b) / 2, replicas[0][1], replicas[1][1])
    ref_loss, ref_grads, ref_counts = moe_reference(moe_params(), 2, True)
    blocks = MOE_EXPERTS // 2

    results = run_ranks(4, _ranks, tmp_path, timeout=180)
    for rank, got in enumerate(results):
        local, (d_loss, d_grads) = got["pp"]
        assert local == tuple(sorted({rank, 3 - rank}))
        mine = [g if s in local else None for s, g in enumerate(grads)]
        assert_bitwise((d_loss, d_grads), (loss, mine), f"pp 4, rank {rank}")
        assert_bitwise(*got["saved"], f"rank {rank}, loaded")
        local, (d_loss, d_grads) = got["dp"]
        assert_bitwise((d_loss, d_grads), (dp_loss, [g if s in local else None for s, g in enumerate(dp_grads)]))
        s_loss, s_grads, s_norm, plain_norm = got["sharded"]  # shard_params=True: the same, gathered
        assert_bitwise((s_loss, s_grads), (d_loss, d_grads), f"sharded, rank {rank}")
        torch.testing.assert_close(s_norm, plain_norm, rtol=1e-13, atol=0)
        (ep, *sequential), (_, *paired) = got["ep"]
        assert_bitwise(paired, sequential, f"experts, rank {rank}")
        e_loss, e_counts, e_grads, kinds = paired
        torch.testing.assert_close(e_loss, ref_loss, rtol=1e-12, atol=0)
        assert torch.equal(e_counts, ref_counts)
        for s, tree in e_grads.items():
            expected = ref_grads[s * 2 : s * 2 + 2]
            for g, is_block, r in zip(
                optree.tree_leaves(tree), optree.tree_leaves(kinds[s]), optree.tree_leaves(expected)
            ):
                want = r[ep * blocks : (ep + 1) * blocks] if is_block else r
                torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-13)
