"""Boxes: the block of a global tensor that a DTensor's local piece holds, for saving and loading.

NOTE [tensor-parallel saves]
A DTensor leaf (notes/tensor_parallel.md) is saved by its global name, as a plain tensor would
be, but never gathered: each tensor-parallel rank writes its own local piece, the n-d box of the
global tensor that its placements give it (``box_of``), and the index records each piece's
offset (NOTE [sharded saves] in ``fpipe/_saving/_store.py`` has the format). A ``Shard(d)``
placement cuts dimension ``d`` as ``torch.chunk`` and DTensor do: pieces of ``ceil(n / T)``,
the last ones shorter or empty (``cut_range``); a ``Replicate`` DTensor, like a plain tensor,
is one box, the whole tensor, written once, by the lowest writer holding it (tensor-parallel
rank 0). The pieces of a name must tile its shape: every element in exactly one box
(``tiling_problem``), which ``save`` checks over all ranks and ``load`` checks in the index.

With ``shard_params=True`` too, each rank holds a flat shard of its local piece, and writes
that shard of its box (NOTE [sharded saves] in ``fpipe/_saving/_store.py``; ``piece_box`` gives
the box from the step's layout, which keeps the DTensor's mesh, placements and global shape).

Expert weights (NOTE [experts are data-parallel for the dense weights] in
``fpipe/_distributed/_topology.py``) are DTensors ``Shard(0)`` on ``mesh["ep"]``: each expert-parallel
rank's block of experts is its box, written by that rank. So the writers of a save with an
``"ep"`` dimension are the ranks of data-parallel index 0, every pipeline and ep index (and every
tp index); the other data-parallel replicas hold the same pieces and write nothing. Whatever
several writers hold alike is written once, by the lowest: a plain tensor (a dense weight, held
by every dp x ep replica) by ep rank 0 and tp rank 0, an expert block by tp rank 0; its copies
must be bitwise equal (the step's all-reduces keep them so).

Loading, the template decides the layout: a DTensor leaf asks for its own box, a plain leaf for
the whole tensor, whatever boxes the save has; each piece on disk that overlaps the box is read
and its overlap copied (``Box.within``). So a save at one ep size loads at any other, or into
plain tensors holding every expert; an expert template whose experts its ep ranks do not
divide is refused (``load``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._sharding import cut_range
from .._tensor_parallel import mesh_ranks


class Box(NamedTuple):
    """Elements ``[offset[i], offset[i] + shape[i])`` of each dimension ``i`` of a global tensor."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This box as an index into a tensor holding the box ``outer`` (which contains it)."""
        return tuple(slice(a - b, a - b + n) for a, b, n in zip(self.offset, outer.offset, self.shape))


def whole(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return Box((0,) * len(shape), tuple(shape))


def overlap(a: Box, b: Box) -> Box | None:
    """The elements in both boxes, ``None`` if there are none."""
    starts = [max(x, y) for x, y in zip(a.offset, b.offset)]
    stops = [min(x + n, y + m) for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape)]
    if any(stop <= start for start, stop in zip(starts, stops)):
        return None
    return Box(tuple(starts), tuple(stop - start for start, stop in zip(starts, stops)))


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """What keeps ``boxes`` from covering a tensor of ``shape`` exactly once (``None``: they do)."""
    for box in boxes:
        inside = len(box.offset) == len(box.shape) == len(shape) and all(
            o >= 0 and n >= 0 and o + n <= m for o, n, m in zip(box.offset, box.shape, shape)
        )
        if not inside:
            return f"the box at offset {list(box.offset)} of shape {list(box.shape)} is not inside shape {list(shape)}"
    covered = sum(box.numel for box in boxes)
    if covered != math.prod(shape):  # first: it is linear in the boxes, the test below quadratic
        return f"they cover {covered} of its {math.prod(shape)} elements"
    for k, a in enumerate(boxes):  # as many elements as the shape, so an overlap leaves a gap
        for b in boxes[k + 1 :]:
            if overlap(a, b) is not None:
                return f"the boxes at offsets {list(a.offset)} and {list(b.offset)} overlap"
    return None


