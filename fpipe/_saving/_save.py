"""``fpipe.save``: parameters and optimizer state to safetensors files, by global name, atomically.

NOTE [names]
A tensor's name is its key path inside its stage's pytree, the entries joined by ``.``: a
mapping key as ``str(key)``, a sequence index in decimal, a named field (namedtuple, dataclass)
by its name. So ``params[3] = {"layers": {"7": {"wq": t}}}``, ``{"layers": [..., {"wq": t}]}``
(``t`` at index 7) and ``{"layers.7.wq": t}`` all name ``t`` ``layers.7.wq``. The stage index is
not part of the name: a save made with 4 stages loads into 2 stages, one process or an
interleaved layout as long as the names match. Two leaves of one stage with the same name are an
error. The same name in two stages is a tied parameter (an embedding shared by the first and last
stages): it is saved once, and must be bitwise equal (dtype, shape and bytes) in every stage
that holds it, otherwise ``save`` raises. Optimizer state is named the same way, in a namespace
of its own (``optimizer_state_map`` in the index), so a step counter ``{"step": tensor}`` held by
every stage is saved once.

NOTE [the save protocol]
On each pipeline rank (one process: a single rank, and the all-gathers are no-ops):

1. Name and hash (sha256) the local stages' tensors; all-gather the manifests (names, dtypes,
   shapes, hashes, DTensor boxes: no tensor data) over the pipeline group (and first the
   tensor-parallel group, on a mesh with one, the expert-parallel group, on a mesh with one, and
   the data-parallel group, in a sharded save), with rank 0's choice of version. Every rank checks the
   manifests the same way (tied names, stages held twice, stage counts, metadata, pieces that
   tile their tensor), so all ranks fail together, and assigns each piece of each name (the
   whole tensor, or a DTensor's box) to the lowest rank holding it.
2. Write the owned tensors into ``directory/.tmp-<version>/`` (one file per rank and kind, all
   ranks in parallel), fsync; all-gather the file sizes.
3. Rank 0 writes the index and commits (NOTE [the save directory] in ``fpipe/_saving/_directory.py``).
4. A last all-gather over the pipeline group, then over the data-parallel group (whose other
   replicas write nothing and wait here; with an ``"ep"`` dimension, ``mesh["dp"]``: NOTE
   [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``), so ``save`` returns on every rank
   only once committed.

An error at any step on any rank raises on every rank (the others name the failing rank) and
rank 0 removes the ``.tmp-`` directory; a killed save leaves it behind, and the next committed
save removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch

from .._distributed import Topology, one_writes
from .._parallelism import Parallelism
from .._plural import plural
from .._pytree import PyTree, leaves_with_names, stage_list
from .._sharding import ParallelView
from .._tensor_parallel import local
from ._boxes import Box, HostPiece, box_of, is_piece, tiling_problem, whole
from ._directory import commit, fsync_directory, locked, next_version
from ._ranks import (
    Full,
    Ranks,
    Setup,
    Sharding,
    agree,
    check_stage_count,
    full_shapes,
    resolve,
    sharded_leaves,
)
from ._store import CODES, DTYPES, Entry, file_name, make_index, sha256, write_safetensors

Piece = Box | tuple[Box, int]
"""Which piece of a name a rank holds: a box (NOTE [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``;
the whole tensor's for a whole one), or shard ``q`` of one (NOTE [sharded saves] in ``fpipe/_saving/_store.py``)."""


def save(
    directory: str | os.PathLike[str],
    params: Sequence[PyTree],
    /,
    *,
    optimizer_state: Sequence[PyTree] | None = None,
    metadata: dict[str, Any] | None = None,
    parallel: Parallelism | ParallelView | None = None,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> Path:
    """Save parameters (and optimizer state and metadata) to ``directory``, atomically.

    Tensors go to safetensors files under their global names (NOTE [names] in
    ``fpipe/_saving/_save.py``: a tensor's key path inside its stage's pytree, joined by ``.``), with a
    Hugging Face style index ``model.safetensors.index.json`` (``{"metadata": ...,
    "weight_map": {name: file}}``, plus every tensor's dtype, shape and sha256 and every file's
    size). Nothing is pickled. ``directory`` holds versioned subdirectories and a ``latest``
    pointer that is replaced atomically: a save that fails or is killed leaves the previous save
    complete and loadable, and the previous version is removed only once the new one is
    committed (NOTE [the save directory] in ``fpipe/_saving/_directory.py``).

    Args:
        directory: where to save; created if needed. Saves to one directory from several
            processes at once (each rank of a job calling ``save`` without ``parallel=``) take turns
            on a lock file in it, and the last to commit is the one loaded (NOTE [save
            concurrency] in ``fpipe/_saving/_directory.py``). Do not load from it while saving to it.
        params: one parameter pytree per stage, as passed to ``step``. Leaves are dense tensors
            (any device; a dtype safetensors stores: not complex128) or ``None`` (skipped); a
            stage that is ``None`` is not held by this rank. A name in several stages (a tied
            parameter) must have bitwise equal values and is saved once.
        optimizer_state: one optimizer state pytree per stage, e.g. ``{"m": ..., "v": ...,
            "step": torch.tensor(t)}``, named like ``params`` in a namespace of its own. Counters
            must be tensors; the same counter in every stage is saved once.
        metadata: a JSON-serializable dict (step number, config), returned by ``load``.
        parallel: save from many processes, as ``fpipe.pipeline`` runs: the ``Step`` (the rank
            holds its ``local_stages``) or an ``fpipe.Parallelism`` with a process group or a
            ``DeviceMesh`` (pipeline dimension ``"pp"``: the rank holds the stages whose
            ``params`` entry is not ``None``); its ``timeout`` is the seconds a rank waits for the
            others at each of the save's all-gathers, which includes the time the slowest rank
            takes to hash or write its tensors, and the seconds rank 0 waits for another save to
            the same directory to finish. Every pipeline rank calls ``save`` with the same ``directory`` (on a
            filesystem they share) and the same ``metadata``, and writes only its own stages'
            tensors, in parallel: no tensor is gathered. Data-parallel replicas other than the
            first (a mesh's ``"dp"`` dimension) write nothing and return once the save is
            committed.
            With a step built with ``shard_params=True`` (``parallel=step``: only the step knows
            the full shapes ``step.shard`` recorded), ``params`` (and optimizer state leaves
            named ``<prefix>.<parameter name>`` of the shard size) are this rank's shards, and
            every replica writes its own (NOTE [sharded saves] in ``fpipe/_saving/_store.py``).
            On a mesh with a ``"tp"`` dimension, leaves may be DTensors on ``mesh["tp"]`` with
            ``Shard`` or ``Replicate`` placements: each tensor-parallel rank writes its own local
            piece under the global name, with its offsets in the index, never gathered; plain
            tensors and ``Replicate`` DTensors are written once, by tensor-parallel rank 0, and
            must be bitwise equal on every tensor-parallel rank (NOTE [tensor-parallel saves] in
            ``fpipe/_saving/_boxes.py``). With ``shard_params=True`` too, each rank's shard of a
            DTensor parameter is a flat piece of its local piece: every rank writes its own, recorded
            as that shard of that box (NOTE [sharded saves] in ``fpipe/_saving/_store.py``).
            On a mesh with an ``"ep"`` dimension (notes/experts.md), expert weights are DTensors
            ``Shard(0)`` on ``mesh["ep"]``: every expert-parallel rank of the first data-parallel
            replica writes its own block of experts (tensor-parallel rank 0 with tp), and plain
            tensors (the dense weights, the same on every expert-parallel rank) are written once,
            by expert-parallel rank 0; the other data-parallel replicas (``mesh["dp"]``) write
            nothing (NOTE [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``).
        step: deprecated: ``parallel=step`` or
        group: deprecated: ``parallel=step`` or
        mesh: deprecated: ``parallel=step`` or
        timeout: deprecated: ``parallel=step`` or
            ``parallel=fpipe.Parallelism(group=..., mesh=..., timeout=...)``, accepted for one
            release with a ``DeprecationWarning`` (NOTE [the set-up is a value]).

    Returns:
        The committed version's directory, such as ``directory/v000003-1a2b3c4d``. ``load``
        takes it or ``directory``.

    Conceptually, on one process, this is::

        for kind, trees in [("params", params), ("optimizer_state", optimizer_state)]:
            tensors = {}
            for s, tree in enumerate(trees):
                for key_path, leaf in flatten_with_path(tree):
                    tensors.setdefault(".".join(key_path), leaf)   # tied: bitwise equal, once
            safetensors.torch.save_file(tensors, f"{kind}.safetensors")

    but each rank writes its own stages, into a temporary directory, committed atomically.

    Examples:
        >>> import tempfile, torch, fpipe
        >>> directory = tempfile.mkdtemp()
        >>> params = [{"embed": torch.randn(10, 4)}, {"head": torch.randn(4, 10)}]
        >>> _ = fpipe.save(directory, params, metadata={"step": 100})
        >>> loaded, _, metadata = fpipe.load(directory, params)
        >>> metadata, torch.equal(loaded[1]["head"], params[1]["head"])
        ({'step': 100}, True)

    Raises:
        TypeError: a leaf is neither a tensor nor ``None``, has a dtype safetensors cannot store,
            or is the whole stage (it has no name), or is a DTensor with a ``Partial`` placement;
            ``metadata`` is not JSON-serializable.
        ValueError: two leaves of a stage have the same name, a leaf is named ``__metadata__`` (safetensors
            reserves it), a tied name has different values (or placements),
            or ranks disagree (stage count, metadata) or hold the same stage (but a stage the step's
            program runs on several ranks, DualPipe's, saved once like a tied name); a DTensor not on the
            mesh's ``"tp"`` (or ``"ep"``) sub-mesh, or a replicated leaf that differs between
            tensor-parallel or expert-parallel ranks.
        OSError: writing failed (the previous save is kept); ``TimeoutError``: another save to
            ``directory`` held its lock for longer than the timeout.
        RuntimeError: another rank failed; its own error says why.
    """
    setup = resolve("save", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
    prepared = prepare(directory, params, optimizer_state, metadata, setup)
    return write(prepared, save_ranks(setup.topology, setup.timeout, prepared))


@dataclass(frozen=True)
class Prepared:
    """A save checked and resolved, before anything is written: what ``write`` needs."""

    root: Path
    trees: dict[str, list[PyTree]]
    user: Any  # the metadata, as JSON gives it back
    topology: Topology | None
    held: tuple[int, ...] | None
    sharding: Sharding | None
    shared: tuple[int, ...] = ()  # held stages other ranks hold too (``Setup.shared``)


def prepare(
    directory: str | os.PathLike[str],
    params: Sequence[PyTree],
    optimizer_state: Sequence[PyTree] | None,
    metadata: dict[str, Any] | None,
    setup: Setup,
) -> Prepared:
    """Check ``save``'s arguments and find its ranks (no communication, nothing written)."""
    trees = {"params": stage_list("fpipe.save", "params", params)}
    if optimizer_state is not None:
        trees["optimizer_state"] = stage_list(
            "fpipe.save", "optimizer_state", optimizer_state, len(trees["params"]), against="params"
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"fpipe.save: metadata must be a dict (metadata: {metadata!r}).")
    try:
        user = json.loads(json.dumps(metadata or {}, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(f"fpipe.save: metadata must be JSON-serializable ({error}).") from error
    check_stage_count("save", params, setup.step)
    sharding = sharded_leaves("save", setup.step, trees)
    return Prepared(Path(directory), trees, user, setup.topology, setup.held, sharding, setup.shared)


def write(prepared: Prepared, ranks: Ranks) -> Path:
    """Write and commit a prepared save among ``ranks`` (NOTE [the save protocol]); its version's directory."""
    root, trees, user, held, sharding = prepared.root, prepared.trees, prepared.user, prepared.held, prepared.sharding
    if sharding is not None:  # NOTE [sharded saves]: every replica writes its own shards
        return root / _save_pipeline(root, trees, user, (held, prepared.shared), ranks, sharding)
    # NOTE [the save protocol], 4: the first replica saves, the others learn its version.
    group = ranks.copies if ranks.replicas else None
    write = (
        None if ranks.replica != 0 else lambda: _save_pipeline(root, trees, user, (held, prepared.shared), ranks, None)
    )
    waits, tells = "the save of the first replica", "the other data-parallel replicas"
    ok, version = one_writes(ranks.topology, group, write, ranks.timeout, waits, tells)
    if not ok:
        raise RuntimeError("fpipe.save: the first data-parallel replica failed to save; its own error says why.")
    return root / str(version)


def save_ranks(topology: Topology | None, timeout: float, prepared: Prepared) -> Ranks:
    """The writers of a save: with shards, every replica; on a mesh with ``"ep"``, every expert-parallel
    rank of the first data-parallel replica (NOTE [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``)."""
    return Ranks("save", topology, timeout, sharded=prepared.sharding is not None, experts=True)


# --- Naming and hashing the local stages ------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What the other ranks learn of a named tensor (no data); sent as JSON, a list of the fields."""

    where: str  # "params[2]['layers'][0]"
    stage: int
    dtype: str  # a safetensors code: "F32"
    shape: list[int]  # the full shape
    sha256: str
    shard: list[int] | None = None  # [q, d] (NOTE [sharded saves])
    box: list[list[int]] | None = None  # [offset, shape] of a DTensor's piece (NOTE [tensor-parallel saves])

    @property
    def value(self) -> tuple[Any, ...]:
        """What holders of one name must agree on, bitwise (NOTE [names])."""
        return self.dtype, self.shape, self.sha256, self.shard, self.box

    @property
    def piece(self) -> Piece:
        """Which piece of its name this is: its box (the whole tensor's for a whole one), and for a
        shard of it, ``q``."""
        box = whole(self.shape) if self.box is None else Box(tuple(self.box[0]), tuple(self.box[1]))
        return box if self.shard is None else (box, self.shard[0])


@dataclass
class _Tensor:
    """A named tensor of this rank: where it is, and its contents as a contiguous CPU tensor."""

    name: str
    where: str  # "params[2]['layers'][0]"
    stage: int
    data: torch.Tensor
    sha256: str
    shape: list[int]  # the full shape: data's, or for a shard or a box the shape of the tensor it was cut from
    shard: list[int] | None = None  # [q, d]: data is shard q of d (NOTE [sharded saves])
    box: Box | None = None  # data is this box of a DTensor (NOTE [tensor-parallel saves])

    def manifest(self) -> Manifest:
        """What the other ranks learn of it."""
        box = None if self.box is None else [list(self.box.offset), list(self.box.shape)]
        return Manifest(self.where, self.stage, CODES[self.data.dtype], self.shape, self.sha256, self.shard, box)

    @property
    def piece(self) -> Piece:
        return self.manifest().piece


def _collect(
    kind: str, trees: Sequence[PyTree], stages: Sequence[int], sharding: Sharding | None, ranks: Ranks
) -> dict[str, _Tensor]:
    """The tensors of ``stages`` by name, each tied name once (NOTE [names]); a DTensor's local
    piece with its box (NOTE [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``)."""
    out: dict[str, _Tensor] = {}
    for s in stages:
        names, codes, leaves, _ = leaves_with_names(trees[s])
        full = {} if sharding is None else full_shapes("fpipe.save", kind, trees[s], sharding.layouts[s])
        for parts, code, leaf in zip(names, codes, leaves):
            if leaf is None:
                continue
            if not parts and isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"fpipe.save: {kind}[{s}] is a tensor, not a pytree of named tensors, so it has no name. "
                    f"Put it in a dict: {kind}[{s}] = {{'w': tensor}}."
                )
            tensor = _tensor(".".join(parts), f"{kind}[{s}]{code}", s, leaf, ranks)
            if tensor.name in full:
                assert sharding is not None
                _as_shard(tensor, full[tensor.name], sharding)
            other = out.get(tensor.name)
            if other is None:
                out[tensor.name] = tensor
            elif other.stage == s:
                raise ValueError(
                    f"fpipe.save: {other.where} and {tensor.where} both get the name {tensor.name!r} (names are "
                    "key paths joined by '.'). Rename a key so that every name in a stage is unique."
                )
            else:
                check_tie(tensor.name, other.manifest(), tensor.manifest())
    return out


def _tensor(name: str, where: str, stage: int, leaf: Any, ranks: Ranks) -> _Tensor:
    box = None
    if is_piece(leaf):
        tensor_ranks = None if ranks.topology is None else ranks.topology.tensor_ranks
        expert_ranks = None if ranks.ep is None or ranks.topology is None else ranks.topology.expert_ranks
        if tensor_ranks is None and expert_ranks is None:
            raise ValueError(
                f"fpipe.save: {where} is a DTensor but the save has no tensor-parallel dimension nor an "
                "expert-parallel one. Pass parallel=step (or fpipe.Parallelism(mesh=mesh)) with a 'tp' dimension, "
                "on whose sub-mesh mesh['tp'] the DTensors live (or an 'ep' one, for expert weights on mesh['ep'])."
            )
        box = box_of("fpipe.save", where, leaf, tensor_ranks, expert_ranks)
        shape = list(leaf.shape)
        leaf = leaf.local if isinstance(leaf, HostPiece) else local(leaf)
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"fpipe.save: {where} is a {type(leaf).__name__}, not a tensor. Only tensors are saved: make it one "
            "(a step counter as torch.tensor(step)) or put it in metadata=."
        )
    if leaf.layout != torch.strided or leaf.device.type == "meta":
        raise TypeError(
            f"fpipe.save: {where} is a {leaf.layout} tensor on {leaf.device}; save dense tensors with data."
        )
    if name == "__metadata__":
        raise ValueError(
            f"fpipe.save: {where} gets the name '__metadata__', which safetensors reserves for its header (the "
            "file could not be read back). Rename its key."
        )
    if leaf.dtype not in CODES:
        raise TypeError(
            f"fpipe.save: {where} has dtype {leaf.dtype}, which safetensors cannot store. Convert it "
            "(a complex128 tensor as torch.view_as_real(x))."
        )
    data = leaf.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    return _Tensor(name, where, stage, data, sha256(data), list(data.shape) if box is None else shape, box=box)


def _as_shard(tensor: _Tensor, full: Full, sharding: Sharding) -> None:
    """Mark ``tensor`` as this rank's shard of ``full`` (a tensor, or a box of a DTensor), which it must be."""
    size = full.size(sharding.shard)
    if list(tensor.data.shape) != [size]:
        piece = "" if full.box is None else f"the local piece (shape {list(full.box.shape)}) of "
        raise ValueError(
            f"fpipe.save: {tensor.where} should be this rank's shard of {piece}a tensor of shape {full.shape}, a 1-D "
            f"tensor of {plural(size, 'element')} (got: shape {list(tensor.data.shape)}). Pass the shards step.shard "
            "returned (or updates of them), not full tensors."
        )
    tensor.shape, tensor.shard, tensor.box = full.shape, list(sharding.shard), full.box


def check_tie(name: str, a: Manifest, b: Manifest, ranks: str = "") -> None:
    """Two holders of ``name`` must agree bitwise (NOTE [names])."""
    if a.value != b.value:

        def show(m: Manifest) -> str:
            return f"{_dtype(m)}{m.shape} sha256 {m.sha256[:12]}"

        raise ValueError(
            f"fpipe.save: {a.where} and {b.where}{ranks} have the same name {name!r} but different values "
            f"({show(a)} vs {show(b)}). A name in several stages is a tied parameter, saved once, so its "
            "values must be bitwise equal; if they are different parameters, give them different key paths."
        )


def _dtype(m: Manifest) -> str:
    """``float32`` for a manifest of dtype code ``F32``."""
    return str(DTYPES[m.dtype]).removeprefix("torch.")


# --- The protocol -----------------------------------------------------------------------------


def _save_pipeline(
    root: Path,
    trees: dict[str, list[PyTree]],
    user: Any,
    stages: tuple[tuple[int, ...] | None, tuple[int, ...]],
    ranks: Ranks,
    sharding: Sharding | None,
) -> str:
    """Steps 1 to 4 of NOTE [the save protocol] on one writer; the committed version. ``stages``:
    the stages held here (``None``: the entries given) and those of them other ranks hold too."""
    (held, shared), me, num_stages = stages, ranks.writer, len(trees["params"])
    local: dict[str, dict[str, _Tensor]] = {}
    version, problem = None, None
    with contextlib.ExitStack() as lock:
        try:
            if held is None:
                held = tuple(s for s in range(num_stages) if any(t[s] is not None for t in trees.values()))
            for kind, kind_trees in trees.items():
                for s, tree in enumerate(kind_trees):
                    if s not in held and tree is not None:
                        raise ValueError(
                            f"fpipe.save: rank {me} holds stages {list(held)} but {kind}[{s}] is not None. "
                            "Pass None for the stages of other ranks."
                        )
            local = {kind: _collect(kind, kind_trees, held, sharding, ranks) for kind, kind_trees in trees.items()}
            if me == 0:  # NOTE [save concurrency] in fpipe/_saving/_directory.py: hold the lock until cleaned up
                root.mkdir(parents=True, exist_ok=True)
                lock.enter_context(locked(root, ranks.timeout))
                version = next_version(root)
                (root / f".tmp-{version}").mkdir()
        except (TypeError, ValueError, OSError) as error:
            problem = error
        my_files = {kind: file_name(kind, ranks.rank, ranks.size, ranks.coordinates) for kind in trees}
        mine: dict[str, Any] = {
            "version": version,
            "rank": ranks.rank,
            "replica": ranks.replica,
            "ep": ranks.ep,
            "tp": ranks.tp,
            "files": my_files,
            "num_stages": num_stages,
            "stages": list(held or ()),
            "shared": list(shared),
            "metadata": json.dumps(user, sort_keys=True),
            "manifest": {
                kind: {n: astuple(t.manifest()) for n, t in tensors.items()} for kind, tensors in local.items()
            },
        }
        try:
            # 1. Agree on names, owners and the version.
            statuses = agree(ranks, problem, mine, "naming their tensors")
            version = statuses[0]["version"]
            for st in statuses:  # the manifests, JSON lists on the way, back as Manifests
                st["manifest"] = {k: {n: Manifest(*m) for n, m in ms.items()} for k, ms in st["manifest"].items()}
            owners = _writers(statuses)
            # 2. Write the tensors this rank owns.
            tmp, files, problem = root / f".tmp-{version}", {}, None
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                for kind, tensors in local.items():
                    owned = {n: t.data for n, t in tensors.items() if owners[kind][n][t.piece] == me}
                    if owned:
                        files[my_files[kind]] = write_safetensors(tmp / my_files[kind], owned)
                fsync_directory(tmp)
            except OSError as error:
                problem = error
            written = agree(ranks, problem, {"files": files}, "writing their files")
            # 3. Rank 0 writes the index and commits; 4. every rank returns once it is committed.
            if me == 0:
                try:
                    commit(root, str(version), _index(statuses, written, owners, user))
                except OSError as error:
                    problem = error
            agree(ranks, problem, {}, "committing the save")
        except BaseException:
            if me == 0 and version is not None:
                shutil.rmtree(root / f".tmp-{version}", ignore_errors=True)
            raise
        return str(version)


def _writers(statuses: list[dict[str, Any]]) -> dict[str, dict[str, dict[Piece, int]]]:
    """Per kind, per name, each piece's writer: the lowest rank holding it. The same on every rank."""
    counts = [st["num_stages"] for st in statuses]
    if len(set(counts)) > 1:
        raise ValueError(f"fpipe.save: the ranks pass different numbers of stages (by rank: {counts}).")
    differ = [r for r, st in enumerate(statuses) if st["metadata"] != statuses[0]["metadata"]]
    if differ:
        raise ValueError(f"fpipe.save: rank(s) {differ} pass other metadata than rank 0. Pass the same on every rank.")
    holders: dict[int, set[int]] = {}
    for st in statuses:
        for s in st["stages"]:
            holders.setdefault(s, set()).add(st["rank"])
    shared = {s for st in statuses for s in st["shared"]}  # held by several ranks by the program: saved as ties
    twice = {s: sorted(rs) for s, rs in sorted(holders.items()) if len(rs) > 1 and s not in shared}
    if twice:
        raise ValueError(
            f"fpipe.save: stages are held by several ranks ({{stage: ranks}}: {twice}). Pass None elsewhere."
        )
    owners: dict[str, dict[str, dict[Piece, int]]] = {}
    for kind in statuses[0]["manifest"]:
        held: dict[str, list[tuple[Manifest, int]]] = {}
        for w, st in enumerate(statuses):
            for name, manifest in st["manifest"][kind].items():
                held.setdefault(name, []).append((manifest, w))
        owners[kind] = {}
        for name, copies in sorted(held.items()):
            shards = [c for c in copies if c[0].shard is not None]
            if shards and len(shards) < len(copies):
                whole_copy = next(c for c in copies if c[0].shard is None)
                (a, v), (b, w) = sorted([shards[0], whole_copy], key=lambda c: c[1])
                raise ValueError(_copies_differ(name, (a, statuses[v]), (b, statuses[w])))
            first: dict[Piece, tuple[Manifest, int]] = {}  # piece -> manifest, writer
            for manifest, w in copies:
                other, v = first.setdefault(manifest.piece, (manifest, w))
                if v == w:
                    continue
                if statuses[v]["rank"] == statuses[w]["rank"] and other.value != manifest.value:
                    raise ValueError(_copies_differ(name, (other, statuses[v]), (manifest, statuses[w])))
                check_tie(name, other, manifest, f" ({_writer(statuses[v])} and {_writer(statuses[w])})")
            _check_pieces(name, [(m, statuses[w]) for m, w in first.values()])
            owners[kind][name] = {piece: w for piece, (_, w) in sorted(first.items(), key=lambda item: _order(item[0]))}
    return owners


def _order(piece: Piece) -> tuple[Any, ...]:
    """Pieces in index order: boxes by offset, the shards of a box by ``q``."""
    box, q = (piece, 0) if isinstance(piece, Box) else piece
    return box.offset, box.shape, q


def _copies_differ(name: str, a: tuple[Manifest, dict[str, Any]], b: tuple[Manifest, dict[str, Any]]) -> str:
    """The error for copies of ``name`` that one rank's replicas (data- or tensor-parallel) hold differently."""
    (ma, sa), (mb, sb) = a, b
    if sa["ep"] != sb["ep"]:
        return (
            f"fpipe.save: {ma.where} differs between expert-parallel ranks ({_writer(sa)}: sha256 {ma.sha256[:12]}; "
            f"{_writer(sb)}: sha256 {mb.sha256[:12]}). A plain tensor is a dense weight, which the expert-parallel "
            "ranks hold as replicas (NOTE [experts are data-parallel for the dense weights]) and which ep rank 0 "
            "saves once, so every expert-parallel rank must hold the same bytes; make expert weights DTensors "
            "sharded over mesh['ep'] (fpipe.moe.distribute_experts)."
        )
    if (ma.shard is None) != (mb.shard is None) or sa["tp"] is None:
        return (
            f"fpipe.save: {ma.where} ({_writer(sa)}) and {mb.where} ({_writer(sb)}) "
            f"have the same name {name!r} but one is a shard and the other a whole tensor, or "
            "data-parallel replicas hold different whole tensors. Leaves of optimizer state are shards "
            "when they are 1-D, of a parameter's shard size, and named <prefix>.<parameter name> (NOTE "
            "[sharded saves]); other leaves are saved whole and must be the same on every replica."
        )
    return (
        f"fpipe.save: {ma.where} differs between tensor-parallel ranks ({_writer(sa)}: sha256 {ma.sha256[:12]}; "
        f"{_writer(sb)}: sha256 {mb.sha256[:12]}). A plain tensor or a Replicate DTensor is saved once, by "
        "tensor-parallel rank 0, so every tensor-parallel rank must hold the same bytes; make it a DTensor with a "
        "Shard placement if each rank holds its own part."
    )


def _check_pieces(name: str, pieces: list[tuple[Manifest, dict[str, Any]]]) -> None:
    """The pieces of ``name`` (whole tensors and DTensor boxes) must agree on dtype and full shape and
    cover it exactly once (NOTE [tensor-parallel saves])."""
    (first, at), *rest = pieces
    for m, st in rest:
        if (m.dtype, m.shape) != (first.dtype, first.shape):
            raise ValueError(
                f"fpipe.save: {first.where} ({_writer(at)}) and {m.where} ({_writer(st)}) have the same name {name!r} "
                f"but different dtypes or shapes ({_dtype(first)}{first.shape} vs {_dtype(m)}{m.shape}). A name in "
                "several stages is a tied parameter: give every copy the same dtype and shape."
            )
    boxes = [whole(m.shape) if m.box is None else Box(tuple(m.box[0]), tuple(m.box[1])) for m, _ in pieces]
    problem = tiling_problem(first.shape, list(dict.fromkeys(boxes)))  # (each box once: not its shards)
    if problem is not None:
        held = ", ".join(f"{m.where} ({_writer(st)})" for m, st in pieces)
        raise ValueError(
            f"fpipe.save: the pieces of {name!r} held by {held} do not cover its shape {first.shape} exactly once: "
            f"{problem}. A tied parameter must have the same placements in every stage that holds it (or be a plain "
            "tensor in all of them)."
        )


def _writer(status: dict[str, Any]) -> str:
    return (
        f"rank {status['rank']}"
        + (f" dp {status['replica']}" if status["replica"] else "")
        + (f" ep {status['ep']}" if status["ep"] else "")
        + (f" tp {status['tp']}" if status["tp"] else "")
    )


def _index(
    statuses: list[dict[str, Any]],
    written: list[dict[str, Any]],
    owners: dict[str, dict[str, dict[Piece, int]]],
    user: Any,
) -> dict[str, Any]:
    entries: dict[str, dict[str, Entry]] = {}
    for kind, kind_owners in owners.items():
        entries[kind] = {}
        for name, writers in kind_owners.items():
            pieces = [statuses[w]["manifest"][kind][name] for w in writers.values()]
            boxes = tuple(p if isinstance(p, Box) else p[0] for p in writers)
            entries[kind][name] = Entry(
                tuple(statuses[w]["files"][kind] for w in writers.values()),
                pieces[0].dtype,
                pieces[0].shape,
                tuple(m.sha256 for m in pieces),
                pieces[0].shard is not None,
                None if all(box == whole(pieces[0].shape) for box in boxes) else boxes,
                1 if pieces[0].shard is None else pieces[0].shard[1],
            )
    files = {
        file: {
            "bytes": nbytes,
            "rank": st["rank"],
            **({"replica": st["replica"]} if "-dp-" in file else {}),
            **({"ep": st["ep"]} if "-ep-" in file else {}),
            **({"tp": st["tp"]} if "-tp-" in file else {}),
        }
        for st, w in zip(statuses, written)
        for file, nbytes in w["files"].items()
    }
    return make_index(entries, files, statuses[0]["num_stages"], user)
