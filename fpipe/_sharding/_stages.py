"""Sharded data parallel (ZeRO-3, FSDP) under the pipeline: parameters live cut into shards.

With ``fpipe.Parallelism(mesh=mesh, shard_params=True)`` each rank keeps, for each of its stages,
only its shard of every parameter (``1 / d`` of it, ``d`` data-parallel ranks). A step all-gathers a
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

NOTE [tensor-parallel shards]
On a mesh with a ``"tp"`` dimension too, a DTensor parameter is sharded over the data-parallel
group by its local piece: the piece is what is flattened, padded and cut, and the shards are
plain 1-D tensors like any other. The ranks of a data-parallel group share their tensor-parallel
index, so their pieces have the same shape and the grid above lines up; the ranks of a
tensor-parallel group cut pieces of their own (of different sizes if the DTensor splits
unevenly). The layout keeps the DTensor's mesh, placements, global shape and stride
(``LeafLayout.dtensor``), so the gather rebuilds the DTensor around the gathered piece without
communication over ``tp``; its gradient (with the parameter's placements, ``like_param``) is
reduce-scattered as its local piece. A plain parameter of a tensor-parallel stage is held whole
by every rank of the tp group: their shards are copies, and ``step.global_norm`` counts them
once, as it counts a shard of a ``Replicate`` DTensor; a shard of a ``Shard`` DTensor's piece
counts on every rank.

NOTE [regather]
With ``fpipe.Parallelism(..., shard_params=True, regather=True)`` a stage's full parameters are alive only
while one of its actions runs: looking up another stage frees them (their storage is resized to
nothing; the graphs of earlier microbatches keep aliases of them), and the next action of the
stage all-gathers them again into the same tensors, with the values those graphs saved. At
most one stage's full parameters are alive at a time, for one all-gather per action instead
of one per stage per step, and without overlap (each gather is waited for at once).

NOTE [gather overlap]
Every all-gather of the step is posted (``async_op=True``) right after the handshake, in the
order the rank first uses its stages; the executor reaches a stage through ``ShardedStages``,
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
from dataclasses import replace

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from .._plural import plural
from .._pytree import PyTree, flatten, map_tensors
from .._run import segments
from .._stage import StageRun
from .._tensor_parallel import local
from ..schedules import Action
from ._layout import DataParallel, Gather, LeafLayout, ReduceScatter, StageLayout, cut, layout_of

# -- the stages of one sharded step -------------------------------------------------------------


class ShardedStages(Mapping[int, StageRun]):
    """The local stages of a sharded step, as the executor sees them (NOTE [gather overlap],
    NOTE [regather]).

    Looking stage ``s`` up the first time waits for its all-gather and builds its ``StageRun``;
    ``post_reduction(s)`` reduce-scatters its gradients and drops it; ``wait_reductions`` waits
    for all of them (on a failed replica, joining the ones not posted yet with zeros).
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
        grad_layouts: Mapping[int, StageLayout] | None = None,
        divide: bool = True,
    ) -> None:
        self.dp = dp
        self._make_run = make_run  # (stage, full params) -> StageRun
        self._layouts = layouts
        # The gradients' layouts: the parameters', in the dtypes the sums are kept in (a
        # precision policy may sum bfloat16 parameters' gradients in float32).
        self._grad_layouts = layouts if grad_layouts is None else grad_layouts
        self._shards = shards
        self._regather = regather
        self._divide = divide  # average the replicas' gradients (else sum them: weight_fn)
        first_use = _first_use(order)
        self._reduction_order = [s for _, done in segments(order) for s in done]
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
                self._full[stage] = _pieces(params)
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
        fresh = _pieces(self._gather(stage).wait())
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

    def post_reduction(self, stage: int) -> None:
        """Post the reduce-scatter of ``stage``'s gradients; free its full parameters and gradients."""
        run = self._runs.pop(stage, None)
        grads = None if run is None else run.grads()
        self._release(stage)
        self._full.pop(stage, None)
        self._reductions[stage] = ReduceScatter(self.dp, stage, grads, self._grad_layouts[stage], divide=self._divide)

    def wait_reductions(self) -> None:
        """Wait for every reduce-scatter: the gradients are averaged (a replica that fails does
        not join: the failure board fails the others, NOTE [failure board] in
        fpipe/_distributed/_faults.py)."""
        for stage in self._reduction_order:
            self._grads[stage] = self._reductions.pop(stage).wait()

    def grads(self, num_stages: int) -> list[PyTree]:
        """The averaged gradient shards, one pytree per stage (``None`` for stages held elsewhere)."""
        return [self._grads.get(s) for s in range(num_stages)]


