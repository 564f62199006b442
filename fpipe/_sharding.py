"""Sharded data parallel (ZeRO-3, FSDP) under the pipeline: parameters live cut into shards.

With ``pipeline(..., mesh=mesh, shard_params=True)`` each rank keeps, for each of its stages, only
its shard of every parameter (``1 / d`` of it, ``d`` data-parallel ranks). A step all-gathers a
stage's full parameters before the stage's first forward and keeps them for the step; once the
stage's last backward has run, its gradients (summed over microbatches by ``StageRun``) are
reduce-scattered, averaged over the replicas, and returned as shards. The optimizer then updates
shards only: parameters, gradients and optimizer state all take ``1 / d`` of the memory between
steps.

NOTE [shard layout]
A tensor leaf of ``n`` elements is flattened and zero-padded to ``d * c`` elements,
``c = ceil(n / d)``; rank ``r`` holds elements ``[r * c, (r + 1) * c)`` as a 1-D tensor of ``c``
elements. Nothing is dropped, and padding is never read back: a gather keeps the first ``n``.
For one stage, one all-gather per dtype (complex as its real dtype, bool as bytes) moves every
leaf: each rank sends its shards concatenated, a row of the grid below, and receives the grid.
Leaf ``k`` is column block ``k`` read row by row (then cut to ``n`` and reshaped):

    leaves a (n = 5) and b (n = 4), d = 2       | a, c = 3 | b, c = 2 |
                                         rank 0 | a0 a1 a2 | b0 b1    |
                                         rank 1 | a3 a4 0  | b2 b3    |

The reduce-scatter runs the same grid backwards: each rank writes every leaf's full gradient,
zero-padded, into its column block; the reduce-scatter sums the grids of all ranks and hands rank
``r`` row ``r``, which is divided by ``d``. Gradients are thus summed over replicas by the
collective, in its own order; with ``d = 2`` that is ``g_a + g_b`` whatever the order (floating
point addition commutes), so the result is bitwise that of the unsharded all-reduce.

NOTE [regather]
With ``pipeline(..., shard_params=True, regather=True)`` a stage's full parameters are alive only
while one of its actions runs: looking up another stage frees them (their storage is resized to
nothing; the graphs of earlier microbatches keep aliases of them), and the next action of the
stage all-gathers them again into the same tensors, with the values those graphs saved. At
most one stage's full parameters are alive at a time, for one all-gather per action instead
of one per stage per step, and without overlap (each gather is waited for at once).

NOTE [gather overlap]
Every all-gather of the step is posted (``async_op=True``) right after the handshake, in the
order the rank first uses its stages; the executor reaches a stage through ``ShardedRuns``,
whose first lookup of stage ``s`` waits for that gather and builds the stage's ``StageRun``.
So the gather of stage ``s`` lands while the rank waits for its first activation and while it
runs the stages it uses before ``s`` (interleaved schedules hold several). A stage's
reduce-scatter is posted as soon as its last action ran, so it overlaps the remaining actions
of other stages, and its full parameters and gradients are freed at once:

    rank r | handshake | post gathers s, s+p | wait s: 1st forward of s ... wait s+p: 1st forward
           | of s+p ... last backward of s+p: post reduce-scatter s+p ... last backward of s: post
           | reduce-scatter s | wait both | all-reduce [loss, failed]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from ._distributed import Topology, resolve_topology, wait
from ._pytree import PyTree, TreeSpec, detached, flatten, leaves_with_paths, map_tensors, unflatten
from ._stage import StageRun
from .schedules._action import Action

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
    )


# -- layouts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeafLayout:
    """A tensor leaf: its full shape and dtype, and ``size`` = elements per shard."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    size: int

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

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


