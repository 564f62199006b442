"""What the saving tests share besides the toy models (tests/helpers.py): a template of meta
tensors, a spy on what a load reads, the index of a save and edits of it, and a save killed
half-written."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import optree
import safetensors
import torch

from fpipe._saving._directory import INDEX, LATEST
from tests._multiprocess import exec_script, start_process


def template(trees: Any) -> Any:
    """The same structure with empty meta tensors: shapes and dtypes only."""
    return optree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), trees, none_is_leaf=False)


def read_index(path: Path) -> dict[str, Any]:
    """The index of the latest version of the save in ``path``."""
    version = (path / LATEST).read_text().strip()
    return json.loads((path / version / INDEX).read_text())


def edit_index(path: list[Any], value: Any) -> Any:
    """An edit of a loaded index: set the value at ``path`` (``KeyError``: delete it)."""

    def edit(index: dict[str, Any]) -> None:
        parent = index
        for key in path[:-1]:
            parent = parent[key]
        if value is KeyError:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value

    return edit


_HALF_WRITE = """
import sys, time, torch, fpipe, fpipe._saving._store as store
def half_write(f, data):  # store._write = half_write: a save that stops halfway
    f.write(data[: len(data) // 2])
    f.flush()
    open(sys.argv[2], "w").close()  # tell the test: the new save is half written
    time.sleep(120)
"""


def kill_when_half_written(script: str, directory: Path, marker: Path) -> None:
    """Run ``script`` (``sys.argv[1:]``: ``directory``, ``marker``; ``half_write`` defined) in a
    process of its own and SIGKILL it once it has created ``marker``: its save is half written."""
    process = start_process(exec_script, _HALF_WRITE + script, [str(directory), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.exitcode is None, "the saving process ended early"
            assert time.monotonic() < deadline, "the saving process never started writing"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.join()


class Spy:
    """Wraps ``safetensors.safe_open``: which names were read, and how many elements of each."""

    def __init__(self, monkeypatch: Any = None) -> None:
        self.read: dict[str, int] = {}
        original, spy = safetensors.safe_open, self

        class Slice:
            def __init__(self, piece: Any, name: str) -> None:
                self.piece, self.name = piece, name

            def __getattr__(self, attribute: str) -> Any:
                return getattr(self.piece, attribute)

            def __getitem__(self, index: Any) -> torch.Tensor:
                return spy.count(self.name, self.piece[index])

        class Handle:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.f = original(*args, **kwargs)

            def __enter__(self) -> Handle:
                self.f.__enter__()
                return self

            def __exit__(self, *error: Any) -> Any:
                return self.f.__exit__(*error)

            def keys(self) -> list[str]:
                return list(self.f.keys())

            def get_slice(self, name: str) -> Slice:
                return Slice(self.f.get_slice(name), name)

            def get_tensor(self, name: str) -> torch.Tensor:
                return spy.count(name, self.f.get_tensor(name))

        if monkeypatch is None:
            safetensors.safe_open = Handle
        else:
            monkeypatch.setattr(safetensors, "safe_open", Handle)

    def count(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.read[name] = self.read.get(name, 0) + tensor.numel()
        return tensor
