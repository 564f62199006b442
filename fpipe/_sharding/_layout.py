"""Shards and their collectives: how a stage's parameters are cut over the data-parallel ranks
(NOTE [shard layout] in ``fpipe/_sharding/_stages.py``), and the all-gather and reduce-scatter that
move them, one flat buffer per dtype per stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._distributed import Board, Topology, as_bytes, wait
from .._plural import plural
from .._pytree import PyTree, TreeSpec, detached, flatten, leaves_with_paths, unflatten
from .._tensor_parallel import DTensorLayout, check_mesh, dtensor_layout, local

# torch 2.13 deprecates ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (FutureWarning)
# in favour of these names, which older releases lack; both are the same collective.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel group a rank's shards are cut over."""

    group: Any
    rank: int  # position in the data-parallel group: which shard this process holds
    size: int  # d, the number of shards
    device: torch.device  # where collective buffers live (cuda for NCCL)
    pipeline_rank: int  # for error messages
    timeout: timedelta
    board: Board  # the job's failure board (NOTE [failure board] in fpipe/_distributed/_faults.py)
    tensor_ranks: tuple[int, ...] | None = None  # the tensor-parallel sub-mesh DTensor leaves must live on


def data_parallel(topology: Topology, timeout: float) -> DataParallel:
    """The data-parallel side of ``topology``, which must have one."""
    assert topology.data_group is not None
    return DataParallel(
        topology.data_group,
        dist.get_rank(topology.data_group),
        topology.data_size,
        topology.device,
        topology.rank,
        timedelta(seconds=timeout),
        topology.board,
        topology.tensor_ranks,
    )


# -- layouts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeafLayout:
    """A tensor leaf: its full shape and dtype, and ``size`` = elements per shard. For a DTensor
    the full tensor is this rank's local piece (``shape`` is the piece's), and ``dtensor`` says
    how to rebuild the DTensor around it (NOTE [tensor-parallel shards] in
    ``fpipe/_sharding/_stages.py``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    size: int
    dtensor: DTensorLayout | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def differentiable(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class StageLayout:
    """A stage's parameter pytree as sharded: its structure and a ``LeafLayout`` per tensor leaf
    (``None`` for non-tensor leaves, which every shard tree keeps whole)."""

    spec: TreeSpec
    paths: tuple[str, ...]
    leaves: tuple[LeafLayout | None, ...]
    num_shards: int


def layout_of(
    tree: PyTree,
    num_shards: int,
    tensor_ranks: Sequence[int] | None = None,
    *,
    caller: str = "fpipe.step.shard",
    name: str = "params",
) -> StageLayout:
    """The layout of ``tree`` cut into ``num_shards`` shards (only shapes and dtypes are read).

    Raises:
        ValueError: naming ``caller`` and ``name`` with the key path, if a DTensor leaf does not
            live on the tensor-parallel sub-mesh whose ranks are ``tensor_ranks`` (``None``: the
            mesh has no ``"tp"`` dimension).
    """
    paths, leaves, spec = leaves_with_paths(tree)
    out: list[LeafLayout | None] = []
    for path, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            out.append(None)
            continue
        dtensor = dtensor_layout(x)
        if dtensor is not None:
            check_mesh(x, tensor_ranks, f"{name}{path}", caller)
            x = local(x)  # NOTE [tensor-parallel shards]: the local piece is what is cut
        out.append(LeafLayout(tuple(x.shape), x.dtype, cut_range(x.numel(), (0, num_shards)).size, dtensor))
    return StageLayout(spec, tuple(paths), tuple(out), num_shards)


def cut(tree: PyTree, layout: StageLayout, rank: int) -> PyTree:
    """Shard ``rank`` of ``tree`` (NOTE [shard layout]): new tensors, the user's are not aliased.
    A DTensor leaf's shard is a plain tensor cut from its local piece."""
    leaves, spec = flatten(tree)
    out: list[Any] = []
    for leaf, shape in zip(leaves, layout.leaves):
        if shape is None:
            out.append(leaf)
            continue
        start, stop, size = cut_range(shape.numel, (rank, layout.num_shards))
        piece = detached(local(leaf)).reshape(-1)[start:stop]
        out.append(torch.cat([piece, piece.new_zeros(size - piece.numel())]))
    return unflatten(spec, out)


class ShardRange(NamedTuple):
    """What ``cut_range`` returns: the elements ``start:stop`` of a flattened tensor that a
    shard holds, and its length with padding (``size``, every shard's)."""

    start: int
    stop: int
    size: int


