"""Boxes (fpipe/_saving/_boxes.py, NOTE [tensor-parallel saves]): the block of a global tensor a
local piece holds, computed from placements as torch chunks, checked to tile the tensor once
(DTensors on real meshes: tests/saving/test_save_tensor_parallel.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fpipe._saving._boxes import Box, overlap, piece_box, tiling_problem, whole


class Mesh:
    """What ``piece_box`` reads of a DeviceMesh: this rank's coordinate and the dimensions' sizes."""

    def __init__(self, coordinate: list[int] | None, sizes: list[int]) -> None:
        self.coordinate, self.sizes = coordinate, sizes

    def get_coordinate(self) -> list[int] | None:
        return self.coordinate

    def size(self, i: int) -> int:
        return self.sizes[i]


def test_boxes_index_and_overlap() -> None:
    box = Box((1, 2), (2, 2))
    assert whole([3, 4]) == Box((0, 0), (3, 4)) and box.numel == 4
    t = torch.arange(12).reshape(3, 4)
    assert torch.equal(t[box.within(whole([3, 4]))], t[1:3, 2:4])
    assert box.within(Box((1, 0), (2, 4))) == (slice(0, 2), slice(2, 4))
    assert overlap(box, Box((0, 0), (2, 3))) == Box((1, 2), (1, 1))
    assert overlap(box, Box((0, 0), (1, 4))) is None  # touching edges share nothing


@pytest.mark.parametrize(
    ("boxes", "problem"),
    [
        ([Box((0, 0), (2, 4)), Box((2, 0), (1, 4))], None),
        (
            [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))],
            "the box at offset [2, 0] of shape [2, 4] is not inside shape [3, 4]",
        ),
        ([Box((0, 0), (2, 4))], "they cover 8 of its 12 elements"),
        (
            [Box((0, 0), (2, 4)), Box((1, 0), (1, 4)), Box((0, 0), (0, 4))],  # 12 elements, one row twice
            "the boxes at offsets [0, 0] and [1, 0] overlap",
        ),
    ],
)
def test_tiling_problems_are_named(boxes: list[Box], problem: str | None) -> None:
    assert tiling_problem([3, 4], boxes) == problem


@pytest.mark.parametrize(
    ("coordinate", "placements", "box"),
    [
        ([1, 0], [Shard(0), Replicate()], Box((3, 0), (2, 4))),  # 5 rows in chunks of 3: rows 3..4
        ([0, 1], [Replicate(), Shard(1)], Box((0, 2), (5, 2))),
        ([1, 1], [Shard(0), Shard(0)], Box((4, 0), (1, 4))),  # rows 3..4, then its second chunk
        ([1, 0], [Shard(-1), Replicate()], Box((0, 2), (5, 2))),
        ([0, 0], [Replicate(), Replicate()], Box((0, 0), (5, 4))),
    ],
)
def test_a_piece_box_follows_torch_chunk(coordinate: list[int], placements: list[Any], box: Box) -> None:
    assert piece_box("f", "w", Mesh(coordinate, [2, 2]), placements, [5, 4]) == box


def test_a_mesh_without_this_rank_or_a_partial_placement_fails() -> None:
    with pytest.raises(ValueError, match="f: w is a DTensor on a mesh that this rank is not part of"):
        piece_box("f", "w", Mesh(None, [2]), [Shard(0)], [4])
    with pytest.raises(TypeError, match="only Shard"):
        piece_box("f", "w", Mesh([0], [2]), [Partial()], [4])
