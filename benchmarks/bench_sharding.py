"""What sharding parameters over the data-parallel ranks saves per rank, and what it costs per step.

Run::

    python benchmarks/bench_sharding.py            # 4 gloo processes on this machine, about a minute
    python benchmarks/bench_sharding.py --quick    # tiny sizes, a few seconds
    python benchmarks/bench_sharding.py --json out.json

Four processes (gloo, 127.0.0.1, one torch thread each) run a 4-stage residual MLP (float32,
one SwiGLU-free ``h + tanh(h W1 + b1) W2`` block per stage, 1F1B) on two meshes: 2 x 2
(dp x pp: each rank holds 2 stages, half of their parameters when sharded) and 4 x 1 (every rank
holds the 4 stages, a quarter of them when sharded). For each mesh and each of
``fpipe.Parallelism(shard_params=False)`` and ``True`` it reports, per rank:

- the bytes a rank keeps between steps: parameters, gradients and AdamW's two moments (measured
  on the tensors: shards include their padding);
- the bytes a sharded step gathers and holds while it runs (the local stages' full parameters);
- the median step time, the two modes timed A/B interleaved (one step of each in turn), each
  rank's median, and the slowest rank's.

Before timing, the sharded grads (gathered) are checked against the replicated ones.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import OneFOneB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share
import bench_vs_torch  # its run_ranks: one gloo process per rank

MESHES = ((2, 2), (4, 1))  # (dp, pp)
WORLD = 4


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def measure(dp: int, pp: int, config: dict[str, Any]) -> dict[str, Any]:
    """One mesh, both modes, on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    num_stages = 4
    stages = [_common.mlp_first] + [_common.mlp_block] * (num_stages - 1)
    schedule = OneFOneB(config["microbatches"])
    full = _common.mlp_params(num_stages, config["dim"], config["hidden"])
    g = torch.Generator().manual_seed(1 + replica)
    batch = {"x": torch.randn(config["batch"], config["dim"], generator=g)}
    batch["y"] = torch.randn(config["batch"], config["dim"], generator=g)

    plain = fpipe.pipeline(_common.mse_loss, stages, schedule, parallel=fpipe.Parallelism(mesh=mesh))
    sharded = fpipe.pipeline(
        _common.mse_loss, stages, schedule, parallel=fpipe.Parallelism(mesh=mesh, shard_params=True)
    )
    local = [p if s in plain.local_stages else None for s, p in enumerate(full)]
    shards = sharded.shard(full)
    mine = batch if plain.rank == 0 else None

    loss_p, grads_p = plain(local, mine)
    loss_s, grads_s = sharded(shards, mine)
    torch.testing.assert_close(loss_s, loss_p, rtol=1e-6, atol=0)
    for s in plain.local_stages:
        torch.testing.assert_close(sharded.gather(grads_s)[s], grads_p[s], rtol=1e-5, atol=1e-7)

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


def rank_main(rank: int, world_size: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    return [measure(dp, pp, config) for dp, pp in MESHES]


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
    args = _common.parser(__doc__, repeats="timed steps per mode (default 21, quick 3)").parse_args(argv)
    if args.quick:
        config = {"dim": 16, "hidden": 24, "batch": 8, "microbatches": 4, "repeats": 3, "warmup": 1}
    else:
        config = {"dim": 256, "hidden": 1024, "batch": 32, "microbatches": 4, "repeats": 21, "warmup": 3}
    if args.repeats:
        config["repeats"] = args.repeats
    start = time.perf_counter()
    results: list[dict[str, Any]] = bench_vs_torch.run_ranks(WORLD, {**config, "timeout": 600}, rank_main)[0]
    print(f"config: {config}; torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank")
    print(table(results))
    print(f"({time.perf_counter() - start:.0f} s)")
    _common.write_json(args.json, {"config": config, "torch": torch.__version__, "meshes": results}, indent=1)
    return results


if __name__ == "__main__":
    main()
