"""DualPipe on gloo ranks: each stage on two ranks, its holders' gradient sums exchanged (NOTE [a
stage on several ranks] in fpipe/schedules/_program.py). The conformance battery runs it on 2
and 4 ranks against one process (tests/test_distributed.py); here its overlapped pairs with
recompute and dropout, its saves, and the set-ups it refuses."""

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
from tests.helpers import assert_bitwise

WIDTH, M = 4, 8


def _stage(p: dict[str, dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    ((layer),) = p.values()  # {"layer<s>": {"w", "b"}}: each stage's names its own (saved under them)
    return F.dropout(torch.tanh(x @ layer["w"] + layer["b"]), p=0.25, training=True)


def _loss(y: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    return ((y - mb) ** 2).mean()


def _model(num_stages: int) -> tuple[list[Any], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = [
        {f"layer{s}": {"w": torch.randn(WIDTH, WIDTH, generator=g), "b": torch.randn(WIDTH, generator=g)}}
        for s in range(num_stages)
    ]
    return params, torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)


def _ranks(rank: int, world: int, directory: Any) -> dict[str, Any]:
    """Overlapped(DualPipe) with recompute and dropout, the batch on rank 0 only (it sends rank 3 its
    microbatches), then a save and a load of the step's parameters, then a dp x pp mesh refused."""
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")  # (the pairs run in sequence: these stages have no communication points)
    params, batch = _model(world)
    step = fpipe.pipeline(
        _loss, [_stage] * world, Overlapped(DualPipe(M)), recompute=True,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
    )  # fmt: skip
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    loss, grads = step(mine, batch if rank == 0 else None, key=3)
    fpipe.save(directory, mine, parallel=step)
    template = [None if p is None else optree.tree_map(torch.zeros_like, p) for p in mine]
    loaded = fpipe.load(directory, template, parallel=step)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    try:
        fpipe.pipeline(_loss, [_stage] * 2, DualPipe(4), parallel=fpipe.Parallelism(mesh=mesh))
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "local": step.local_stages,
        "loss": loss,
        "grads": grads,
        "loaded": loaded.params,
        "mine": mine,
        "refused": refused,
    }


@pytest.mark.timeout(150)
def test_overlapped_dual_pipe_with_recompute_and_dropout_saves_and_refuses_replicas(tmp_path: Any) -> None:
    """4 gloo ranks: loss and every gradient bitwise those of one process (the same key: the same
    draws; each stage's gradients on both its holders); the saved parameters load back bitwise on
    every rank; dp x pp is refused with a message naming what DualPipe runs on."""
    torch.set_default_dtype(torch.float64)  # (the test's default dtype, restored by conftest)
    params, batch = _model(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = fpipe.pipeline(_loss, [_stage] * 4, Overlapped(DualPipe(M)), recompute=True)
        loss, grads = step(params, batch, key=3)
    plain_loss, plain_grads = fpipe.pipeline(_loss, [_stage] * 4, DualPipe(M))(params, batch, key=3)
    assert_bitwise((loss, grads), (plain_loss, plain_grads), "pairs and recompute against DualPipe")
    results = run_ranks(4, _ranks, tmp_path, timeout=120)
    for rank, got in enumerate(results):
        assert got["local"] == tuple(sorted({rank, 3 - rank}))
        mine = [g if s in got["local"] else None for s, g in enumerate(grads)]
        assert_bitwise((got["loss"], got["grads"]), (loss, mine), f"rank {rank}")
        assert_bitwise(got["loaded"], got["mine"], f"rank {rank}, loaded")
        assert "runs a stage on several ranks (DualPipe)" in got["refused"]
        assert "data-parallel or expert-parallel replicas" in got["refused"]
