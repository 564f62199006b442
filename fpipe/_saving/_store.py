"""The format of ``fpipe.save``: safetensors files and their index, written, checked and read.

Where the files go (versions, the lock, the commit) is NOTE [the save directory] in
``fpipe/_saving/_directory.py``.

The index follows Hugging Face's ``model.safetensors.index.json`` (``metadata`` and
``weight_map``), plus ``optimizer_state_map`` (optimizer state has its own names and files),
``tensors`` (per file, per name: safetensors dtype code, shape, sha256 of the bytes) and
``files`` (per file: size in bytes, writing rank). On load, each file's size is checked before it
is opened and each tensor read is checked against its dtype, shape and sha256, so a truncated or
corrupt file raises a ``ValueError`` naming it rather than failing inside safetensors; a rank
hashes only the tensors it reads.

NOTE [sharded saves]
With a step built with ``shard_params=True`` (``save``/``load`` with ``parallel=step``), tensors are
shards (NOTE [shard layout] in ``fpipe/_sharding/_stages.py``: flattened, zero-padded to ``d * c``,
``c = ceil(n / d)``, piece ``q`` on data-parallel rank ``q``). Every rank of the mesh writes
its own pieces, in parallel, to ``model-rank-0000r-of-0000p-dp-0000q-of-0000d.safetensors``
(``optimizer-...`` likewise); no tensor is gathered. In the index a sharded name maps to the
list of its ``d`` files, and each piece's entry in ``tensors`` has ``shape`` ``[c]``, its
``sha256``, ``shard`` ``[q, d]`` and ``full_shape``. Reading (``read_tensors``) serves either a
full tensor (all pieces, concatenated, padding dropped) or piece ``q'`` of any ``d'`` (only the
saved pieces overlapping it are read, each whole so that its hash is checked). Leaves that are
not shards (a step counter) are saved whole, once, by the first replica that holds them, and
every replica must hold the same bytes. In an unsharded save a name maps to one file.

On a mesh with a tensor-parallel dimension (NOTE [tensor-parallel saves] in
``fpipe/_saving/_boxes.py``) every tensor-parallel rank writes its own file,
``model-rank-0000r-of-0000p-tp-0000t-of-0000T.safetensors``. A DTensor cut by ``Shard``
placements maps to the list of its pieces' files, and each piece's entry in ``tensors`` has
``shape`` (the piece's), ``offset`` (where it starts in each dimension), ``full_shape`` and its
``sha256``; the pieces must cover the full shape exactly once (``read_index`` checks it). A
whole tensor (plain, ``Replicate``) maps to one file, as without tensor parallelism. Reading a
box (a DTensor template's piece) or a whole tensor copies the overlap of each saved piece that
overlaps it, each piece read whole so that its hash is checked. With an expert-parallel
dimension every ep rank of the first data-parallel replica writes its own file,
``model-rank-0000r-of-0000p-ep-0000e-of-0000E[-tp-...].safetensors``, and an expert weight's
blocks are pieces like these (NOTE [tensor-parallel saves] in ``fpipe/_saving/_boxes.py``).

Both at once (``shard_params=True`` on a mesh with ``"tp"``: NOTE [tensor-parallel shards] in
``fpipe/_sharding/_stages.py``), a DTensor parameter's shard is a flat piece of its local piece:
shard ``q`` of ``d`` of a box. Every rank writes its own, to
``model-rank-0000r-of-0000p-dp-0000q-of-0000d-tp-0000t-of-0000T.safetensors``; the name maps to
the list of its pieces' files, box by box (by offset) and within a box by ``q``, and each
piece's entry has ``shape`` ``[ceil(box elements / d)]``, ``shard`` ``[q, d]``, ``offset`` and
``box_shape`` (its box), and ``full_shape``; ``read_index`` checks that the ``d`` shards of a
box agree on it and that the boxes tile the full shape. A plain tensor or a ``Replicate``
DTensor is a sharded tensor without boxes (tensor-parallel rank 0 writes it, and the other
tensor-parallel ranks must hold the same bytes). Reading, a box is the concatenation of its
shards, padding dropped; a request for shard ``q'`` of ``d'`` of a box the save has reads only
the shards of that box overlapping it (so the same layout reads exactly its own shards), any
other request reads every shard of each box it overlaps.

NOTE [trust model]
A save directory may come from elsewhere (a download, an unpacked archive), so ``load`` trusts
neither the index nor the links in it. ``read_index`` checks the type of every field that
loading reads and that every file name is plain (``model-rank-00000-of-00001.safetensors``: no
separator, no leading ``.``, so no ``..`` and no absolute path), raising a ``ValueError`` that
says which field is wrong, never a ``KeyError``. Every path opened (``latest``, the version, the
index, each file) must resolve into the directory it is in (``inside`` in
``fpipe/_saving/_directory.py``): a symbolic link leading elsewhere is refused before anything
about its target is looked at, so no message tells whether a file outside exists or its size.
The directory's contents are assumed not to change while loading (notes/saving.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import safetensors
import torch

from .._distributed import tensor_bytes
from .._plural import plural
from .._sharding import cut_range
from ._boxes import Box, overlap, whole
from ._directory import inside

FORMAT, FORMAT_VERSION = "fpipe", 1
KINDS = ("params", "optimizer_state")
MAPS = {"params": "weight_map", "optimizer_state": "optimizer_state_map"}
_PREFIXES = {"params": "model", "optimizer_state": "optimizer"}

CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in [
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
]:
    if isinstance(getattr(torch, _name, None), torch.dtype):
        CODES[getattr(torch, _name)] = _code
DTYPES = {code: dtype for dtype, code in CODES.items()}


class Entry(NamedTuple):
    """One saved tensor as the index records it: whole in one file, or cut into pieces, one per file.

    A sharded tensor (NOTE [sharded saves]) is cut into ``shards`` flat pieces, piece ``q`` in
    ``files[q]`` with hash ``sha256s[q]``; a tensor-parallel one (NOTE [tensor-parallel saves] in
    ``fpipe/_saving/_boxes.py``) is pieces ``boxes[k]`` of it; a sharded tensor-parallel one has
    each box cut into ``shards`` flat pieces, ``boxes[k]`` repeated for each (piece ``k`` is
    shard ``k % shards`` of its box); a whole one has one file and one hash.
    """

    files: tuple[str, ...]
    dtype: str  # a safetensors code: "F32"
    shape: list[int]  # the full shape
    sha256s: tuple[str, ...]  # of each piece's bytes
    sharded: bool = False
    boxes: tuple[Box, ...] | None = None  # per piece
    shards: int = 1  # flat pieces per box: d for a sharded tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def box(self, k: int) -> Box:
        """The box piece ``k`` holds, or is a shard of."""
        return self.boxes[k] if self.boxes is not None else whole(self.shape)

    def shard(self, k: int) -> tuple[int, int] | None:
        """``(q, d)`` if piece ``k`` is shard ``q`` of ``d`` of its box."""
        return (k % self.shards, self.shards) if self.sharded else None

    def piece_shape(self, k: int) -> list[int]:
        """The shape of piece ``k`` as its file stores it."""
        shard = self.shard(k)
        return list(self.box(k).shape) if shard is None else [cut_range(self.box(k).numel, shard).size]


def file_name(kind: str, rank: int, num_ranks: int, inner: Sequence[tuple[str, int, int]] = ()) -> str:
    """The file that pipeline rank ``rank`` writes its tensors of ``kind`` to; ``inner``
    (``("dp", q, d)`` in a sharded save, ``("ep", e, E)`` with expert parallelism, ``("tp", t, T)``
    with tensor parallelism, or several) names its place in the other dimensions whose ranks all write."""
    suffix = "".join(f"-{label}-{index:05d}-of-{size:05d}" for label, index, size in inner)
    return f"{_PREFIXES[kind]}-rank-{rank:05d}-of-{num_ranks:05d}{suffix}.safetensors"


def sha256(data: torch.Tensor) -> str:
    """The sha256 of a contiguous CPU tensor's bytes."""
    return hashlib.sha256(tensor_bytes(data)).hexdigest()


