"""``fpipe.shard`` and ``fpipe.gather``: cut a pytree over a mesh's data-parallel ranks, and
gather it back (NOTE [shard layout] in fpipe/_sharding/_stages.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch.distributed.device_mesh import DeviceMesh

from .._distributed import Topology, resolve_topology
from .._parallelism import Parallelism
from .._pytree import PyTree
from ._layout import DataParallel, StageLayout, cut, data_parallel, layout_of
from ._stages import gather_tree


@runtime_checkable
class ParallelView(Protocol):
    """What sharding and saving read of a ``Step``: its public, read-only view by its parallel
    set-up (fpipe/_api.py imports this package, so ``Step`` is never imported here or in
    ``_saving``)."""

    @property
    def parallel(self) -> Parallelism:
        """The ``fpipe.Parallelism`` the step was built with."""
        ...

    @property
    def topology(self) -> Topology | None:
        """Where this process sits, resolved once from ``parallel`` (``None``: one process)."""
        ...

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        ...

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this process holds."""
        ...

    @property
    def shared_stages(self) -> tuple[int, ...]:
        """The stages this process holds with other processes (DualPipe's), which they all save."""
        ...

    @property
    def shard_layouts(self) -> Mapping[int, StageLayout]:
        """With ``shard_params``: the full shapes ``step.shard`` recorded (empty before)."""
        ...


def _data_parallel_of(over: Any, caller: str) -> DataParallel:
    topology: Topology | None = None
    if isinstance(over, DeviceMesh):
        over = Parallelism(mesh=over)
    if isinstance(over, Parallelism):
        topology, timeout = resolve_topology(over.mesh, over.group), over.timeout
    elif isinstance(over, ParallelView):
        topology, timeout = over.topology, over.parallel.timeout
    if topology is None or topology.data_group is None:
        raise ValueError(
            f"{caller}: shards are cut over the data-parallel ranks of a mesh, and this has none "
            f"(got: {over!r:.120}). Pass the DeviceMesh with dimensions ('dp', 'pp') given to "
            "fpipe.pipeline, its fpipe.Parallelism, or its step."
        )
    return data_parallel(topology, timeout)


def shard(tree: PyTree, over: Any, /) -> PyTree:
    """This rank's shards of a full pytree, cut over the data-parallel ranks of ``over``.

    Each tensor leaf of ``n`` elements becomes a 1-D tensor of ``ceil(n / d)`` elements: the
    rank's slice of the flattened leaf, zero-padded at the end on the last ranks (``d``: the
    data-parallel size); nothing is dropped. A DTensor leaf (on the mesh's ``"tp"`` sub-mesh) is
    cut by its local piece, into a plain 1-D tensor. Other leaves are kept whole. Only the rank's
    own data is read; no communication. ``step.shard(params)`` does this for every local stage and
    records the full shapes a sharded step needs.

    Args:
        tree: a full pytree, the same on every data-parallel replica (parameters, or anything
            shaped like them, such as optimizer state).
        over: the ``DeviceMesh`` (dimensions ``"dp"`` and ``"pp"``, maybe ``"tp"``), an
            ``fpipe.Parallelism`` with one, or a ``Step`` built on one.

    Raises:
        ValueError: if ``over`` has no data-parallel dimension, or a DTensor leaf does not live
            on its ``"tp"`` sub-mesh.

    On each rank of a mesh with 2 data-parallel ranks::

        shards = fpipe.shard({"w": torch.ones(5, 3)}, mesh)
        shards["w"].shape  # torch.Size([8]): 15 elements, 8 per rank
    """
    dp = _data_parallel_of(over, "fpipe.shard")
    return cut(tree, layout_of(tree, dp.size, dp.tensor_ranks, caller="fpipe.shard", name="tree"), dp.rank)


def gather(shards: PyTree, like: PyTree, over: Any, /) -> PyTree:
    """The full pytree of ``shards`` (cut by ``fpipe.shard``), gathered from every data-parallel rank.

    A collective: every rank of the data-parallel group calls it with the same structure.
    ``None`` leaves in ``shards`` (gradients of non-float leaves) stay ``None``.
    ``step.gather(shards)`` does this for every local stage, with the full shapes ``step.shard``
    recorded as ``like`` (the same code: ``gather_tree`` in fpipe/_sharding/_stages.py).

    Args:
        shards: this rank's shards.
        like: a pytree with the full shapes: the full tensors, or tensors on the ``meta`` device.
            The result has the dtypes of ``shards`` (optimizer state kept in float32 for
            bfloat16 parameters gathers as float32 with the parameters as ``like``). Where
            ``like`` has a DTensor, the result has a DTensor with its placements, around the
            gathered local piece.
        over: the ``DeviceMesh``, its ``fpipe.Parallelism`` or the ``Step``, as for ``fpipe.shard``.
    """
    dp = _data_parallel_of(over, "fpipe.gather")
    layout = layout_of(like, dp.size, dp.tensor_ranks, caller="fpipe.gather", name="like")
    return gather_tree(dp, shards, layout, "fpipe.gather", "shards")