def cut_range(numel: int, shard: tuple[int, int] | None) -> ShardRange:
    """``(start, stop, size)``: the elements of a flattened tensor of ``numel`` that shard ``(q, d)``
    holds, and its length with padding (NOTE [shard layout]); ``None``: all of it."""
    if shard is None:
        return ShardRange(0, numel, numel)
    q, d = shard
    size = -(-numel // d)
    return ShardRange(min(q * size, numel), min((q + 1) * size, numel), size)


def check_shards(stage: int, tree: PyTree, layout: StageLayout | None) -> None:
    """Raise ``ValueError`` naming the leaf if ``tree`` is not a shard tree of ``layout``."""
    if layout is None:
        raise ValueError(
            f"fpipe.step: the step shards parameters but has no layout for stage {stage} (the full shapes "
            f"of its parameters). Cut the full parameters with shards = step.shard(params) first: it records "
            "each local stage's layout (tensors on the meta device will do for the shapes)."
        )
    paths, leaves, spec = leaves_with_paths(tree)
    if spec != layout.spec:
        raise ValueError(
            f"fpipe.step: params[{stage}] does not have the structure step.shard recorded for stage {stage} "
            f"(params[{stage}]: {spec}; recorded: {layout.spec}). Pass the shards step.shard(params) "
            "returned, or updates of them with the same structure."
        )
    for path, leaf, shape in zip(paths, leaves, layout.leaves):
        if shape is None:
            continue
        if not (isinstance(leaf, torch.Tensor) and leaf.dtype == shape.dtype and tuple(leaf.shape) == (shape.size,)):
            got = (
                f"{leaf.dtype} tensor of shape {tuple(leaf.shape)}"
                if isinstance(leaf, torch.Tensor)
                else type(leaf).__name__
            )
            full = f"a {shape.dtype} tensor of shape {shape.shape}"
            if shape.dtensor is not None:
                global_shape = shape.dtensor.shape
                full = f"the local piece (shape {shape.shape}) of a {shape.dtype} DTensor of shape {global_shape}"
            raise ValueError(
                f"fpipe.step: params[{stage}]{path} should be this rank's shard of {full}, a 1-D {shape.dtype} "
                f"tensor of {plural(shape.size, 'element')} (got: {got}). Cut full parameters with step.shard(params)."
            )


def norm_leaves(stage: int, grads: PyTree, layout: StageLayout | None) -> list[tuple[torch.Tensor, Any]]:
    """The tensor leaves of a stage's gradient shards, each with the placements of the DTensor
    whose local piece it is a shard of (``None`` for a plain parameter's): ``step.global_norm``
    counts a shard of a ``Shard`` DTensor on every tensor-parallel rank, the others once."""
    if layout is None:
        raise ValueError(
            f"fpipe.step.global_norm: the step has no layout for stage {stage}; cut the parameters with "
            "step.shard(params) first."
        )
    leaves, spec = flatten(grads)
    if spec.num_leaves != len(layout.leaves):
        raise ValueError(
            f"fpipe.step.global_norm: grads[{stage}] has {plural(spec.num_leaves, 'leaf')} but stage {stage}'s "
            f"parameters have {len(layout.leaves)} (grads[{stage}]: {spec}; parameters: {layout.spec}). Pass the "
            "grads the step returned."
        )
    return [
        (g, None if shape is None or shape.dtensor is None else shape.dtensor.placements)
        for g, shape in zip(leaves, layout.leaves)
        if isinstance(g, torch.Tensor)
    ]


# -- flat buffers -------------------------------------------------------------------------------


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, in a dtype every backend moves: complex as its (re, im) pairs, bool as bytes."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).reshape(-1)
    if t.dtype == torch.bool:
        return as_bytes(t)
    return t.reshape(-1)


def _unwire(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``_wire`` on a flat tensor."""
    if dtype.is_complex:
        pairs = flat.reshape(-1, 2)
        return torch.view_as_complex(pairs if pairs.storage_offset() % 2 == 0 else pairs.clone())
    if dtype == torch.bool:
        return flat.view(torch.bool)
    return flat


def _buckets(layout: StageLayout, keep: Callable[[LeafLayout], bool]) -> list[tuple[torch.dtype, list[_Member]]]:
    """Non-empty tensor leaves grouped by the dtype they travel as, each with its offset in the
    bucket's row, in leaf order (the same on every replica)."""
    buckets: dict[torch.dtype, list[_Member]] = {}
    for k, shape in enumerate(layout.leaves):
        if shape is not None and keep(shape) and shape.size:
            members = buckets.setdefault(_wire(torch.empty(1, dtype=shape.dtype)).dtype, [])
            offset = members[-1].offset + _width(members[-1].shape) if members else 0
            members.append(_Member(k, shape, offset))
    return list(buckets.items())


@dataclass(frozen=True)
class _Member:
    """Leaf ``index`` in a bucket: its columns ``[offset, offset + _width(shape))`` of the grid."""

    index: int
    shape: LeafLayout
    offset: int

    @property
    def columns(self) -> slice:
        return slice(self.offset, self.offset + _width(self.shape))


def _width(shape: LeafLayout) -> int:
    """Elements of a shard on the wire: complex numbers travel as two reals."""
    return shape.size * (2 if shape.dtype.is_complex else 1)


class Gather:
    """The all-gathers of one stage's shards, posted; ``wait`` returns the full parameter pytree."""

    def __init__(self, dp: DataParallel, what: str, shards: PyTree, layout: StageLayout) -> None:
        self.dp, self.what, self.layout = dp, what, layout
        self._leaves, self._spec = flatten(shards)
        self._posted: list[tuple[list[_Member], torch.Tensor, torch.Tensor, Any]] = []
        for wire_dtype, members in _buckets(layout, lambda shape: True):
            send = torch.cat([_wire(self._leaves[m.index]).to(dp.device) for m in members])
            grid = torch.empty(dp.size, send.numel(), dtype=wire_dtype, device=dp.device)
            work = _all_gather(grid.view(-1), send, group=dp.group, async_op=True)
            self._posted.append((members, send, grid, work))

    def wait(self) -> PyTree:
        leaves = list(self._leaves)
        for k, shape in enumerate(self.layout.leaves):
            if shape is not None and not shape.size:  # an empty tensor: nothing travelled
                leaves[k] = torch.empty(shape.shape, dtype=shape.dtype, device=self.dp.device)
        what = f"the all-gather of {self.what} over the data-parallel group"
        for members, _, grid, work in self._posted:
            wait(work, self.dp.board, self.dp.timeout, self.dp.pipeline_rank, what)
            for m in members:
                padded = grid[:, m.columns].reshape(-1)  # the column block, row by row
                leaves[m.index] = _unwire(padded, m.shape.dtype)[: m.shape.numel].view(m.shape.shape)
        self._posted.clear()
        for k, shape in enumerate(self.layout.leaves):
            if shape is not None and shape.dtensor is not None:  # the gathered local piece, as its DTensor
                leaves[k] = shape.dtensor.wrap(leaves[k])
        return unflatten(self._spec, leaves)


class ReduceScatter:
    """The reduce-scatters of one stage's full gradients, posted; ``wait`` returns the averaged shards.

    ``grads`` is ``StageRun.grads()`` (``None`` for leaves without a gradient; a DTensor's
    gradient, with its parameter's placements, is reduced as its local piece). Without
    ``divide`` the shards are summed over the replicas, not averaged (``weight_fn``: each replica's
    share is already over the total count).
    """

    def __init__(
        self, dp: DataParallel, stage: int, grads: PyTree | None, layout: StageLayout, *, divide: bool = True
    ) -> None:
        self.dp, self.stage, self.layout, self.divide = dp, stage, layout, divide
        leaves = [None] * len(layout.leaves) if grads is None else flatten(grads)[0]
        self._posted: list[tuple[list[_Member], torch.Tensor, torch.Tensor, Any]] = []
        for wire_dtype, members in _buckets(layout, lambda shape: shape.differentiable):
            width = members[-1].columns.stop
            grid = torch.empty(dp.size, width, dtype=wire_dtype, device=dp.device)
            for m in members:
                g, block = leaves[m.index], grid[:, m.columns]
                if g is None:
                    block.zero_()
                    continue
                flat = _wire(local(g)).to(dp.device)  # a DTensor's gradient: its local piece
                if flat.numel() < block.numel():  # the padding of NOTE [shard layout]
                    flat = torch.cat([flat, flat.new_zeros(block.numel() - flat.numel())])
                block.copy_(flat.view(block.shape))
            out = torch.empty(width, dtype=wire_dtype, device=dp.device)
            work = _reduce_scatter(out, grid.view(-1), group=dp.group, async_op=True)
            self._posted.append((members, grid, out, work))

    def wait(self) -> PyTree:
        leaves: list[Any] = [None] * len(self.layout.leaves)
        for k, shape in enumerate(self.layout.leaves):
            if shape is not None and shape.differentiable and not shape.size:
                leaves[k] = torch.empty(0, dtype=shape.dtype, device=self.dp.device)
        what = f"the reduce-scatter of stage {self.stage}'s gradients over the data-parallel group"
        for members, _, out, work in self._posted:
            wait(work, self.dp.board, self.dp.timeout, self.dp.pipeline_rank, what)
            if self.divide:
                out.div_(self.dp.size)
            for m in members:
                leaves[m.index] = _unwire(out[m.columns], m.shape.dtype)
        self._posted.clear()
        return unflatten(self.layout.spec, leaves)
