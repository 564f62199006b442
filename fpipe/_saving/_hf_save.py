"""``fpipe.save_hf``: parameters written as a Hugging Face checkpoint directory.

NOTE [Hugging Face export]
The directory is what ``save_pretrained`` writes and ``from_pretrained`` reads::

    directory/
      model-00001-of-00003.safetensors     written by pipeline rank 0 (its stages, in name order)
      model-00002-of-00003.safetensors     rank 0 again, past max_shard_size
      model-00003-of-00003.safetensors     rank 1
      model.safetensors.index.json         {"metadata": {"total_size": ...}, "weight_map": {name: file}}
      config.json                          copied from config=, when given

Names are NOTE [names] in ``fpipe/_saving/_save.py`` (split_module's params: ``state_dict``
names). A name held by several stages (a tied embedding) must be bitwise equal everywhere and is
written once, by the lowest rank holding it; ``lm_head.weight`` of a tied model is not in
split_module's params, so it is not written, as ``save_pretrained`` leaves it out.

The protocol, on each pipeline rank (one process: one rank, the all-gathers are no-ops):

1. Name and hash the local tensors; all-gather the manifests (dtype, shape, sha256) and rank 0's
   temporary directory ``.<directory name>.tmp-<random>`` next to ``directory``. Every rank
   computes the same writers' files: each name's writer, and each writer's names cut into files of at most
   ``max_shard_size`` bytes (a larger tensor gets a file of its own), numbered across ranks.
2. Each rank writes its files into the temporary directory; all-gather the outcome.
3. Rank 0 writes the index and ``config.json``, fsyncs, and renames the temporary directory to
   ``directory`` (which must not exist, or be empty): a failed or killed export leaves no partial
   checkpoint there. A last all-gather, so every rank returns once it is in place.

NOTE [tensor-parallel export]
Hugging Face files hold whole tensors, so on a mesh with a ``"tp"`` dimension each DTensor leaf
is gathered (``full_tensor()``, an all-gather over the tensor-parallel group) one at a time, in
leaf order, and moved to the host at once: the device holds at most one full tensor beyond the
local pieces, and tensor-parallel rank 0 keeps the host copies and writes them, as the protocol
above (its writers among the tensor-parallel rank 0 of each pipeline rank); the other
tensor-parallel ranks drop theirs and wait for it, as data-parallel replicas do. Before the first
gather every rank all-gathers a description of its leaves (where, DTensor or not, shape, dtype,
and the sha256 of each plain tensor, which only rank 0 writes), so a DTensor on the wrong mesh
or with a ``Partial`` placement, or tensor-parallel ranks holding different leaves, fail every
rank before any gather that would not match. With ``shard_params=True`` too, each stage is first
gathered over the data-parallel group into its DTensors (their local pieces), then over tp.
Expert weights (DTensors on ``mesh["ep"]``) are gathered the same way, first, over the
expert-parallel group, whose ranks hold the same stages; the first replica writes them.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._distributed import Topology, one_writes, watched
from .._parallelism import Parallelism
from .._pytree import PyTree, flatten, leaves_with_names, stage_list, unflatten
from .._sharding import ParallelView, gather
from .._tensor_parallel import is_dtensor
from ._boxes import box_of
from ._directory import fsync_directory, write_atomic
from ._hf_load import HF_INDEX
from ._ranks import Ranks, agree, check_stage_count, resolve
from ._store import CODES, DTYPES, sha256, write_safetensors

_SIZE = re.compile(r"\s*(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*")
_UNITS = {
    None: 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


def save_hf(
    directory: str | os.PathLike[str],
    params: Sequence[PyTree],
    /,
    *,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    parallel: Parallelism | ParallelView | None = None,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> Path:
    """Write parameters as a Hugging Face checkpoint directory that ``from_pretrained`` loads.

    Safetensors files named ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``, tensors under their names (NOTE [names] in
    ``fpipe/_saving/_save.py``: ``split_module``'s params are keyed by ``state_dict`` names), each
    rank writing its own stages; the directory appears whole or not at all (NOTE [Hugging Face
    export] in ``fpipe/_saving/_hf_save.py``).

    Args:
        directory: the checkpoint directory to create. It must not exist, or be empty; its
            parent must exist and, with several ranks, be on a filesystem they share.
        params: one pytree per stage, ``None`` for stages of other ranks; leaves are dense tensors
            (any device) or ``None`` (skipped). A name in several stages (a tied parameter) must
            be bitwise equal and is written once.
        config: what to write as ``config.json``: a checkpoint directory holding one (its
            ``config.json`` and, if present, ``generation_config.json`` are copied), a path to a
            ``config.json``, a dict, or a ``transformers`` config (anything with ``to_dict()``).
            ``None``: no config (``from_pretrained`` then needs ``config=``).
        max_shard_size: the most bytes of tensors per file, an int or a string such as ``"5GB"``
            or ``"100MiB"``; a larger tensor gets a file of its own.
        parallel: export from many processes, as ``fpipe.save`` (the ``Step``, or an
            ``fpipe.Parallelism``, whose ``timeout`` is the seconds a rank waits for the others
            at each all-gather): every pipeline rank
            calls ``save_hf`` with the same arguments and writes only its stages; data-parallel
            replicas other than the first write nothing. With a step built with
            ``shard_params=True`` (``parallel=step``), ``params`` are this rank's shards: each local stage is gathered
            whole (one at a time, a collective over the data-parallel ranks) and the first replica
            writes it.
            On a mesh with a ``"tp"`` dimension, leaves may be DTensors on ``mesh["tp"]`` with
            ``Shard`` or ``Replicate`` placements: each is gathered whole to tensor-parallel rank
            0, one at a time, which writes it (NOTE [tensor-parallel export]); plain tensors must
            be bitwise equal on every tensor-parallel rank.
            On a mesh with an ``"ep"`` dimension, expert weights (DTensors ``Shard(0)`` on
            ``mesh["ep"]``) are gathered whole over the expert-parallel group, one at a time, and
            the first replica (ep 0) writes them with the rest.
        step: deprecated, as for ``fpipe.save``: ``parallel=``.
        group: deprecated, as for ``fpipe.save``: ``parallel=``.
        mesh: deprecated, as for ``fpipe.save``: ``parallel=``.
        timeout: deprecated, as for ``fpipe.save``: ``parallel=``.

    Returns:
        ``Path(directory)``.

    Conceptually, on one process, this is::

        tensors = {name: leaf for stage in params for name, leaf in named_leaves(stage)}
        safetensors.torch.save_file(tensors, f"{directory}/model.safetensors")   # cut by max_shard_size
        json.dump(config, open(f"{directory}/config.json", "w"))

    With ``transformers`` installed, after training ``split_module``'s params of ``model``::

        fpipe.save_hf("out", params, config=model.config)
        LlamaForCausalLM.from_pretrained("out")

    Raises:
        TypeError: a leaf is neither a tensor nor ``None``, or a DTensor with a ``Partial``
            placement; a bad ``config`` or ``max_shard_size``.
        ValueError: ``directory`` exists and is not empty; two leaves of a stage share a name; a
            tied name has different values; stages held by several ranks; a DTensor not on the
            mesh's ``"tp"`` sub-mesh, or tensor-parallel ranks holding different leaves.
        OSError: writing failed (nothing is left at ``directory``).
        RuntimeError: another rank failed; its own error says why.
    """
    trees = stage_list("fpipe.save_hf", "params", params)
    limit = _shard_size(max_shard_size)
    config_files = _config_files(config)
    setup = resolve("save_hf", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
    topology, held, timeout = setup.topology, setup.held, setup.timeout
    check_stage_count("save_hf", trees, setup.step)
    if setup.step is not None and setup.step.parallel.shard_params:
        trees = _gathered(trees, setup.step)
    root = Path(directory)
    if topology is not None and topology.expert_group is not None:
        trees = _experts_whole(trees, topology, timeout)
    tensor_group = None if topology is None else topology.tensor_group
    if topology is None or tensor_group is None:
        _replicas(root, trees, held, config_files, limit, Ranks("save_hf", topology, timeout))
        return root
    # NOTE [tensor-parallel export]: tensor-parallel rank 0 gathers each DTensor and writes; the others wait.
    first = dist.get_rank(tensor_group) == 0
    if Ranks("save_hf", topology, timeout).replica == 0:  # the other replicas write nothing: they only wait
        trees = _whole(trees, topology, timeout)
    ranks = Ranks("save_hf", topology, timeout, tensor_parallel=False)  # tensor-parallel rank 0's: pp x dp
    write = (lambda: _replicas(root, trees, held, config_files, limit, ranks)) if first else None
    waits, tells = "the export of tensor-parallel rank 0", "the other tensor-parallel ranks"
    if not one_writes(topology, tensor_group, write, timeout, waits, tells).ok:
        raise RuntimeError("fpipe.save_hf: tensor-parallel rank 0 failed to export; its own error says why.")
    return root


def _replicas(
    root: Path,
    trees: list[PyTree],
    held: tuple[int, ...] | None,
    config_files: dict[str, bytes],
    limit: int,
    ranks: Ranks,
) -> None:
    """The export by the first data-parallel replica, which the others wait for."""
    group = None if ranks.topology is None or not ranks.replicas else ranks.topology.data_group
    write = None if ranks.replica != 0 else lambda: _export(root, trees, held, config_files, limit, ranks)
    waits, tells = "the export of the first replica", "the other data-parallel replicas"
    if not one_writes(ranks.topology, group, write, ranks.timeout, waits, tells).ok:
        raise RuntimeError("fpipe.save_hf: the first data-parallel replica failed to export; its own error says why.")


def _whole(trees: list[PyTree], topology: Topology, timeout: float) -> list[PyTree]:
    """The trees with each DTensor gathered whole on tensor-parallel rank 0, one at a time (NOTE
    [tensor-parallel export]); every stage ``None`` on the other tensor-parallel ranks.

    Before any gather, the ranks agree (an error on one raises on all): each DTensor must live on
    the tensor-parallel sub-mesh with ``Shard`` or ``Replicate`` placements, and the ranks of a
    tensor-parallel group must hold the same names, DTensors and plain tensors alike, with the same
    bytes for the plain ones (which only rank 0 writes).
    """
    ranks = Ranks("save_hf", topology, timeout)  # every pipeline and tensor-parallel rank
    mine: list[list[Any]] = []
    problem = None
    try:
        for s, tree in enumerate(trees):
            _, codes, leaves, _ = leaves_with_names(tree)
            for code, leaf in zip(codes, leaves):
                where = f"params[{s}]{code}"
                if is_dtensor(leaf):
                    box_of("fpipe.save_hf", where, leaf, topology.tensor_ranks)
                    mine.append([where, "DTensor", list(leaf.shape), str(leaf.dtype)])
                elif isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.device.type != "meta":
                    data = leaf.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
                    mine.append([where, "Tensor", list(leaf.shape), str(leaf.dtype), sha256(data)])
    except (TypeError, ValueError) as error:
        problem = error
    statuses = agree(ranks, problem, {"leaves": mine}, "checking their DTensors")
    size = dist.get_world_size(topology.tensor_group)
    for p in range(0, len(statuses), size):
        group = [st["leaves"] for st in statuses[p : p + size]]
        for t, leaves in enumerate(group[1:], 1):
            if leaves != group[0]:
                k = next((k for k, (x, y) in enumerate(zip(group[0], leaves)) if x != y), len(group[0]))
                a, b = (_leaf(x[k]) if k < len(x) else "no more leaves" for x in (group[0], leaves))
                raise ValueError(
                    f"fpipe.save_hf: the tensor-parallel ranks of pipeline rank {p // size} hold different leaves "
                    f"(rank {ranks.name(p)}: {a}; rank {ranks.name(p + t)}: {b}). Every tensor-parallel rank passes "
                    "the same names, with DTensors where the others have them, and the same bytes for plain tensors, "
                    "which tensor-parallel rank 0 writes."
                )
    first = dist.get_rank(topology.tensor_group) == 0
    out: list[PyTree] = []
    with watched(topology, timeout, "the tensor-parallel gathers of the DTensors"):
        for tree in trees:
            leaves, spec = flatten(tree)
            whole = []
            for leaf in leaves:
                if is_dtensor(leaf):  # a collective over the tensor-parallel group; one full tensor at a time
                    full = leaf.full_tensor()  # type: ignore[attr-defined]
                    leaf = full.detach().to("cpu") if first else None
                whole.append(leaf if first else None)
            out.append(unflatten(spec, whole) if first else None)
    return out


def _experts_whole(trees: list[PyTree], topology: Topology, timeout: float) -> list[PyTree]:
    """The trees with each expert weight (a DTensor on this rank's ``mesh["ep"]``) gathered whole over
    the expert-parallel group, one at a time, in leaf order (NOTE [tensor-parallel export]): kept on
    the host by the first replica (dp 0, ep 0), which writes, and dropped by the other ranks, which
    wait for it. Every rank of an expert group holds the same stages, so the gathers pair up."""
    first = dist.get_rank(topology.data_group) == 0 if topology.data_group is not None else True
    out: list[PyTree] = []
    with watched(topology, timeout, "the expert-parallel gathers of the expert weights"):
        for tree in trees:
            leaves, spec = flatten(tree)
            whole = []
            for leaf in leaves:
                if topology.is_expert(leaf):  # a collective over mesh["ep"]; one full tensor at a time
                    full = leaf.full_tensor()  # type: ignore[attr-defined]
                    leaf = full.detach().to("cpu") if first else None
                whole.append(leaf)
            out.append(unflatten(spec, whole))
    return out


def _gathered(trees: list[PyTree], step: ParallelView) -> list[PyTree]:
    """The full stages of a step built with ``shard_params=True``, gathered one at a time from the
    data-parallel ranks' shards (NOTE [shard layout] in ``fpipe/_sharding/_stages.py``)."""
    missing = [s for s in step.local_stages if s not in step.shard_layouts or trees[s] is None]
    if missing:
        raise ValueError(
            f"fpipe.save_hf: the step shards parameters but has no shards or no layout for stage(s) {missing}. "
            "Pass the shards step.shard(params) returned (or updates of them)."
        )
    out = list(trees)
    for s in step.local_stages:
        layout = step.shard_layouts[s]
        likes: list[Any] = []
        for leaf in layout.leaves:  # a DTensor parameter's shards gather into its local piece, wrapped
            if leaf is None:
                likes.append(None)
                continue
            meta = torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
            likes.append(meta if leaf.dtensor is None else leaf.dtensor.wrap(meta))
        like = unflatten(layout.spec, likes)
        out[s] = gather(trees[s], like, step)
    return out


def _leaf(x: list[Any]) -> str:
    """A leaf as ``_whole`` describes it, for a message: ``params[0]['w']: a Tensor float64[3] sha256 1a2b...``."""
    where, kind, shape, dtype, *digest = x
    return f"{where}: a {kind} {str(dtype).removeprefix('torch.')}{shape}" + "".join(
        f" sha256 {d[:12]}" for d in digest
    )


def _shard_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) <= 0:
        raise TypeError(
            f"fpipe.save_hf: max_shard_size must be a number of bytes > 0 or a string such as '5GB' or '100MiB' "
            f"(max_shard_size: {value!r})."
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def _config_files(config: Any) -> dict[str, bytes]:
    """The files ``config`` stands for, by name, read now (before anything is written)."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(
                    f"fpipe.save_hf: config names a directory without config.json (config: {path})."
                )
            extra = ["generation_config.json"] if (path / "generation_config.json").is_file() else []
            return {name: (path / name).read_bytes() for name in ["config.json", *extra]}
        return {"config.json": path.read_bytes()}
    if hasattr(config, "to_json_string"):  # a transformers PretrainedConfig: its own serialization
        return {"config.json": str(config.to_json_string(use_diff=False)).encode()}
    value = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(value, dict):
        raise TypeError(
            "fpipe.save_hf: config must be a checkpoint directory, a path to a config.json, a dict or a transformers "
            f"config (config: {type(config).__name__})."
        )
    try:
        return {"config.json": json.dumps(value, indent=2, sort_keys=True).encode()}
    except (TypeError, ValueError) as error:
        raise TypeError(f"fpipe.save_hf: config must be JSON-serializable ({error}).") from error


def _local(trees: Sequence[PyTree], held: tuple[int, ...]) -> dict[str, tuple[str, torch.Tensor]]:
    """``name -> (where, contiguous CPU tensor)`` of this rank's stages, tied names once."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for s in held:
        seen: dict[str, str] = {}
        names, codes, leaves, _ = leaves_with_names(trees[s])
        for parts, code, leaf in zip(names, codes, leaves):
            where = f"params[{s}]{code}"
            if leaf is None:
                continue
            if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided or leaf.device.type == "meta":
                raise TypeError(
                    f"fpipe.save_hf: {where} is a {type(leaf).__name__}"
                    f"{f' on {leaf.device}' if isinstance(leaf, torch.Tensor) else ''}; leaves are dense tensors "
                    "with data, or None."
                )
            if leaf.dtype not in CODES:
                raise TypeError(f"fpipe.save_hf: {where} has dtype {leaf.dtype}, which safetensors cannot store.")
            if not parts:
                raise TypeError(f"fpipe.save_hf: params[{s}] is a tensor, not a pytree of named tensors.")
            name = ".".join(parts)
            if name == "__metadata__":
                raise ValueError(
                    f"fpipe.save_hf: {where} gets the name '__metadata__', which safetensors reserves for its header. "
                    "Rename its key."
                )
            if name in seen:
                raise ValueError(
                    f"fpipe.save_hf: {seen[name]} and {where} both get the name {name!r} (names are key paths "
                    "joined by '.'). Rename a key so that every name in a stage is unique."
                )
            seen[name] = where
            data = leaf.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
            if name in out and not _same(out[name][1], data):
                raise ValueError(_untied(name, out[name][0], where))
            out.setdefault(name, (where, data))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and sha256(a) == sha256(b)


def _untied(name: str, a: str, b: str) -> str:
    return (
        f"fpipe.save_hf: {a} and {b} have the same name {name!r} but different values. A name in several stages is "
        "a tied parameter, written once, so its values must be bitwise equal (fpipe.sum_tied sums their gradients)."
    )


def _export(
    root: Path,
    trees: list[PyTree],
    held: tuple[int, ...] | None,
    config_files: dict[str, bytes],
    limit: int,
    ranks: Ranks,
) -> None:
    """Steps 1 to 3 of NOTE [Hugging Face export] on one pipeline rank."""
    tmp, local, problem = None, {}, None
    try:
        if held is None:
            held = tuple(s for s, tree in enumerate(trees) if tree is not None)
        for s, tree in enumerate(trees):
            if s not in held and tree is not None:
                raise ValueError(
                    f"fpipe.save_hf: rank {ranks.rank} holds stages {list(held)} but params[{s}] is not None. "
                    "Pass None for the stages of other ranks."
                )
        local = _local(trees, held)
        if ranks.rank == 0:
            if root.exists() and (not root.is_dir() or any(root.iterdir())):
                raise ValueError(
                    f"fpipe.save_hf: {root} exists and is not an empty directory. Export to a new directory, or "
                    "remove it first."
                )
            root.parent.mkdir(parents=True, exist_ok=True)
            tmp = root.parent / f".{root.name}.tmp-{secrets.token_hex(4)}"
            tmp.mkdir()
    except (TypeError, ValueError, OSError) as error:
        problem = error
    manifest = {name: [CODES[t.dtype], list(t.shape), sha256(t), where] for name, (where, t) in local.items()}
    mine = {"tmp": None if tmp is None else tmp.name, "stages": list(held or ()), "manifest": manifest}
    try:
        # 1. Agree on the writers and their files.
        statuses = agree(ranks, problem, mine, "naming their tensors")
        tmp = root.parent / str(statuses[0]["tmp"])
        files = _writer_files(statuses, limit)
        # 2. Write this rank's files.
        problem = None
        try:
            for file, names in files[ranks.rank].items():
                write_safetensors(tmp / file, {name: local[name][1] for name in names})
        except OSError as error:
            problem = error
        agree(ranks, problem, {}, "writing their files")
        # 3. Rank 0 writes the index and config, and puts the directory in place.
        if ranks.rank == 0:
            try:
                weight_map = {
                    name: file for rank_files in files for file, names in rank_files.items() for name in names
                }
                total = sum(DTYPES[m[0]].itemsize * math.prod(m[1]) for st in statuses for m in st["manifest"].values())
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                write_atomic(tmp / HF_INDEX, json.dumps(index, indent=2).encode())
                for name, data in config_files.items():
                    write_atomic(tmp / name, data)
                os.replace(tmp, root)
                fsync_directory(root.parent)
            except OSError as error:
                problem = error
        agree(ranks, problem, {}, "putting the checkpoint in place")
    except BaseException:
        if ranks.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _writer_files(statuses: list[dict[str, Any]], limit: int) -> list[dict[str, list[str]]]:
    """Per rank, its files and their names: each name written by the lowest rank holding it, each
    rank's names cut into files of at most ``limit`` bytes, numbered across ranks. The same on every rank."""
    holders: dict[int, list[int]] = {}
    for r, st in enumerate(statuses):
        for s in st["stages"]:
            holders.setdefault(s, []).append(r)
    twice = {s: rs for s, rs in sorted(holders.items()) if len(rs) > 1}
    if twice:
        raise ValueError(
            f"fpipe.save_hf: stages are held by several ranks ({{stage: ranks}}: {twice}). Pass None elsewhere."
        )
    first: dict[str, tuple[int, list[Any]]] = {}
    chunks: list[list[list[str]]] = [[] for _ in statuses]
    sizes: list[int] = [0 for _ in statuses]
    for r, st in enumerate(statuses):
        for name, m in sorted(st["manifest"].items()):
            if name in first:
                other_rank, other = first[name]
                if other[:3] != m[:3]:
                    raise ValueError(_untied(name, f"{other[3]} (rank {other_rank})", f"{m[3]} (rank {r})"))
                continue
            first[name] = (r, m)
            nbytes = DTYPES[m[0]].itemsize * math.prod(m[1])
            if not chunks[r] or (sizes[r] + nbytes > limit and chunks[r][-1]):
                chunks[r].append([])
                sizes[r] = 0
            chunks[r][-1].append(name)
            sizes[r] += nbytes
    total = sum(len(c) for c in chunks)
    out: list[dict[str, list[str]]] = []
    number = 0
    for rank_chunks in chunks:
        out.append({})
        for names in rank_chunks:
            number += 1
            out[-1][f"model-{number:05d}-of-{total:05d}.safetensors"] = names
    return out
