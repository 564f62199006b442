"""Where this process sits in a distributed job: its pipeline, data-parallel, expert-parallel and
tensor-parallel groups, its device.

NOTE [mesh dimensions]
A mesh has one pipeline dimension (``"pp"`` or ``"pipeline"``), at most one data-parallel one
(``"dp"`` or ``"data"``), at most one expert-parallel one (``"ep"`` or ``"expert"``) and at most
one tensor-parallel one (``"tp"`` or ``"tensor"``), in any order. A process's pipeline group is
the ranks with its own data, expert and tensor coordinates, so the pipeline's messages go between
ranks of the same tensor-parallel index; its tensor-parallel group (``mesh["tp"]``) is where its
stages' tensor-parallel DTensors live (notes/tensor_parallel.md).

NOTE [experts are data-parallel for the dense weights]
The expert dimension is laid out as DeepSeek-V3's (notes/experts.md): the ranks of an expert
group (``mesh["ep"]``) hold different data, like data-parallel replicas, and each holds its
block of every MoE layer's experts (DTensors sharded over ``mesh["ep"]``); tokens travel to their
experts and back inside a stage (``fpipe.moe``). So for everything but the expert weights, the
dp and ep dimensions together are the replicas: ``data_group`` is the ranks with this rank's pp
and tp coordinates (dp x ep of them, flattened in the mesh's order), which average the loss and
the dense gradients and each feed their own batch. An expert weight's local piece is held by the
ranks of the same ep index only: its gradient, which autograd already summed over the expert
group's tokens (the combine's backward brings every rank's cotangents home), is summed over
``expert_data_group`` (``mesh["dp"]``, ``None`` without dp) and divided by the dp x ep
replicas, like the dense ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._tensor_parallel import is_dtensor, on_ranks
from ._board import Board
from ._faults import WATCHDOG


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
    replica: int = 0  # this rank's data-parallel index (its position in ``data_group``)
    tensor_rank: int = 0  # its tensor-parallel index (its position in ``tensor_group``)
    # NOTE [experts are data-parallel for the dense weights]
    expert_group: Any | None = None  # the expert-parallel ProcessGroup (``mesh["ep"]``), the all-to-alls'
    expert_ranks: tuple[int, ...] | None = None  # its global ranks, in mesh order: where expert DTensors live
    expert_data_group: Any | None = None  # the ranks holding this rank's expert pieces (``mesh["dp"]``)

    @property
    def stage_collectives(self) -> bool:
        """Whether stages run collectives of their own (tensor-parallel DTensors, expert all-to-alls)."""
        return self.tensor_group is not None or self.expert_group is not None

    def is_expert(self, leaf: Any) -> bool:
        """Whether ``leaf`` is an expert weight's piece: a DTensor on this rank's ``mesh["ep"]``."""
        return self.expert_ranks is not None and is_dtensor(leaf) and on_ranks(leaf, self.expert_ranks)


# NOTE [the rank's device]
# A rank's device is where its messages and collectives live, and where its stages must be
# (``check_devices`` in fpipe/_distributed/_rank_step.py): with a ``mesh``, the mesh's device type;
# with a ``group``, the backend's (nccl: cuda, xccl: xpu, hccl: hpu; gloo: cpu; a multi-device
# backend such as "cpu:gloo,cuda:nccl" gives the accelerator's). An accelerator's index is its
# module's current device (``torch.cuda.set_device(local_rank)`` before building the pipeline,
# as torchrun scripts do): one process per device. On CPU the same code runs over gloo.
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}


def device_of(backend: str, mesh_device_type: str | None) -> torch.device:
    """This rank's device (NOTE [the rank's device]); ``mesh_device_type`` from the ``mesh``."""
    named = {part.split(":")[-1]: part.split(":")[0] for part in backend.lower().split(",")}
    types = [_ACCELERATOR_BACKENDS[b] for b in named if b in _ACCELERATOR_BACKENDS]
    if mesh_device_type is not None:
        cpu_only, accelerator_only = not types, "gloo" not in named
        if (mesh_device_type != "cpu" and cpu_only) or (mesh_device_type == "cpu" and accelerator_only):
            wanted = {v: k for k, v in _ACCELERATOR_BACKENDS.items()}.get(mesh_device_type, "gloo")
            raise ValueError(
                f"fpipe.pipeline: the mesh is on {mesh_device_type} but its process group's backend is {backend} "
                f"(mesh.device_type: {mesh_device_type!r}). Build the mesh and the process group for one device "
                f"type: init_process_group({wanted!r}) for a {mesh_device_type} mesh."
            )
        kind = mesh_device_type
    else:
        kind = types[0] if types else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


# Each role a mesh dimension may play, and the names it may have (NOTE [mesh dimensions]): a new
# dimension is one more entry here and fields of ``Topology``, as the expert-parallel "ep" was.
MESH_ROLES = {"pp": ("pp", "pipeline"), "dp": ("dp", "data"), "ep": ("ep", "expert"), "tp": ("tp", "tensor")}


def mesh_roles(names: tuple[str, ...], ndim: int, caller: str = "fpipe.pipeline") -> dict[str, str]:
    """The mesh's dimension for each role it has (``{"pp": "pp", "dp": "data"}``): one pipeline
    dimension, at most one of each other role, nothing else (NOTE [mesh dimensions]); a 1-D mesh
    without names is a pipeline.

    Raises:
        ValueError: naming the dimensions and the names each role may have.
    """
    if ndim == 1 and not names:
        names = ("pp",)
    found = {role: [n for n in names if n in aliases] for role, aliases in MESH_ROLES.items()}
    if len(found["pp"]) != 1 or any(len(f) > 1 for f in found.values()) or sum(map(len, found.values())) != ndim:
        raise ValueError(
            f"{caller}: the mesh needs one pipeline dimension named 'pp', at most one data dimension "
            f"named 'dp', at most one expert-parallel dimension named 'ep' and at most one tensor-parallel "
            f"dimension named 'tp' (mesh_dim_names: "
            f"{names or None!r}). Build it with e.g. init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'pp'))."
        )
    return {role: f[0] for role, f in found.items() if f}


def resolve_topology(mesh: Any, group: Any) -> Topology | None:
    """The topology of a ``fpipe.Parallelism``'s ``mesh`` or ``group`` (which it has checked:
    resolved once per step, and by a save or load given a ``Parallelism``); ``None`` for one process."""
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
    expert_group = expert_ranks = expert_data_group = None
    where: dict[int, tuple[int, int | None]] = {}  # global rank -> (pipeline rank, replica)
    labels: dict[int, str] = {}  # global rank -> its name in failure messages
    if mesh is not None:
        roles = mesh_roles(tuple(mesh.mesh_dim_names or ()), mesh.ndim)
        names = tuple(mesh.mesh_dim_names or ()) or ("pp",)
        pipe = [roles["pp"]]
        # The replicas of the dense weights: dp and ep, in the mesh's order (NOTE [experts are
        # data-parallel for the dense weights]).
        data = [n for n in names if n in (roles.get("dp"), roles.get("ep"))]
        tensor = [roles["tp"]] if "tp" in roles else []
        group = mesh.get_group(pipe[0])
        if len(data) == 2:
            data_group = mesh[tuple(data)]._flatten("_".join(data)).get_group()
        elif data:
            data_group = mesh.get_group(data[0])
        if "ep" in roles:
            expert_group = mesh.get_group(roles["ep"])
            expert_ranks = tuple(mesh[roles["ep"]].mesh.reshape(-1).tolist())
            expert_data_group = mesh.get_group(roles["dp"]) if "dp" in roles else None
        if tensor:
            tensor_group, tensor_mesh = mesh.get_group(tensor[0]), mesh[tensor[0]]
            tensor_ranks = tuple(tensor_mesh.mesh.reshape(-1).tolist())
        # One pipeline per (data, expert, tensor) coordinate. Failure messages name a rank by its global
        # rank and every coordinate, in the mesh's order: "rank 2 (dp 1, pp 0)".
        rows = mesh.mesh.permute(*(names.index(n) for n in (*data, *tensor, pipe[0])))
        per_replica = mesh.size(names.index(tensor[0])) if tensor else 1
        for k, row in enumerate(rows.reshape(-1, rows.shape[-1]).tolist()):
            where.update({g: (r, k // per_replica if data else None) for r, g in enumerate(row)})
        for coordinates in itertools.product(*map(range, mesh.mesh.shape)):
            g = int(mesh.mesh[coordinates])
            labels[g] = f"rank {g} (" + ", ".join(f"{n} {i}" for n, i in zip(names, coordinates)) + ")"
    size = dist.get_world_size(group)
    global_ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
    where = where or {g: (r, None) for r, g in enumerate(global_ranks)}
    labels = labels or {g: f"rank {r}" for r, g in enumerate(global_ranks)}  # a group: its pipeline ranks
    device = device_of(dist.get_backend(group), None if mesh is None else mesh.device_type)
    return Topology(
        group=group,
        rank=dist.get_rank(group),
        size=size,
        global_ranks=global_ranks,
        data_group=data_group,
        data_size=1 if data_group is None else dist.get_world_size(data_group),
        device=device,
        board=WATCHDOG.board(
            tuple(sorted(where)),
            [g for g in (group, data_group, tensor_group, expert_group, expert_data_group) if g is not None],
            where,
            labels,
        ),
        tensor_group=tensor_group,
        tensor_mesh=tensor_mesh,
        tensor_ranks=tensor_ranks,
        replica=0 if data_group is None else dist.get_rank(data_group),
        tensor_rank=0 if tensor_group is None else dist.get_rank(tensor_group),
        expert_group=expert_group,
        expert_ranks=expert_ranks,
        expert_data_group=expert_data_group,
    )
