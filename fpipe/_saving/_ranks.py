"""The ranks of a save or load: who takes part, what each holds, and agreeing among them.

``fpipe.save`` (``fpipe/_saving/_save.py``) and ``fpipe.load`` (``fpipe/_saving/_load.py``) both
find their ranks from their ``parallel=``, an ``fpipe.Parallelism`` or a step (``resolve``, a
``Setup``), all-gather JSON values among them (``Ranks``, ``agree``: an error on one rank raises
on every rank), check the per-stage arguments (``check_stage_count``; ``stage_list`` of
``fpipe/_pytree.py``) and, for a step built with ``shard_params=True``, describe this rank's
shards (``Sharding``, ``sharded_leaves``, ``full_shapes``: of a DTensor parameter, a shard of
its local piece's box; NOTE [sharded saves] in ``fpipe/_saving/_store.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._distributed import Status, Topology, all_gather_json, gather_over, resolve_topology
from .._errors import DEFAULT_TIMEOUT
from .._parallelism import Parallelism, deprecated
from .._plural import brief
from .._pytree import PyTree, leaves_with_names, stage_list, unflatten
from .._sharding import ParallelView, StageLayout, cut_range
from ._boxes import Box, piece_box

# --- Shards -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """This rank's place in a sharded step: shard ``q`` of ``d``, and its stages' layouts."""

    shard: tuple[int, int]
    layouts: dict[int, StageLayout]


def sharded_leaves(function: str, step: ParallelView | None, trees: dict[str, list[PyTree]]) -> Sharding | None:
    """The ``Sharding`` of a step built with ``shard_params=True`` (``None`` otherwise)."""
    topology = None if step is None else step.topology
    if step is None or not step.parallel.shard_params or topology is None:
        return None
    missing = [s for s in step.local_stages if s not in step.shard_layouts]
    if missing:
        raise ValueError(
            f"fpipe.{function}: the step shards parameters but has no layout for stage(s) {missing} (their full "
            "shapes). Cut the parameters with step.shard(params) first (meta tensors of the full shapes will do)."
        )
    assert topology.data_group is not None
    return Sharding((dist.get_rank(topology.data_group), topology.data_size), dict(step.shard_layouts))


class Full(NamedTuple):
    """What a shard leaf is cut from: a tensor of ``shape``, or for a DTensor parameter's shard
    (NOTE [tensor-parallel shards] in ``fpipe/_sharding/_stages.py``) the ``box`` of that global
    shape which this rank's local piece holds (NOTE [sharded saves] in ``fpipe/_saving/_store.py``)."""

    shape: list[int]
    box: Box | None = None

    def size(self, shard: tuple[int, int]) -> int:
        """Elements of shard ``(q, d)`` of it, padding included."""
        return cut_range(math.prod(self.shape if self.box is None else self.box.shape), shard).size


def full_shapes(function: str, kind: str, tree: PyTree, layout: StageLayout) -> dict[str, Full]:
    """The names of ``tree``'s leaves that are shards, with what each is cut from (NOTE [sharded saves]).

    A parameter is a shard when the stage's layout has its name. An optimizer state leaf is a
    shard when its name ends with a parameter's name (``m.layers.0.w`` for ``layers.0.w``) and it
    is a 1-D tensor of that parameter's shard size; it is cut from what the parameter is.
    """
    # Names, not key paths: {"m": {"layers.0.w": ...}} holds the state of {"layers": {"0": {"w": ...}}}.
    parts_of, _, _, _ = leaves_with_names(unflatten(layout.spec, list(range(len(layout.leaves)))))
    params = {".".join(parts): leaf for parts, leaf in zip(parts_of, layout.leaves) if leaf is not None}
    out: dict[str, Full] = {}
    names, _, leaves, _ = leaves_with_names(tree)
    for parts, leaf in zip(names, leaves):
        name = ".".join(parts)
        if kind == "params":
            found = params.get(name)
        else:  # the longest suffix of the name, cut at a dot, that names a parameter
            suffixes = [name] + [name[k + 1 :] for k, c in enumerate(name) if c == "."]
            found = next((params[suffix] for suffix in suffixes if suffix in params), None)
            if found is not None and not (isinstance(leaf, torch.Tensor) and tuple(leaf.shape) == (found.size,)):
                found = None
        if found is None:
            continue
        d = found.dtensor
        if d is None:
            out[name] = Full(list(found.shape))
        else:  # the shard of a local piece: the box of the DTensor it holds
            box = piece_box(function, f"the parameter {name!r}", d.mesh, d.placements, d.shape)
            out[name] = Full(list(d.shape), None if box.shape == tuple(d.shape) else box)
    return out


