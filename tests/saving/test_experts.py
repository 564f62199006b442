"""Saving and resuming with expert parallelism (NOTE [tensor-parallel saves] in
fpipe/_saving/_boxes.py; notes/experts.md, "Saving"), on the toy mixture of experts of
tests/helpers.py, in float64.

One 4-process spawn: a pp 2 x ep 2 save (each block of experts written by its ep rank, the dense
weights once, by ep rank 0) loads bitwise into pp 1 x ep 4 (one expert per rank), which saves
again and loads back into pp 2 x ep 2; on pp 1 x ep 2 x tp 2 tensor-parallel rank 0 writes; a
dense weight that differs between ep ranks and a save of 6 experts loaded onto 4 expert ranks
are refused; on dp 2 x pp 1 x ep 2 a run of 4 steps equals bitwise 2 steps, ``save_state`` (and
``AsyncSaver.save_state``), a ``load_state`` into fresh parameters and 2 more steps (dp 1 writes
nothing), and the same save does not restore its generators on ("ep", "pp", "dp"), where two
ranks run other experts. Here, in one process, the saves load into plain tensors holding every
expert (ep 1), bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import fpipe
import fpipe.optim
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import EXPERT_WIDTH, assert_bitwise, expert_batch, expert_layer, expert_loss, expert_params
from tests.saving._tools import read_index, template

pytestmark = pytest.mark.timeout(120)

LAYERS, STEPS, SAVED_AT = 4, 4, 2


def stage(p: dict[str, Any], x: Any) -> torch.Tensor:
    """The layers of a stage, named by their global index (so that names do not repeat across stages)."""
    h = x["x"] if isinstance(x, dict) else x
    for name in sorted(p, key=int):
        h = expert_layer(p[name], h)
    return h


def stages_of(full: list[dict[str, torch.Tensor]], num_stages: int, experts: Any = None) -> list[dict[str, Any]]:
    """``full``'s layers cut into ``num_stages`` stages; ``experts`` (a function) makes each ``w``."""
    per = len(full) // num_stages
    return [
        {
            str(i): {"dense": full[i]["dense"], "w": full[i]["w"] if experts is None else experts(full[i]["w"])}
            for i in range(s * per, (s + 1) * per)
        }
        for s in range(num_stages)
    ]


def moments(params: list[Any]) -> list[Any]:
    """An optimizer state shaped like ``params`` (expert DTensors where they are), with a counter."""
    return [None if p is None else {"m": optree.tree_map(lambda t: 2 * t, p), "step": torch.tensor(3)} for p in params]


def moments_template(params: list[Any]) -> list[Any]:
    return [None if p is None else {"m": p, "step": torch.empty((), dtype=torch.int64, device="meta")} for p in params]


