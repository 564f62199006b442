"""The save format (fpipe/_saving/_store.py): safetensors files and their index, written and read
back by pieces, each file checked against its size and each tensor
against its sha256 (whole saves end to end: tests/saving/test_save.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

from fpipe._saving._boxes import Box
from fpipe._saving._directory import INDEX
from fpipe._saving._index import read_index
from fpipe._saving._store import (
    Entry,
    Part,
    entry,
    file_name,
    make_index,
    read_tensors,
    sha256,
    write_safetensors,
)
from tests.helpers import assert_bitwise

W = torch.arange(12.0).reshape(3, 4)
STEP = torch.tensor([7], dtype=torch.int64)


def _save(root: Path, *, sharded: bool = False) -> dict[str, Any]:
    """A save of ``w`` (whole, or as two flat shards of 6) and ``step`` in ``root``; its index."""
    root.mkdir(exist_ok=True)
    if sharded:
        shards = {"a.safetensors": W.reshape(-1)[:6], "b.safetensors": W.reshape(-1)[6:]}
        files = {f: {"bytes": write_safetensors(root / f, {"w": t})} for f, t in shards.items()}
        w = Entry(tuple(shards), "F32", [3, 4], tuple(sha256(t) for t in shards.values()), sharded=True, shards=2)
        files["c.safetensors"] = {"bytes": write_safetensors(root / "c.safetensors", {"step": STEP})}
        step = Entry(("c.safetensors",), "I64", [1], (sha256(STEP),))
    else:
        size = write_safetensors(root / "a.safetensors", {"w": W, "step": STEP})
        files = {"a.safetensors": {"bytes": size}}
        w = Entry(("a.safetensors",), "F32", [3, 4], (sha256(W),))
        step = Entry(("a.safetensors",), "I64", [1], (sha256(STEP),))
    index = make_index({"params": {"w": w, "step": step}}, files, 2, {"note": "x"})
    (root / INDEX).write_text(json.dumps(index))
    return index


def test_file_names() -> None:
    assert file_name("params", 1, 4) == "model-rank-00001-of-00004.safetensors"
    assert file_name("optimizer_state", 0, 2, [("dp", 1, 2), ("tp", 0, 8)]) == (
        "optimizer-rank-00000-of-00002-dp-00001-of-00002-tp-00000-of-00008.safetensors"
    )


def test_files_round_trip_through_safetensors(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "f.safetensors", {"w": W, "step": STEP, "h": W[0].half()})
    assert size == (tmp_path / "f.safetensors").stat().st_size
    with safetensors.safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        assert_bitwise([f.get_tensor(name) for name in ("w", "step", "h")], [W, STEP, W[0].half()])


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_a_save_reads_back_by_parts(tmp_path: Path, sharded: bool) -> None:
    _save(tmp_path, sharded=sharded)
    index = read_index(tmp_path)
    assert index["metadata"]["user"] == {"note": "x"} and index["metadata"]["num_stages"] == 2
    box = Box((1, 1), (2, 2))
    requests = [("w", Part()), ("w", Part(box=box)), ("w", Part(shard=(1, 5))), ("step", Part())]
    got = read_tensors(tmp_path, index, "params", requests)
    shard = W.reshape(-1)[3:6]  # ceil(12 / 5) = 3 elements per shard
    assert_bitwise([got[r] for r in requests[:3]], [W, W[1:3, 1:3], shard])
    assert_bitwise(got["step", Part()], STEP)
    assert torch.equal(got["w", Part(shard=(1, 5))], torch.tensor([3.0, 4.0, 5.0]))  # ceil(12 / 5) = 3 per shard


def test_entries_say_what_the_index_says(tmp_path: Path) -> None:
    index = _save(tmp_path, sharded=True)
    e = entry(index, "params", "w")
    assert (e.files, e.shape, e.sharded, e.shards) == (("a.safetensors", "b.safetensors"), [3, 4], True, 2)
    assert e.piece_shape(1) == [6] and e.shard(1) == (1, 2) and e.box(1) == Box((0, 0), (3, 4))


def test_a_truncated_or_corrupt_file_is_named(tmp_path: Path) -> None:
    index = _save(tmp_path)
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"a\.safetensors should have \d+ bytes but it has"):
        read_tensors(tmp_path, index, "params", [("w", Part())])
    (tmp_path / "a.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ValueError, match="is corrupt: the bytes of 'w' do not match their sha256"):
        read_tensors(tmp_path, index, "params", [("w", Part()), ("step", Part())])
