"""``fpipe.save``/``load`` with DTensor parameters on a pp x tp mesh (NOTE [tensor-parallel saves]).

A pp 2 x tp 2 save: every tensor-parallel rank writes its own pieces (uneven ones, an empty one,
a tied DTensor held by both pipeline ranks, replicated norms and plain tensors written once), and
the save loads bitwise into the same layout (DTensor templates on the meta device, each rank
reading only its pieces), into one process with plain tensors, and a plain save loads into the
pp 2 x tp 2 DTensors. ``save_state``/``load_state`` and ``AsyncSaver`` take the same path.
The same processes load a Hugging Face checkpoint into a tiny Llama parallelized by torch's
``parallelize_module`` and split in two (``load_hf``), each rank reading only its pieces' bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import fpipe
from fpipe._saving._directory import INDEX, LATEST
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.saving.test_hf_load import TWO, Spy, checkpoint, example, meta_model
from tests.saving.test_hf_save import assert_same_logits, from_pretrained
from tests.saving.test_save import assert_bitwise, edit_index, template

pytestmark = pytest.mark.timeout(120)

# name -> placement on the tp sub-mesh: ("Shard", dim) or ("Replicate",); other names are plain tensors
PLACEMENTS = {
    "wq": ("Shard", 0),  # 8 rows: 4 and 4
    "wo": ("Shard", 1),  # 8 columns: 4 and 4
    "odd": ("Shard", 0),  # 5 rows: 3 and 2 (torch.chunk)
    "col": ("Shard", 1),  # 5 columns: 3 and 2
    "tiny": ("Shard", 0),  # 1 row: 1 and an empty piece
    "norm": ("Replicate",),
    "tied": ("Shard", 0),  # in both stages, bitwise equal: a tied parameter
}


def _full() -> list[dict[str, torch.Tensor]]:
    """Two stages' full parameters, in float64; ``tied`` is the same tensor in both."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    tied = w(7, 4)
    stages = []
    for s in range(2):
        block = {"wq": w(8, 8), "wo": w(8, 8), "odd": w(5, 3), "col": w(3, 5), "tiny": w(1, 4), "norm": 1 + w(8)}
        stages.append({**{f"b{s}.{k}": v for k, v in block.items()}, "tied": tied.clone(), f"bias{s}": w(3)})
    return stages


