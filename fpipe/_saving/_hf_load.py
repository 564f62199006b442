"""``fpipe.load_hf``: a Hugging Face checkpoint directory read into one rank's stages.

NOTE [Hugging Face checkpoints]
A Hugging Face checkpoint directory holds ``model.safetensors``, or shards
``model-00001-of-0000n.safetensors`` with ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {name: file}}``), plus ``config.json``. Names are the
model's ``state_dict`` names, which are the keys of ``fpipe.split_module``'s per-stage params
(NOTE [names] in ``fpipe/_saving/_save.py``: a leaf's key path joined by ``.``), so a template
of split_module's params is matched name by name.

What a rank reads: only the names its template holds. Each needed file is opened once with
``safetensors.safe_open`` (a memory map: nothing is read until asked for); a whole tensor is
``get_tensor``, and a shard of a step built with ``shard_params=True`` (NOTE [shard layout] in
``fpipe/_sharding/_stages.py``: elements ``[q * c, (q + 1) * c)`` of the flattened tensor) is read
with ``get_slice`` as at most two partial rows per dimension and one block of whole rows
(``read_range``), so exactly the shard's bytes are touched, then zero-padded to ``c``.

Tied weights: ``save_pretrained`` leaves out a weight tied to another (``lm_head.weight`` when
``tie_word_embeddings``), and ``split_module`` names a tied parameter by its first name
(``model.embed_tokens.weight``) in every stage that uses it, so neither side has the second name.
A name in several stages of a template is read once and copied. Some checkpoints store the tied
weight under both names: when ``config.json`` says ``"tie_word_embeddings": true``, a name of
the checkpoint that no template has and that is a word embedding (``vocab_size`` rows) is read by
each rank holding a leaf of its dtype and shape (its possible partners: the input embedding), the
same part as that leaf (its box, its shard), and compared bitwise;
the ranks all-gather the verdicts, and the name is accepted when it equals one partner
everywhere they were compared, else ``strict`` raises naming both (a duplicate that differs) or
it (a name without a partner).

DTensor leaves (a template of stages whose modules torch's ``parallelize_module`` cut, or made
with ``distribute_tensor``; on the meta device too) read only their box: ``get_slice`` with one
slice per dimension (NOTE [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``), and come back
as DTensors with the template leaf's mesh and placements.

The checkpoint is trusted no more than an fpipe save (NOTE [trust model] in
``fpipe/_saving/_store.py``): the index must be JSON of the expected shape, every file it names a
plain ``.safetensors`` name resolving inside the directory, and pickled checkpoints
(``pytorch_model.bin``) are refused, never unpickled.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import safetensors
import torch

from .._distributed import tensor_bytes
from .._parallelism import Parallelism
from .._pytree import PyTree, stage_list
from .._sharding import ParallelView, cut_range
from ._boxes import Box, whole
from ._directory import inside
from ._index import is_plain
from ._ranks import Ranks, Sharding, agree, resolve, sharded_leaves
from ._store import DTYPES, Part, safe_open
from ._template import Use, dtype_name, fill, listing, template_uses

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def load_hf(
    directory: str | os.PathLike[str],
    template: Sequence[PyTree],
    /,
    *,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    parallel: Parallelism | ParallelView | None = None,
    step: Any = None,
    group: Any = None,
    mesh: Any = None,
    timeout: float | None = None,
) -> list[PyTree]:
    """Load a Hugging Face checkpoint directory into the layout of ``template``, reading only its tensors.

    Each rank reads only the tensors its template names, from memory-mapped safetensors files
    (with ``shard_params=True``, only its shard's bytes of each), NOTE [Hugging Face checkpoints]
    in ``fpipe/_saving/_hf_load.py``.

    Args:
        directory: a directory with ``model.safetensors`` or ``model.safetensors.index.json`` and
            the files it names, as ``save_pretrained`` (or ``fpipe.save_hf``) writes.
        template: one pytree per stage, ``None`` for the stages this rank does not hold; leaves
            are tensors named as the checkpoint names them (the params of ``fpipe.split_module``,
            keyed by ``state_dict`` names), giving the expected shape and dtype and the device of
            the result (``device="meta"`` loads to the CPU: nothing is allocated before loading),
            or ``None`` (kept). With a step built with ``shard_params=True`` (``parallel=step``), the template is this
            rank's shards (``step.shard`` of meta tensors of the full shapes; of a DTensor, a
            shard of its local piece, whose bytes alone are read). A DTensor leaf
            (``Shard`` or ``Replicate``, from ``parallelize_module`` or ``distribute_tensor``,
            on the meta device too) reads only its local piece's bytes and comes back as a
            DTensor with its mesh and placements.
        dtype: convert the checkpoint's floating-point tensors to this dtype (a bfloat16 checkpoint
            into a float32 model); the template's floating leaves must then have it. ``None``: the
            dtypes must match.
        strict: names of the checkpoint that no stage of the template has (on any rank, when
            distributed) are an error, but for a word embedding stored under its tied name too
            (``lm_head.weight`` with ``"tie_word_embeddings": true`` in ``config.json``), accepted
            when bitwise equal to the template's (NOTE [Hugging Face checkpoints]);
            ``strict=False`` ignores them all. Names of the template missing from the checkpoint
            are always an error.
        parallel: when distributed, the ranks whose templates together cover the checkpoint
            (as in ``fpipe.load``: the ``Step``, needed for sharded templates, or an
            ``fpipe.Parallelism``, whose ``timeout`` is the seconds a rank waits for the others
            while gathering names).
        step: deprecated, as for ``fpipe.load``: ``parallel=``.
        group: deprecated, as for ``fpipe.load``: ``parallel=``.
        mesh: deprecated, as for ``fpipe.load``: ``parallel=``.
        timeout: deprecated, as for ``fpipe.load``: ``parallel=``.

    Returns:
        The template's structure with new tensors (not requiring grad; a name in several stages
        gives each stage its own copy).

    Conceptually, on one process, this is::

        tensors = {}
        for file in set(index["weight_map"].values()):
            tensors.update(safetensors.torch.load_file(file))
        params = [{name: tensors[name].to(dtype) for name in stage} for stage in template]

    but each rank reads only its own names (and shards).

    On each rank of a 2-rank pipeline::

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig.from_pretrained(path))
        stages, template = fpipe.split_module(model, ["model.embed_tokens + model.layers[0:2]", ...])
        params = fpipe.load_hf(path, [template[0], None], parallel=step)  # this rank holds stage 0

    Raises:
        FileNotFoundError: ``directory`` holds no safetensors checkpoint.
        TypeError: a template leaf is neither a tensor nor ``None``.
        ValueError: a pickled checkpoint, a malformed index or file, names missing or (with
            ``strict``) unexpected, a tied duplicate that differs from its partner, or a shape or
            dtype that differs (named with its key path, the value on disk and the expected one).
        RuntimeError: another rank failed (a file it found truncated or corrupt, say); its own
            error says why. Every rank raises, or none does.
    """
    trees = stage_list("fpipe.load_hf", "template", template)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"fpipe.load_hf: dtype must be a floating-point torch.dtype or None (dtype: {dtype!r}).")
    setup = resolve("load_hf", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
    ranks = Ranks("load_hf", setup.topology, setup.timeout)
    root, weight_map, wanted, vocab, problem = Path(directory), {}, {}, None, None
    try:
        sharding = sharded_leaves("load_hf", setup.step, {"params": trees})
        weight_map = read_weight_map(root)
        wanted = _wanted(root, weight_map, trees, sharding, dtype)
        vocab = _tied_vocabulary(root)
    except (TypeError, ValueError, OSError) as error:
        problem = error
    statuses = agree(ranks, problem, {"names": sorted(wanted)}, "reading their templates")
    everywhere = {name for st in statuses for name in st["names"]}
    extra = sorted(set(weight_map) - everywhere) if strict else []
    if extra and vocab is None:
        raise ValueError(_unexpected(root, extra, ranks))
    # A tied weight stored under both names (NOTE [Hugging Face checkpoints]): each unexpected
    # word embedding is read where a leaf of its dtype and shape is, and accepted if bitwise equal.
    tensors: dict[tuple[str, Part], torch.Tensor] = {}
    partners: dict[str, list[str]] = {}
    problem = None
    try:
        partners, duplicates = _duplicates(root, weight_map, wanted, extra, vocab)
        tensors = _read(root, {**wanted, **duplicates})
    except (ValueError, OSError) as error:
        problem, partners = error, {}
    # Agreed (a file one rank finds truncated or unreadable fails every rank, and none returns
    # its tensors), with the comparison of tied weights when there is one.
    if extra:
        equal = {e: {n: _same(tensors, e, n, wanted[n].uses) for n in found} for e, found in partners.items()}
        statuses = agree(ranks, problem, {"ties": equal}, "comparing tied weights")
        _check_duplicates(root, extra, [st["ties"] for st in statuses], ranks)
    else:
        agree(ranks, problem, {}, "reading their tensors")
    if dtype is not None:
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items() if k[0] in wanted}
    return fill(trees, {name: want.uses for name, want in wanted.items()}, tensors)


def _unexpected(root: Path, extra: list[str], ranks: Ranks) -> str:
    any_rank = " on any rank" if ranks.size > 1 else ""
    return (
        f"fpipe.load_hf: the checkpoint at {root} has {len(extra)} name(s) that no stage of the "
        f"template{any_rank} has: {listing([repr(n) for n in extra])}. Add them to the template, or pass "
        "strict=False to leave them out."
    )


# --- Tied duplicates --------------------------------------------------------------------------


def _tied_vocabulary(root: Path) -> int | None:
    """The vocabulary size of a checkpoint whose ``config.json`` says ``"tie_word_embeddings": true``
    (its tied weights are the word embeddings, ``vocab_size`` rows); ``None`` otherwise."""
    if not os.path.lexists(root / "config.json"):
        return None
    path = inside(root, "config.json")
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:
        raise ValueError(f"fpipe.load_hf: {path} is not JSON ({type(error).__name__}: {error}).") from None
    if not isinstance(config, dict) or config.get("tie_word_embeddings") is not True:
        return None
    vocab = config.get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _duplicates(
    root: Path, weight_map: dict[str, str], wanted: dict[str, _Want], extra: list[str], vocab: int | None
) -> tuple[dict[str, list[str]], dict[str, _Want]]:
    """For each unexpected word embedding (``vocab`` rows), the names of this rank's template with its
    dtype and shape (its possible tied partners), and what to read of it: the parts those leaves read."""
    headers: dict[str, dict[str, tuple[str, list[int]]]] = {}
    partners: dict[str, list[str]] = {}
    duplicates: dict[str, _Want] = {}
    for name in extra:
        file = weight_map[name]
        if file not in headers:
            headers[file] = _header(root, file)
        code, shape = headers[file].get(name, (None, None))
        found = [n for n, want in sorted(wanted.items()) if (want.code, want.shape) == (code, shape)]
        if found and code is not None and shape is not None and shape[:1] == [vocab]:
            partners[name] = found
            duplicates[name] = _Want(file, code, shape, [use for n in found for use in wanted[n].uses])
    return partners, duplicates


def _same(tensors: dict[tuple[str, Part], torch.Tensor], a: str, b: str, uses: list[Use]) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes in every part the leaves ``uses`` read."""
    return all(
        bytes(tensor_bytes(tensors[a, use.part].contiguous())) == bytes(tensor_bytes(tensors[b, use.part].contiguous()))
        for use in uses
    )


