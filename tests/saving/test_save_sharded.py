"""``fpipe.save`` and ``fpipe.load`` of sharded parameters and optimizer state (NOTE [sharded saves]).

One spawn of 4 gloo ranks: shards of a 2 x 2 (dp x pp) mesh are saved, each rank writing its own;
they load into a 4 x 1 mesh (4 shards, one pipeline rank), which saves them again, and back into
the 2 x 2 mesh, bitwise; one process loads both saves whole. The leaves include a tied
embedding, leaves that do not divide by 2 or 4, a scalar, float32 and bfloat16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optree
import pytest
import torch
from safetensors import safe_open

import fpipe
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import TWO_STAGES, assert_bitwise, named_weights, stage_weights
from tests.saving._tools import read_index, template

pytestmark = pytest.mark.timeout(120)


def _full() -> list[dict[str, torch.Tensor]]:
    stages = stage_weights(named_weights(), TWO_STAGES)
    g = torch.Generator().manual_seed(1)
    for s, stage in enumerate(stages):
        stage[f"odd{s}"] = torch.randn(5, generator=g, dtype=torch.float64)  # 5 elements: padded over 2 and 4
        stage[f"scale{s}"] = torch.tensor(1.5 + s, dtype=torch.float64)  # 1 element: rank 0 holds it, the rest pad
    return stages


def _state(params: list[Any]) -> list[Any]:
    """AdamW-like state shaped like ``params`` (shards or full), with a step counter saved whole."""
    return [
        None
        if p is None
        else {
            "step": torch.tensor(7),
            "m": optree.tree_map(lambda t: t * 2, p),
            "v": optree.tree_map(lambda t: (t * t).float(), p),
        }
        for p in params
    ]


def _nest(tree: Any) -> Any:
    """``{"layers.0.w": t}`` as ``{"layers": {"0": {"w": t}}}``, recursively: the same names."""
    if not isinstance(tree, dict):
        return tree
    out: dict[str, Any] = {}
    for key, value in tree.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = _nest(value)
    return out


def _meta(trees: list[Any]) -> list[Any]:
    return [None if t is None else template(t) for t in trees]


def _step(mesh: Any) -> fpipe.Step:
    return fpipe.pipeline(
        lambda y, mb: y.sum(),
        [lambda p, x: x] * 2,
        OneFOneB(2),
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=True),
    )


def _ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    first, second = Path(directory) / "2x2", Path(directory) / "4x1"
    full = _full()
    out: dict[str, Any] = {}
    # 2 x 2: each rank saves its shards.
    step = _step(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")))
    shards = step.shard(full)
    out["stages"], out["shards"] = step.local_stages, shards
    fpipe.save(first, shards, optimizer_state=_state(shards), metadata={"step": 7}, parallel=step)
    # 4 x 1: load the 2 x 2 save cut in 4, save it.
    step4 = _step(init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "pp")))
    target = step4.shard(_meta(full))  # meta shards: records the layouts
    loaded = fpipe.load(first, target, optimizer_state=_meta(_state(target)), parallel=step4)
    out["4x1"], out["4x1 state"], out["4x1 expected"] = loaded.params, loaded.optimizer_state, step4.shard(full)
    fpipe.save(second, loaded.params, optimizer_state=loaded.optimizer_state, parallel=step4)
    # Back into 2 x 2.
    back = fpipe.load(second, step.shard(_meta(full)), optimizer_state=_meta(_state(shards)), parallel=step)
    out["back"], out["back state"] = back.params, back.optimizer_state
    # Optimizer state keyed by nested key paths while the parameters' keys hold dots: the same
    # names (NOTE [names]), so its leaves are shards too, and it loads into the flat template.
    nested = Path(directory) / "nested"
    fpipe.save(nested, shards, optimizer_state=[_nest(t) for t in _state(shards)], parallel=step)
    out["nested state"] = fpipe.load(
        nested, step.shard(_meta(full)), optimizer_state=_meta(_state(shards)), parallel=step
    )
    # Full tensors where shards are expected.
    try:
        fpipe.save(
            Path(directory) / "bad", [t if s in step.local_stages else None for s, t in enumerate(full)], parallel=step
        )
    except ValueError as error:
        out["error"] = str(error)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    directory = tmp_path_factory.mktemp("sharded")
    return directory, run_ranks(4, _ranks, str(directory), timeout=100)


def test_sharded_saves_reload_under_other_layouts_bitwise(saved: tuple[Path, list[Any]]) -> None:
    directory, results = saved
    full = _full()
    for result in results:
        assert_bitwise(result["4x1"], result["4x1 expected"])
        assert_bitwise(result["4x1 state"], _state(result["4x1 expected"]))
        assert_bitwise(result["back"], result["shards"])
        assert_bitwise(result["back state"], _state(result["shards"]))
    # One process loads either save whole: the full parameters and state, bitwise.
    for name in ("2x2", "4x1"):
        loaded = fpipe.load(directory / name, template(full), optimizer_state=_meta(_state(full)))
        assert_bitwise(loaded.params, full)
        assert_bitwise(loaded.optimizer_state, _state(full))
        assert loaded.metadata == ({"step": 7} if name == "2x2" else {})


def test_optimizer_state_is_matched_to_parameters_by_name_not_key_path(saved: tuple[Path, list[Any]]) -> None:
    """``m.layers.0.w`` is the state of ``layers.0.w`` whether either is keyed flat or nested.
    Matching key paths took the nested state for whole tensors, which differ across replicas."""
    for result in saved[1]:
        assert_bitwise(result["nested state"].params, result["shards"])
        assert_bitwise(result["nested state"].optimizer_state, _state(result["shards"]))


def test_full_tensors_are_refused_where_shards_are_expected(saved: tuple[Path, list[Any]]) -> None:
    for result in saved[1]:
        assert (
            "should be this rank's shard of a tensor of shape [11, 4], a 1-D tensor of 22 elements" in result["error"]
        )


def test_each_rank_writes_only_its_own_shards(saved: tuple[Path, list[Any]]) -> None:
    root = saved[0] / "2x2"
    index = read_index(root)
    # Pipeline rank r, data-parallel rank q writes file (r, q), and nothing else.
    names = {(r, q): f"model-rank-0000{r}-of-00002-dp-0000{q}-of-00002.safetensors" for r in (0, 1) for q in (0, 1)}
    files = {n: (f["rank"], f["replica"]) for n, f in index["files"].items() if n.startswith("model")}
    assert files == {n: k for k, n in names.items()}
    full = _full()
    version = root / (root / "latest").read_text().strip()
    for (r, _), file in names.items():
        with safe_open(version / file, "pt") as f:
            shapes = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        tied = {"embed"} if r == 1 else set()  # pipeline rank 0 writes the tied embedding
        assert shapes == {n: [-(-t.numel() // 2)] for n, t in full[r].items() if n not in tied}
    assert index["weight_map"]["layers.0.w"] == [names[0, 0], names[0, 1]]
    assert index["weight_map"]["embed"] == [names[0, 0], names[0, 1]]
    piece = index["tensors"][names[0, 1]]["odd0"]
    assert piece["shard"] == [1, 2] and piece["full_shape"] == [5] and piece["shape"] == [3]
    # The step counter is the same on every replica: saved whole, once, by pipeline rank 0's first replica.
    assert index["optimizer_state_map"]["step"] == "optimizer-rank-00000-of-00002-dp-00000-of-00002.safetensors"
    assert index["optimizer_state_map"]["m.scale1"] == [
        "optimizer-rank-00001-of-00002-dp-00000-of-00002.safetensors",
        "optimizer-rank-00001-of-00002-dp-00001-of-00002.safetensors",
    ]
