"""``fpipe.optim.adamw`` in training: a pipeline step, saving and loading its state, sharded on 4 ranks.

The battery of ``test_optimizer.py`` compares the update itself with ``torch.optim.AdamW``; here
the gradients come from ``fpipe.pipeline``. A one-process 2-stage pipeline trains as
``torch.optim.AdamW`` on the unsplit model's ``torch.func.grad`` (to float64 rounding: the
pipeline sums microbatch gradients, the unsplit model differentiates the whole batch). The state
saves and loads bitwise, and one spawn of 4 gloo ranks (dp 2 x pp 2, ``shard_params=True``)
trains on shards as one process trains on full tensors, then saves shards that load whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import fpipe
import fpipe.optim
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import assert_bitwise

F64 = torch.float64  # explicit: spawned ranks keep torch's default dtype, float32
STEPS = 3


def _stage(p: dict[str, dict[str, torch.Tensor]], x: Any) -> torch.Tensor:
    (layer,) = p.values()  # {"<stage index>": {"w", "b"}}: names unique across stages, for fpipe.save
    x = x["x"] if isinstance(x, dict) else x
    return torch.tanh(x @ layer["w"] + layer["b"])


def _loss(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((y - batch["y"]) ** 2).mean()


def _params(num_stages: int) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        {str(s): {"w": torch.randn(5, 5, generator=g, dtype=F64), "b": torch.randn(5, generator=g, dtype=F64)}}
        for s in range(num_stages)
    ]


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 5, generator=g, dtype=F64), "y": torch.randn(6, 5, generator=g, dtype=F64)}


SCHEDULE = fpipe.optim.warmup_cosine(0.05, warmup_steps=2, total_steps=STEPS)


def _optimizer() -> fpipe.optim.Optimizer:
    mask = [{str(s): {"w": True, "b": False}} for s in range(4)]  # decided on full shapes: shards are 1-D
    return fpipe.optim.adamw(SCHEDULE, weight_decay=0.1, weight_decay_mask=mask)


def _flat(params: list[Any]) -> list[torch.Tensor]:
    return [t for s, p in enumerate(params) for t in (p[str(s)]["w"], p[str(s)]["b"])]


def test_pipeline_training_equals_torch_adamw_on_the_unsplit_model(tmp_path: Path) -> None:
    step = fpipe.pipeline(_loss, [_stage, _stage], OneFOneB(num_microbatches=2))
    opt = _optimizer()
    params = _params(2)
    state = opt.init(params)
    flat = [t.clone().requires_grad_() for t in _flat(params)]
    reference = torch.optim.AdamW(
        [{"params": flat[0::2]}, {"params": flat[1::2], "weight_decay": 0.0}], weight_decay=0.1
    )

    def full_loss(ps: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = batch["x"]
        for w, b in zip(ps[0::2], ps[1::2]):
            h = _stage({"": {"w": w, "b": b}}, h)
        return _loss(h, batch)

    for k in range(STEPS):
        batch = _batch(k)
        _, grads = step(params, batch)
        grads = fpipe.optim.clip_by_global_norm(grads, step.global_norm(grads), max_norm=0.5)
        params, state = opt.update(params, grads, state)

        ref_grads = torch.func.grad(full_loss)([p.detach() for p in flat], batch)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads]))
        for p, g in zip(flat, ref_grads):
            p.grad = g * torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        for group in reference.param_groups:
            group["lr"] = SCHEDULE(k)
        reference.step()
    torch.testing.assert_close(_flat(params), [p.detach() for p in flat], rtol=1e-13, atol=1e-13)
    for key in ("exp_avg", "exp_avg_sq"):
        expected = [reference.state[p][key] for p in flat]
        torch.testing.assert_close(_flat([t[key] for t in state]), expected, rtol=1e-12, atol=1e-15)

    # The state saves and loads bitwise, and training resumes from it as if never stopped.
    fpipe.save(tmp_path, params, optimizer_state=state, metadata={"step": STEPS})
    loaded = fpipe.load(tmp_path, params, optimizer_state=opt.init(params))
    assert_bitwise(loaded.optimizer_state, state)
    _, grads = step(params, _batch(STEPS))
    assert_bitwise(opt.update(loaded.params, grads, loaded.optimizer_state), opt.update(params, grads, state))


def _sharded_ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    step = fpipe.pipeline(
        _loss, [_stage] * 4, OneFOneB(4), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30)
    )
    opt = _optimizer()
    shards = step.shard(_params(4))
    state = opt.init(shards)
    for k in range(STEPS):
        _, grads = step(shards, _batch(10 * k + replica) if step.rank == 0 else None)
        grads = fpipe.optim.clip_by_global_norm(grads, step.global_norm(grads), max_norm=1e9)  # scale 1: bitwise
        if k == STEPS - 1:
            opt.update_(shards, grads, state)  # in place on shards
        else:
            shards, state = opt.update(shards, grads, state)
    fpipe.save(directory, shards, optimizer_state=state, parallel=step)
    buffers = {key: step.gather([None if t is None else t[key] for t in state]) for key in ("exp_avg", "exp_avg_sq")}
    return {"stages": step.local_stages, "params": step.gather(shards), "buffers": buffers, "state": state}


@pytest.mark.timeout(150)
def test_sharded_training_equals_one_process_and_its_save_loads_whole(tmp_path: Path) -> None:
    results = run_ranks(4, _sharded_ranks, str(tmp_path), timeout=120)
    # One process: both replicas' batches through an unsharded step, gradients averaged.
    step = fpipe.pipeline(_loss, [_stage] * 4, OneFOneB(4))
    opt = _optimizer()
    params = _params(4)
    state = opt.init(params)
    for k in range(STEPS):
        grads = [step(params, _batch(10 * k + replica))[1] for replica in (0, 1)]
        mean = [optree.tree_map(lambda a, b: (a + b) / 2, g0, g1) for g0, g1 in zip(*grads)]
        params, state = opt.update(params, mean, state)
    loaded = fpipe.load(tmp_path, _params(4), optimizer_state=opt.init(_params(4)))
    for result in results:
        assert result["state"][result["stages"][0]]["exp_avg"]["0" if 0 in result["stages"] else "1"]["w"].dim() == 1
        for s in result["stages"]:
            assert_bitwise(result["params"][s], params[s])
            for key, full in result["buffers"].items():
                assert_bitwise(full[s], state[s][key])
    assert_bitwise(loaded.optimizer_state, state)
    assert_bitwise(loaded.params, params)
