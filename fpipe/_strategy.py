"""The parallel strategy of a step, as a value: which runs the stages a process holds get, and how
their gradients and losses are reduced over data-parallel replicas.

``pipeline()`` builds one ``Strategy`` (as torchtitan's ``parallelize`` composes its policies in
one place) and the step hands it to the run, here or distributed; nothing calls back into
``Step``. The strategies:

    replicated     every replica holds its stages' full parameters; with data-parallel replicas
                   each stage's gradients are averaged as soon as its last action has run
                   (``replica_mean``, NOTE [reduction overlap] in fpipe/_distributed/_rank_step.py)
    sharded        ``shard_params``: parameters are shards, all-gathered before a stage's first
                   forward and its gradients reduce-scattered after its last backward
                   (``ShardedStages``, notes/sharding.md)
    tensor-parallel a ``"tp"`` mesh dimension: DTensor leaves, under either of the two above
                   (fpipe/_tensor_parallel/)

The set-up it runs on is the user's ``fpipe.Parallelism`` (``parallel``: sharding, regather,
timeout) with its topology resolved once. With ``shard_params`` a run's strategy also carries
the full shapes ``step.shard`` recorded (``layouts``, part of the step's state: the step hands
each run ``with_layouts`` of them).
The collectives it needs are functions over its topology (fpipe/_distributed/_collectives.py):
the global norm (``norm_over``) and, when it unscales a step's gradients under the precision
policy (``unscale``), loss scaling's inf/nan agreement (``any_inf_nan``), handed in.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch
from torch.distributed.tensor import Replicate

from ._distributed import Topology, all_reduce_sum, any_inf_nan, average_loss, norm_over, replica_mean, sum_over
from ._parallelism import Parallelism
from ._precision import LossScaleState, Precision, Unscaled, check_params, unscale
from ._pytree import PyTree, flatten, stage_list, unflatten
from ._run import HeldStages, Order, ReplicatedStages, StepView, stage_run
from ._sharding import (
    ShardedStages,
    StageLayout,
    check_shards,
    data_parallel,
    gather_stages,
    gathered,
    norm_leaves,
    reduce_scattered,
    shard_stages,
)
from ._stage import StageRun
from ._tensor_parallel import square_sum


@dataclass(frozen=True)
class Strategy:
    """How a step's held stages run and how their gradients and losses are reduced.

    Attributes:
        topology: where this process sits (``None``: the whole pipeline in one process),
            resolved from ``parallel`` once.
        parallel: the set-up (``shard_params``: parameters are shards over the data-parallel
            ranks; ``regather``: gather a stage's parameters again for each action;
            ``timeout``: seconds a collective waits for a peer).
        divide: average over replicas (``True``), or sum (``weight_fn``: each replica's share
            is already over the whole count, NOTE [loss weights] in fpipe/_run.py).
        precision: the step's ``Precision`` (the gradient sums' dtypes), or ``None``.
        layouts: with ``shard_params``, the full shapes and dtypes of the held stages'
            parameters, recorded by ``step.shard`` (empty before).
    """

    topology: Topology | None
    parallel: Parallelism
    divide: bool
    precision: Precision | None
    layouts: Mapping[int, StageLayout] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def shard_params(self) -> bool:
        """Parameters are shards over the data-parallel ranks (``parallel.shard_params``)."""
        return self.parallel.shard_params

    @property
    def timeout(self) -> float:
        """Seconds a collective waits for a peer (``parallel.timeout``)."""
        return self.parallel.timeout

    def with_layouts(self, layouts: Mapping[int, StageLayout]) -> Strategy:
        """This strategy with the full shapes ``step.shard`` recorded."""
        return replace(self, layouts=MappingProxyType(dict(layouts)))

    def check(self, step: StepView, params: Sequence[PyTree]) -> None:
        """Raise ``ValueError`` for held parameters this strategy cannot run: shards that do not
        fit the recorded layouts, or leaves the precision policy refuses."""
        if self.shard_params:
            for s in step.local_stages:
                check_shards(s, params[s], self.layouts.get(s))
        if self.precision is not None:
            for s in step.local_stages:
                check_params(self.precision, s, params[s])

    def held_stages(self, step: StepView, order: Order, params: Sequence[PyTree]) -> HeldStages:
        """The runs of the stages this process holds, for one run of ``order``; with
        ``shard_params``, every stage's all-gather is posted here and waited for at the stage's
        first forward (NOTE [gather overlap])."""
        topology = self.topology
        if not self.shard_params:
            if topology is None or topology.data_group is None:
                return ReplicatedStages(step, params)
            return ReplicatedStages(step, params, replica_mean(topology, self.timeout, divide=self.divide))
        assert topology is not None

        def make_run(s: int, stage_params: PyTree) -> StageRun:
            return stage_run(step, s, stage_params)

        dp = data_parallel(topology, self.timeout)
        return ShardedStages(
            dp,
            make_run,
            params,
            self.layouts,
            order.actions,
            regather=self.parallel.regather,
            grad_layouts=self._grad_layouts(),
            divide=self.divide,
        )

    def _grad_layouts(self) -> Mapping[int, StageLayout]:
        """The sharded gradients' layouts: the parameters', in the dtypes the sums are kept in
        (NOTE [precision of a leaf])."""
        precision = self.precision
        if precision is None:
            return self.layouts
        return {
            s: StageLayout(
                layout.spec,
                layout.paths,
                tuple(
                    None if leaf is None else replace(leaf, dtype=precision.accumulate_dtype(leaf.dtype))
                    for leaf in layout.leaves
                ),
                layout.num_shards,
            )
            for s, layout in self.layouts.items()
        }

    def full_params(self, order: Order, params: Sequence[PyTree]) -> list[PyTree]:
        """The held stages' full parameters for a compiled row (NOTE [compiled rows] in
        fpipe/_distributed/_compiled.py): ``params`` themselves, or, with ``shard_params``, their
        shards gathered as the eager row gathers them (NOTE [gather overlap])."""
        if not self.shard_params:
            return list(params)
        assert self.topology is not None
        return gathered(data_parallel(self.topology, self.timeout), params, self.layouts, order.actions)

    def reduce_grads(self, order: Order, grads: list[PyTree]) -> list[PyTree]:
        """A compiled row's full ``grads`` (NOTE [compiled rows] in fpipe/_distributed/_compiled.py)
        reduced over the replicas, each stage's as the eager row posts it (at its last action: NOTE
        [reduction overlap]), so that replicas that ran eagerly and replicas that ran compiled post
        the same reductions in the same order: averaged in place, or, with ``shard_params``,
        reduce-scattered into averaged shards."""
        topology = self.topology
        if topology is None or topology.data_group is None:
            return grads
        # Each stage at its last action; a stage on several ranks once its holders' sums are added.
        shared = sorted({s for _, done in order.segments for s in done if len(order.program.holders(s)) > 1})
        ends = [s for _, done in order.segments for s in done if s not in shared] + shared
        if self.shard_params:
            dp = data_parallel(topology, self.timeout)
            return reduce_scattered(dp, grads, self._grad_layouts(), ends, divide=self.divide)
        reduce = replica_mean(topology, self.timeout, divide=self.divide)
        pending = [reduce(s, [g for g in flatten(grads[s])[0] if isinstance(g, torch.Tensor)]) for s in ends]
        for posted in pending:
            posted.wait()
        return grads

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This replica's ``loss`` reduced over the data-parallel replicas: averaged, or summed
        with ``weight_fn`` (each replica's share is already over the total count)."""
        if self.topology is None or self.topology.data_group is None:
            return loss
        return average_loss(self.topology, loss, self.timeout, divide=self.divide)

    def replica_sum(self, tree: PyTree) -> PyTree:
        """``step.replica_sum``: ``tree``'s tensor leaves summed over the replicas (the ranks of
        ``data_group``: dp x ep), a new tree on every rank; ``tree`` itself without replicas."""
        topology = self.topology
        if topology is None or topology.data_group is None:
            return tree
        leaves, spec = flatten(tree)
        sums = [x.detach().to(topology.device, copy=True) if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors = [x for x in sums if isinstance(x, torch.Tensor)]
        all_reduce_sum(topology, topology.data_group, tensors, self.timeout, "the other replicas' sums")
        return unflatten(spec, [x.to(y.device) if isinstance(y, torch.Tensor) else x for x, y in zip(sums, leaves)])

    def shard(self, step: StepView, params: Sequence[PyTree]) -> tuple[list[PyTree], Mapping[int, StageLayout]]:
        """``step.shard``: this rank's shards of the held stages' full ``params``, and their layouts."""
        if not self.shard_params or self.topology is None:
            raise ValueError(
                "fpipe.step.shard: this step does not shard. Build it with "
                "pipeline(..., parallel=fpipe.Parallelism(mesh=mesh, shard_params=True))."
            )
        stage_list("fpipe.step.shard", "params", params, step.num_stages)
        for s in step.local_stages:
            if params[s] is None:
                raise ValueError(f"fpipe.step.shard: params[{s}] is None but this rank holds stage {s}. Pass it.")
        shards, layouts = shard_stages(data_parallel(self.topology, self.timeout), step.local_stages, params)
        return shards, MappingProxyType(dict(layouts))

    def gather(self, step: StepView, shards: Sequence[PyTree]) -> list[PyTree]:
        """``step.gather``: the full pytrees of the held stages' ``shards`` (a collective)."""
        if not self.layouts or self.topology is None:
            raise ValueError("fpipe.step.gather: the step has no layouts; cut the parameters with step.shard first.")
        stage_list("fpipe.step.gather", "shards", shards, step.num_stages)
        dp = data_parallel(self.topology, self.timeout)
        return gather_stages(dp, self.layouts, shards, "fpipe.step.gather")

    def global_norm(self, local_stages: Sequence[int], grads: Sequence[PyTree]) -> torch.Tensor:
        """The 2-norm of all gradients of the pipeline, on every rank: ``step.global_norm``, whose
        docstring says which groups sum what; this rank's sum of squares (a DTensor's as
        ``square_sum`` counts it, a shard's by its layout, ``norm_leaves``), summed over the mesh
        by ``norm_over`` (fpipe/_distributed/_collectives.py)."""
        topology = self.topology
        tensor_group = None if topology is None else topology.tensor_group
        total, experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for s in local_stages:
            if self.shard_params and tensor_group is not None:  # shards are plain: the layout knows their DTensor
                leaves = norm_leaves(s, grads[s], self.layouts.get(s))
            else:
                leaves = [(g, None) for g in flatten(grads[s])[0] if isinstance(g, torch.Tensor)]
            for g, placements in leaves:
                if topology is not None and topology.is_expert(g):  # one block of experts per ep rank,
                    experts = experts + square_sum(g, tensor_group, [Replicate()])  # held by every tp rank
                else:
                    total = total + square_sum(g, tensor_group, placements)
        if topology is not None and topology.expert_group is not None:  # the other ep ranks' blocks
            buffer = experts.reshape(1).to(topology.device)
            sum_over(topology, ("ep",), [buffer], self.timeout, "the expert-parallel sum of the global norm")
            experts = buffer.reshape(()).cpu()
        dims = ("pp", "tp", "dp") if self.shard_params else ("pp", "tp")  # replicas hold the same sums
        return norm_over(self.topology, dims, total + experts, self.timeout)

    def unscale(
        self, params: Sequence[PyTree], grads: list[PyTree], local_stages: Sequence[int], state: LossScaleState | None
    ) -> Unscaled:
        """The returned gradients, the next loss scaling state and whether the step is skipped:
        ``unscale`` (fpipe/_precision.py) with the inf/nan finding agreed over the mesh
        (``any_inf_nan``, fpipe/_distributed/_collectives.py); ``(grads, state, False)`` as they
        are without a precision policy. The state is returned, never changed in place."""
        if self.precision is None:
            return Unscaled(grads, state, False)
        agree = functools.partial(any_inf_nan, self.topology, self.timeout)
        return unscale(self.precision, params, grads, local_stages, state, agree)
