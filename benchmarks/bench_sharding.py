"""What sharding parameters over the data-parallel ranks saves per rank, and what it costs per step.

Run::

    python benchmarks/bench_sharding.py            # 4 gloo processes on this machine, about a minute
    python benchmarks/bench_sharding.py --quick    # tiny sizes, a few seconds
    python benchmarks/bench_sharding.py --json out.json

Four processes (gloo, 127.0.0.1, one torch thread each) run a 4-stage residual MLP (float32,
one SwiGLU-free ``h + tanh(h W1 + b1) W2`` block per stage, 1F1B) on two meshes: 2 x 2
(dp x pp: each rank holds 2 stages, half of their parameters when sharded) and 4 x 1 (every rank
holds the 4 stages, a quarter of them when sharded). For each mesh and each of
``pipeline(..., shard_params=False)`` and ``True`` it reports, per rank:

- the bytes a rank keeps between steps: parameters, gradients and AdamW's two moments (measured
  on the tensors: shards include their padding);
- the bytes a sharded step gathers and holds while it runs (the local stages' full parameters);
- the median step time, the two modes timed A/B interleaved (one step of each in turn), each
  rank's median, and the slowest rank's.

Before timing, the sharded grads (gathered) are checked against the replicated ones.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fpipe
from fpipe.schedules import OneFOneB

MESHES = ((2, 2), (4, 1))  # (dp, pp)
WORLD = 4


def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def loss_fn(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((y - batch["y"]) ** 2).mean()


def first(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return block(p, batch["x"])


def init_params(num_stages: int, dim: int, hidden: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "w1": torch.randn(dim, hidden, generator=g) / dim**0.5,
            "b1": torch.zeros(hidden),
            "w2": torch.randn(hidden, dim, generator=g) / hidden**0.5,
        }
        for _ in range(num_stages)
    ]


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def measure(dp: int, pp: int, config: dict[str, Any]) -> dict[str, Any]:
    """One mesh, both modes, on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    num_stages = 4
    stages = [first] + [block] * (num_stages - 1)
    schedule = OneFOneB(config["microbatches"])
    full = init_params(num_stages, config["dim"], config["hidden"])
    g = torch.Generator().manual_seed(1 + replica)
    batch = {"x": torch.randn(config["batch"], config["dim"], generator=g)}
    batch["y"] = torch.randn(config["batch"], config["dim"], generator=g)

    plain = fpipe.pipeline(loss_fn, stages, schedule, mesh=mesh)
    sharded = fpipe.pipeline(loss_fn, stages, schedule, mesh=mesh, shard_params=True)
    local = [p if s in plain.local_stages else None for s, p in enumerate(full)]
    shards = sharded.shard(full)
    mine = batch if plain.rank == 0 else None

    loss_p, grads_p = plain(local, mine)
    loss_s, grads_s = sharded(shards, mine)
    torch.testing.assert_close(loss_s, loss_p, rtol=1e-6, atol=0)
    for s in plain.local_stages:
        torch.testing.assert_close(sharded.unshard(grads_s)[s], grads_p[s], rtol=1e-5, atol=1e-7)

    times: dict[str, list[float]] = {"replicated": [], "sharded": []}
    runs = {"replicated": lambda: plain(local, mine), "sharded": lambda: sharded(shards, mine)}
    for k in range(config["warmup"] + config["repeats"]):
        for name, run in runs.items():
            dist.barrier()  # start together: a step's time is then this rank's share of it
            start = time.perf_counter()
            run()
            if k >= config["warmup"]:
                times[name].append(time.perf_counter() - start)

    def state(params: Any, grads: Any) -> dict[str, int]:
        moments = 2 * nbytes(params)  # AdamW's m and v: zeros_like(params)
        return {"params": nbytes(params), "grads": nbytes(grads), "adamw": moments}

    row = {
        "rank": dist.get_rank(),
        "replica": replica,
        "local_stages": list(plain.local_stages),
        "replicated": {**state(local, grads_p), "step_s": statistics.median(times["replicated"])},
        "sharded": {**state(shards, grads_s), "step_s": statistics.median(times["sharded"])},
        "gathered_during_step": nbytes(local),
    }
    for mode in ("replicated", "sharded"):
        row[mode]["total"] = row[mode]["params"] + row[mode]["grads"] + row[mode]["adamw"]
    rows: list[Any] = [None] * WORLD
    dist.all_gather_object(rows, row)
    return {"dp": dp, "pp": pp, "ranks": rows}


def _rank(rank: int, port: int, config: dict[str, Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        results = [measure(dp, pp, config) for dp, pp in MESHES]
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(results, buffer)
            queue.put(buffer.getvalue())
    finally:
        dist.destroy_process_group()


def run(config: dict[str, Any]) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, config, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        payload = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    results: list[dict[str, Any]] = torch.load(io.BytesIO(payload), weights_only=False)
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| mesh (dp x pp) | rank | stages | mode | params | grads | AdamW m+v | total | ratio | gathered | step ms "
        "| slowest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mesh in results:
        slowest = {m: max(r[m]["step_s"] for r in mesh["ranks"]) for m in ("replicated", "sharded")}
        for r in mesh["ranks"][:2] if mesh["pp"] > 1 else mesh["ranks"][:1]:
            for mode in ("replicated", "sharded"):
                row = r[mode]
                ratio = r["replicated"]["total"] / row["total"]
                gathered = f"{r['gathered_during_step']:,}" if mode == "sharded" else "-"
                lines.append(
                    f"| {mesh['dp']} x {mesh['pp']} | {r['rank']} | {tuple(r['local_stages'])} | {mode} | "
                    f"{row['params']:,} | {row['grads']:,} | {row['adamw']:,} | {row['total']:,} | {ratio:.2f} | "
                    f"{gathered} | {1e3 * row['step_s']:.2f} | {1e3 * slowest[mode]:.2f} |"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (seconds)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, help="timed steps per mode (default 21, quick 3)")
    args = parser.parse_args(argv)
    if args.quick:
        config = {"dim": 16, "hidden": 24, "batch": 8, "microbatches": 4, "repeats": 3, "warmup": 1}
    else:
        config = {"dim": 256, "hidden": 1024, "batch": 32, "microbatches": 4, "repeats": 21, "warmup": 3}
    if args.repeats:
        config["repeats"] = args.repeats
    start = time.perf_counter()
    results = run(config)
    print(f"config: {config}; torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank")
    print(table(results))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "torch": torch.__version__, "meshes": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