def test_expert_saves_load_into_every_expert_count_and_resume_bitwise(tmp_path: Path) -> None:
    full = expert_params(LAYERS)
    six = torch.randn(6, EXPERT_WIDTH, EXPERT_WIDTH, generator=torch.Generator().manual_seed(6))
    fpipe.save(tmp_path / "six", [{"0": {"dense": full[0]["dense"], "w": six}}])
    results = run_ranks(4, _ranks, str(tmp_path), timeout=100)

    # Who wrote what: each block of experts its ep rank, the dense weights ep rank 0, dp 1 nothing.
    ep2 = read_index(tmp_path / "ep2")
    assert sorted(ep2["files"]) == [
        f"{kind}-rank-0000{r}-of-00002-ep-0000{e}-of-00002.safetensors"
        for kind in ("model", "optimizer")
        for r in range(2)
        for e in range(2)
    ]
    assert ep2["weight_map"]["0.dense"] == "model-rank-00000-of-00002-ep-00000-of-00002.safetensors"
    assert ep2["weight_map"]["3.w"] == [f"model-rank-00001-of-00002-ep-0000{e}-of-00002.safetensors" for e in range(2)]
    piece = ep2["tensors"]["model-rank-00001-of-00002-ep-00001-of-00002.safetensors"]["3.w"]
    assert (piece["offset"], piece["shape"], piece["full_shape"]) == ([2, 0, 0], [2, 3, 3], [4, 3, 3])
    state = read_index(tmp_path / "state")
    assert sorted(state["files"]) == [
        f"{k}-rank-00000-of-00001-ep-0000{e}-of-00002.safetensors" for k in ("model", "optimizer") for e in range(2)
    ]

    every = state["metadata"]["user"]["fpipe_train_state"]  # each process's generators once
    assert (every["num_ranks"], sorted(every["rng"])) == (4, ["0", "1", "2", "3"])
    tp = read_index(tmp_path / "ep tp")  # with tp: tensor-parallel rank 0 of each ep rank
    assert sorted(tp["files"]) == [
        f"model-rank-00000-of-00001-ep-0000{e}-of-00002-tp-00000-of-00002.safetensors" for e in range(2)
    ]

    # ep 2 -> ep 1 and ep 4 -> ep 1: one process, plain tensors, every expert.
    params = stages_of(full, 1)
    assert_bitwise(fpipe.load(tmp_path / "ep tp", template(params)).params, params)
    for name in ("ep2", "ep4"):
        for num_stages in (1, 4):
            params = stages_of(full, num_stages)
            loaded = fpipe.load(tmp_path / name, template(params), optimizer_state=moments_template(template(params)))
            assert_bitwise(loaded.params, params, f"{name} into {num_stages} stages")
            assert_bitwise(loaded.optimizer_state, moments(params), f"{name} into {num_stages} stages")

    for r, out in enumerate(results):
        # ep 2 -> ep 4: expert r of each layer here; then ep 4 -> ep 2: block r % 2 on pipeline rank r // 2.
        for layer in range(LAYERS):
            assert out["ep4"][str(layer)]["w"] == ("DTensor", "(Shard(dim=0),)")
            assert_bitwise(out["ep4 pieces"][str(layer)]["w"], full[layer]["w"][r : r + 1], f"rank {r}")
            assert_bitwise(out["ep4 pieces"][str(layer)]["dense"], full[layer]["dense"], f"rank {r}")
            assert_bitwise(out["ep4 moments"][str(layer)]["w"], 2 * full[layer]["w"][r : r + 1], f"rank {r}")
        pp, ep = divmod(r, 2)
        for layer in range(2 * pp, 2 * pp + 2):
            assert_bitwise(out["ep2 again"][str(layer)]["w"], full[layer]["w"][2 * ep : 2 * ep + 2], f"rank {r}")
            assert_bitwise(out["ep2 again"][str(layer)]["dense"], full[layer]["dense"], f"rank {r}")
        # a dense weight that differs between the expert ranks (the first name checked, on every rank)
        assert (
            "ValueError: fpipe.save: params[0]['0']['dense'] differs between expert-parallel ranks (rank 0: sha256 "
            in out["differ"]
        ), out["differ"]
        assert "; rank 0 ep 1: sha256 " in out["differ"]
        # 6 experts into 4 expert ranks
        assert (
            "fpipe.load: template[0]['0']['w'] is an expert weight of 6 experts (its first dimension, sharded over "
            "mesh['ep']), which the 4 expert-parallel ranks do not divide" in out["six"]
        )
        assert "Load it on an expert-parallel size that divides 6 ([1, 2, 3, 6])" in out["six"]
        if r in (1, 2):  # ep 0 then 1 (rank 1), 1 then 0 (rank 2); the same replica index
            assert (
                f"ValueError: fpipe.load_state: this process (global rank {r}) is pipeline rank 0 of replica {r} "
                f"(tensor-parallel index 0, expert-parallel index {(r + 1) % 2}), but the save's rank {r} was pipeline "
                f"rank 0 of replica {r} (tensor-parallel index 0, expert-parallel index {r % 2})" in out["other layout"]
            ), out["other layout"]
        else:
            assert "RuntimeError: fpipe.load_state: rank(s) [" in out["other layout"], out["other layout"]
        # the resumes: losses and final pieces bitwise equal to the uninterrupted run's
        uninterrupted, resumed, resumed_async = out["runs"]
        assert sorted(resumed[0]) == list(range(SAVED_AT, STEPS))
        for run in (resumed, resumed_async):
            assert_bitwise({i: uninterrupted[0][i] for i in run[0]}, run[0], f"rank {r}")
            assert_bitwise(uninterrupted[1], run[1], f"rank {r}")


