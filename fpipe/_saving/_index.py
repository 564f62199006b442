"""A save's index read back and checked, field by field, to be one that ``fpipe.save`` wrote.

The index is JSON from a directory that may hold anything (NOTE [trust model] in
``fpipe/_saving/_store.py``): before loading reads a field, ``read_index`` checks its type, every
file name is a plain name inside the save directory, and the pieces of each tensor (boxes of a
DTensor, shards) agree and tile its full shape exactly once. A failed check is a ``ValueError``
naming the field, where it is in the index, and its value cut short.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .._sharding import cut_range
from ._boxes import Box, tiling_problem, whole
from ._directory import INDEX, inside
from ._store import DTYPES, FORMAT, FORMAT_VERSION, MAPS

_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def read_index(root: Path) -> dict[str, Any]:
    """The index in ``root``, checked to be one that ``fpipe.save`` wrote (NOTE [trust model])."""
    path = inside(root, INDEX)
    try:
        index = json.loads(path.read_bytes())
        _check_index(index)
    except (ValueError, RecursionError, _Invalid) as error:  # RecursionError: JSON nested too deep
        what = str(error) if isinstance(error, _Invalid) else f"it is not JSON ({type(error).__name__}: {error})"
        raise ValueError(
            f"fpipe.load: {path} is not an index written by fpipe.save: {what}. Load an intact save."
        ) from None
    return dict(index)


class _Invalid(Exception):
    """What is wrong with an index: ``<what> (<where in the index>: <value>)``."""


def _check_index(index: Any) -> None:
    """Check the type of every field that loading reads, and that every file name is plain."""
    _expect(index, dict, "a JSON object", "the index")
    meta = _field(index, "metadata", dict, "a JSON object")
    if (meta.get("format"), meta.get("format_version")) != (FORMAT, FORMAT_VERSION):
        raise _Invalid(
            f"it is not in format {FORMAT!r} version {FORMAT_VERSION} (metadata: format "
            f"{_show(meta.get('format'))}, version {_show(meta.get('format_version'))})"
        )
    _field(meta, "user", dict, "a JSON object", "metadata")
    files = _field(index, "files", dict, "a JSON object")
    for file, info in files.items():
        _plain(file, "files")
        at = f"files[{file!r}]"
        _natural(_field(_expect(info, dict, "a JSON object", at), "bytes", int, "an int >= 0", at), f"{at}['bytes']")
    tensors = _field(index, "tensors", dict, "a JSON object")
    for file, infos in tensors.items():
        _plain(file, "tensors")
        _expect(infos, dict, "a JSON object", f"tensors[{file!r}]")
    for kind, key in MAPS.items():
        if kind == "params" or key in index:
            for name, where in _field(index, key, dict, "a JSON object").items():
                _check_entry(files, tensors, key, name, where)


def _check_entry(files: dict[str, Any], tensors: dict[str, Any], key: str, name: str, where: Any) -> None:
    """Check what ``index[key][name]`` says: its files, and each piece's dtype, shape, sha256 (and shard)."""
    at = f"{key}[{name!r}]"
    pieces = [where] if isinstance(where, str) else where
    if not isinstance(pieces, list) or not pieces or not all(isinstance(file, str) for file in pieces):
        raise _Invalid(f"{at} should be a file name or a non-empty list of them ({at}: {_show(where)})")
    if len(set(pieces)) != len(pieces):
        raise _Invalid(f"{at} names a file twice ({at}: {_show(where)})")
    first, d = None, 0
    boxes: list[Box] = []
    pieces_kind: tuple[bool, bool] | None = None
    for q, file in enumerate(pieces):
        _plain(file, at)
        if file not in files:
            raise _Invalid(f"{at} names a file that 'files' does not list ({at}: {file!r})")
        info_at = f"tensors[{file!r}]"
        info = _field(tensors.get(file, {}), name, dict, "a JSON object", info_at)
        info_at += f"[{name!r}]"
        dtype = _field(info, "dtype", str, "a safetensors dtype code", info_at)
        if dtype not in DTYPES:
            raise _Invalid(f"{info_at}['dtype'] should be one of {sorted(DTYPES)} ({info_at}['dtype']: {_show(dtype)})")
        shape = _shape(info, "shape", info_at)
        sha = _field(info, "sha256", str, "64 hex digits", info_at)
        if not _SHA256.fullmatch(sha):
            raise _Invalid(f"{info_at}['sha256'] should be 64 hex digits ({info_at}['sha256']: {_show(sha)})")
        if not isinstance(where, list):
            continue
        # NOTE [tensor-parallel saves]: a box has an offset; NOTE [sharded saves]: a shard has 'shard'
        # (a piece with neither is read as a shard, so that its missing 'shard' is what is reported)
        kind = ("offset" in info, "offset" not in info or "shard" in info)
        boxed, sharded = kind
        shard = _field(info, "shard", list, "[q, d]", info_at) if sharded else None
        if q and kind != pieces_kind:
            raise _Invalid(
                f"the pieces of {name!r} disagree: each should be a box, a shard or a shard of a box like the first "
                f"({info_at}: {_show(info)})"
            )
        pieces_kind = kind
        if shard is not None:
            if not boxed:
                d = len(pieces)
            elif q == 0 and len(shard) == 2 and all(type(x) is int for x in shard) and shard[1] > 0:
                d = shard[1] if len(pieces) % shard[1] == 0 else 0
            if not d or shard != [q % d, d]:
                expected = f"[{q % d}, {d}]" if d else f"[q, d] with d > 0 dividing its {len(pieces)} pieces"
                raise _Invalid(f"{info_at}['shard'] should be {expected} ({info_at}['shard']: {_show(shard)})")
        full = _shape(info, "full_shape", info_at)
        first = first or (dtype, full)
        box = whole(full)
        if boxed:
            offset = _shape(info, "offset", info_at)
            box = Box(tuple(offset), tuple(_shape(info, "box_shape", info_at) if sharded else shape))
            if (dtype, full) != first or len(offset) != len(full) or len(box.shape) != len(full):
                raise _Invalid(
                    f"the pieces of {name!r} disagree: each should have the dtype and full shape of the first, "
                    f"{first}, and an offset and shape of {len(full)} dimensions ({info_at}: {_show(info)})"
                )
            if sharded and q % d and box != boxes[-1]:
                raise _Invalid(
                    f"the shards of one box of {name!r} disagree: each should have the offset and box shape of the "
                    f"first, {[list(boxes[-1].offset), list(boxes[-1].shape)]} ({info_at}: {_show(info)})"
                )
            if not sharded or q % d == 0:
                boxes.append(box)
        if sharded:
            size = cut_range(box.numel, (0, d)).size
            if (dtype, full, shape) != (*first, [size]):
                raise _Invalid(
                    f"the pieces of {name!r} disagree: each should have the dtype and full shape of the first, "
                    f"{first}, and shape [{size}] ({info_at}: {_show(info)})"
                )
    if boxes and first is not None:
        problem = tiling_problem(first[1], boxes)
        if problem is not None:
            raise _Invalid(
                f"the pieces of {name!r} do not cover its full shape {first[1]} exactly once: {problem} ({at}: "
                f"{_show(where)})"
            )


