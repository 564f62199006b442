"""The parallel strategy of a step, as a value: which runs the stages a process holds get, and how
their gradients and losses are reduced over data-parallel replicas.

``pipeline()`` builds one ``Strategy`` (as torchtitan's ``parallelize`` composes its policies in
one place) and the step hands it to the run, here or distributed; nothing calls back into
``Step``. The strategies:

    replicated     every replica holds its stages' full parameters; with data-parallel replicas
                   each stage's gradients are averaged as soon as its last action has run
                   (``replica_mean``, NOTE [reduction overlap] in fpipe/_distributed/_runtime.py)
    sharded        ``shard_params``: parameters are shards, all-gathered before a stage's first
                   forward and its gradients reduce-scattered after its last backward
                   (``ShardedStages``, notes/sharding.md)
    tensor-parallel a ``"tp"`` mesh dimension: DTensor leaves, under either of the two above
                   (fpipe/_tensor_parallel/)

With ``shard_params`` a strategy also carries the full shapes ``step.shard`` recorded
(``layouts``); the step holds the strategy and replaces it, a new value, when it records them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ._distributed import Topology, replica_mean
from ._precision import Precision, check_params
from ._pytree import PyTree
from ._run import HeldStages, Order, ReplicatedStages, StepView, stage_run
from ._sharding import ShardedStages, StageLayout, check_shards, data_parallel
from ._stage import StageRun


@dataclass(frozen=True)
class Strategy:
    """How a step's held stages run and how their gradients and losses are reduced.

    Attributes:
        topology: where this process sits (``None``: the whole pipeline in one process).
        shard_params: parameters are shards over the data-parallel ranks (ZeRO-3, FSDP).
        regather: with ``shard_params``, gather a stage's parameters again for each action.
        divide: average over replicas (``True``), or sum (``weight_fn``: each replica's share
            is already over the whole count, NOTE [loss weights] in fpipe/_run.py).
        timeout: seconds a collective waits for a peer.
        precision: the step's ``Precision`` (the gradient sums' dtypes), or ``None``.
        layouts: with ``shard_params``, the full shapes and dtypes of the held stages'
            parameters, recorded by ``step.shard`` (empty before).
    """

    topology: Topology | None
    shard_params: bool
    regather: bool
    divide: bool
    timeout: float
    precision: Precision | None
    layouts: Mapping[int, StageLayout] = field(default_factory=lambda: MappingProxyType({}))

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

        grad_layouts = None
        if self.precision is not None:  # the sums' dtypes (NOTE [precision of a leaf])
            precision = self.precision
            grad_layouts = {
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
        dp = data_parallel(topology, self.timeout)
        return ShardedStages(
            dp,
            make_run,
            params,
            self.layouts,
            order.actions,
            regather=self.regather,
            grad_layouts=grad_layouts,
            divide=self.divide,
        )