@dataclass(frozen=True)
class HostPiece:
    """A DTensor's local piece copied to host memory, with its mesh, placements and global shape:
    what ``AsyncSaver`` keeps of a DTensor leaf (a DTensor cannot hold a CPU piece on a CUDA mesh)."""

    local: torch.Tensor
    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]


def host_piece(t: torch.Tensor, copy: Any) -> HostPiece:
    """``t`` (a DTensor) as a ``HostPiece`` whose local piece is ``copy(local piece)``."""
    assert isinstance(t, DTensor)
    return HostPiece(copy(t.to_local()), t.device_mesh, tuple(t.placements), tuple(t.shape))


def is_piece(leaf: Any) -> bool:
    """Whether ``leaf`` is a DTensor or a ``HostPiece`` of one."""
    return isinstance(leaf, (DTensor, HostPiece))


def box_of(
    function: str,
    where: str,
    leaf: Any,
    tensor_ranks: Sequence[int] | None = None,
    expert_ranks: Sequence[int] | None = None,
) -> Box | None:
    """The box of DTensor (or ``HostPiece``) ``leaf`` that this rank holds; ``None`` for the whole tensor
    (NOTE [tensor-parallel saves]). With ``tensor_ranks`` or ``expert_ranks`` (saving), the DTensor
    must live on the tensor-parallel sub-mesh with those ranks, or on the expert-parallel one.

    Raises:
        TypeError: a placement other than ``Shard`` and ``Replicate`` (a ``Partial`` value is not
            the tensor's value until summed).
        ValueError: a mesh this rank is not in, or not a sub-mesh of the save's when saving, or
            a local piece whose shape is not the one torch's chunking gives.
    """
    if isinstance(leaf, DTensor):
        local, mesh, placements, shape = leaf.to_local(), leaf.device_mesh, tuple(leaf.placements), tuple(leaf.shape)
    else:
        local, mesh, placements, shape = leaf.local, leaf.mesh, leaf.placements, leaf.shape
    homes = {
        kind: list(ranks)
        for kind, ranks in (("tensor-parallel", tensor_ranks), ("expert-parallel", expert_ranks))
        if ranks is not None
    }
    if homes and (mesh.ndim != 1 or mesh_ranks(mesh) not in homes.values()):
        ranks_of = "; ".join(f"the {kind} ranks: {ranks}" for kind, ranks in homes.items())
        raise ValueError(
            f"{function}: {where} is a DTensor on a mesh that is not this rank's {' nor its '.join(homes)} sub-mesh "
            f"(its mesh: {mesh!r}; {ranks_of}). Save DTensors on mesh['tp'] (expert weights on mesh['ep']) of the "
            "mesh of parallel= (a Parallelism's or the step's), whose ranks write their own pieces."
        )
    box = piece_box(function, where, mesh, placements, shape)
    if list(local.shape) != list(box.shape):
        raise ValueError(
            f"{function}: {where} is a DTensor whose local piece has shape {list(local.shape)}, but its placements "
            f"{list(placements)} cut shape {list(shape)} into pieces of shape {list(box.shape)} here (as torch.chunk "
            "does). Make it with distribute_tensor or DTensor.from_local on evenly chunked pieces."
        )
    return None if box.shape == tuple(shape) else box


def piece_box(function: str, where: str, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> Box:
    """The box of a tensor of global ``shape`` that this rank's local piece holds under ``placements``
    on ``mesh`` (NOTE [tensor-parallel saves]); the whole tensor's for ``Replicate`` ones.

    Raises:
        TypeError: a placement other than ``Shard`` and ``Replicate``.
        ValueError: a mesh this rank is not in.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{function}: {where} is a DTensor on a mesh that this rank is not part of ({mesh!r}).")
    offset, size = [0] * len(shape), list(shape)
    for i, placement in enumerate(placements):
        if type(placement) is Shard:
            d = placement.dim % max(len(shape), 1)
            start, stop, _ = cut_range(size[d], (coordinate[i], mesh.size(i)))
            offset[d] += start
            size[d] = stop - start
        elif type(placement) is not Replicate:
            raise TypeError(
                f"{function}: {where} is a DTensor with placement {placement!r}; only Shard(dim) and Replicate "
                "DTensors are saved and loaded by their pieces. Redistribute it first (a Partial one to Replicate)."
            )
    return Box(tuple(offset), tuple(size))
