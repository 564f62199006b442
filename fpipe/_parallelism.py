"""``fpipe.Parallelism``: where and how a job runs, one frozen value built once and handed to
``pipeline`` and to every save and load (as ``fpipe.Precision`` says which dtypes it runs in).

NOTE [the set-up is a value]
The parallel set-up of a job (its mesh or process group, whether parameters are sharded over the
data-parallel ranks, how long a rank waits for a peer) is one value, checked when it is built
(torchtitan's ``ParallelismConfig``): ``pipeline(..., parallel=p)`` and ``save``, ``load``,
``save_state``, ``load_state``, ``save_hf``, ``load_hf`` and ``AsyncSaver`` all take it as
``parallel=``. A save or load that must know a step's stages and shard layouts takes the step
itself (``parallel=step``), which carries its value (``step.parallel``). A new mesh dimension
(an expert-parallel ``"ep"``) is a role of the mesh (``MESH_ROLES`` in
fpipe/_distributed/_topology.py) and, if it needs an option, a field here: never a keyword on
every function. The keywords this value replaced are kept for one release, with a
``DeprecationWarning`` naming the replacement (``deprecated``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._distributed import mesh_roles
from ._errors import DEFAULT_TIMEOUT
from ._plural import brief


@dataclass(frozen=True)
class Parallelism:
    """Where and how a job runs: ``pipeline(..., parallel=fpipe.Parallelism(...))``.

    One value, checked when built and handed unchanged to ``fpipe.pipeline`` and to every save
    and load (``save``, ``load``, ``save_state``, ``load_state``, ``save_hf``, ``load_hf``,
    ``AsyncSaver``), which take it as ``parallel=``; a save or load of a step's shards takes the
    step instead (``parallel=step``: its ``step.parallel`` and the shard layouts it recorded).
    Without a ``mesh`` or a ``group`` the whole pipeline runs in this process.

    Attributes:
        mesh: run distributed, one pipeline rank per process, over a ``DeviceMesh`` with a
            pipeline dimension named ``"pp"`` and optionally a data-parallel one named ``"dp"``
            (each data-parallel replica gets its own batch; grads and loss are averaged over
            replicas), an expert-parallel one named ``"ep"`` (its ranks hold different data, like
            data-parallel replicas, and each its block of the experts: DTensors sharded over
            ``mesh["ep"]``, ``fpipe.moe``; notes/experts.md) and a tensor-parallel one named
            ``"tp"`` (stages' DTensors live on ``mesh["tp"]``), in any order.
        group: run distributed over this process group instead (the pipeline ranks are the
            positions in the group).
        shard_params: keep each stage's parameters sharded over the mesh's data-parallel ranks
            (ZeRO-3, FSDP): ``params[s]`` is then this rank's pytree of shards, cut by
            ``step.shard(params)``, and ``grads[s]`` the same shard of the replicas' average
            gradient (``notes/sharding.md``). Needs a mesh with a ``"dp"`` dimension.
        regather: with ``shard_params``, keep a stage's gathered parameters only while one of its
            actions runs and gather them again for the next (at most one stage's full
            parameters alive; results bitwise unchanged).
        timeout: seconds a rank waits for a peer (in a step, a collective, a save's all-gathers)
            before raising; a step raises ``PipelineTimeoutError``.

    Examples:
        >>> parallel = fpipe.Parallelism(timeout=60.0)
        >>> parallel
        Parallelism(mesh=None, group=None, shard_params=False, regather=False, timeout=60.0)
        >>> parallel.distributed, parallel == fpipe.Parallelism(timeout=60)
        (False, True)
        >>> fpipe.Parallelism(regather=True)
        Traceback (most recent call last):
        ...
        ValueError: fpipe.Parallelism: regather=True re-gathers sharded parameters; it needs shard_params=True ...

    Raises:
        TypeError: if ``mesh`` is not a ``DeviceMesh``, ``group`` not a ``ProcessGroup``, both are
            given, or ``shard_params`` or ``regather`` is not a bool.
        ValueError: if ``timeout`` is not a positive finite number, the mesh's dimensions are not
            named as above, ``shard_params`` has no data-parallel dimension to shard over, or
            ``regather`` is asked without ``shard_params``, or ``shard_params`` with an ``"ep"``
            dimension.
    """

    mesh: DeviceMesh | None = None
    group: dist.ProcessGroup | None = None
    shard_params: bool = False
    regather: bool = False
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        mesh, group = self.mesh, self.group
        if mesh is not None and group is not None:
            raise TypeError(
                f"fpipe.Parallelism: pass mesh= or group=, not both (mesh: {brief(mesh)}, group: {brief(group)}). "
                "A mesh's 'pp' dimension is the pipeline group: pass the mesh alone."
            )
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"fpipe.Parallelism: mesh must be a torch DeviceMesh (mesh: {brief(mesh)}). Build one with "
                "torch.distributed.device_mesh.init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'pp'))."
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"fpipe.Parallelism: group must be a torch.distributed ProcessGroup (group: {brief(group)}). "
                "Pass e.g. group=torch.distributed.group.WORLD after init_process_group()."
            )
        for name in ("shard_params", "regather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"fpipe.Parallelism: {name} must be True or False ({name}: {brief(getattr(self, name))}). "
                    "Pass a bool."
                )
        timeout = self.timeout
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(
                f"fpipe.Parallelism: timeout must be a positive number of seconds (timeout: {brief(timeout)}). "
                f"Pass e.g. timeout={DEFAULT_TIMEOUT:g}, the default."
            )
        object.__setattr__(self, "timeout", float(timeout))  # 60 and 60.0 are one value, shown alike
        roles = {} if mesh is None else mesh_roles(tuple(mesh.mesh_dim_names or ()), mesh.ndim, "fpipe.Parallelism")
        if self.regather and not self.shard_params:
            raise ValueError(
                "fpipe.Parallelism: regather=True re-gathers sharded parameters; it needs shard_params=True "
                "(regather: True, shard_params: False). Pass shard_params=True too, or leave regather=False."
            )
        if self.shard_params and "ep" in roles:
            raise ValueError(
                "fpipe.Parallelism: shard_params=True with an expert-parallel dimension is not supported yet: "
                f"expert weights are already sharded over 'ep' (mesh: {brief(mesh)}). Leave shard_params=False "
                "(notes/experts.md says what is held where)."
            )
        if self.shard_params and "dp" not in roles:
            given = f"group: {brief(group)}" if group is not None else f"mesh: {brief(mesh)}"
            raise ValueError(
                "fpipe.Parallelism: shard_params=True cuts parameters over the data-parallel ranks, but this "
                f"set-up has none ({given}). Pass mesh= a DeviceMesh with dimensions ('dp', 'pp'), or leave "
                "shard_params=False."
            )

    @property
    def distributed(self) -> bool:
        """Whether the job runs over many processes (a ``mesh`` or a ``group`` is given)."""
        return self.mesh is not None or self.group is not None


def deprecated(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warn that ``old`` (a spelling: ``"fpipe.pipeline: mesh="``) is deprecated for ``new``
    (NOTE [the set-up is a value]); ``stacklevel`` as ``warnings.warn`` counts it from the caller."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new} instead.",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def parallelism_of(
    caller: str,
    parallel: Parallelism | None,
    *,
    mesh: Any = None,
    group: Any = None,
    shard_params: bool | None = None,
    regather: bool | None = None,
    timeout: float | None = None,
) -> Parallelism:
    """``pipeline``'s ``parallel=``, checked, or the value its deprecated keywords spell (with a
    ``DeprecationWarning``); ``Parallelism()``, one process, when neither is given.

    Raises:
        TypeError: if ``parallel`` is not a ``Parallelism``, or is given with the keywords it replaces.
    """
    old = {"mesh": mesh, "group": group, "shard_params": shard_params, "regather": regather, "timeout": timeout}
    given = {name: value for name, value in old.items() if value is not None}
    names = ", ".join(f"{name}=" for name in given)
    replacement = f"parallel=fpipe.Parallelism({', '.join(f'{name}=...' for name in given)})"
    if given and parallel is not None:
        raise TypeError(
            f"{caller}: pass parallel= alone, not with the keywords it replaces ({names}; parallel: "
            f"{brief(parallel)}). Pass {replacement}."
        )
    if given:
        deprecated(f"{caller}({names})", replacement, stacklevel=3)
        return Parallelism(**given)
    if parallel is None:
        return Parallelism()
    if not isinstance(parallel, Parallelism):
        raise TypeError(
            f"{caller}: parallel must be an fpipe.Parallelism (parallel: {brief(parallel)}). "
            f"Pass e.g. parallel=fpipe.Parallelism(mesh=mesh) or parallel=fpipe.Parallelism(group=group)."
        )
    return parallel