# --- Writing ----------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write contiguous CPU tensors as a safetensors file, fsynced; its size in bytes.

    The format is 8 bytes of header size, a JSON header, the raw bytes. Written here rather than
    with ``safetensors.torch.save_file`` to stream the tensors without a NumPy dependency and to
    fsync before returning; ``safe_open`` reads it back. Largest elements first, so that every
    tensor is aligned to its element size.
    """
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            _write(f, tensor_bytes(tensors[name]))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + offset


def _write(f: IO[bytes], data: memoryview) -> None:
    """Write one tensor's bytes (a seam: tests slow it down to kill a save midway)."""
    f.write(data)


def make_index(
    entries: dict[str, dict[str, Entry]], files: dict[str, dict[str, int]], num_stages: int, user: Any
) -> dict[str, Any]:
    """The index: per kind, names to entries; per file, its size and writer; user metadata."""
    total = sum(DTYPES[e.dtype].itemsize * e.numel for e in entries.get("params", {}).values())
    index: dict[str, Any] = {
        "metadata": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "total_size": total,
            "num_stages": num_stages,
            "user": user,
        },
        "tensors": {},
        "files": dict(sorted(files.items())),
    }
    for kind, kind_entries in entries.items():
        index[MAPS[kind]] = {}
        for name, e in sorted(kind_entries.items()):
            index[MAPS[kind]][name] = list(e.files) if e.sharded or e.boxes is not None else e.files[0]
            for k, (file, digest) in enumerate(zip(e.files, e.sha256s)):
                info: dict[str, Any] = {"dtype": e.dtype, "shape": e.piece_shape(k), "sha256": digest}
                shard = e.shard(k)
                if shard is not None:
                    info.update(shard=list(shard), full_shape=e.shape)
                if e.boxes is not None:
                    info.update(offset=list(e.boxes[k].offset), full_shape=e.shape)
                    if shard is not None:  # "shape" is the flat piece's
                        info.update(box_shape=list(e.boxes[k].shape))
                index["tensors"].setdefault(file, {})[name] = info
    return index


