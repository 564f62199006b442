"""The shared comparisons of tests/helpers.py: ``assert_bitwise`` compares bits, not values."""

from __future__ import annotations

import collections
import math
import struct
from typing import Any

import pytest
import torch

from tests.helpers import assert_bitwise, assert_close, bitwise_equal


def nan_with_payload(payload: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A quiet NaN whose mantissa carries ``payload``."""
    bits = struct.unpack("<q", struct.pack("<d", math.nan))[0] | payload
    return torch.tensor([bits], dtype=torch.int64).view(torch.float64).to(dtype)


def test_zero_and_negative_zero_differ() -> None:
    assert torch.equal(torch.tensor(0.0), torch.tensor(-0.0))  # what a value comparison says
    with pytest.raises(AssertionError, match=r"1 of 1 elements differ in their bits.*0\.0 and -0\.0"):
        assert_bitwise(torch.tensor(0.0), torch.tensor(-0.0))
    with pytest.raises(AssertionError, match=r"at \['b'\]\[1\]: 0\.0 and -0\.0"):
        assert_bitwise({"a": 1, "b": [2.0, 0.0]}, {"a": 1, "b": [2.0, -0.0]})  # Python floats too
    with pytest.raises(AssertionError, match="differ in their bits"):
        assert_bitwise(torch.tensor([complex(1, 0.0)]), torch.tensor([complex(1, -0.0)]))


def test_equal_nan_payloads_are_equal_and_different_ones_differ() -> None:
    a = nan_with_payload(5)
    assert not torch.equal(a, a.clone())  # what a value comparison says
    assert_bitwise(a, a.clone())
    assert_bitwise({"x": [math.nan]}, {"x": [math.nan]})
    with pytest.raises(AssertionError, match="differ in their bits"):
        assert_bitwise(a, nan_with_payload(6))
    assert bitwise_equal([a], [a.clone()]) and not bitwise_equal([a], [nan_with_payload(6)])


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [  # built when the tests are collected, before the float64 fixture: float32
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64), r"torch.float32 \(2,\) on cpu and torch.float64 \(2,\)"),
        (torch.zeros(2), torch.zeros(1, 2), r"\(2,\) on cpu and torch.float32 \(1, 2\)"),
        (torch.zeros(()), torch.zeros(1), r"\(\) on cpu and torch.float32 \(1,\)"),
        (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.uint32), "torch.int32"),  # the same bits
        (torch.ones(2), 1.0, "types Tensor and float"),
        (torch.nn.Parameter(torch.ones(2)), torch.ones(2), "types Parameter and Tensor"),
        (1, True, "types int and bool"),
        (1, 1.0, "types int and float"),
        ("a", "b", "'a' and 'b'"),
        ({"a": torch.ones(1)}, {"b": torch.ones(1)}, "the structures differ"),
        ([torch.ones(1)], (torch.ones(1),), "the structures differ"),
        ([None], [torch.ones(1)], "types NoneType and Tensor"),
        (torch.tensor([True, False]), torch.tensor([True, True]), r"1 of 2 elements .* flat index 1: False and True"),
    ],
)
def test_different_dtypes_shapes_types_structures_and_values_differ(actual: Any, expected: Any, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        assert_bitwise(actual, expected)


def test_equal_bits_are_equal_whatever_the_layout() -> None:
    x = torch.randn(3, 4)
    Pair = collections.namedtuple("Pair", "first second")
    tree = {
        "strided": x.t(),
        "one element, stride 2": x[0, ::2][:1],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False]),
        "bf16": torch.randn(3).to(torch.bfloat16),
        "c64": torch.randn(2, dtype=torch.complex64).conj(),  # a lazily conjugated view
        "pair": Pair(None, "tag"),
        "meta": torch.empty(2, 3, device="meta"),
    }
    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tree.items()}
    copy["strided"], copy["c64"] = x.t().contiguous(), tree["c64"].resolve_conj()
    assert_bitwise(tree, copy)
    with pytest.raises(AssertionError, match=r"step 3: at \['c64'\]"):
        assert_bitwise(tree, {**copy, "c64": tree["c64"].conj()}, "step 3")


def test_a_dtensor_is_compared_by_its_placements_and_local_tensor() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = torch.randn(4, 2)
        assert_bitwise(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(x.clone(), mesh, [Shard(0)]))
        with pytest.raises(AssertionError, match=r"placements \(Shard\(dim=0\),\)"):
            assert_bitwise(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(x, mesh, [Replicate()]))
        with pytest.raises(AssertionError, match=r"\(local tensor\): 1 of 8 elements"):
            y = x.clone()
            y[1, 1] = -y[1, 1]
            assert_bitwise(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)]))
    finally:
        dist.destroy_process_group()


def test_assert_close_allows_a_relative_error() -> None:
    x = torch.randn(5)
    assert_close(x * (1 + 1e-12), x)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(x * (1 + 1e-6), x)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_close([x], (x,), context="tolerance")