def gathered(
    dp: DataParallel, shards: Sequence[PyTree], layouts: Mapping[int, StageLayout], order: Sequence[tuple[int, Action]]
) -> list[PyTree]:
    """The held stages' full parameters, gathered as ``ShardedStages`` gathers them (every gather
    posted at once, in the order the rank first uses its stages: NOTE [gather overlap]), for a
    compiled row (NOTE [compiled rows] in fpipe/_distributed/_compiled.py); ``None`` elsewhere."""
    posted = [(s, Gather(dp, f"stage {s}'s parameter shards", shards[s], layouts[s])) for s in _first_use(order)]
    full: list[PyTree] = [None] * len(shards)
    for s, gather in posted:
        full[s] = gather.wait()
    return full


def reduce_scattered(
    dp: DataParallel,
    grads: Sequence[PyTree],
    layouts: Mapping[int, StageLayout],
    stages: Sequence[int],
    *,
    divide: bool = True,
) -> list[PyTree]:
    """A compiled row's full ``grads`` reduce-scattered into averaged shards (summed without
    ``divide``), posted for ``stages`` in the order given: the order ``ShardedStages`` posts them
    (each stage at its last action), so that replicas that ran eagerly and compiled post the
    same collectives."""
    posted = [(s, ReduceScatter(dp, s, grads[s], layouts[s], divide=divide)) for s in stages]
    out: list[PyTree] = [None] * len(grads)
    for s, reduction in posted:
        out[s] = reduction.wait()
    return out


def _first_use(order: Sequence[tuple[int, Action]]) -> list[int]:
    """The stages of ``order``, in the order it first uses them."""
    return list(dict.fromkeys(action.stage for _, action in order))


def _pieces(params: PyTree) -> list[torch.Tensor]:
    """The tensors holding ``params``' data: a DTensor's local piece, which its graphs alias too."""
    return [local(t) for t in flatten(params)[0] if isinstance(t, torch.Tensor)]


# -- cutting and gathering whole pytrees ---------------------------------------------------------


def shard_stages(
    dp: DataParallel, local_stages: Sequence[int], params: Sequence[PyTree]
) -> tuple[list[PyTree], dict[int, StageLayout]]:
    """``step.shard``: this rank's shards of the local stages' params, and their layouts."""
    layouts = {s: layout_of(params[s], dp.size, dp.tensor_ranks, name=f"params[{s}]") for s in local_stages}
    return [cut(p, layouts[s], dp.rank) if s in layouts else None for s, p in enumerate(params)], layouts


def gather_stages(
    dp: DataParallel, layouts: Mapping[int, StageLayout], shards: Sequence[PyTree], caller: str
) -> list[PyTree]:
    """``step.gather``: the full pytrees of the local stages' shards (a collective over replicas)."""
    out: list[PyTree] = [None] * len(shards)
    for s in sorted(layouts):
        if shards[s] is None:
            raise ValueError(f"{caller}: shards[{s}] is None but this rank holds stage {s}. Pass its shards.")
        out[s] = gather_tree(dp, shards[s], layouts[s], caller, f"shards[{s}]")
    return out


def gather_tree(dp: DataParallel, tree: PyTree, layout: StageLayout, caller: str, name: str) -> PyTree:
    """The full pytree of ``tree``'s shards, in their dtypes; leaves that are ``None`` in ``tree``
    (grads) stay ``None``."""
    leaves, spec = flatten(tree)
    if spec.num_leaves != len(layout.leaves):
        raise ValueError(
            f"{caller}: {name} has {plural(spec.num_leaves, 'leaf')} but the full pytree has {len(layout.leaves)} "
            f"({name}: {spec}; full: {layout.spec}). Pass shards cut from it."
        )
    present: list[LeafLayout | None] = []
    for path, leaf, shape in zip(layout.paths, leaves, layout.leaves):
        if shape is None or leaf is None:
            present.append(None)
            continue
        if not (isinstance(leaf, torch.Tensor) and tuple(leaf.shape) == (shape.size,)):
            got = f"shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"{caller}: {name}{path} should be a shard of {plural(shape.size, 'element')} of a tensor of shape "
                f"{shape.shape} (got: {got}). Pass shards cut from the same full pytree."
            )
        # The shards' own dtype: float32 optimizer state of bfloat16 parameters gathers as float32.
        present.append(replace(shape, dtype=leaf.dtype))
    partial = StageLayout(spec, layout.paths, tuple(present), layout.num_shards)
    return Gather(dp, name, tree, partial).wait()
