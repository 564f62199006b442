"""``fpipe.save_state``, ``fpipe.load_state``: the whole training state, for an exact resume.

NOTE [train state]
A run resumed from a save goes on bitwise as if it had never stopped when everything its next
steps read is restored: the parameters, the optimizer state (its step counter included), the
number of steps done, the random generators every process draws from (dropout inside a stage),
the position in the data stream, and whatever else is kept from step to step (a loss scale).
``save_state`` saves a ``TrainState`` through ``fpipe.save``, so with the same files, checksums
and atomic commit: parameters and optimizer state as ``save`` names them, everything else in the
index's metadata under ``"fpipe_train_state"``::

    {"step": 120, "metadata": {...the user's...}, "extra": "<base64 safetensors>",
     "rng": {"0": "<base64 safetensors: cpu, cuda:0...>", "1": ...}, "num_ranks": 2}

Random states are per process, keyed by global rank: each process's own generators, captured
when ``save_state`` is called (or ``TrainState.rng``), all-gathered over the pipeline and
data-parallel groups (5 KB each for the CPU generator) so that the metadata every rank passes
to ``save`` is the same. ``load_state`` on global rank ``r`` restores what rank ``r`` saved;
loading on another number of processes restores what exists and warns about the rest
(randomness drawn inside stages then differs from the saved run's: one process draws every
stage's numbers from one generator, in the schedule's order).
"""

from __future__ import annotations

import base64
import binascii
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

from .._distributed import Topology
from .._parallelism import Parallelism
from .._pytree import PyTree
from .._sharding import ParallelView
from ._load import Loaded, load_then
from ._ranks import Ranks, Setup, resolve
from ._save import Prepared, prepare, save_ranks, write

KEY = "fpipe_train_state"


@dataclass(frozen=True)
class TrainState:
    """Everything a training loop needs to go on exactly where it was (NOTE [train state]).

    Attributes:
        params: one parameter pytree per stage (``None`` for stages of other ranks), as ``step`` takes.
        optimizer_state: one optimizer state pytree per stage (``fpipe.optim``'s ``init``), or ``None``.
        step: the number of training steps done.
        metadata: a JSON-serializable dict: the data position (``{"epoch": 2, "batch": 310}``),
            a config; the same on every rank.
        extra: tensors kept between steps that affect results (a loss scale, an EMA decay
            counter), by name; the same on every rank. Loaded back on the CPU.
        rng: this process's random generator states (``"cpu"``, ``"cuda:<i>"``). ``None`` when
            saving captures the generators as they are at the call; ``load_state`` returns
            what it restored, or ``None`` when the save has nothing for this rank.
    """

    params: list[PyTree]
    optimizer_state: list[PyTree] | None = None
    step: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    rng: dict[str, torch.Tensor] | None = None