def layout_of(tree: PyTree, num_shards: int) -> StageLayout:
    """The layout of ``tree`` cut into ``num_shards`` shards (only shapes and dtypes are read)."""
    paths, leaves, spec = leaves_with_paths(tree)
    return StageLayout(
        spec,
        tuple(paths),
        tuple(
            LeafLayout(tuple(x.shape), x.dtype, -(-x.numel() // num_shards)) if isinstance(x, torch.Tensor) else None
            for x in leaves
        ),
        num_shards,
    )


def cut(tree: PyTree, layout: StageLayout, rank: int) -> PyTree:
    """Shard ``rank`` of ``tree`` (NOTE [shard layout]): new tensors, the user's are not aliased."""
    leaves, spec = flatten(tree)
    out: list[Any] = []
    for leaf, shape in zip(leaves, layout.leaves):
        if shape is None:
            out.append(leaf)
            continue
        flat = detached(leaf).reshape(-1)
        piece = flat[min(rank * shape.size, flat.numel()) : (rank + 1) * shape.size]
        out.append(torch.cat([piece, piece.new_zeros(shape.size - piece.numel())]))
    return unflatten(spec, out)


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
            raise ValueError(
                f"fpipe.step: params[{stage}]{path} should be this rank's shard of a {shape.dtype} tensor of "
                f"shape {shape.shape}, a 1-D {shape.dtype} tensor of {shape.size} elements (got: {got}). "
                "Cut full parameters with step.shard(params)."
            )


# -- flat buffers -------------------------------------------------------------------------------


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, in a dtype every backend moves: complex as its (re, im) pairs, bool as bytes."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).reshape(-1)
    if t.dtype == torch.bool:
        return t.reshape(-1).view(torch.uint8)
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
            wait(work, self.dp.timeout, self.dp.pipeline_rank, what)
            for m in members:
                padded = grid[:, m.columns].reshape(-1)  # the column block, row by row
                leaves[m.index] = _unwire(padded, m.shape.dtype)[: m.shape.numel].view(m.shape.shape)
        self._posted.clear()
        return unflatten(self._spec, leaves)


class ReduceScatter:
    """The reduce-scatters of one stage's full gradients, posted; ``wait`` returns the averaged shards.

    ``grads`` is ``StageRun.grads()`` (``None`` for leaves without a gradient), or ``None`` on a
    replica that failed: it still joins, with zeros, so that the others do not wait forever.
    """

    def __init__(self, dp: DataParallel, stage: int, grads: PyTree | None, layout: StageLayout) -> None:
        self.dp, self.stage, self.layout = dp, stage, layout
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
                flat = _wire(g).to(dp.device)
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
            wait(work, self.dp.timeout, self.dp.pipeline_rank, what)
            out.div_(self.dp.size)
            for m in members:
                leaves[m.index] = _unwire(out[m.columns], m.shape.dtype)
        self._posted.clear()
        return unflatten(self.layout.spec, leaves)


# -- the stages of one sharded step -------------------------------------------------------------


def segments(order: Sequence[tuple[int, Action]]) -> list[tuple[Sequence[tuple[int, Action]], list[int]]]:
    """``order`` cut after each stage's last action: ``(actions, stages finished by them)`` pairs."""
    last = {action.stage: k for k, (_, action) in enumerate(order)}
    out: list[tuple[Sequence[tuple[int, Action]], list[int]]] = []
    start = 0
    for k in sorted(set(last.values())):
        out.append((order[start : k + 1], [s for s, end in last.items() if end == k]))
        start = k + 1
    if start < len(order):
        out.append((order[start:], []))
    return out


class ShardedRuns(Mapping[int, StageRun]):
    """The local stages of a sharded step, as the executor sees them (NOTE [regather]
    With ``pipeline(..., shard_params=True, regather=True)`` a stage's full parameters are alive only
    while one of its actions runs: looking up another stage frees them (their storage is resized to
    nothing; the graphs of earlier microbatches keep aliases of them), and the next action of the
    stage all-gathers them again into the same tensors, with the values those graphs saved. At
    most one stage's full parameters are alive at a time, for one all-gather per action instead
    of one per stage per step, and without overlap (each gather is waited for at once).

    NOTE [gather overlap]).

        Looking stage ``s`` up the first time waits for its all-gather and builds its ``StageRun``;
        ``finish_stage(s)`` reduce-scatters its gradients and drops it; ``finish`` waits for all of
        them (on a failed replica, joining the ones not posted yet with zeros).
    """

    def __init__(
        self,
        dp: DataParallel,
        make_run: Callable[[int, PyTree], StageRun],
        shards: Sequence[PyTree],
        layouts: Mapping[int, StageLayout],
        order: Sequence[tuple[int, Action]],
        *,
        regather: bool = False,
    ) -> None:
        self.dp = dp
        self._make_run = make_run  # (stage, full params) -> StageRun
        self._layouts = layouts
        self._shards = shards
        self._regather = regather
        first_use = list(dict.fromkeys(action.stage for _, action in order))
        self._finish_order = [s for _, done in segments(order) for s in done]
        # With regather, a gather is posted only when its stage is needed (NOTE [regather]).
        self._gathers = {} if regather else {s: self._gather(s) for s in first_use}
        self._runs: dict[int, StageRun] = {}
        self._full: dict[int, list[torch.Tensor]] = {}  # with regather: the tensors the StageRun aliases
        self._resident: set[int] = set()
        self._reductions: dict[int, ReduceScatter] = {}
        self._grads: dict[int, PyTree] = {}

    def _gather(self, stage: int) -> Gather:
        return Gather(self.dp, f"stage {stage}'s parameter shards", self._shards[stage], self._layouts[stage])

    def __getitem__(self, stage: int) -> StageRun:
        if stage not in self._layouts:
            raise KeyError(stage)
        if self._regather:
            for other in self._resident - {stage}:
                self._release(other)
        run = self._runs.get(stage)
        if run is None:
            params = (self._gathers.pop(stage) if stage in self._gathers else self._gather(stage)).wait()
            if self._regather:  # own storage per leaf, so that each can be freed and refilled alone
                params = map_tensors(torch.clone, params)
                self._full[stage] = [t for t in flatten(params)[0] if isinstance(t, torch.Tensor)]
                self._resident.add(stage)
            run = self._runs[stage] = self._make_run(stage, params)
        elif self._regather and stage not in self._resident:
            self._refill(stage)
        return run

    def _release(self, stage: int) -> None:
        """Free ``stage``'s full parameters; the graphs that saved them keep (empty) aliases."""
        for t in self._full.get(stage, ()):
            t.untyped_storage().resize_(0)
        self._resident.discard(stage)

    def _refill(self, stage: int) -> None:
        """Gather ``stage``'s parameters again, into the very tensors its saved graphs alias."""
        fresh = [t for t in flatten(self._gather(stage).wait())[0] if isinstance(t, torch.Tensor)]
        for t, value in zip(self._full[stage], fresh):
            t.untyped_storage().resize_(t.numel() * t.element_size())
            # The values are those the graphs saved: no version bump, or autograd would object.
            with torch.no_grad(), _unsafe_preserve_version_counter(t):
                t.copy_(value)
        self._resident.add(stage)

    def __contains__(self, stage: object) -> bool:
        return stage in self._layouts

    def __iter__(self) -> Iterator[int]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def finish_stage(self, stage: int) -> None:
        """Post the reduce-scatter of ``stage``'s gradients; free its full parameters and gradients."""
        run = self._runs.pop(stage, None)
        grads = None if run is None else run.grads()
        self._release(stage)
        self._full.pop(stage, None)
        self._reductions[stage] = ReduceScatter(self.dp, stage, grads, self._layouts[stage])

    def finish(self, *, failed: bool) -> None:
        """Wait for every reduce-scatter; a failed replica first joins those it has not posted."""
        for stage in list(self._gathers):  # a failure before the stage's first forward
            self._gathers.pop(stage).wait()
        for stage in self._finish_order:
            if stage not in self._reductions:
                assert failed, f"fpipe: stage {stage} was never finished"
                self._runs.pop(stage, None)
                self._reductions[stage] = ReduceScatter(self.dp, stage, None, self._layouts[stage])
        for stage in self._finish_order:
            self._grads[stage] = self._reductions.pop(stage).wait()

    def grads(self, num_stages: int) -> list[PyTree]:
        """The averaged gradient shards, one pytree per stage (``None`` for stages held elsewhere)."""
        return [self._grads.get(s) for s in range(num_stages)]


# -- cutting and gathering whole pytrees ---------------------------------------------------------


def shard_stages(
    dp: DataParallel, local_stages: Sequence[int], params: Sequence[PyTree]
) -> tuple[list[PyTree], dict[int, StageLayout]]:
    """``step.shard``: this rank's shards of the local stages' params, and their layouts."""
    layouts = {s: layout_of(params[s], dp.size) for s in local_stages}
    return [cut(p, layouts[s], dp.rank) if s in layouts else None for s, p in enumerate(params)], layouts


def gather_stages(
    dp: DataParallel, layouts: Mapping[int, StageLayout], shards: Sequence[PyTree], caller: str
) -> list[PyTree]:
    """``step.unshard``: the full pytrees of the local stages' shards (a collective over replicas)."""
    out: list[PyTree] = [None] * len(shards)
    for s in sorted(layouts):
        if shards[s] is None:
            raise ValueError(f"{caller}: shards[{s}] is None but this rank holds stage {s}. Pass its shards.")
        out[s] = gather_tree(dp, shards[s], layouts[s], caller, f"shards[{s}]")
    return out


def gather_tree(dp: DataParallel, tree: PyTree, layout: StageLayout, caller: str, name: str) -> PyTree:
    """The full pytree of ``tree``'s shards; leaves that are ``None`` in ``tree`` (grads) stay ``None``."""
    leaves, spec = flatten(tree)
    if spec.num_leaves != len(layout.leaves):
        raise ValueError(
            f"{caller}: {name} has {spec.num_leaves} leaves but the full pytree has {len(layout.leaves)} "
            f"({name}: {spec}; full: {layout.spec}). Pass shards cut from it."
        )
    present = tuple(None if leaf is None else shape for leaf, shape in zip(leaves, layout.leaves))
    for path, leaf, shape in zip(layout.paths, leaves, present):
        if shape is not None and not (isinstance(leaf, torch.Tensor) and tuple(leaf.shape) == (shape.size,)):
            got = f"shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"{caller}: {name}{path} should be a shard of {shape.size} elements of a tensor of shape "
                f"{shape.shape} (got: {got}). Pass shards cut from the same full pytree."
            )
    partial = StageLayout(spec, layout.paths, present, layout.num_shards)
    return Gather(dp, name, tree, partial).wait()


def _data_parallel_of(over: Any, caller: str) -> DataParallel:
    from ._api import Step  # a cycle at import time: _api uses this module

    topology: Topology | None = None
    timeout = 300.0
    if isinstance(over, Step):
        topology, timeout = over._topology, over.timeout
    elif hasattr(over, "mesh_dim_names"):  # a DeviceMesh
        topology = resolve_topology(over, None)
    if topology is None or topology.data_group is None:
        raise ValueError(
            f"{caller}: shards are cut over the data-parallel ranks of a mesh, and this has none "
            f"(got: {over!r:.120}). Pass the DeviceMesh with dimensions ('dp', 'pp') given to "
            "fpipe.pipeline, or its step."
        )
    return data_parallel(topology, timeout)


def shard(tree: PyTree, over: Any, /) -> PyTree:
    """This rank's shards of a full pytree, cut over the data-parallel ranks of ``over``.

    Each tensor leaf of ``n`` elements becomes a 1-D tensor of ``ceil(n / d)`` elements: the
    rank's slice of the flattened leaf, zero-padded at the end on the last ranks (``d``: the
    data-parallel size); nothing is dropped. Other leaves are kept whole. Only the rank's own
    data is read; no communication. ``step.shard(params)`` does this for every local stage and
    records the full shapes a sharded step needs.

    Args:
        tree: a full pytree, the same on every data-parallel replica (parameters, or anything
            shaped like them, such as optimizer state).
        over: the ``DeviceMesh`` (dimensions ``"dp"`` and ``"pp"``) or a ``Step`` built on one.

    Example:
        >>> shards = fpipe.shard({"w": torch.ones(5, 3)}, mesh)  # doctest: +SKIP
        >>> shards["w"].shape  # with 2 data-parallel ranks: 15 elements, 8 per rank
        torch.Size([8])
    """
    dp = _data_parallel_of(over, "fpipe.shard")
    return cut(tree, layout_of(tree, dp.size), dp.rank)


def gather(shards: PyTree, like: PyTree, over: Any, /) -> PyTree:
    """The full pytree of ``shards`` (cut by ``fpipe.shard``), gathered from every data-parallel rank.

    A collective: every rank of the data-parallel group calls it with the same structure.
    ``None`` leaves in ``shards`` (gradients of non-float leaves) stay ``None``.

    Args:
        shards: this rank's shards.
        like: a pytree with the full shapes and dtypes: the full tensors, or tensors on the
            ``meta`` device.
        over: the ``DeviceMesh`` or the ``Step``, as for ``fpipe.shard``.
    """
    dp = _data_parallel_of(over, "fpipe.gather")
    return gather_tree(dp, shards, layout_of(like, dp.size), "fpipe.gather", "shards")
