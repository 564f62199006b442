"""Tensor-parallel saves (NOTE [tensor-parallel saves]): the parameters, the spawned ranks and the
checks shared by the saving tests, whose spawns run once per session (tests/saving/conftest.py).

A pp 2 x tp 2 save (``tp_save_ranks``): every tensor-parallel rank writes its own pieces (uneven ones, an
empty one, a tied DTensor held by both pipeline ranks, replicated norms and plain tensors written
once), and the save loads bitwise into the same layout (DTensor templates on the meta device,
each rank reading only its pieces), into one process with plain tensors, and a plain save loads
into the pp 2 x tp 2 DTensors. ``save_state``/``load_state`` and ``AsyncSaver`` take the same path.
The same processes load a Hugging Face checkpoint into a tiny Llama parallelized by torch's
``parallelize_module`` and split in two (``load_hf``), each rank reading only its pieces' bytes.
A dp 2 x pp 1 x tp 2 save with ``shard_params=True`` (``tp_sharded_save_ranks``) holds, per DTensor, a
flat shard of its local piece.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import fpipe
from fpipe.schedules import OneFOneB
from tests.helpers import HF_TWO_STAGES, assert_bitwise, hf_example, hf_meta_model
from tests.saving._tools import Spy, template

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


def tp_params() -> list[dict[str, torch.Tensor]]:
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


def distribute_tp(tree: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, t in tree.items():
        p = PLACEMENTS.get(name.split(".")[-1])
        out[name] = t if p is None else distribute_tensor(t, mesh, [Shard(p[1]) if p[0] == "Shard" else Replicate()])
    return out


def tp_state(params: list[Any]) -> list[Any]:
    """Optimizer state shaped like ``params`` (DTensors where they are), with a step counter."""
    return [None if p is None else {"m": {k: v * 2 for k, v in p.items()}, "step": torch.tensor(3)} for p in params]


def tp_state_template(params: list[Any]) -> list[Any]:
    return [None if p is None else {"m": p, "step": torch.empty((), dtype=torch.int64, device="meta")} for p in params]


def gather_tp(trees: list[Any]) -> list[Any]:
    """Every DTensor as its full tensor (a collective over the tp group), with its type and placements."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor(), "DTensor", str(tuple(t.placements)), list(t.to_local().shape)
        return t, "Tensor", "", list(t.shape)

    def walk(tree: Any) -> Any:
        return {k: walk(v) for k, v in tree.items()} if isinstance(tree, dict) else full(tree)

    return [None if t is None else walk(t) for t in trees]