def save_state(
    directory: str | os.PathLike[str],
    state: TrainState,
    /,
    *,
    parallel: Parallelism | ParallelView | None = None,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> Path:
    """Save a whole training state atomically: ``fpipe.save`` plus step, RNG, extra tensors.

    Every process's random generators are saved (its own, keyed by global rank), so that
    ``load_state`` followed by the same loop reproduces the uninterrupted run bit for bit
    (NOTE [train state] in ``fpipe/_saving/_state.py``). Everything ``save`` guarantees holds:
    one file per rank and kind, sha256 of every tensor, an atomic commit.

    Args:
        directory: as for ``fpipe.save``.
        state: the ``TrainState`` to save; with ``state.rng`` ``None`` (the default) the
            generators are captured now.
        parallel: as for ``fpipe.save`` (the ``Step``, or an ``fpipe.Parallelism``); every
            process of the job calls ``save_state`` (data-parallel replicas too: their random
            states are saved).
        step: deprecated, as for ``fpipe.save``: ``parallel=``.
        group: deprecated, as for ``fpipe.save``: ``parallel=``.
        mesh: deprecated, as for ``fpipe.save``: ``parallel=``.
        timeout: deprecated, as for ``fpipe.save``: ``parallel=``.

    Returns:
        The committed version's directory.

    Examples:
        >>> import tempfile, torch, fpipe
        >>> directory = tempfile.mkdtemp()
        >>> params = [{"w": torch.ones(2)}]
        >>> _ = fpipe.save_state(directory, fpipe.TrainState(params, step=7, metadata={"batch": 70}))
        >>> state = fpipe.load_state(directory, params)
        >>> state.step, state.metadata
        (7, {'batch': 70})

    Raises:
        TypeError: ``state`` is not a ``TrainState``, or one of its fields has the wrong type;
            otherwise as ``fpipe.save``.
    """
    setup = resolve("save_state", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
    prepared, mine = prepare_state(directory, state, setup)
    return write_state(prepared, mine, save_ranks(setup.topology, setup.timeout, prepared))


def prepare_state(
    directory: str | os.PathLike[str], state: TrainState, setup: Setup
) -> tuple[Prepared, dict[str, Any]]:
    """Check ``state``, capture this process's generators; the save and what this rank contributes."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"fpipe.save_state: state must be a fpipe.TrainState (got: {type(state).__name__}). "
            "Wrap it: fpipe.TrainState(params, optimizer_state, step=...)."
        )
    if isinstance(state.step, bool) or not isinstance(state.step, int) or state.step < 0:
        raise TypeError(f"fpipe.save_state: state.step must be an int >= 0 (step: {state.step!r}).")
    for name, tensors in [("extra", state.extra), ("rng", state.rng or {})]:
        bad = (
            [repr(tensors)]
            if not isinstance(tensors, dict)
            else [f"{k!r}" for k, t in tensors.items() if not isinstance(k, str) or not isinstance(t, torch.Tensor)]
        )
        if bad:
            raise TypeError(
                f"fpipe.save_state: state.{name} must be a dict of tensors by name (not: {', '.join(bad)}). "
                "Put other values in metadata."
            )
    rng = capture_rng() if state.rng is None else state.rng
    saved = {"step": state.step, "metadata": state.metadata, "extra": _encode(state.extra)}
    prepared = prepare(directory, state.params, state.optimizer_state, {KEY: saved}, setup)
    rank = 0 if prepared.topology is None else dist.get_rank()
    return prepared, {"rank": rank, "rng": _encode(rng), "role": role_of(prepared.topology)}


def write_state(prepared: Prepared, mine: dict[str, Any], ranks: Ranks) -> Path:
    """All-gather every process's random states into the metadata, then ``write`` the save."""
    every = _every_process(ranks, mine)
    saved = dict(
        prepared.user[KEY],
        rng={str(v["rank"]): v["rng"] for v in every},
        roles={str(v["rank"]): v["role"] for v in every},
        num_ranks=len(every),
    )
    return write(replace(prepared, user={KEY: saved}), ranks)


def load_state(
    directory: str | os.PathLike[str],
    template: list[PyTree],
    /,
    *,
    optimizer_state: list[PyTree] | None = None,
    strict: bool = True,
    restore_rng: bool = True,
    parallel: Parallelism | ParallelView | None = None,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> TrainState:
    """Load a ``save_state`` save and restore this process's random generators.

    Parameters and optimizer state load as with ``fpipe.load`` (checked names, shapes, dtypes,
    checksums; any number of stages or ranks). Only once everything is read and checked are the
    generators restored, so a save of another model raises with nothing changed.

    Args:
        directory: as for ``fpipe.load``.
        template: as for ``fpipe.load``.
        optimizer_state: as for ``fpipe.load``.
        strict: as for ``fpipe.load``.
        parallel: as for ``fpipe.load``.
        restore_rng: set this process's generators to those its global rank saved, once every
            rank has read and checked the save. A rank the save has no state for keeps its
            generators, and rank 0 names the saved ranks that no process restores
            (``RuntimeWarning``s); a rank that had another role in the saving run raises.
            ``False``: keep every generator (to resume into another mesh layout).
        step: deprecated, as for ``fpipe.load``: ``parallel=``.
        group: deprecated, as for ``fpipe.load``: ``parallel=``.
        mesh: deprecated, as for ``fpipe.load``: ``parallel=``.
        timeout: deprecated, as for ``fpipe.load``: ``parallel=``.

    Returns:
        The ``TrainState``: params and optimizer state in the templates' structure, the step,
        metadata and extra tensors saved, and ``rng`` this rank's saved generator states
        (``None`` if the save has none for it).

    Distributed, it succeeds on every rank or changes nothing anywhere: a file one rank cannot
    read (missing, truncated, a byte changed) or a malformed state fails every rank before any
    generator is restored, the others with a ``RuntimeError`` naming the rank and its error.

    Raises:
        ValueError: the save was written by ``fpipe.save`` (no training state) or its training
            state is malformed, or (with ``restore_rng``) this process had another role in the
            saving run: another mesh layout (NOTE [resuming in another layout] in
            ``fpipe/_saving/_state.py``; ``restore_rng=False`` loads anyway); otherwise as ``fpipe.load``.
        RuntimeError: another rank failed; the message names it and the first line of its error.
    """
    setup = resolve("load_state", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
    distributed = setup.topology is not None
    me = dist.get_rank() if distributed else 0

    def read(loaded: Loaded, topology: Topology | None) -> tuple[TrainState, dict[str, Any]]:
        return _state_of(directory, loaded, me, role_of(topology), restore_rng)

    state, states = load_then(
        directory, template, read, optimizer_state=optimizer_state, strict=strict, setup=setup, function="load_state"
    )
    if restore_rng:  # every rank read its state: only now is anything changed (NOTE [train state])
        _restore(state.rng, me, states, dist.get_world_size() if distributed else 1)
    return state


def _state_of(
    directory: Any, loaded: Loaded, me: int, role: list[int], restore_rng: bool
) -> tuple[TrainState, dict[str, Any]]:
    """The ``TrainState`` of ``loaded`` for global rank ``me`` in ``role``, and every rank's saved
    generators (still encoded), all checked.

    Raises:
        ValueError: the save holds no training state or a malformed one, or with ``restore_rng``
            the save's rank ``me`` had another role (NOTE [resuming in another layout]).
    """
    saved = loaded.metadata.get(KEY)
    if not isinstance(saved, dict):
        raise ValueError(
            f"fpipe.load_state: the save at {directory} holds no training state (it was written by fpipe.save, not "
            "fpipe.save_state). Load it with fpipe.load."
        )
    number, metadata, num_ranks = saved.get("step"), saved.get("metadata"), saved.get("num_ranks")
    states, roles = saved.get("rng"), saved.get("roles", {})
    for what, value, ok in [
        ("step", number, isinstance(number, int) and number >= 0),
        ("metadata", metadata, isinstance(metadata, dict)),
        ("num_ranks", num_ranks, isinstance(num_ranks, int)),
        ("rng", states, isinstance(states, dict) and all(isinstance(v, str) for v in states.values())),
        ("roles", roles, isinstance(roles, dict)),
    ]:
        if not ok:
            raise ValueError(
                f"fpipe.load_state: the training state at {directory} is malformed ({what}: {str(value)[:80]}). "
                "Load an intact save written by fpipe.save_state."
            )
    assert isinstance(number, int) and isinstance(metadata, dict) and isinstance(states, dict)
    extra = _decode(directory, "extra", saved.get("extra"))
    rng = _decode(directory, f"rng of rank {me}", states[str(me)]) if str(me) in states else None
    was = roles.get(str(me))
    if restore_rng and rng is not None and was is not None and was != role:
        raise ValueError(
            f"fpipe.load_state: this process (global rank {me}) is {_said(role)}, but the save's rank {me} was "
            f"{_said(was)}: the mesh's dimensions differ from the saving run's (names, order or sizes), and its "
            f"random states would go to a process in another role (roles: saved {was}, here {role}). Resume on "
            "the saving run's mesh, or pass restore_rng=False to load the parameters and optimizer state into "
            "this layout, keeping this process's generators (NOTE [resuming in another layout] in "
            "fpipe/_saving/_state.py)."
        )
    return TrainState(loaded.params, loaded.optimizer_state, number, metadata, extra, rng), states


# NOTE [resuming in another layout]
# Random states are restored by global rank, and a process's draws depend on its role: which
# stages it runs (its pipeline rank), its data-parallel replica and its tensor-parallel index.
# A ("dp", "pp") mesh of 2 x 2 and a ("pp", "dp") one give global rank 1 different roles (pipeline
# rank 1 of replica 0, then pipeline rank 0 of replica 1), so a resume with the same number of
# processes would silently give each rank another's generators, and the run would differ from
# the saved one. ``save_state`` records each process's role, ``[pipeline rank, replica,
# tensor-parallel index]`` and on a mesh with ``"ep"`` its expert-parallel index (the experts it
# runs: a ("dp", "ep") mesh and an ("ep", "dp") one give global rank 1 the same replica, 1 of the
# dp x ep replicas, but other experts), next to its generators (``"roles"``), and ``load_state``
# refuses to restore a generator into a process of another role: every rank raises, nothing is
# changed.
# ``restore_rng=False`` is the opt-in: the parameters and optimizer state load by name into any
# layout. A process the save has no state for (another number of processes) warns
# (NOTE [train state]); a save without roles (older fpipe) is not checked.


def role_of(topology: Topology | None) -> list[int]:
    """A process's ``[pipeline rank, replica, tensor-parallel index]``, and its expert-parallel index
    on a mesh with one (NOTE [resuming in another layout])."""
    if topology is None:
        return [0, 0, 0]
    role = [topology.rank, topology.replica, topology.tensor_rank]
    return role if topology.expert_group is None else [*role, dist.get_rank(topology.expert_group)]


def _said(role: Any) -> str:
    if not isinstance(role, list) or len(role) not in (3, 4):
        return f"the role {role!r}"
    rank, replica, tensor_rank, *expert = role
    return f"pipeline rank {rank} of replica {replica} (tensor-parallel index {tensor_rank}" + (
        f", expert-parallel index {expert[0]})" if expert else ")"
    )


# --- Random generators ------------------------------------------------------------------------


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's generator states: the CPU's, and each CUDA device's once CUDA is in use."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # no CUDA start
        states.update({f"cuda:{i}": torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())})
    return states


def _restore(rng: dict[str, torch.Tensor] | None, me: int, states: dict[str, Any], world_size: int) -> None:
    if rng is None:
        warnings.warn(
            f"fpipe.load_state: the save has random states for ranks {sorted(int(r) for r in states)} but not for "
            f"this process (rank {me}); its generators are left as they are.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    left = []
    for name, state in rng.items():
        if name == "cpu":
            torch.set_rng_state(state)
        elif name.startswith("cuda:") and torch.cuda.is_available() and int(name[5:]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(state, int(name[5:]))
        else:
            left.append(name)
    if left:
        warnings.warn(
            f"fpipe.load_state: this process (rank {me}) has no device for the saved generator states {left}; "
            "they are not restored.",
            RuntimeWarning,
            stacklevel=3,
        )
    unused = sorted(r for r in (int(k) for k in states) if r >= world_size)
    if me == 0 and unused:
        warnings.warn(
            f"fpipe.load_state: the save holds the random states of {len(states)} processes and this job has "
            f"{world_size}: those of ranks {unused} are not restored.",
            RuntimeWarning,
            stacklevel=3,
        )


# --- Ranks and encoding -----------------------------------------------------------------------


def _every_process(ranks: Ranks, value: dict[str, Any]) -> list[dict[str, Any]]:
    """``value`` of every process of the save, pipeline ranks and data-parallel replicas."""
    if ranks.topology is None:
        return [value]
    what = "the other ranks to gather their random states"
    row = ranks.gather_replicas(value, what) if ranks.replicas and not ranks.sharded else [value]
    every = [v for rows in ranks.gather(row, what) for v in rows]
    return sorted(every, key=lambda v: int(v["rank"]))


def _encode(tensors: dict[str, torch.Tensor]) -> str:
    data = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    return base64.b64encode(safetensors.torch.save(data)).decode("ascii")


def _decode(directory: Any, what: str, text: Any) -> dict[str, torch.Tensor]:
    try:
        if not isinstance(text, str):
            raise TypeError(type(text).__name__)
        return safetensors.torch.load(base64.b64decode(text, validate=True))
    except (TypeError, ValueError, binascii.Error, safetensors.SafetensorError) as error:
        raise ValueError(
            f"fpipe.load_state: the training state at {directory} is malformed ({what}: {error}). "
            "Load an intact save written by fpipe.save_state."
        ) from error
