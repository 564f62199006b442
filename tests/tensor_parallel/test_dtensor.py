"""DTensor leaves (fpipe/_tensor_parallel/_dtensor.py): placements as plain data, a DTensor's description and
rebuild around its local piece without communication, copies that keep a ``Partial`` sum
partial, and each rank's share of a squared norm. On a one-rank mesh in this process (tensor
parallelism over many ranks: tests/tensor_parallel/test_end_to_end.py)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from fpipe._tensor_parallel._dtensor import (
    check_mesh,
    clone,
    dtensor_layout,
    from_header,
    header_of,
    is_dtensor,
    like_param,
    local,
    placements_data,
    placements_from,
    shares_storage,
    square_sum,
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank CPU mesh on a process group of this process alone, destroyed after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def test_placements_travel_as_plain_data() -> None:
    placements = (Shard(1), Replicate(), Partial("max"))
    data = placements_data(placements, "y")
    assert data == (("Shard", 1), ("Replicate",), ("Partial", "max"))
    assert placements_from([list(p) for p in data]) == placements  # as JSON gives them back


@pytest.mark.parametrize("data", [("Shard", 0), [("Shard", -1)], [("Partial", "xor")], [("Replicate", 1)], [[]]])
def test_data_that_is_no_placement_is_refused(data: Any) -> None:
    with pytest.raises(ValueError, match="not"):
        placements_from(data)


def test_a_placement_the_wire_cannot_carry_is_named() -> None:
    with pytest.raises(TypeError, match=r"cannot travel between ranks \(y\['h'\]: "):
        placements_data([object()], "y['h']")


def test_plain_tensors_pass_through() -> None:
    t = torch.arange(3.0)
    assert not is_dtensor(t) and local(t) is t and dtensor_layout(t) is None and like_param(t, t) is t
    copy = clone(t)
    assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr()


def test_shared_storage_is_seen() -> None:
    t = torch.arange(4.0)
    assert not shares_storage(torch.arange(4.0))
    view = t[1:]
    assert shares_storage(t) and shares_storage(view)
    del view
    assert not shares_storage(t)


def test_a_dtensor_travels_as_its_piece_and_its_header(mesh: DeviceMesh) -> None:
    t = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(1)])
    header = header_of(t, "x")
    assert header == ((("Shard", 1),), (2, 3), (3, 1))
    rebuilt = from_header(local(t), mesh, header)
    assert isinstance(rebuilt, DTensor) and rebuilt.placements == (Shard(1),)
    assert local(rebuilt).data_ptr() == local(t).data_ptr()  # no copy
    layout = dtensor_layout(t)
    assert layout is not None and layout.wrap(local(t)).placements == (Shard(1),)


def test_a_partial_copy_stays_partial_until_like_param(mesh: DeviceMesh) -> None:
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
    copy = clone(partial)
    assert copy.placements == (Partial(),) and local(copy).data_ptr() != local(partial).data_ptr()
    param = distribute_tensor(torch.zeros(2), mesh, [Replicate()])
    summed = like_param(copy, param)
    assert summed.placements == (Replicate(),) and torch.equal(local(summed), torch.ones(2))


def test_square_sums_count_each_piece_once(mesh: DeviceMesh) -> None:
    g = torch.tensor([3.0, 4.0])
    assert square_sum(g, None).item() == 25.0 and square_sum(g, None).dtype == torch.float64
    assert square_sum(distribute_tensor(g, mesh, [Shard(0)]), mesh.get_group()).item() == 25.0
    with pytest.raises(ValueError, match="a gradient with Partial placements"):
        square_sum(g, None, [Partial()])


def test_a_dtensor_must_live_on_the_tensor_parallel_mesh() -> None:
    leaf: Any = SimpleNamespace(device_mesh=SimpleNamespace(ndim=1, mesh=torch.tensor([2, 3])))
    check_mesh(leaf, [2, 3], "w")
    with pytest.raises(ValueError, match=r"fpipe\.step: w is a DTensor but the pipeline's mesh has no tensor-parallel"):
        check_mesh(leaf, None, "w")
    with pytest.raises(ValueError, match=r"fpipe\.save: w is a DTensor on the wrong mesh"):
        check_mesh(leaf, [0, 1], "w", "fpipe.save")
