"""DTensor leaves (tensor parallelism, notes/tensor_parallel.md): local pieces and placements as data.

A stage may hold ``torch.distributed.tensor.DTensor`` parameters on the mesh's tensor-parallel
sub-mesh and return DTensors. fpipe never gathers them: the wire carries each rank's local
piece with the placements in its header (``header_of``, ``from_header``), gradients are summed as
DTensors (``clone`` keeps a ``Partial`` sum partial) and redistributed to their parameter's
placements at the end of the step (``like_param``), and the global norm adds every piece once
(``square_sum``). Sharded data parallelism cuts a DTensor parameter's local piece and rebuilds
the DTensor from its layout (``DTensorLayout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

_REDUCE_OPS = ("sum", "avg", "max", "min", "product")  # of a Partial placement (c10d's names)

# A DTensor's description on the wire: (placements as plain data, global shape, global stride).
DTensorHeader = tuple[tuple[tuple[Any, ...], ...], tuple[int, ...], tuple[int, ...]]


def is_dtensor(leaf: Any) -> bool:
    """Whether ``leaf`` is a DTensor."""
    return isinstance(leaf, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor, detached and without a copy; any other tensor as it is."""
    return t.to_local().detach() if isinstance(t, DTensor) else t


def with_piece(template: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` as the local piece of a DTensor laid out as ``template`` (no communication), or
    ``piece`` itself where ``template`` is a plain tensor."""
    if not isinstance(template, DTensor):
        return piece
    return DTensor.from_local(
        piece,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


def shares_storage(t: torch.Tensor) -> bool:
    """Whether another tensor shares ``t``'s storage (a DTensor's local piece's): a view, an
    alias, or ``t`` as a view of another's."""
    piece = t._local_tensor if isinstance(t, DTensor) else t
    # The storage's references: one per tensor on it, and the Python storage object asked here.
    return bool(_storage_users(piece.untyped_storage()._cdata) > 2)


_storage_users: Any = torch._C._storage_Use_Count


def clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, with the same placements if it is a DTensor, without communication.

    DTensor's own ``clone()`` of a ``Partial`` tensor sums it over the ranks first (an all-reduce
    to ``Replicate``): a gradient sum started with it would all-reduce every microbatch's partial
    gradient apart, in another order of additions than one all-reduce of their sum.
    """
    if not isinstance(t, DTensor):
        return t.clone()
    piece = t.to_local().clone()
    out: torch.Tensor = DTensor.from_local(
        piece, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
    return out


def placements_data(placements: Any, where: str) -> tuple[tuple[Any, ...], ...]:
    """Placements as plain data: ``("Shard", dim)``, ``("Replicate",)``, ``("Partial", op)``.

    Raises:
        TypeError: for any other placement (``where`` says which leaf), which the wire does not carry.
    """
    out: list[tuple[Any, ...]] = []
    for p in placements:
        if type(p) is Shard:
            out.append(("Shard", p.dim))
        elif type(p) is Replicate:
            out.append(("Replicate",))
        elif type(p) is Partial and p.reduce_op in _REDUCE_OPS:
            out.append(("Partial", p.reduce_op))
        else:
            raise TypeError(
                f"fpipe.step: a DTensor placement cannot travel between ranks ({where}: {p!r}). Use Shard, "
                "Replicate or Partial placements for what a stage returns."
            )
    return tuple(out)


def placements_from(data: Any) -> tuple[Any, ...]:
    """Inverse of ``placements_data``; raises ``ValueError`` for anything else."""
    if type(data) not in (list, tuple):
        raise ValueError(f"not placements: {data!r:.80}")
    out: list[Any] = []
    for p in data:
        kind, *args = p if type(p) in (list, tuple) and p else [None]
        if kind == "Shard" and len(args) == 1 and type(args[0]) is int and args[0] >= 0:
            out.append(Shard(args[0]))
        elif kind == "Replicate" and not args:
            out.append(Replicate())
        elif kind == "Partial" and len(args) == 1 and args[0] in _REDUCE_OPS:
            out.append(Partial(args[0]))
        else:
            raise ValueError(f"not a placement: {p!r:.80}")
    return tuple(out)


def mesh_ranks(mesh: Any) -> list[int]:
    """The global ranks of a device mesh, in its order."""
    ranks: list[int] = mesh.mesh.reshape(-1).tolist()
    return ranks


def on_ranks(leaf: torch.Tensor, ranks: Sequence[int]) -> bool:
    """Whether DTensor ``leaf`` lives on the 1-D mesh whose global ranks are ``ranks``, in order."""
    mesh = leaf.device_mesh  # type: ignore[attr-defined]
    return bool(mesh.ndim == 1 and mesh_ranks(mesh) == list(ranks))


def check_mesh(
    leaf: torch.Tensor,
    tensor_ranks: Sequence[int] | None,
    where: str,
    caller: str = "fpipe.step",
    *,
    experts: Sequence[int] | None = None,
) -> None:
    """Raise unless DTensor ``leaf`` lives on the tensor-parallel sub-mesh whose ranks are
    ``tensor_ranks`` (``None``: the step has no ``"tp"`` dimension). ``experts``: the ranks of the
    expert-parallel sub-mesh, where expert weights may live too (checked by the caller)."""
    mesh = leaf.device_mesh  # type: ignore[attr-defined]
    also = "" if experts is None else f" or expert ranks {list(experts)}"
    if tensor_ranks is None:
        raise ValueError(
            f"{caller}: {where} is a DTensor but the pipeline's mesh has no tensor-parallel dimension "
            f"(the DTensor's mesh: {mesh!r}{also}). Build the "
            "pipeline with parallel=fpipe.Parallelism(mesh=mesh), mesh a DeviceMesh with a 'tp' dimension (or an "
            "'ep' one for expert weights: fpipe.moe.distribute_experts(params, mesh['ep']))."
        )
    if not on_ranks(leaf, tensor_ranks):
        raise ValueError(
            f"{caller}: {where} is a DTensor on the wrong mesh (its mesh: {mesh!r}; this rank's tensor-parallel "
            f"sub-mesh has ranks {list(tensor_ranks)}{also}). Make stage DTensors on mesh['tp'] of the pipeline's "
            "mesh (expert weights on mesh['ep'])."
        )


def header_of(t: torch.Tensor, where: str) -> DTensorHeader:
    """The description of DTensor ``t`` that its local piece travels with."""
    placements = placements_data(t.placements, where)  # type: ignore[attr-defined]
    return placements, tuple(t.shape), tuple(t.stride())


def from_header(piece: torch.Tensor, mesh: Any, header: DTensorHeader) -> torch.Tensor:
    """The DTensor on ``mesh`` whose local piece is ``piece`` (no copy, no communication)."""
    placements, shape, stride = header
    out: torch.Tensor = DTensor.from_local(
        piece, mesh, placements_from(placements), run_check=False, shape=torch.Size(shape), stride=stride
    )
    return out


@dataclass(frozen=True)
class DTensorLayout:
    """A DTensor without its data: its mesh, placements, global shape and stride. Sharded data
    parallelism keeps only a shard of a DTensor parameter's local piece (notes/sharding.md,
    "With tensor parallelism"); ``wrap`` rebuilds the DTensor around the gathered piece."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def wrap(self, piece: torch.Tensor) -> torch.Tensor:
        """The DTensor whose local piece is ``piece`` (no copy, no communication)."""
        out: torch.Tensor = DTensor.from_local(
            piece, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape), stride=self.stride
        )
        return out


def dtensor_layout(t: torch.Tensor) -> DTensorLayout | None:
    """The layout of DTensor ``t``; ``None`` for any other tensor."""
    if not isinstance(t, DTensor):
        return None
    return DTensorLayout(t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride()))


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``param``'s placements (a replicated weight's gradient comes out of autograd
    as a ``Partial`` sum over the tensor-parallel ranks: this sums it); other tensors as they are."""
    if not is_dtensor(grad) or tuple(grad.placements) == tuple(param.placements):  # type: ignore[attr-defined]
        return grad
    out: torch.Tensor = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[attr-defined]
    return out


def square_sum(g: torch.Tensor, tensor_group: Any, placements: Sequence[Any] | None = None) -> torch.Tensor:
    """This rank's share of ``sum(g ** 2)`` in float64 such that the shares of the ranks of
    ``tensor_group`` add up to it: a piece replicated over them (a plain tensor, a ``Replicate``
    DTensor) counts on the group's first rank only, a shard on every rank. ``placements``: those
    of the DTensor that ``g``, a plain tensor, is a data-parallel shard of the local piece of
    (``shard_params``); ``None`` reads them from ``g``."""
    if placements is None and is_dtensor(g):
        placements = g.placements  # type: ignore[attr-defined]
    if placements is not None and any(type(p) is Partial for p in placements):
        raise ValueError(
            f"fpipe.step.global_norm: a gradient with Partial placements ({placements}); pass the grads the step "
            "returned, whose placements are their parameters'."
        )
    replicated = placements is None or all(type(p) is Replicate for p in placements)
    if tensor_group is not None and replicated and dist.get_rank(tensor_group) != 0:
        return torch.zeros((), dtype=torch.float64)
    return local(g).abs().double().square().sum().cpu()