# --- Ranks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Where a save or load runs: its ``parallel=`` resolved (``resolve``).

    Attributes:
        topology: the ranks taking part (``None``: one process).
        timeout: seconds a rank waits for the others.
        step: the step whose stages and shard layouts a save or load reads (``parallel=step``),
            through its public view; ``None`` for a ``Parallelism`` or nothing.
    """

    topology: Topology | None
    timeout: float
    step: ParallelView | None = None

    @property
    def held(self) -> tuple[int, ...] | None:
        """The stages the step holds here (``None`` without a step: the entries given)."""
        return None if self.step is None else self.step.local_stages

    @property
    def shared(self) -> tuple[int, ...]:
        """The stages the step holds here and on other ranks too (DualPipe's), which each holder
        saves as a tied name is saved: written once, its copies bitwise equal."""
        return () if self.step is None else self.step.shared_stages


def resolve(
    function: str,
    parallel: Parallelism | ParallelView | None,
    *,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> Setup:
    """The ``Setup`` of ``parallel=`` (an ``fpipe.Parallelism``, a step, or ``None``: one process),
    or of the deprecated ``step=``, ``group=``, ``mesh=`` and ``timeout=`` (with a
    ``DeprecationWarning``: NOTE [the set-up is a value] in fpipe/_parallelism.py). Called by the
    public function itself, so that the warning names the user's line.

    Raises:
        TypeError: ``parallel`` is neither, or is given with the keywords it replaces.
        ValueError: a ``Parallelism`` with ``shard_params=True``: the shards' layouts are the step's.
        RuntimeError: a mesh or group given before ``torch.distributed`` is initialized.
    """
    old = {"step": step, "group": group, "mesh": mesh, "timeout": timeout}
    given = [name for name, value in old.items() if value is not None]
    if given:
        names = ", ".join(f"{name}=" for name in given)
        if parallel is not None:
            raise TypeError(
                f"fpipe.{function}: pass parallel= alone; it replaces {names} (parallel: {brief(parallel)}). "
                "Pass parallel=step, or parallel=fpipe.Parallelism(mesh=..., timeout=...)."
            )
        new = (
            "parallel=step"
            if step is not None
            else "parallel=fpipe.Parallelism(" + ", ".join(f"{name}=..." for name in given) + ")"
        )
        deprecated(f"fpipe.{function}({names})", new, stacklevel=3)
        return _legacy(function, step, group, mesh, DEFAULT_TIMEOUT if timeout is None else timeout)
    if parallel is None:
        return Setup(None, DEFAULT_TIMEOUT)
    if isinstance(parallel, Parallelism):
        if parallel.shard_params:
            raise ValueError(
                f"fpipe.{function}: a save or load of shards needs their full shapes, which the step recorded "
                f"(parallel: {brief(parallel)}). Pass parallel=step, the step whose step.shard cut them."
            )
        return Setup(_topology(function, parallel.mesh, parallel.group), parallel.timeout)
    if isinstance(parallel, ParallelView) and isinstance(parallel.parallel, Parallelism):
        return Setup(parallel.topology, parallel.parallel.timeout, parallel)
    raise TypeError(
        f"fpipe.{function}: parallel must be an fpipe.Parallelism or a Step from fpipe.pipeline (parallel: "
        f"{brief(parallel)}). Pass parallel=fpipe.Parallelism(mesh=mesh) (or group=), or parallel=step."
    )


def _legacy(function: str, step: Any, group: Any, mesh: Any, timeout: float) -> Setup:
    """The ``Setup`` of the deprecated keywords, as they were read before ``parallel=``."""
    if sum(x is not None for x in (step, group, mesh)) > 1:
        raise TypeError(f"fpipe.{function}: pass one of step=, group= and mesh=, not several.")
    if step is not None:
        if not isinstance(step, ParallelView):
            raise TypeError(f"fpipe.{function}: step must be a Step from fpipe.pipeline (step: {brief(step)}).")
        return Setup(step.topology, timeout, step)
    return Setup(_topology(function, mesh, group), timeout)


def _topology(function: str, mesh: Any, group: Any) -> Topology | None:
    if (group is not None or mesh is not None) and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"fpipe.{function}: torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "first, or leave out parallel= in one process."
        )
    return resolve_topology(mesh, group)


class Ranks:
    """The ranks taking part in a save or load (the pipeline ranks; the data-parallel ranks of a
    sharded save, the expert-parallel ranks of a save with ``experts``, the tensor-parallel ranks of
    a mesh with a ``"tp"`` dimension), and all-gathers of JSON values among them."""

    def __init__(
        self,
        function: str,
        topology: Topology | None,
        timeout: float,
        *,
        sharded: bool = False,
        tensor_parallel: bool = True,
        all_replicas: bool = False,
        experts: bool = False,
    ) -> None:
        """``tensor_parallel=False``: only tensor-parallel rank 0 takes part (``save_hf``, whose other
        tensor-parallel ranks gathered their pieces to it); ``all_replicas``: the data-parallel
        ranks take part, as in a sharded save (``load``: every process agrees on its outcome);
        ``experts``: on a mesh with an ``"ep"`` dimension, the expert-parallel ranks take part
        (``save``: each writes its block of experts, NOTE [tensor-parallel saves] in
        fpipe/_saving/_boxes.py), and only the data-parallel replicas (``mesh["dp"]``) wait."""
        self.function = function  # "save" or "load", for messages
        self.topology = topology
        self.timeout = timeout
        self.rank = 0 if topology is None else topology.rank
        self.size = 1 if topology is None else topology.size
        self.sharded = sharded and topology is not None and topology.data_group is not None
        # The expert ranks write their own blocks: the replicas that wait are the data-parallel
        # ones of this (pp, ep, tp) coordinate (NOTE [experts are data-parallel for the dense weights]).
        expert_writers = (
            experts
            and topology is not None
            and topology.expert_group is not None
            and not (self.sharded or all_replicas)
        )
        # The ranks holding this rank's pieces, of which the first writes and the others wait.
        self.copies: Any = None if topology is None else topology.data_group
        if expert_writers:
            assert topology is not None  # (for mypy)
            self.copies = topology.expert_data_group
        self.replicas = self.copies is not None and dist.get_world_size(self.copies) > 1
        self.replica = dist.get_rank(self.copies) if self.replicas else 0
        # The other dimensions whose ranks all take part: data-parallel in a sharded save (every
        # replica writes its shards; in a load, the dp x ep replicas), expert-parallel (every ep rank
        # writes its block of experts), tensor-parallel (every tp rank writes its pieces, NOTE
        # [tensor-parallel saves] in fpipe/_saving/_boxes.py), or several. ``gather`` spans them and
        # the pipeline group, and writer ``((rank * dp_size + dp_index) * ep_size + ep_index) *
        # tp_size + tp_index`` (each factor present only with its dimension) is the position in its result.
        self.inner: list[tuple[str, Any]] = []
        if topology is not None and topology.data_group is not None and (self.sharded or all_replicas):
            self.inner.append(("dp" if topology.expert_group is None else "replica", topology.data_group))
        if expert_writers:
            assert topology is not None  # (for mypy)
            self.inner.append(("ep", topology.expert_group))
        if topology is not None and topology.tensor_group is not None and tensor_parallel:
            self.inner.append(("tp", topology.tensor_group))
        # (label, index, size) of this rank in each inner dimension
        self.coordinates = [(label, dist.get_rank(g), dist.get_world_size(g)) for label, g in self.inner]
        self.tp = next((index for label, index, _ in self.coordinates if label == "tp"), None)
        self.ep = next((index for label, index, _ in self.coordinates if label == "ep"), None)
        self.writer = self.rank
        for _, index, size in self.coordinates:
            self.writer = self.writer * size + index

    def gather(self, value: Any, what: str) -> list[Any]:
        """``value`` of every pipeline rank (and every rank of the inner dimensions), as JSON gives it back."""
        if self.topology is None:
            return [json.loads(json.dumps(value))]
        groups = [group for _, group in reversed(self.inner)] + [self.topology.group]  # tp, then dp, then pp
        return gather_over(self.topology, groups, value, self.timeout, what)

    def name(self, position: int) -> str:
        """How messages name the rank at ``position`` in ``gather``'s result: ``1``, or ``1 (dp 0 tp 1)``."""
        inner = []
        for label, _, size in reversed(self.coordinates):
            position, index = divmod(position, size)
            inner.append(f"{label} {index}")
        return str(position) + (f" ({' '.join(reversed(inner))})" if inner else "")

    def gather_replicas(self, value: Any, what: str) -> list[Any]:
        """``value`` of every rank of ``copies``: the data-parallel replicas of this pipeline rank
        (with ``experts``, of this pipeline and expert-parallel rank)."""
        assert self.topology is not None
        return all_gather_json(self.topology, self.copies, value, self.timeout, what)


@dataclass(frozen=True)
class _Report(Status):
    """What a rank tells the others in ``agree``."""

    error: str | None  # the first line of its error (``None``: it did not fail)
    value: dict[str, Any]  # what it has to say when it did not (JSON)


def agree(ranks: Ranks, problem: BaseException | None, value: dict[str, Any], what: str) -> list[Any]:
    """All-gather ``value`` and an error flag; raise ``problem`` here, and elsewhere an error that
    names each failed rank with the first line of its error (which names the file, for a read).
    Every rank's ``value``, in ``Ranks.gather``'s order."""
    mine = _Report(None if problem is None else _first_line(problem), value).to_json()
    reports = [_Report.from_json(r) for r in ranks.gather(mine, f"the other ranks to finish {what}")]
    if problem is not None:
        raise problem
    failed = [(ranks.name(r), report.error) for r, report in enumerate(reports) if report.error is not None]
    if failed:
        said = "; ".join(f"rank {name}: {text}" for name, text in failed)
        raise RuntimeError(
            f"fpipe.{ranks.function}: rank(s) [{', '.join(name for name, _ in failed)}] failed while {what}; their "
            f"own errors say why ({said})."
        )
    return [report.value for report in reports]


def _first_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message, cut to 400 characters."""
    text = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    return text if len(text) <= 400 else f"{text[:397]}..."


_OTHER_RANKS = "None stands for the stages of other ranks."


def check_stage_count(function: str, params: Sequence[PyTree], step: ParallelView | None) -> None:
    """Raise ``ValueError`` unless ``params`` has one entry per stage of ``step`` (when given)."""
    if step is not None:
        stage_list(f"fpipe.{function}", "params", params, step.num_stages, against="the step", fix=_OTHER_RANKS)
