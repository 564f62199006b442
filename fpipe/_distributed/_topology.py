"""Where this process sits in a distributed job: its pipeline, data-parallel and tensor-parallel groups, its device.

NOTE [mesh dimensions]
A mesh has one pipeline dimension (``"pp"`` or ``"pipeline"``), at most one data-parallel one
(``"dp"`` or ``"data"``) and at most one tensor-parallel one (``"tp"`` or ``"tensor"``), in any
order. A process's pipeline group is the ranks with its own data and tensor coordinates, so the
pipeline's messages go between ranks of the same tensor-parallel index; its tensor-parallel
group (``mesh["tp"]``) is where its stages' DTensors live (notes/tensor_parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._faults import WATCHDOG, Board


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its pipeline group and, optionally, its data-parallel group."""

    group: Any  # the pipeline ProcessGroup
    rank: int  # position in the pipeline group = pipeline rank
    size: int
    global_ranks: tuple[int, ...]  # pipeline rank -> global rank
    data_group: Any | None
    data_size: int
    device: torch.device
    board: Board  # the job's failure board (NOTE [failure board] in fpipe/_distributed/_faults.py)
    tensor_group: Any | None = None  # the tensor-parallel ProcessGroup (NOTE [mesh dimensions])
    tensor_mesh: Any | None = None  # the tensor-parallel sub-mesh, where stage DTensors live
    tensor_ranks: tuple[int, ...] | None = None  # its global ranks, in mesh order


_PIPELINE_DIMS = ("pp", "pipeline")
_DATA_DIMS = ("dp", "data")
_TENSOR_DIMS = ("tp", "tensor")


def resolve_topology(mesh: Any, group: Any) -> Topology | None:
    """The topology for ``pipeline(..., mesh=...)`` or ``group=...``; ``None`` for one process."""
    if mesh is None and group is None:
        return None
    if mesh is not None and group is not None:
        raise TypeError("fpipe.pipeline: pass mesh= or group=, not both.")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fpipe.pipeline: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group() first (torchrun sets up the environment)."
        )
    data_group = tensor_group = tensor_mesh = tensor_ranks = None
    where: dict[int, tuple[int, int | None]] = {}  # global rank -> (pipeline rank, replica)
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1 and not names:
            names = ("pp",)
        pipe = [n for n in names if n in _PIPELINE_DIMS]
        data = [n for n in names if n in _DATA_DIMS]
        tensor = [n for n in names if n in _TENSOR_DIMS]
        if len(pipe) != 1 or len(data) > 1 or len(tensor) > 1 or len(pipe) + len(data) + len(tensor) != mesh.ndim:
            raise ValueError(
                f"fpipe.pipeline: the mesh needs one pipeline dimension named 'pp', at most one data dimension "
                f"named 'dp' and at most one tensor-parallel dimension named 'tp' (mesh_dim_names: "
                f"{mesh.mesh_dim_names!r})."
            )
        group = mesh.get_group(pipe[0])
        data_group = mesh.get_group(data[0]) if data else None
        if tensor:
            tensor_group, tensor_mesh = mesh.get_group(tensor[0]), mesh[tensor[0]]
            tensor_ranks = tuple(tensor_mesh.mesh.reshape(-1).tolist())
        # One pipeline per (data, tensor) coordinate; failure messages name a rank by its
        # pipeline rank and data-parallel replica (the tensor-parallel ranks of one pipeline rank
        # run the same stages, and fail together).
        rows = mesh.mesh.permute(*(names.index(n) for n in (*data, *tensor, pipe[0])))
        per_replica = mesh.size(names.index(tensor[0])) if tensor else 1
        for k, row in enumerate(rows.reshape(-1, rows.shape[-1]).tolist()):
            where.update({g: (r, k // per_replica if data else None) for r, g in enumerate(row)})
    size = dist.get_world_size(group)
    global_ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
    where = where or {g: (r, None) for r, g in enumerate(global_ranks)}
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return Topology(
        group=group,
        rank=dist.get_rank(group),
        size=size,
        global_ranks=global_ranks,
        data_group=data_group,
        data_size=1 if data_group is None else dist.get_world_size(data_group),
        device=device,
        board=WATCHDOG.board(
            tuple(sorted(where)), [g for g in (group, data_group, tensor_group) if g is not None], where
        ),
        tensor_group=tensor_group,
        tensor_mesh=tensor_mesh,
        tensor_ranks=tensor_ranks,
    )