def _distribute(tree: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, t in tree.items():
        p = PLACEMENTS.get(name.split(".")[-1])
        out[name] = t if p is None else distribute_tensor(t, mesh, [Shard(p[1]) if p[0] == "Shard" else Replicate()])
    return out


def _state(params: list[Any]) -> list[Any]:
    """Optimizer state shaped like ``params`` (DTensors where they are), with a step counter."""
    return [None if p is None else {"m": {k: v * 2 for k, v in p.items()}, "step": torch.tensor(3)} for p in params]


def _state_template(params: list[Any]) -> list[Any]:
    return [None if p is None else {"m": p, "step": torch.empty((), dtype=torch.int64, device="meta")} for p in params]


def _gathered(trees: list[Any]) -> list[Any]:
    """Every DTensor as its full tensor (a collective over the tp group), with its type and placements."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor(), "DTensor", str(tuple(t.placements)), list(t.to_local().shape)
        return t, "Tensor", "", list(t.shape)

    def walk(tree: Any) -> Any:
        return {k: walk(v) for k, v in tree.items()} if isinstance(tree, dict) else full(tree)

    return [None if t is None else walk(t) for t in trees]


def _ranks(rank: int, world: int, directory: str, plain: str, hf: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    root = Path(directory)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_coordinate()
    full = _full()
    params = [_distribute(p, mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    meta = [_distribute(template(p), mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    out: dict[str, Any] = {"pp": pp, "tp": tp}
    step = fpipe.pipeline(lambda y, mb: y.sum(), [lambda p, x: x] * 2, OneFOneB(2), mesh=mesh)
    fpipe.save(root / "tp", params, optimizer_state=_state(params), metadata={"step": 3}, step=step)
    spy = Spy()
    loaded = fpipe.load(root / "tp", meta, optimizer_state=_state_template(meta), mesh=mesh)
    out["read"] = dict(spy.read)
    out["same layout"] = _gathered(loaded.params), _gathered(loaded.optimizer_state), loaded.metadata
    out["from plain"] = _gathered(fpipe.load(plain, meta, mesh=mesh).params)
    # The training state, and AsyncSaver (a host copy of each local piece, saved in a thread).
    fpipe.save_state(root / "state", fpipe.TrainState(params, _state(params), step=5, metadata={"at": 1}), mesh=mesh)
    state = fpipe.load_state(root / "state", meta, optimizer_state=_state_template(meta), mesh=mesh)
    out["state"] = _gathered(state.params), _gathered(state.optimizer_state), state.step, state.metadata
    with fpipe.AsyncSaver(mesh=mesh) as saver:
        saver.save(root / "async", params)
    out["async"] = _gathered(fpipe.load(root / "async", meta, mesh=mesh).params)
    # Errors, on every rank, and the mesh usable after each.
    errors: dict[str, Any] = {}
    differ = [None if p is None else {**p, f"bias{pp}": p[f"bias{pp}"] + tp} for p in params]  # tp 1's copy differs
    wrong_mesh = [None if p is None else dict(p) for p in params]
    if (pp, tp) == (1, 1):
        wrong_mesh[1]["b1.norm"] = DTensor.from_local(params[1]["b1.norm"].to_local(), mesh["pp"], [Replicate()])
    other_layout = [None if p is None else dict(p) for p in params]
    if pp == 1:  # the tied parameter cut by columns here, by rows on pipeline rank 0
        other_layout[1]["tied"] = _distribute({"b.col": full[1]["tied"]}, mesh["tp"])["b.col"]
    partial = [
        None if p is None else {**p, f"b{pp}.wq": DTensor.from_local(torch.ones(2), mesh["tp"], [Partial()])}
        for p in params
    ]
    other_shape = [None if p is None else dict(p) for p in params]
    if pp == 1:  # the tied parameter with a row less here
        other_shape[1]["tied"] = _distribute({"b.wq": full[1]["tied"][:6]}, mesh["tp"])["b.wq"]
    odd_piece = [None if t is None else dict(t) for t in meta]  # a local piece torch.chunk would not cut
    odd_piece[pp][f"b{pp}.wq"] = DTensor.from_local(
        torch.empty(2, 8, dtype=torch.float64), mesh["tp"], [Shard(0)], run_check=False, shape=(8, 8), stride=(8, 1)
    )
    for what, call in [
        ("differ", lambda: fpipe.save(root / "bad", differ, mesh=mesh)),
        ("wrong mesh", lambda: fpipe.save(root / "bad", wrong_mesh, mesh=mesh)),
        ("other layout", lambda: fpipe.save(root / "bad", other_layout, mesh=mesh)),
        ("other shape", lambda: fpipe.save(root / "bad", other_shape, mesh=mesh)),
        ("odd piece", lambda: fpipe.load(root / "tp", odd_piece, mesh=mesh)),
        ("no tp", lambda: fpipe.save(root / "bad", params, group=dist.group.WORLD)),
        ("partial", lambda: fpipe.save(root / "bad", partial, mesh=mesh)),
        ("save_hf differ", lambda: fpipe.save_hf(root / "hf bad", differ, mesh=mesh)),
        ("save_hf wrong mesh", lambda: fpipe.save_hf(root / "hf bad", wrong_mesh, mesh=mesh)),
    ]:
        try:
            call()
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as error:
            errors[what] = f"{type(error).__name__}: {error}"
    out["errors"] = errors
    out["after"] = _gathered(fpipe.load(root / "tp", meta, mesh=mesh).params)
    out["hf"] = _load_hf(mesh, hf, root / "hf_out")
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], Any]:
    directory = tmp_path_factory.mktemp("tp")
    fpipe.save(directory / "plain", _full())
    model = checkpoint(example(), directory / "hf")
    results = run_ranks(4, _ranks, str(directory), str(directory / "plain"), str(directory / "hf"), timeout=150)
    return directory, results, model


def _check_gathered(result: Any, full: list[dict[str, torch.Tensor]], pp: int, *, state: bool = False) -> None:
    """``result`` (of ``_gathered``) is stage ``pp`` of ``full``, bitwise, with the placements of ``PLACEMENTS``."""
    for s, tree in enumerate(result):
        if s != pp:
            assert tree is None
            continue
        expected = full[s]
        assert tree.keys() == expected.keys()
        for name, (value, kind, placements, _) in tree.items():
            assert_bitwise(value, expected[name] * 2 if state else expected[name])
            p = PLACEMENTS.get(name.split(".")[-1])
            assert kind == ("Tensor" if p is None else "DTensor"), name
            if p is not None:
                assert placements == (f"(Shard(dim={p[1]}),)" if p[0] == "Shard" else "(Replicate(),)"), name


def test_a_tensor_parallel_save_reloads_bitwise_into_the_same_layout(saved: tuple[Path, list[Any], Any]) -> None:
    _, results, _ = saved
    full = _full()
    for r in results:
        params, state, metadata = r["same layout"]
        _check_gathered(params, full, r["pp"])
        _check_gathered([None if t is None else t["m"] for t in state], full, r["pp"], state=True)
        assert [None if t is None else t["step"][0] for t in state] == [
            torch.tensor(3) if s == r["pp"] else None for s in range(2)
        ]
        assert metadata == {"step": 3}
        # Uneven pieces as torch.chunk cuts them: 5 rows as 3 and 2, 1 row as 1 and 0.
        stage = params[r["pp"]]
        assert stage[f"b{r['pp']}.odd"][3] == [[3, 3], [2, 3]][r["tp"]]
        assert stage[f"b{r['pp']}.tiny"][3] == [[1, 4], [0, 4]][r["tp"]]
        _check_gathered(r["after"], full, r["pp"])


def test_each_rank_writes_and_reads_only_its_own_pieces(saved: tuple[Path, list[Any], Any]) -> None:
    directory, results, _ = saved
    root = directory / "tp"
    version = root / (root / LATEST).read_text().strip()
    index = json.loads((version / INDEX).read_text())
    name = "model-rank-0000{}-of-00002-tp-0000{}-of-00002.safetensors"
    files = {f: (i["rank"], i["tp"]) for f, i in index["files"].items() if f.startswith("model")}
    assert files == {name.format(p, t): (p, t) for p in (0, 1) for t in (0, 1)}
    for p in (0, 1):
        for t in (0, 1):
            with safe_open(version / name.format(p, t), "pt") as f:
                shapes = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
            # the pieces of this (pp, tp); whole tensors (norms, biases) once, by tp 0; the tied
            # parameter by pipeline rank 0 only
            expected = {f"b{p}.wq": [4, 8], f"b{p}.wo": [8, 4], f"b{p}.odd": [[3, 3], [2, 3]][t]}
            expected |= {f"b{p}.col": [[3, 3], [3, 2]][t], f"b{p}.tiny": [[1, 4], [0, 4]][t]}
            expected |= {f"b{p}.norm": [8], f"bias{p}": [3]} if t == 0 else {}
            expected |= {"tied": [[4, 4], [3, 4]][t]} if p == 0 else {}
            assert shapes == expected, (p, t)
    assert index["weight_map"]["b1.norm"] == name.format(1, 0)
    assert index["weight_map"]["b1.odd"] == [name.format(1, 0), name.format(1, 1)]
    piece = index["tensors"][name.format(1, 1)]["b1.odd"]
    assert piece["offset"] == [3, 0] and piece["shape"] == [2, 3] and piece["full_shape"] == [5, 3]
    assert index["weight_map"]["tied"] == [name.format(0, 0), name.format(0, 1)]
    for r in results:  # the same layout reads exactly its own pieces, each once (none if empty)
        mine = {k: _local_numel(k, v, r["tp"]) for k, v in _full()[r["pp"]].items()}
        expected = {k: n for k, n in mine.items() if n} | {f"m.{k}": n for k, n in mine.items() if n} | {"step": 1}
        assert r["read"] == expected


def _local_numel(name: str, t: torch.Tensor, tp: int) -> int:
    """The elements of ``t`` that tensor-parallel rank ``tp`` of 2 holds (torch.chunk's pieces)."""
    p = PLACEMENTS.get(name.split(".")[-1])
    if p is None or p[0] == "Replicate":
        return t.numel()
    n = t.shape[p[1]]
    c = -(-n // 2)
    return t.numel() // n * max(0, min(n, (tp + 1) * c) - tp * c)


def test_a_tensor_parallel_save_loads_into_one_process_and_a_plain_save_into_tensor_parallel(
    saved: tuple[Path, list[Any], Any],
) -> None:
    directory, results, _ = saved
    full = _full()
    loaded = fpipe.load(directory / "tp", template(full), optimizer_state=_state_template(template(full)))
    assert_bitwise(loaded.params, full)
    assert_bitwise(loaded.optimizer_state, _state(full))
    merged = fpipe.load(directory / "tp", [{**template(full[0]), **template(full[1])}]).params[0]
    assert_bitwise(merged, {**full[0], **full[1]})  # one stage: every name, the tied one once
    for r in results:
        _check_gathered(r["from plain"], full, r["pp"])
        _check_gathered(r["async"], full, r["pp"])


def test_save_state_round_trips_with_tensor_parallel(saved: tuple[Path, list[Any], Any]) -> None:
    full = _full()
    for r in saved[1]:
        params, state, number, metadata = r["state"]
        _check_gathered(params, full, r["pp"])
        _check_gathered([None if t is None else t["m"] for t in state], full, r["pp"], state=True)
        assert (number, metadata) == (5, {"at": 1})


def test_bad_tensor_parallel_saves_fail_on_every_rank(saved: tuple[Path, list[Any], Any]) -> None:
    for r in saved[1]:
        errors = r["errors"]
        # bias0 is the first name checked, the same on every rank
        assert (
            "ValueError: fpipe.save: params[0]['bias0'] differs between tensor-parallel ranks (rank 0: "
            in (errors["differ"])
        )
        assert "; rank 0 tp 1: sha256 " in errors["differ"]
        if (r["pp"], r["tp"]) == (1, 1):
            assert (
                "params[1]['b1.norm'] is a DTensor on a mesh that is not this rank's tensor-parallel"
                in (errors["wrong mesh"])
            )
        else:
            assert "RuntimeError: fpipe.save: rank(s) [1 (tp 1)] failed while naming their" in errors["wrong mesh"]
        assert (
            "the pieces of 'tied' held by params[0]['tied'] (rank 0), params[0]['tied'] (rank 0 tp 1)"
            in (errors["other layout"])
        )
        assert "do not cover its shape [7, 4] exactly once: they cover 56 of its 28 elements" in errors["other layout"]
        b = f"b{r['pp']}"
        assert (
            f"ValueError: fpipe.save: params[{r['pp']}]['{b}.col'] is a DTensor but the save has no tensor-"
            in (errors["no tp"])
        )
        assert (
            f"TypeError: fpipe.save: params[{r['pp']}]['{b}.wq'] is a DTensor with placement Partial"
            in (errors["partial"])
        )
        assert (
            "have the same name 'tied' but different dtypes or shapes (float64[7, 4] vs float64[6, 4])"
            in (errors["other shape"])
        )
        assert (
            f"ValueError: fpipe.load: template[{r['pp']}]['{b}.wq'] is a DTensor whose local piece has shape "
            in (errors["odd piece"])
        )
        assert (
            "[2, 8], but its placements [Shard(dim=0)] cut shape [8, 8] into pieces of shape [4, 8]"
            in (errors["odd piece"])
        )
        assert (
            "ValueError: fpipe.save_hf: the tensor-parallel ranks of pipeline rank 0 hold different leaves (rank 0 "
            "(tp 0): params[0]['bias0']: a Tensor float64[3] sha256 " in errors["save_hf differ"]
        )
        if (r["pp"], r["tp"]) == (1, 1):
            assert (
                "ValueError: fpipe.save_hf: params[1]['b1.norm'] is a DTensor on a mesh that is not this rank's "
                "tensor-parallel sub-mesh" in errors["save_hf wrong mesh"]
            )
        else:
            assert (
                "RuntimeError: fpipe.save_hf: rank(s) [1 (tp 1)] failed while checking their DTensors"
                in errors["save_hf wrong mesh"]
            )
        assert not (saved[0] / "hf bad").exists()


def _three_dimensions(rank: int, world: int, directory: str) -> tuple[int, list[Any]]:
    """dp 2 x pp 2 x tp 2: the first replica's ranks write, the other replica waits; all load."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    pp = mesh.get_coordinate()[1]
    full = _full()
    params = [_distribute(p, mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    fpipe.save(directory, params, mesh=mesh)
    meta = [_distribute(template(p), mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    return pp, _gathered(fpipe.load(directory, meta, mesh=mesh).params)


@pytest.mark.slow
def test_data_times_pipeline_times_tensor_parallel_saves(tmp_path: Path) -> None:
    results = run_ranks(8, _three_dimensions, str(tmp_path), timeout=200)
    full = _full()
    for pp, gathered in results:
        _check_gathered(gathered, full, pp)
    index = json.loads((tmp_path / (tmp_path / LATEST).read_text().strip() / INDEX).read_text())
    assert sorted((f["rank"], f["tp"]) for f in index["files"].values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_bitwise(fpipe.load(tmp_path, template(full)).params, full)


# --- shard_params=True on dp 2 x pp 1 x tp 2 -------------------------------------------------


def _sharded_ranks(rank: int, world: int, directory: str, plain: str, hf: str) -> dict[str, Any]:
    """Each rank of dp 2 x pp 1 x tp 2 (both stages on the one pipeline rank) holds, per DTensor, a
    flat shard of its local piece: the sharded step's save, loaded into the same layout, a
    tensor-parallel layout without shards; ``load_hf`` and a plain save into the shards; errors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fpipe._sharding._layout import cut_range

    root = Path(directory)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    dp, _, tp = mesh.get_coordinate()
    full = _full()
    params = [_distribute(p, mesh["tp"]) for p in full]
    meta = [_distribute(template(p), mesh["tp"]) for p in full]
    step = fpipe.pipeline(lambda y, mb: y.sum(), [lambda p, x: x] * 2, OneFOneB(2), mesh=mesh, shard_params=True)
    shards = step.shard(params)
    target = step.shard(meta)
    out: dict[str, Any] = {"dp": dp, "tp": tp, "shards": shards, "state": _state(shards)}
    fpipe.save(root / "sharded", shards, optimizer_state=_state(shards), metadata={"step": 3}, step=step)
    spy = Spy()
    same = fpipe.load(root / "sharded", target, optimizer_state=_state_template(target), step=step)
    out["read"], out["same layout"] = dict(spy.read), (same.params, same.optimizer_state, same.metadata)
    unsharded = fpipe.load(root / "sharded", meta, optimizer_state=_state_template(meta), mesh=mesh)
    out["tp layout"] = _gathered(unsharded.params), _gathered([t["m"] for t in unsharded.optimizer_state])
    out["from plain"] = fpipe.load(plain, target, step=step).params
    # dp 4 without tp: each rank's shard of each whole tensor, from every shard of the boxes it overlaps
    step4 = fpipe.pipeline(
        lambda y, mb: y.sum(),
        [lambda p, x: x] * 2,
        OneFOneB(2),
        mesh=init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "pp")),
        shard_params=True,
    )
    out["dp 4"] = fpipe.load(root / "sharded", step4.shard(template(full)), step=step4).params, step4.shard(full)
    fpipe.save_state(root / "state", fpipe.TrainState(shards, _state(shards), step=5), step=step)
    state = fpipe.load_state(root / "state", target, optimizer_state=_state_template(target), step=step)
    with fpipe.AsyncSaver(step=step) as saver:
        saver.save(root / "async", shards, optimizer_state=_state(shards))
    out["train state"] = state.params, state.optimizer_state, state.step
    out["async"] = fpipe.load(root / "async", target, optimizer_state=_state_template(target), step=step)[:2]
    spy = Spy()
    out["hf"] = fpipe.load_hf(hf, target, step=step)
    # each rank reads the elements of its shard of its local piece, the padding excluded
    out["hf read"] = dict(spy.read)
    ranges = {
        n: cut_range(t.to_local().numel() if isinstance(t, DTensor) else t.numel(), (dp, 2))
        for p in params
        for n, t in p.items()
    }
    out["hf expected"] = {n: stop - start for n, (start, stop, _) in ranges.items()}
    fpipe.save_hf(root / "hf_out", shards, step=step)
    errors = {}
    full_here = [dict(p) for p in shards]
    if rank == 3:  # a full DTensor where its shard belongs, on one rank
        full_here[0]["b0.wq"] = params[0]["b0.wq"]
    for what, call in [
        ("full here", lambda: fpipe.save(root / "bad", full_here, step=step)),
        ("unsharded template", lambda: fpipe.load(root / "sharded", meta, step=step)),
    ]:
        try:
            call()
        except (ValueError, RuntimeError) as error:
            errors[what] = f"{type(error).__name__}: {error}"
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def sharded(saved: tuple[Path, list[Any], Any]) -> tuple[Path, list[Any]]:
    directory = saved[0]
    fpipe.save_hf(directory / "hf sharded", _full())
    args = str(directory / "sharded"), str(directory / "plain"), str(directory / "hf sharded")
    return directory / "sharded", run_ranks(4, _sharded_ranks, *args, timeout=150)


def test_sharded_tensor_parallel_saves_reload_bitwise_into_every_layout(sharded: tuple[Path, list[Any]]) -> None:
    directory, results = sharded
    full = _full()
    for r in results:
        params, state, metadata = r["same layout"]
        assert_bitwise(params, r["shards"])
        assert_bitwise(state, r["state"])
        assert metadata == {"step": 3}
        tp_params, tp_state = r["tp layout"]
        for s in (0, 1):
            _check_gathered([t if i == s else None for i, t in enumerate(tp_params)], full, s)
            _check_gathered([t if i == s else None for i, t in enumerate(tp_state)], full, s, state=True)
        assert_bitwise(r["from plain"], r["shards"])
        assert_bitwise(*r["dp 4"])
        assert_bitwise(r["train state"][:2], (r["shards"], r["state"]))
        assert r["train state"][2] == 5
        assert_bitwise(r["async"], (r["shards"], r["state"]))
        assert_bitwise(r["hf"], r["shards"])
        assert r["hf read"] == {n: k for n, k in r["hf expected"].items() if k}
    # the replicated run's params, bitwise: into one process, from the shards of every rank, and
    # exported by save_hf (each DTensor's local piece gathered over dp, then over tp)
    assert_bitwise(fpipe.load_hf(directory / "hf_out", template(full)), full)
    loaded = fpipe.load(directory / "sharded", template(full), optimizer_state=_state_template(template(full)))
    assert_bitwise(loaded.params, full)
    assert_bitwise(loaded.optimizer_state, _state(full))


def test_each_sharded_tensor_parallel_rank_writes_and_reads_its_own_shards(sharded: tuple[Path, list[Any]]) -> None:
    directory, results = sharded
    root = directory / "sharded"
    version = root / (root / LATEST).read_text().strip()
    index = json.loads((version / INDEX).read_text())
    name = "model-rank-00000-of-00001-dp-0000{}-of-00002-tp-0000{}-of-00002.safetensors"
    files = {f: (i["replica"], i["tp"]) for f, i in index["files"].items() if f.startswith("model")}
    assert files == {name.format(q, t): (q, t) for q in (0, 1) for t in (0, 1)}
    # b0.odd: 5 x 3 by rows over tp 2 (3 and 2 rows), each piece cut in 2 flat shards over dp
    assert index["weight_map"]["b0.odd"] == [name.format(q, t) for t in (0, 1) for q in (0, 1)]
    piece = index["tensors"][name.format(1, 1)]["b0.odd"]
    assert piece == {
        **piece,
        "shard": [1, 2],
        "offset": [3, 0],
        "box_shape": [2, 3],
        "shape": [3],
        "full_shape": [5, 3],
    }
    # a plain tensor and a Replicate DTensor: flat shards of the whole tensor, written by tp 0
    assert index["weight_map"]["b0.norm"] == [name.format(q, 0) for q in (0, 1)]
    assert "offset" not in index["tensors"][name.format(0, 0)]["b0.norm"]
    for r in results:  # the same layout reads exactly its own shards, each once
        with safe_open(version / name.format(r["dp"], r["tp"]), "pt") as f:
            mine = {n: f.get_slice(n).get_shape()[0] for n in f.keys()}  # noqa: SIM118
        shards = {n: t.numel() for p in r["shards"] for n, t in p.items()}
        nonempty = {n: k for n, k in shards.items() if k}
        assert r["read"] == nonempty | {f"m.{n}": k for n, k in nonempty.items()} | {"step": 1}
        assert all(mine[n] == shards[n] for n in mine)


def test_bad_sharded_tensor_parallel_saves_fail_on_every_rank(sharded: tuple[Path, list[Any]]) -> None:
    for rank, r in enumerate(sharded[1]):
        errors = r["errors"]
        if rank == 3:
            assert (
                "ValueError: fpipe.save: params[0]['b0.wq'] should be this rank's shard of the local piece (shape "
                "[4, 8]) of a tensor of shape [8, 8], a 1-D tensor of 16 elements (got: shape [4, 8])"
                in errors["full here"]
            )
        else:
            assert "RuntimeError: fpipe.save: rank(s) [0 (dp 1 tp 1)] failed while naming" in errors["full here"]
        assert (
            "ValueError: fpipe.load: template[0]['b0.col'] should be this rank's shard of the local piece (shape "
            f"{[[3, 3], [3, 2]][r['tp']]}) of a tensor of shape [3, 5]" in errors["unsharded template"]
        )


# --- load_hf -----------------------------------------------------------------------------------

# Megatron's plan: q, k, v, gate and up cut by rows (their outputs), o and down by columns.
TP_PLAN = {
    **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _load_hf(mesh: Any, directory: str, out: Path) -> dict[str, Any]:
    """On pp 2 x tp 2: a meta model parallelized by torch's ``parallelize_module``, split in two;
    each rank loads its stage's pieces from a Hugging Face checkpoint, and exports them to ``out``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    hf = example()
    pp = mesh.get_coordinate()[0]
    model = meta_model(hf)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    _, meta = fpipe.split_module(model, TWO, call=hf.CALL)
    spy = Spy()
    params = fpipe.load_hf(directory, [p if s == pp else None for s, p in enumerate(meta)], mesh=mesh)
    fpipe.save_hf(out, params, config=directory, mesh=mesh)
    local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in params[pp].items()}
    full = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t, str(getattr(t, "placements", "")))
        for n, t in params[pp].items()
    }
    return {"pp": pp, "read": dict(spy.read), "local": {n: t.numel() for n, t in local.items()}, "full": full}


def test_load_hf_into_tensor_parallel_stages_reads_only_their_pieces(saved: tuple[Path, list[Any], Any]) -> None:
    _, results, model = saved
    hf = example()
    results = [r["hf"] for r in results]
    named = {n: p.detach() for n, p in model.named_parameters()}
    _, params = fpipe.split_module(model, TWO, call=hf.CALL)
    for result in results:
        names = set(params[result["pp"]])
        assert result["full"].keys() == names
        for name, (tensor, placements) in result["full"].items():
            assert_bitwise(tensor, named[name])
            kind = next((v for k, v in TP_PLAN.items() if name.startswith(k.replace("*", name.split(".")[2]))), None)
            assert placements == {"colwise": "(Shard(dim=0),)", "rowwise": "(Shard(dim=1),)", None: ""}[kind], name
        # each rank read exactly the elements of its own pieces: half of each cut weight
        assert result["read"] == result["local"]
        assert sum(n for n in result["local"].values()) < sum(named[n].numel() for n in names)


def test_save_hf_from_tensor_parallel_stages_loads_with_from_pretrained(saved: tuple[Path, list[Any], Any]) -> None:
    """The pp 2 x tp 2 stages that ``load_hf`` filled, exported by ``save_hf`` (each DTensor
    gathered to tensor-parallel rank 0): ``from_pretrained`` gives the model's weights and logits."""
    directory, _, model = saved
    out = directory / "hf_out"
    assert_bitwise(dict(from_pretrained(out).state_dict()), dict(model.state_dict()))
    assert_same_logits(out, model, example())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


# --- Hostile indexes (NOTE [trust model]) -----------------------------------------------------


def _edits() -> list[tuple[Any, str]]:
    a, b = (f"model-rank-00000-of-00002-tp-0000{t}-of-00002.safetensors" for t in (0, 1))

    odd = ["tensors", b, "b0.odd"]
    return [
        (
            edit_index([*odd, "offset"], [4, 0]),
            r"the box at offset \[4, 0\] of shape \[2, 3\] is not inside shape \[5, 3\]",
        ),
        (edit_index([*odd, "offset"], [2, 0]), r"the boxes at offsets \[0, 0\] and \[2, 0\] overlap"),
        (edit_index(["weight_map", "b0.odd"], [a]), r"they cover 9 of its 15 elements"),
        (edit_index(["weight_map", "b0.odd"], [a, a]), r"weight_map\['b0.odd'\] names a file twice"),
        (edit_index([*odd, "offset"], [3]), r"an offset and shape of 2 dimensions"),
        (edit_index([*odd, "full_shape"], [6, 3]), r"the pieces of 'b0.odd' disagree"),
        (edit_index([*odd, "offset"], KeyError), r"\['b0.odd'\]\['shard'\] is missing"),  # neither a box nor a shard
        (edit_index([*odd, "offset"], [-1, 0]), r"\['offset'\] should be a list of ints >= 0"),
    ]


def _sharded_edits() -> list[tuple[Any, str]]:
    """Edits of the sharded tensor-parallel save's index: ``b0.odd``'s pieces are (box, shard) (rows
    [0, 3), 0), ([0, 3), 1), ([3, 5), 0), ([3, 5), 1), of 5, 5, 3 and 3 elements."""
    name = "model-rank-00000-of-00001-dp-0000{}-of-00002-tp-0000{}-of-00002.safetensors"
    second = ["tensors", name.format(1, 1), "b0.odd"]  # shard 1 of the box at rows [3, 5)

    return [
        (edit_index([*second, "box_shape"], [1, 3]), r"the shards of one box of 'b0.odd' disagree"),
        (edit_index([*second, "box_shape"], KeyError), r"\['box_shape'\] is missing"),
        (edit_index([*second, "shard"], [0, 2]), r"\['shard'\] should be \[1, 2\]"),
        (edit_index([*second, "shard"], KeyError), r"each should be a box, a shard or a shard of a box like the first"),
        (edit_index(["tensors", name.format(0, 0), "b0.odd", "shard"], [0, 3]), r"with d > 0 dividing its 4 pieces"),
        (edit_index([*second, "shape"], [4]), r"the pieces of 'b0.odd' disagree: .* and shape \[3\]"),
        (edit_index([*second, "offset"], [2, 0]), r"the shards of one box of 'b0.odd' disagree"),
        (edit_index(["weight_map", "b0.odd"], [name.format(q, 0) for q in (0, 1)]), r"they cover 9 of its 15 elements"),
    ]


def test_hostile_sharded_boxes_are_refused(sharded: tuple[Path, list[Any]]) -> None:
    _refused(sharded[0] / "sharded", _sharded_edits())


def test_hostile_boxes_are_refused(saved: tuple[Path, list[Any], Any]) -> None:
    _refused(saved[0] / "tp", _edits())


def _refused(root: Path, edits: list[tuple[Any, str]]) -> None:
    """Each of ``edits`` to the index of the save in ``root`` makes ``fpipe.load`` raise its fragment."""
    version = root / (root / LATEST).read_text().strip()
    original = (version / INDEX).read_text()
    full = _full()
    try:
        for apply, fragment in edits:
            index = json.loads(original)
            apply(index)
            (version / INDEX).write_text(json.dumps(index))
            with pytest.raises(ValueError, match=r"is not an index written by fpipe\.save: .*" + fragment):
                fpipe.load(root, template(full))
    finally:
        (version / INDEX).write_text(original)
