"""``fpipe.shard`` and ``fpipe.gather`` (fpipe/_sharding/_public.py): what they cut over, and the
round trip. On a one-rank ``("dp", "pp")`` mesh of a process group of this process alone, so a
shard is the whole flattened leaf (the cut of many ranks, padding included: test_layout.py;
shards over 4 gloo ranks, against ``step.shard``: test_stages.py)."""

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
    # A step is read through its topology and timeout (its public view): a stand-in has them too.
    view = SimpleNamespace(topology=resolve_topology(mesh, None), timeout=30.0)
    for over in (mesh, view):
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
    one_process_step = SimpleNamespace(topology=None, timeout=30.0)
    for over in (mesh["pp"], one_process_step, object(), None):
        with pytest.raises(ValueError, match=rf"^fpipe.{name}: shards are cut over the data-parallel ranks of a mesh"):
            call(over)