# --- Reading ----------------------------------------------------------------------------------


# NOTE [header size]
# A safetensors file opens with its header's length (8 bytes) and the header, JSON naming every
# tensor of the file; ``safetensors.safe_open`` parses all of it before it reads any tensor, and
# safetensors accepts headers up to 100 MB, whose parsing takes seconds and hundreds of MB of
# memory whatever is read from the file. Reading one tensor must not cost that. So fpipe reads
# the length first and refuses a header larger than MAX_HEADER_BYTES (16 MiB, about 150,000
# tensors of 100-byte entries) with a ``ValueError`` naming the file, before safetensors sees it.
# An fpipe file holds one rank's tensors of one kind, a Hugging Face shard a few hundred to a few
# thousand tensors (headers of tens to hundreds of KB): neither comes near the limit. The
# measured costs: notes/saving.md, "Trust model: what `load` accepts".
MAX_HEADER_BYTES = 16 << 20


def safe_open(path: Path, function: str) -> Any:
    """``safetensors.safe_open(path)`` for torch, once its header is known to be at most
    ``MAX_HEADER_BYTES`` (NOTE [header size]).

    Raises:
        ValueError: the header is larger (``fpipe.<function>: ...`` naming ``path``).
        OSError: ``path`` cannot be read.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
    size = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    if size > MAX_HEADER_BYTES:
        raise ValueError(
            f"fpipe.{function}: {path} has a safetensors header of {plural(size, 'byte')}, more than fpipe reads "
            f"(MAX_HEADER_BYTES: {MAX_HEADER_BYTES}, about 150,000 tensors), since parsing it costs seconds and "
            "memory before any tensor is read. Split the file into files of fewer tensors, or load an intact save."
        )
    return safetensors.safe_open(str(path), framework="pt")  # type: ignore[no-untyped-call]


def entry(index: dict[str, Any], kind: str, name: str) -> Entry:
    """What the index says about ``name`` of ``kind``."""
    where = index[MAPS[kind]][name]
    if isinstance(where, str):
        info = index["tensors"][where][name]
        return Entry((where,), info["dtype"], list(info["shape"]), (info["sha256"],))
    pieces = [index["tensors"][file][name] for file in where]
    first, hashes = pieces[0], tuple(p["sha256"] for p in pieces)
    boxes = None
    if "offset" in first:  # NOTE [tensor-parallel saves]; with "shard", each box's shards
        boxes = tuple(Box(tuple(p["offset"]), tuple(p.get("box_shape", p["shape"]))) for p in pieces)
    sharded = "shard" in first
    d = first["shard"][1] if sharded else 1
    return Entry(tuple(where), first["dtype"], list(first["full_shape"]), hashes, sharded, boxes, d)


class Part(NamedTuple):
    """What a template leaf asks for: the elements of ``box`` (``None``: the whole tensor; a
    DTensor's local piece, NOTE [tensor-parallel saves]) in its shape, or with ``shard`` ``(q,
    d)`` that piece of them flattened, as ``fpipe.shard`` cuts it (1-D, zero-padded; NOTE
    [sharded saves])."""

    box: Box | None = None
    shard: tuple[int, int] | None = None


def read_tensors(
    root: Path, index: dict[str, Any], kind: str, requests: Sequence[tuple[str, Part]]
) -> dict[tuple[str, Part], torch.Tensor]:
    """Read each ``(name, part)`` (CPU tensors), whatever pieces the save has.

    Only the pieces on disk that overlap a request are read, file by file (of a sharded box
    that is the request's own box cut into shards, only the shards overlapping the request's);
    each is checked whole against its size, dtype, shape and sha256 (NOTE [sharded saves]). A
    piece of a tensor saved whole or in boxes is copied where the requests want it as soon as it
    is read, and dropped (one whole tensor more than the results at a time, loading into DTensor
    templates); the shards of a sharded tensor's box are kept until concatenated.
    """
    entries = {name: entry(index, kind, name) for name, _ in requests}
    needed: dict[str, set[str]] = {}  # file -> names
    plans: dict[tuple[str, Part], list[int]] = {}  # the pieces each request reads
    parts: dict[str, list[Part]] = {}  # name -> its requests' parts
    for name, part in requests:
        parts.setdefault(name, []).append(part)
        e = entries[name]
        plans[name, part] = _pieces(e, part)
        for k in plans[name, part]:
            needed.setdefault(e.files[k], set()).add(name)
    got: dict[tuple[str, str], torch.Tensor] = {}  # the shards of sharded tensors, to concatenate
    filled: dict[tuple[str, Part], torch.Tensor] = {}  # the boxes of the requests, as their pieces come
    for file, names in sorted(needed.items()):
        path = inside(root, file)
        expected = index["files"][file]["bytes"]
        on_disk = path.stat().st_size if path.is_file() else None
        if on_disk != expected:
            found = "it is missing" if on_disk is None else f"it has {on_disk}"
            raise ValueError(
                f"fpipe.load: {path} should have {plural(expected, 'byte')} but {found}: the file is truncated or "
                "corrupt. Load an intact save."
            )
        try:
            with safe_open(path, "load") as f:
                for name in sorted(names):
                    e = entries[name]
                    k = e.files.index(file)
                    piece = f.get_slice(name)
                    header = (piece.get_dtype(), list(piece.get_shape()))
                    if header != (e.dtype, e.piece_shape(k)):
                        raise _Corrupt(
                            f"its header has {name!r} as {header}, the index as {(e.dtype, e.piece_shape(k))}"
                        )
                    tensor = f.get_tensor(name)
                    if sha256(tensor) != e.sha256s[k]:
                        raise _Corrupt(f"the bytes of {name!r} do not match their sha256 in the index")
                    if e.sharded:
                        got[file, name] = tensor
                        continue
                    for part in parts[name]:
                        if k in plans[name, part]:
                            _fill(filled, (name, part), _target(e, part), e.box(k), tensor)
        except (_Corrupt, safetensors.SafetensorError) as error:
            raise ValueError(f"fpipe.load: {path} is corrupt: {error}. Load an intact save.") from error
    out: dict[tuple[str, Part], torch.Tensor] = {}
    for (name, part), pieces in plans.items():
        e = entries[name]
        dtype, target = DTYPES[e.dtype], _target(e, part)
        boxes: dict[int, list[int]] = {}  # the shards read of each box (of a sharded tensor)
        for k in pieces if e.sharded else ():
            boxes.setdefault(k // e.shards, []).append(k)
        for group in boxes.values():
            k, box = group[0], e.box(group[0])
            flat = torch.cat([got[e.files[j], name].reshape(-1) for j in group])
            if box == target and part.shard is not None:  # the request's own shard, of the shards read
                start, stop, size = cut_range(box.numel, part.shard)
                first = k % e.shards * cut_range(box.numel, (0, e.shards)).size
                data = flat[start - first : stop - first]
                out[name, part] = torch.cat([data, torch.zeros(size - data.numel(), dtype=dtype)])
            else:  # every shard of the box was read
                _fill(filled, (name, part), target, box, flat[: box.numel].view(box.shape))
        if (name, part) in out:
            continue
        data = filled.get((name, part), torch.empty(target.shape, dtype=dtype))  # (empty if it has no elements)
        if part.shard is not None:  # a shard of the box
            start, stop, size = cut_range(target.numel, part.shard)
            data = torch.cat([data.reshape(-1)[start:stop], torch.zeros(size - (stop - start), dtype=dtype)])
        out[name, part] = data
    return out


def _target(e: Entry, part: Part) -> Box:
    """The box of ``e`` that ``part`` wants elements of."""
    return whole(e.shape) if part.box is None else part.box


def _pieces(e: Entry, part: Part) -> list[int]:
    """The pieces of ``e`` on disk to read for ``part``: those whose boxes overlap its box, and of a
    sharded box that is its box, only the shards overlapping its shard."""
    target, out = _target(e, part), []
    for k in range(len(e.files)):
        box, shard = e.box(k), e.shard(k)
        if overlap(box, target) is None:
            continue
        if shard is not None and part.shard is not None and box == target:
            start, stop, _ = cut_range(box.numel, part.shard)
            first, last, _ = cut_range(box.numel, shard)
            if not (start < stop and first < stop and last > start):
                continue
        out.append(k)
    return out


def _fill(
    filled: dict[tuple[str, Part], torch.Tensor], key: tuple[str, Part], target: Box, box: Box, piece: torch.Tensor
) -> None:
    """Copy the part of ``piece`` (holding ``box``) that lies in ``target`` into ``filled[key]``."""
    if box == target:
        filled[key] = piece  # the whole request: no copy
        return
    common = overlap(box, target)
    if common is None:
        return
    if key not in filled:
        filled[key] = torch.empty(target.shape, dtype=piece.dtype)  # every element is written once (tiling)
    filled[key][common.within(target)] = piece[common.within(box)]


class _Corrupt(Exception):
    pass