def _check_duplicates(root: Path, extra: list[str], ties: list[dict[str, dict[str, bool]]], ranks: Ranks) -> None:
    """Accept each unexpected name that equals a partner wherever they were compared; raise otherwise."""
    left = []
    for name in extra:
        compared: dict[str, list[tuple[int, bool]]] = {}
        for position, found in enumerate(ties):
            for partner, equal in found.get(name, {}).items():
                compared.setdefault(partner, []).append((position, equal))
        if any(all(equal for _, equal in results) for results in compared.values()):
            continue
        if compared:
            partner, results = next(iter(sorted(compared.items())))
            where = ranks.name(next(p for p, equal in results if not equal))
            raise ValueError(
                f"fpipe.load_hf: the checkpoint at {root} stores {name!r} as well as its tied partner {partner!r} "
                f"(config.json: tie_word_embeddings), with other values (compared on rank {where}). A tied weight has "
                f"one value: fix the checkpoint, or pass strict=False to leave {name!r} out."
            )
        left.append(name)
    if left:
        raise ValueError(_unexpected(root, left, ranks))


# --- The directory ----------------------------------------------------------------------------


def read_weight_map(root: Path) -> dict[str, str]:
    """``name -> file`` of the checkpoint in ``root``, checked (NOTE [Hugging Face checkpoints])."""
    if not root.is_dir():
        raise FileNotFoundError(f"fpipe.load_hf: {root} is not a directory. Pass a Hugging Face checkpoint directory.")
    if os.path.lexists(root / HF_INDEX):
        path = inside(root, HF_INDEX)
        try:
            index = json.loads(path.read_bytes())
        except (ValueError, RecursionError) as error:
            raise ValueError(f"fpipe.load_hf: {path} is not JSON ({type(error).__name__}: {error}).") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(
                f"fpipe.load_hf: {path} should be a JSON object whose 'weight_map' maps tensor names to file names "
                f"(weight_map: {_show(weight_map)}). Load an intact checkpoint."
            )
        for name, file in weight_map.items():
            if file.endswith(".bin"):
                raise ValueError(_pickled(root, file))
            if not is_plain(file):
                raise ValueError(
                    f"fpipe.load_hf: {path} names a file that is not a plain file name in the checkpoint directory "
                    f"(letters, digits, '_', '-' and '.', not first, ending in '.safetensors') "
                    f"(weight_map[{_show(name)}]: {_show(file)}). Load an intact checkpoint."
                )
        return dict(weight_map)
    if os.path.lexists(root / HF_SINGLE):
        return dict.fromkeys(_header(root, HF_SINGLE), HF_SINGLE)
    pickled = [name for name in _PICKLED if os.path.lexists(root / name)]
    if pickled:
        raise ValueError(_pickled(root, pickled[0]))
    raise FileNotFoundError(
        f"fpipe.load_hf: no Hugging Face safetensors checkpoint in {root} (neither {HF_SINGLE} nor {HF_INDEX}). "
        "Pass the directory save_pretrained wrote."
    )


