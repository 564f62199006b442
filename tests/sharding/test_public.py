"""``fpipe.shard`` and ``fpipe.gather`` (fpipe/_sharding/_public.py): what they cut over, and the
round trip. On a one-rank ``("dp", "pp")`` mesh of a process group of this process alone, so a
shard is the whole flattened leaf (the cut of many ranks, padding included: test_layout.py;
shards over 4 gloo ranks, against ``step.shard``: test_stages.py). Bad DTensor inputs to
``fpipe.shard``, ``fpipe.gather``, ``step.shard`` and ``step.global_norm`` on dp 2 x pp 1 x tp 2 gloo
ranks fail on every rank (the model: tests/_tensor_parallel_llama.py)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fpipe
from fpipe._distributed import resolve_topology
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests._tensor_parallel_llama import (
    distribute_llama,
    dtensor_api,
    llama_batch,
    llama_loss,
    llama_params,
    llama_stages,
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank ("dp", "pp") CPU mesh on a process group of this process alone, destroyed after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "pp"))
    finally:
        dist.destroy_process_group()


def tree() -> dict[str, Any]:
    return {"w": torch.arange(15.0).reshape(5, 3), "s": torch.tensor(2.0), "n": torch.tensor([1, 2]), "act": "tanh"}


def test_a_shard_is_the_rank_s_slice_of_the_flattened_leaf_and_gathers_back(mesh: DeviceMesh) -> None:
    full = tree()
    # A step is read through its public view (``ParallelView``): a stand-in has it too.
    topology = resolve_topology(mesh, None)
    view = SimpleNamespace(
        parallel=fpipe.Parallelism(mesh=mesh, timeout=30.0), topology=topology, num_stages=1, local_stages=(0,),
        shard_layouts={},
        shared_stages=(),
    )  # fmt: skip
    for over in (mesh, fpipe.Parallelism(mesh=mesh), view):
        shards = fpipe.shard(full, over)
        assert shards["act"] == "tanh"  # not a tensor: kept whole
        for key in ("w", "s", "n"):
            assert torch.equal(shards[key], full[key].reshape(-1)) and shards[key].dtype == full[key].dtype
        meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in full.items()}
        for like in (full, meta):
            back = fpipe.gather(shards, like, over)
            assert back["act"] == "tanh"
            assert all(torch.equal(back[k], full[k]) and back[k].shape == full[k].shape for k in ("w", "s", "n"))


@pytest.mark.parametrize("name", ["shard", "gather"])
def test_anything_without_a_data_parallel_dimension_is_refused(mesh: DeviceMesh, name: str) -> None:
    full = tree()
    call = {"shard": lambda over: fpipe.shard(full, over), "gather": lambda over: fpipe.gather(full, full, over)}[name]
    one_process_step = SimpleNamespace(
        parallel=fpipe.Parallelism(timeout=30.0),
        topology=None,
        num_stages=1,
        local_stages=(0,),
        shard_layouts={},
        shared_stages=(),
    )
    for over in (mesh["pp"], fpipe.Parallelism(), one_process_step, object(), None):
        with pytest.raises(ValueError, match=rf"^fpipe.{name}: shards are cut over the data-parallel ranks of a mesh"):
            call(over)


def _sharded_bad_inputs(rank, world):
    """On dp 2 x pp 1 x tp 2 with shard_params=True: DTensors on the wrong mesh or on a mesh without
    tp, full DTensor params given to the step on one rank, then a good step, then grads of the
    wrong structure to global_norm; what each rank raised."""
    from torch.distributed.device_mesh import init_device_mesh

    DTensor, _, Replicate, _ = dtensor_api()
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    step = fpipe.pipeline(
        llama_loss, llama_stages(2), OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30)
    )
    params = [distribute_llama(p, mesh["tp"]) for p in llama_params(2)]
    messages = {}
    wrong = [dict(p) for p in params]
    wrong[0]["wq"] = DTensor.from_local(wrong[0]["wq"].to_local(), mesh["dp"], [Replicate()])
    for name, call in {
        "shard, wrong mesh": lambda: step.shard(wrong),
        "gather, wrong mesh": lambda: fpipe.gather(fpipe.shard(params[0], mesh), wrong[0], mesh),
        "shard, no tp": lambda: fpipe.shard(params[0], mesh["dp", "pp"]),
    }.items():
        with pytest.raises(ValueError) as info:
            call()
        messages[name] = str(info.value)
    shards = step.shard(params)
    batch = llama_batch(1) if step.rank == 0 else None
    with pytest.raises(ValueError) as info:
        # on one rank, a full DTensor where its shard belongs
        step([{**shards[0], "wq": params[0]["wq"]}, shards[1]] if rank == 3 else shards, batch)
    messages["full params"] = str(info.value)
    loss, grads = step(shards, batch)  # input errors leave the mesh usable
    messages["after"] = float(loss)
    with pytest.raises(ValueError) as info:
        step.global_norm([{"wq": g["wq"]} for g in grads])
    messages["norm, wrong structure"] = str(info.value)
    unsharded = fpipe.pipeline(
        llama_loss, llama_stages(2), OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30)
    )
    with pytest.raises(ValueError) as info:
        unsharded.global_norm(grads)  # no step.shard yet: no layouts to read the placements from
    messages["norm, no layout"] = str(info.value)
    return messages


@pytest.mark.timeout(240)
def test_sharded_tensor_parallel_bad_inputs_fail_on_every_rank():
    results = run_ranks(4, _sharded_bad_inputs, timeout=120)
    for rank, m in enumerate(results):  # global rank = 2 * dp + tp
        tp_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert "fpipe.step.shard: params[0]['wq'] is a DTensor on the wrong mesh" in m["shard, wrong mesh"]
        assert f"this rank's tensor-parallel sub-mesh has ranks {tp_ranks}" in m["shard, wrong mesh"]
        assert "fpipe.gather: like['wq'] is a DTensor on the wrong mesh" in m["gather, wrong mesh"]
        assert "fpipe.shard: tree['n1'] is a DTensor but the pipeline's mesh has no tensor-par" in m["shard, no tp"]
        assert "grads[0] has 1 leaf but stage 0's parameters have 10" in m["norm, wrong structure"]
        assert "fpipe.step.global_norm: the step has no layout for stage 0" in m["norm, no layout"]
    full = "params[0]['wq'] should be this rank's shard of the local piece (shape (4, 8)) of a torch.float64 DTensor"
    assert full + " of shape (8, 8), a 1-D torch.float64 tensor of 16 elements" in results[3]["full params"]
    assert "another data-parallel replica rejected its inputs" in results[1]["full params"]
    assert "another tensor-parallel rank rejected its inputs" in results[0]["full params"]
    assert "another tensor-parallel rank rejected its inputs" in results[2]["full params"]
    assert len({r["after"] for r in results}) == 1
