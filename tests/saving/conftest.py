"""The saving tests' spawns of tensor-parallel ranks, run once per session however many test modules
read them (tests/saving/_tensor_parallel_saves.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fpipe
from tests._multiprocess import run_ranks
from tests.helpers import hf_checkpoint, hf_example
from tests.saving._tensor_parallel_saves import tp_params, tp_save_ranks, tp_sharded_save_ranks


@pytest.fixture(scope="session")
def tp_saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], Any]:
    """A plain save, a Hugging Face checkpoint, and the results of ``tp_save_ranks`` on pp 2 x tp 2."""
    directory = tmp_path_factory.mktemp("tp")
    fpipe.save(directory / "plain", tp_params())
    model = hf_checkpoint(hf_example(), directory / "hf")
    results = run_ranks(4, tp_save_ranks, str(directory), str(directory / "plain"), str(directory / "hf"), timeout=150)
    return directory, results, model


@pytest.fixture(scope="session")
def tp_sharded_saves(tp_saves: tuple[Path, list[Any], Any]) -> tuple[Path, list[Any]]:
    """The results of ``tp_sharded_save_ranks`` on dp 2 x pp 1 x tp 2, and the directory of their save."""
    directory = tp_saves[0]
    fpipe.save_hf(directory / "hf sharded", tp_params())
    args = str(directory / "sharded"), str(directory / "plain"), str(directory / "hf sharded")
    return directory / "sharded", run_ranks(4, tp_sharded_save_ranks, *args, timeout=150)