def _pickled(root: Path, file: str) -> str:
    return (
        f"fpipe.load_hf: the checkpoint at {root} is pickled ({file}), and unpickling runs arbitrary code, so "
        "fpipe.load_hf does not read it. Convert it to safetensors once, where you trust it: "
        "model = AutoModelForCausalLM.from_pretrained(path); model.save_pretrained(new_path, safe_serialization=True)."
    )


def _header(root: Path, file: str) -> dict[str, tuple[str, list[int]]]:
    """``name -> (dtype code, shape)`` of every tensor in ``file``, from its header alone."""
    path = inside(root, file)
    if not path.is_file():
        raise ValueError(f"fpipe.load_hf: {path} is missing. Load an intact checkpoint.")
    try:
        with safe_open(path, "load_hf") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
            return {name: (piece.get_dtype(), list(piece.get_shape())) for name, piece in slices.items()}
    except safetensors.SafetensorError as error:
        raise ValueError(f"fpipe.load_hf: {path} is not a valid safetensors file ({error}).") from error


# --- What the template wants ------------------------------------------------------------------


class _Want(NamedTuple):
    """A name to read: its file, dtype code and full shape on disk, and the leaves it fills."""

    file: str
    code: str
    shape: list[int]
    uses: list[Use]


def _wanted(
    root: Path,
    weight_map: dict[str, str],
    trees: Sequence[PyTree],
    sharding: Sharding | None,
    dtype: torch.dtype | None,
) -> dict[str, _Want]:
    """Each name the template needs, with the leaves it fills, checked against the files' headers."""
    uses = template_uses("fpipe.load_hf", "params", trees, sharding)
    missing = [f"{name!r} ({found[0].where})" for name, found in sorted(uses.items()) if name not in weight_map]
    if missing:
        raise ValueError(
            f"fpipe.load_hf: {len(missing)} name(s) of the template are missing from the checkpoint at {root}: "
            f"{listing(missing)}. The checkpoint has {listing([repr(n) for n in sorted(weight_map)])}. "
            "Build the template from the same model (split_module's params are keyed by state_dict names)."
        )
    headers: dict[str, dict[str, tuple[str, list[int]]]] = {}
    wanted: dict[str, _Want] = {}
    mismatches = []
    for name, found in sorted(uses.items()):
        file = weight_map[name]
        if file not in headers:
            headers[file] = _header(root, file)
        if name not in headers[file]:
            raise ValueError(
                f"fpipe.load_hf: {root / HF_INDEX} puts {name!r} in {file}, which has no tensor of that name. "
                "Load an intact checkpoint."
            )
        code, shape = headers[file][name]
        if code not in DTYPES:
            raise ValueError(
                f"fpipe.load_hf: {root / file} stores {name!r} as {code!r}, a dtype fpipe does not read (it reads "
                f"{sorted(DTYPES)}). Convert the checkpoint."
            )
        on_disk = DTYPES[code]
        converted = dtype if dtype is not None and on_disk.is_floating_point else on_disk
        for use in found:
            if shape != use.full_shape:
                mismatches.append(f"  {use.where} (name {name!r}): shape on disk {shape}, expected {use.full_shape}")
            if converted != use.leaf.dtype:
                hint = ""
                if dtype is None and on_disk.is_floating_point and use.leaf.dtype.is_floating_point:
                    hint = f" (pass dtype={use.leaf.dtype} to convert)"
                mismatches.append(
                    f"  {use.where} (name {name!r}): dtype on disk {dtype_name(on_disk)}"
                    f"{f' converted to {dtype_name(converted)}' if converted != on_disk else ''}, expected "
                    f"{dtype_name(use.leaf.dtype)}{hint}"
                )
        wanted[name] = _Want(file, code, shape, found)
    if mismatches:
        raise ValueError(
            f"fpipe.load_hf: the template does not match the checkpoint at {root}:\n" + "\n".join(mismatches)
        )
    return wanted


