"""Boxes (fpipe/_saving/_boxes.py, NOTE [tensor-parallel saves]): the block of a global tensor a
local piece holds, computed from placements as torch chunks, checked to tile the tensor once
(DTensors on real meshes: tests/saving/_tensor_parallel_saves.py, whose indexes this module's last tests
edit into hostile boxes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fpipe
from fpipe._saving._boxes import Box, overlap, piece_box, tiling_problem, whole
from fpipe._saving._directory import INDEX, LATEST
from tests.saving._tensor_parallel_saves import (
    tp_params,
)
from tests.saving._tools import edit_index, template


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


# --- With tensor parallelism (tests/saving/_tensor_parallel_saves.py; its spawns: tests/saving/conftest.py) ---


# --- Hostile indexes (NOTE [trust model]) -----------------------------------------------------


def _edits() -> list[tuple[Any, str]]:
    a, b = (f"model-rank-00000-of-00002-tp-0000{t}-of-00002.safetensors" for t in (0, 1))

    odd = ["tensors", b, "b0.odd"]
    return [
        (
            edit_index([*odd, "offset"], [4, 0]),
            r"the box at offset \[4, 0\] of shape \[2, 3\] is not inside shape \[5, 3\]",
        ),
        (edit_index([*odd, "offset"], [2, 0]), r"the boxes at offsets \[0, 0\] and \[2, 0\] overlap"),
        (edit_index(["weight_map", "b0.odd"], [a]), r"they cover 9 of its 15 elements"),
        (edit_index(["weight_map", "b0.odd"], [a, a]), r"weight_map\['b0.odd'\] names a file twice"),
        (edit_index([*odd, "offset"], [3]), r"an offset and shape of 2 dimensions"),
        (edit_index([*odd, "full_shape"], [6, 3]), r"the pieces of 'b0.odd' disagree"),
        (edit_index([*odd, "offset"], KeyError), r"\['b0.odd'\]\['shard'\] is missing"),  # neither a box nor a shard
        (edit_index([*odd, "offset"], [-1, 0]), r"\['offset'\] should be a list of ints >= 0"),
    ]


def _sharded_edits() -> list[tuple[Any, str]]:
    """Edits of the tp_sharded_saves tensor-parallel save's index: ``b0.odd``'s pieces are (box, shard) (rows
    [0, 3), 0), ([0, 3), 1), ([3, 5), 0), ([3, 5), 1), of 5, 5, 3 and 3 elements."""
    name = "model-rank-00000-of-00001-dp-0000{}-of-00002-tp-0000{}-of-00002.safetensors"
    second = ["tensors", name.format(1, 1), "b0.odd"]  # shard 1 of the box at rows [3, 5)

    return [
        (edit_index([*second, "box_shape"], [1, 3]), r"the shards of one box of 'b0.odd' disagree"),
        (edit_index([*second, "box_shape"], KeyError), r"\['box_shape'\] is missing"),
        (edit_index([*second, "shard"], [0, 2]), r"\['shard'\] should be \[1, 2\]"),
        (edit_index([*second, "shard"], KeyError), r"each should be a box, a shard or a shard of a box like the first"),
        (edit_index(["tensors", name.format(0, 0), "b0.odd", "shard"], [0, 3]), r"with d > 0 dividing its 4 pieces"),
        (edit_index([*second, "shape"], [4]), r"the pieces of 'b0.odd' disagree: .* and shape \[3\]"),
        (edit_index([*second, "offset"], [2, 0]), r"the shards of one box of 'b0.odd' disagree"),
        (edit_index(["weight_map", "b0.odd"], [name.format(q, 0) for q in (0, 1)]), r"they cover 9 of its 15 elements"),
    ]


@pytest.mark.timeout(120)
def test_hostile_sharded_boxes_are_refused(tp_sharded_saves: tuple[Path, list[Any]]) -> None:
    _refused(tp_sharded_saves[0] / "sharded", _sharded_edits())


@pytest.mark.timeout(120)
def test_hostile_boxes_are_refused(tp_saves: tuple[Path, list[Any], Any]) -> None:
    _refused(tp_saves[0] / "tp", _edits())


def _refused(root: Path, edits: list[tuple[Any, str]]) -> None:
    """Each of ``edits`` to the index of the save in ``root`` makes ``fpipe.load`` raise its fragment."""
    version = root / (root / LATEST).read_text().strip()
    original = (version / INDEX).read_text()
    full = tp_params()
    try:
        for apply, fragment in edits:
            index = json.loads(original)
            apply(index)
            (version / INDEX).write_text(json.dumps(index))
            with pytest.raises(ValueError, match=r"is not an index written by fpipe\.save: .*" + fragment):
                fpipe.load(root, template(full))
    finally:
        (version / INDEX).write_text(original)