def tp_save_ranks(rank: int, world: int, directory: str, plain: str, hf: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    root = Path(directory)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_coordinate()
    full = tp_params()
    params = [distribute_tp(p, mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    meta = [distribute_tp(template(p), mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    out: dict[str, Any] = {"pp": pp, "tp": tp}
    step = fpipe.pipeline(
        lambda y, mb: y.sum(), [lambda p, x: x] * 2, OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh)
    )
    fpipe.save(root / "tp", params, optimizer_state=tp_state(params), metadata={"step": 3}, parallel=step)
    spy = Spy()
    loaded = fpipe.load(
        root / "tp", meta, optimizer_state=tp_state_template(meta), parallel=fpipe.Parallelism(mesh=mesh)
    )
    out["read"] = dict(spy.read)
    out["same layout"] = gather_tp(loaded.params), gather_tp(loaded.optimizer_state), loaded.metadata
    out["from plain"] = gather_tp(fpipe.load(plain, meta, parallel=fpipe.Parallelism(mesh=mesh)).params)
    # The training state, and AsyncSaver (a host copy of each local piece, saved in a thread).
    fpipe.save_state(
        root / "state",
        fpipe.TrainState(params, tp_state(params), step=5, metadata={"at": 1}),
        parallel=fpipe.Parallelism(mesh=mesh),
    )
    state = fpipe.load_state(
        root / "state", meta, optimizer_state=tp_state_template(meta), parallel=fpipe.Parallelism(mesh=mesh)
    )
    out["state"] = gather_tp(state.params), gather_tp(state.optimizer_state), state.step, state.metadata
    with fpipe.AsyncSaver(parallel=fpipe.Parallelism(mesh=mesh)) as saver:
        saver.save(root / "async", params)
    out["async"] = gather_tp(fpipe.load(root / "async", meta, parallel=fpipe.Parallelism(mesh=mesh)).params)
    # Errors, on every rank, and the mesh usable after each.
    errors: dict[str, Any] = {}
    differ = [None if p is None else {**p, f"bias{pp}": p[f"bias{pp}"] + tp} for p in params]  # tp 1's copy differs
    wrong_mesh = [None if p is None else dict(p) for p in params]
    if (pp, tp) == (1, 1):
        wrong_mesh[1]["b1.norm"] = DTensor.from_local(params[1]["b1.norm"].to_local(), mesh["pp"], [Replicate()])
    other_layout = [None if p is None else dict(p) for p in params]
    if pp == 1:  # the tied parameter cut by columns here, by rows on pipeline rank 0
        other_layout[1]["tied"] = distribute_tp({"b.col": full[1]["tied"]}, mesh["tp"])["b.col"]
    partial = [
        None if p is None else {**p, f"b{pp}.wq": DTensor.from_local(torch.ones(2), mesh["tp"], [Partial()])}
        for p in params
    ]
    other_shape = [None if p is None else dict(p) for p in params]
    if pp == 1:  # the tied parameter with a row less here
        other_shape[1]["tied"] = distribute_tp({"b.wq": full[1]["tied"][:6]}, mesh["tp"])["b.wq"]
    odd_piece = [None if t is None else dict(t) for t in meta]  # a local piece torch.chunk would not cut
    odd_piece[pp][f"b{pp}.wq"] = DTensor.from_local(
        torch.empty(2, 8, dtype=torch.float64), mesh["tp"], [Shard(0)], run_check=False, shape=(8, 8), stride=(8, 1)
    )
    for what, call in [
        ("differ", lambda: fpipe.save(root / "bad", differ, parallel=fpipe.Parallelism(mesh=mesh))),
        ("wrong mesh", lambda: fpipe.save(root / "bad", wrong_mesh, parallel=fpipe.Parallelism(mesh=mesh))),
        ("other layout", lambda: fpipe.save(root / "bad", other_layout, parallel=fpipe.Parallelism(mesh=mesh))),
        ("other shape", lambda: fpipe.save(root / "bad", other_shape, parallel=fpipe.Parallelism(mesh=mesh))),
        ("odd piece", lambda: fpipe.load(root / "tp", odd_piece, parallel=fpipe.Parallelism(mesh=mesh))),
        ("no tp", lambda: fpipe.save(root / "bad", params, parallel=fpipe.Parallelism(group=dist.group.WORLD))),
        ("partial", lambda: fpipe.save(root / "bad", partial, parallel=fpipe.Parallelism(mesh=mesh))),
        ("save_hf differ", lambda: fpipe.save_hf(root / "hf bad", differ, parallel=fpipe.Parallelism(mesh=mesh))),
        (
            "save_hf wrong mesh",
            lambda: fpipe.save_hf(root / "hf bad", wrong_mesh, parallel=fpipe.Parallelism(mesh=mesh)),
        ),
    ]:
        try:
            call()
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as error:
            errors[what] = f"{type(error).__name__}: {error}"
    out["errors"] = errors
    out["after"] = gather_tp(fpipe.load(root / "tp", meta, parallel=fpipe.Parallelism(mesh=mesh)).params)
    out["hf"] = _load_hf(mesh, hf, root / "hf_out")
    return out


def check_gathered(result: Any, full: list[dict[str, torch.Tensor]], pp: int, *, state: bool = False) -> None:
    """``result`` (of ``gather_tp``) is stage ``pp`` of ``full``, bitwise, with the placements of ``PLACEMENTS``."""
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


def tp_sharded_save_ranks(rank: int, world: int, directory: str, plain: str, hf: str) -> dict[str, Any]:
    """Each rank of dp 2 x pp 1 x tp 2 (both stages on the one pipeline rank) holds, per DTensor, a
    flat shard of its local piece: the sharded step's save, loaded into the same layout, a
    tensor-parallel layout without shards; ``load_hf`` and a plain save into the shards; errors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fpipe._sharding._layout import cut_range

    root = Path(directory)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    dp, _, tp = mesh.get_coordinate()
    full = tp_params()
    params = [distribute_tp(p, mesh["tp"]) for p in full]
    meta = [distribute_tp(template(p), mesh["tp"]) for p in full]
    step = fpipe.pipeline(
        lambda y, mb: y.sum(),
        [lambda p, x: x] * 2,
        OneFOneB(2),
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=True),
    )
    shards = step.shard(params)
    target = step.shard(meta)
    out: dict[str, Any] = {"dp": dp, "tp": tp, "shards": shards, "state": tp_state(shards)}
    fpipe.save(root / "sharded", shards, optimizer_state=tp_state(shards), metadata={"step": 3}, parallel=step)
    spy = Spy()
    same = fpipe.load(root / "sharded", target, optimizer_state=tp_state_template(target), parallel=step)
    out["read"], out["same layout"] = dict(spy.read), (same.params, same.optimizer_state, same.metadata)
    unsharded = fpipe.load(
        root / "sharded", meta, optimizer_state=tp_state_template(meta), parallel=fpipe.Parallelism(mesh=mesh)
    )
    out["tp layout"] = gather_tp(unsharded.params), gather_tp([t["m"] for t in unsharded.optimizer_state])
    out["from plain"] = fpipe.load(plain, target, parallel=step).params
    # dp 4 without tp: each rank's shard of each whole tensor, from every shard of the boxes it overlaps
    step4 = fpipe.pipeline(
        lambda y, mb: y.sum(),
        [lambda p, x: x] * 2,
        OneFOneB(2),
        parallel=fpipe.Parallelism(
            mesh=init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "pp")), shard_params=True
        ),
    )
    out["dp 4"] = fpipe.load(root / "sharded", step4.shard(template(full)), parallel=step4).params, step4.shard(full)
    fpipe.save_state(root / "state", fpipe.TrainState(shards, tp_state(shards), step=5), parallel=step)
    state = fpipe.load_state(root / "state", target, optimizer_state=tp_state_template(target), parallel=step)
    with fpipe.AsyncSaver(parallel=step) as saver:
        saver.save(root / "async", shards, optimizer_state=tp_state(shards))
    out["train state"] = state.params, state.optimizer_state, state.step
    out["async"] = fpipe.load(root / "async", target, optimizer_state=tp_state_template(target), parallel=step)[:2]
    spy = Spy()
    out["hf"] = fpipe.load_hf(hf, target, parallel=step)
    # each rank reads the elements of its shard of its local piece, the padding excluded
    out["hf read"] = dict(spy.read)
    ranges = {
        n: cut_range(t.to_local().numel() if isinstance(t, DTensor) else t.numel(), (dp, 2))
        for p in params
        for n, t in p.items()
    }
    out["hf expected"] = {n: stop - start for n, (start, stop, _) in ranges.items()}
    fpipe.save_hf(root / "hf_out", shards, parallel=step)
    errors = {}
    full_here = [dict(p) for p in shards]
    if rank == 3:  # a full DTensor where its shard belongs, on one rank
        full_here[0]["b0.wq"] = params[0]["b0.wq"]
    for what, call in [
        ("full here", lambda: fpipe.save(root / "bad", full_here, parallel=step)),
        ("unsharded template", lambda: fpipe.load(root / "sharded", meta, parallel=step)),
    ]:
        try:
            call()
        except (ValueError, RuntimeError) as error:
            errors[what] = f"{type(error).__name__}: {error}"
    out["errors"] = errors
    return out


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

    hf = hf_example()
    pp = mesh.get_coordinate()[0]
    model = hf_meta_model(hf)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    _, meta = fpipe.split_module(model, HF_TWO_STAGES, call=hf.CALL)
    spy = Spy()
    params = fpipe.load_hf(
        directory, [p if s == pp else None for s, p in enumerate(meta)], parallel=fpipe.Parallelism(mesh=mesh)
    )
    fpipe.save_hf(out, params, config=directory, parallel=fpipe.Parallelism(mesh=mesh))
    local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in params[pp].items()}
    full = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t, str(getattr(t, "placements", "")))
        for n, t in params[pp].items()
    }
    return {"pp": pp, "read": dict(spy.read), "local": {n: t.numel() for n, t in local.items()}, "full": full}