# --- Reading ----------------------------------------------------------------------------------


def _read(root: Path, wanted: dict[str, _Want]) -> dict[tuple[str, Part], torch.Tensor]:
    """Each ``(name, part)`` of ``wanted``, file by file (each opened once, memory-mapped), as stored."""
    by_file: dict[str, list[str]] = {}
    for name, want in sorted(wanted.items()):
        by_file.setdefault(want.file, []).append(name)
    out: dict[tuple[str, Part], torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        path = inside(root, file)
        try:
            with safe_open(path, "load_hf") as f:
                for name in names:
                    want = wanted[name]
                    for part in dict.fromkeys(use.part for use in want.uses):
                        box = whole(want.shape) if part.box is None else part.box
                        if part.box is None and part.shard is None:
                            tensor = f.get_tensor(name)
                        elif part.shard is None:  # a DTensor's piece: its box's bytes only
                            tensor = (
                                f.get_slice(name)[box.within(whole(want.shape))]
                                if box.numel
                                else torch.empty(box.shape, dtype=DTYPES[want.code])
                            )
                        else:  # a shard of the tensor, or of a DTensor's piece: its bytes only
                            start, stop, size = cut_range(box.numel, part.shard)
                            data = (
                                read_range(_Within(f.get_slice(name), box), box.shape, start, stop)
                                if stop > start
                                else torch.empty(0, dtype=DTYPES[want.code])
                            )
                            tensor = torch.cat([data, data.new_zeros(size - data.numel())])
                        out[name, part] = tensor
        except safetensors.SafetensorError as error:
            raise ValueError(f"fpipe.load_hf: {path} is corrupt ({error}). Load an intact checkpoint.") from error
    return out


def read_range(piece: Any, shape: Sequence[int], start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` (``start < stop``) of the flattened tensor behind ``piece`` (a safetensors slice),
    reading only those: per dimension, a partial first row, a block of whole rows, a partial last row.

    For a (4, 3) tensor and elements [2, 10)::

        row 0: . . x      piece[0, 2:3]     a partial row (recursing into the row)
        row 1: x x x      piece[1:3]        whole rows, one read
        row 2: x x x
        row 3: x . .      piece[3, 0:1]     a partial row
    """
    parts: list[torch.Tensor] = []

    def visit(prefix: tuple[Any, ...], dims: Sequence[int], a: int, b: int) -> None:
        if a >= b:
            return
        if a == 0 and b == math.prod(dims):
            parts.append(piece[prefix].reshape(-1))
            return
        row = math.prod(dims[1:])  # elements per row of the first dimension
        first_full = -(-a // row)
        if a % row:  # 1. a partial first row
            visit((*prefix, a // row), dims[1:], a % row, min(row, b - (a // row) * row))
        if first_full < b // row:  # 2. whole rows
            parts.append(piece[(*prefix, slice(first_full, b // row))].reshape(-1))
        if b % row and b // row >= first_full:  # 3. a partial last row
            visit((*prefix, b // row), dims[1:], 0, b % row)

    visit((), list(shape), start, stop)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class _Within:
    """A safetensors slice seen through ``box``: index ``i`` of dimension ``j`` is element
    ``box.offset[j] + i`` of the tensor, and the dimensions not indexed are the box's."""

    def __init__(self, piece: Any, box: Box) -> None:
        self.piece, self.box = piece, box

    def __getitem__(self, index: tuple[Any, ...]) -> torch.Tensor:
        out: list[Any] = []
        for j, (offset, size) in enumerate(zip(self.box.offset, self.box.shape)):
            i = index[j] if j < len(index) else slice(0, size)
            out.append(offset + i if isinstance(i, int) else slice(offset + i.start, offset + i.stop))
        tensor: torch.Tensor = self.piece[tuple(out)]
        return tensor


def _show(value: Any) -> str:
    """``repr(value)``, cut short: an index may hold anything."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
