"""``fpipe.shard`` and ``fpipe.gather``: cut a pytree over a mesh's data-parallel ranks, and
gather it back (NOTE [shard layout] in fpipe/_sharding/_stages.py)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .._distributed import Topology, resolve_topology
from .._errors import DEFAULT_TIMEOUT
from .._pytree import PyTree
from ._layout import DataParallel, cut, data_parallel, layout_of
from ._stages import gather_tree


@runtime_checkable
class _StepView(Protocol):
    """What sharding reads of a ``Step`` (its public read-only view; fpipe/_api.py imports this
    package, so it is never imported here)."""

    @property
    def topology(self) -> Topology | None: ...

    @property
    def timeout(self) -> float: ...


def _data_parallel_of(over: Any, caller: str) -> DataParallel:
    topology: Topology | None = None
    timeout = DEFAULT_TIMEOUT
    if isinstance(over, _StepView):
        topology, timeout = over.topology, over.timeout
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
    data-parallel size); nothing is dropped. A DTensor leaf (on the mesh's ``"tp"`` sub-mesh) is
    cut by its local piece, into a plain 1-D tensor. Other leaves are kept whole. Only the rank's
    own data is read; no communication. ``step.shard(params)`` does this for every local stage and
    records the full shapes a sharded step needs.

    Args:
        tree: a full pytree, the same on every data-parallel replica (parameters, or anything
            shaped like them, such as optimizer state).
        over: the ``DeviceMesh`` (dimensions ``"dp"`` and ``"pp"``, maybe ``"tp"``) or a ``Step``
            built on one.

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
    ``step.unshard(shards)`` does this for every local stage, with the full shapes ``step.shard``
    recorded as ``like``.

    Args:
        shards: this rank's shards.
        like: a pytree with the full shapes: the full tensors, or tensors on the ``meta`` device.
            The result has the dtypes of ``shards`` (optimizer state kept in float32 for
            bfloat16 parameters gathers as float32 with the parameters as ``like``). Where
            ``like`` has a DTensor, the result has a DTensor with its placements, around the
            gathered local piece.
        over: the ``DeviceMesh`` or the ``Step``, as for ``fpipe.shard``.
    """
    dp = _data_parallel_of(over, "fpipe.gather")
    layout = layout_of(like, dp.size, dp.tensor_ranks, caller="fpipe.gather", name="like")
    return gather_tree(dp, shards, layout, "fpipe.gather", "shards")