def _ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    root, full, out = Path(directory), expert_params(LAYERS), {}

    def pipeline(mesh: Any) -> Any:
        parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
        return fpipe.pipeline(expert_loss, [stage] * mesh["pp"].size(), OneFOneB(4), parallel=parallel)

    def held(step: Any, trees: list[Any]) -> list[Any]:
        return [t if s in step.local_stages else None for s, t in enumerate(trees)]

    def on(mesh: Any, trees: list[dict[str, torch.Tensor]], step: Any) -> list[Any]:
        experts = lambda w: distribute_tensor(w, mesh["ep"], [Shard(0)])  # noqa: E731
        return held(step, stages_of(trees, mesh["pp"].size(), experts))

    def pieces(tree: Any) -> Any:
        return optree.tree_map(lambda t: t.to_local() if hasattr(t, "to_local") else t, tree)

    # pp 2 x ep 2 -> pp 1 x ep 4 -> pp 2 x ep 2
    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    step_a = pipeline(a)
    params = on(a, full, step_a)
    fpipe.save(root / "ep2", params, optimizer_state=moments(params), parallel=step_a)
    c = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "ep"))
    step_c = pipeline(c)
    meta = on(c, template(full), step_c)
    loaded = fpipe.load(root / "ep2", meta, optimizer_state=moments_template(meta), parallel=step_c)
    out["ep4"] = optree.tree_map(lambda t: (type(t).__name__, str(getattr(t, "placements", ""))), loaded.params[0])
    out["ep4 pieces"] = pieces(loaded.params[0])
    out["ep4 moments"] = pieces(loaded.optimizer_state[0]["m"])
    fpipe.save(root / "ep4", loaded.params, optimizer_state=loaded.optimizer_state, parallel=step_c)
    meta = on(a, template(full), step_a)
    out["ep2 again"] = pieces(fpipe.load(root / "ep4", meta, parallel=step_a).params[a.get_coordinate()[0]])
    differ = [None if p is None else {**p, str(2 * s): {**p[str(2 * s)]}} for s, p in enumerate(params)]
    pp, ep = a.get_coordinate()
    differ[pp][str(2 * pp)]["dense"] = differ[pp][str(2 * pp)]["dense"] + ep  # ep 1's copy differs
    try:
        fpipe.save(root / "differ", differ, parallel=step_a)
    except (ValueError, RuntimeError) as error:
        out["differ"] = f"{type(error).__name__}: {error}"
    # pp 1 x ep 2 x tp 2: tensor-parallel rank 0 writes (every tp rank holds its ep index's experts)
    d = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "ep", "tp"))
    step_d = pipeline(d)
    fpipe.save(root / "ep tp", on(d, full, step_d), parallel=step_d)
    six = distribute_tensor(torch.empty(6, 3, 3, device="meta"), c["ep"], [Shard(0)])  # 2, 2, 2 and 0 experts
    try:
        fpipe.load(root / "six", [{"0": {"dense": template(full[0]["dense"]), "w": six}}], parallel=step_c)
    except ValueError as error:
        out["six"] = str(error)
    # dp 2 x pp 1 x ep 2: a run of STEPS steps, and the same run saved after SAVED_AT and resumed
    b = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "ep"))
    dp, _, ep = b.get_coordinate()
    step_b = pipeline(b)
    optimizer = fpipe.optim.adamw(1e-2, weight_decay=0.01)

    def train(params: list[Any], state: Any, start: int, stop: int) -> tuple[dict[int, torch.Tensor], Any, Any]:
        losses = {}
        for i in range(start, stop):
            loss, grads = step_b(params, expert_batch(4 * i + 2 * dp + ep))
            params, state = optimizer.update(params, grads, state)
            losses[i] = loss
        return losses, params, state

    params = on(b, full, step_b)
    runs = [train(params, optimizer.init(params), 0, STEPS)]
    _, params, state = train(params, optimizer.init(params), 0, SAVED_AT)
    fpipe.save_state(root / "state", fpipe.TrainState(params, state, step=SAVED_AT), parallel=step_b)
    with fpipe.AsyncSaver(parallel=step_b) as saver:
        saver.save_state(root / "async state", fpipe.TrainState(params, state, step=SAVED_AT))
    for name in ("state", "async state"):
        fresh = on(b, template(full), step_b)
        resumed = fpipe.load_state(root / name, fresh, optimizer_state=optimizer.init(fresh), parallel=step_b)
        assert resumed.step == SAVED_AT
        runs.append(train(resumed.params, resumed.optimizer_state, SAVED_AT, STEPS))
    out["runs"] = [(losses, pieces(params)) for losses, params, _ in runs]
    # ("ep", "pp", "dp"): global ranks 1 and 2 keep their replica index but run other experts
    e = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("ep", "pp", "dp"))
    step_e = pipeline(e)
    try:
        fpipe.load_state(root / "state", on(e, template(full), step_e), parallel=step_e)
    except (ValueError, RuntimeError) as error:
        out["other layout"] = f"{type(error).__name__}: {error}"
    return out