def _expect(value: Any, kind: type, what: str, where: str) -> Any:
    """``value``, found at ``where`` in the index, which must be a ``kind`` (a bool is not an int)."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _Invalid(f"{where} should be {what} ({where}: {_show(value)})")
    return value


def _field(parent: dict[str, Any], key: str, kind: type, what: str, where: str = "") -> Any:
    """``parent[key]``, which must be a ``kind``; ``where`` is ``parent``'s place in the index."""
    at = f"{where}[{key!r}]" if where else repr(key)
    if key not in parent:
        raise _Invalid(f"{at} is missing (keys there: {_show(sorted(parent))})")
    return _expect(parent[key], kind, what, at)


def _natural(value: int, where: str) -> None:
    if value < 0:
        raise _Invalid(f"{where} should be an int >= 0 ({where}: {value})")


def _shape(info: dict[str, Any], key: str, where: str) -> list[int]:
    shape = _field(info, key, list, "a list of ints >= 0", where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _Invalid(f"{where}[{key!r}] should be a list of ints >= 0 ({where}[{key!r}]: {_show(shape)})")
    return list(shape)


def is_plain(file: str) -> bool:
    """Whether ``file`` is a plain ``.safetensors`` name: no separator, no leading ``.`` (NOTE [trust model])."""
    return _PLAIN.fullmatch(file) is not None


def _plain(file: str, where: str) -> None:
    """Refuse a file name that is not a plain name inside the save directory (NOTE [trust model])."""
    if not is_plain(file):
        raise _Invalid(
            f"{where} names a file that is not a plain file name in the save directory (letters, digits, "
            f"'_', '-' and '.', not first, ending in '.safetensors') ({where}: {_show(file)})"
        )


def _show(value: Any) -> str:
    """``repr(value)``, cut short: an index may hold anything."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
