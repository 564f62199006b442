"""A save's index checked as it is read (fpipe/_saving/_index.py, NOTE [trust model]): an index
that ``fpipe.save`` did not write is refused, naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fpipe
from fpipe._saving._directory import INDEX, committed
from fpipe._saving._index import is_plain, read_index


def _save(root: Path) -> Path:
    """A save of one tensor in ``root``: the version directory that holds its index."""
    fpipe.save(root, [{"w": torch.arange(12.0).reshape(3, 4)}], metadata={"note": "x"})
    return committed(root)


def test_plain_names() -> None:
    assert is_plain("model-rank-00001-of-00004.safetensors")
    assert not any(is_plain(f) for f in ("../x.safetensors", ".hidden.safetensors", "a/b.safetensors", "x.bin"))


def _first_file(index: dict[str, Any]) -> str:
    return next(iter(index["files"]))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda i: i["files"].update({"../x.safetensors": {"bytes": 1}}), "not a plain file name"),
        (lambda i: i["metadata"].update(format_version=99), "it is not in format"),
        (lambda i: i["weight_map"].update(w="z.safetensors"), "names a file that 'files' does not list"),
        (lambda i: i["files"][_first_file(i)].update(bytes=-1), "an int >= 0"),
        (lambda i: i["files"].update({"a.safetensors": "x" * 1000}), "should be a JSON object"),
    ],
)
def test_an_index_not_written_by_save_is_refused(tmp_path: Path, change: Any, fragment: str) -> None:
    version = _save(tmp_path)
    index = read_index(version)
    change(index)
    (version / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"is not an index written by fpipe\.save") as raised:
        read_index(version)
    assert fragment in str(raised.value)
    assert len(str(raised.value)) < 600  # a value is shown cut short


def test_an_index_that_is_not_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / INDEX).write_text("{")
    with pytest.raises(ValueError, match="it is not JSON"):
        read_index(tmp_path)
