"""How much of the data-parallel gradient reduction a step still waits for: at the end, or overlapped.

Run::

    python benchmarks/bench_reduction.py            # 4 gloo processes, dp 2 x pp 2, about a minute
    python benchmarks/bench_reduction.py --quick    # tiny sizes, a few seconds
    python benchmarks/bench_reduction.py --json out.json

Four processes (gloo, 127.0.0.1, one torch thread each) on a dp 2 x pp 2 mesh run 4 residual
MLP stages (``h + tanh(h W1 + b1) W2``, float32), ``Interleaved1F1B`` with 2 stages per rank,
replicated parameters, in two modes timed A/B interleaved (one step of each in turn):

- ``end``: the replicated run as it was, every gradient in one all-reduce after the pipeline
  (``ReplicatedStages`` without a ``Reduce``, then ``end_mean`` here: the runtime no longer has
  that path);
- ``overlap``: each stage's all-reduce posted at its last action (NOTE [reduction overlap] in
  fpipe/_distributed/_rank_step.py), waited for when the row is done.

Per rank it reports the median step time and the median exposed reduction time: the seconds the
step spends, after its last action, waiting for the gradients' reduction and the loss's average
(``ReplicatedStages.wait_reductions`` plus ``average_loss``, plus ``end_mean`` in ``end`` mode). Both
modes' grads are checked bitwise equal.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import Interleaved1F1B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share
import bench_vs_torch  # its run_ranks: one gloo process per rank

WORLD = 4
MODES = ("end", "overlap")


class _Timer:
    """Seconds spent in the wrapped functions during one step."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def measure(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Both modes on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from fpipe import _run, _strategy

    timer = _Timer()
    _run.ReplicatedStages.wait_reductions = timer.wrap(_run.ReplicatedStages.wait_reductions)  # type: ignore[method-assign]
    _strategy.average_loss = timer.wrap(_strategy.average_loss)
    overlapping = _strategy.replica_mean

    def use(mode: str) -> None:
        _strategy.replica_mean = overlapping if mode == "overlap" else lambda topology, timeout, **_: None  # type: ignore[assignment]

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    num_stages = 4
    stages = [_common.mlp_first] + [_common.mlp_block] * (num_stages - 1)
    step = fpipe.pipeline(
        _common.mse_loss,
        stages,
        Interleaved1F1B(config["microbatches"], stages_per_rank=2),
        parallel=fpipe.Parallelism(mesh=mesh),
    )
    full = _common.mlp_params(num_stages, config["dim"], config["hidden"])
    params = [p if s in step.local_stages else None for s, p in enumerate(full)]
    g = torch.Generator().manual_seed(1 + replica)
    batch = {"x": torch.randn(config["batch"], config["dim"], generator=g)}
    batch["y"] = torch.randn(config["batch"], config["dim"], generator=g)
    mine = batch if step.rank == 0 else None

    dp_group = mesh.get_group("dp")

    @timer.wrap
    def end_mean(grads: list[Any]) -> None:
        """The old end of a replicated step: the gradients summed in one all-reduce, then halved."""
        leaves = [g for s in step.local_stages for g in grads[s].values()]
        flat = torch.cat([g.reshape(-1) for g in leaves])
        dist.all_reduce(flat, group=dp_group)
        flat.div_(2)
        for g, piece in zip(leaves, torch.split(flat, [g.numel() for g in leaves])):
            g.copy_(piece.view_as(g))

    def run(mode: str) -> Any:
        use(mode)
        result = step(params, mine)
        if mode == "end":
            end_mean(result[1])
        return result

    results = {mode: run(mode) for mode in MODES}
    for s in step.local_stages:
        for k in full[s]:
            assert torch.equal(results["end"][1][s][k], results["overlap"][1][s][k]), (s, k)
    assert torch.equal(results["end"][0], results["overlap"][0])

    times: dict[str, list[float]] = {m: [] for m in MODES}
    exposed: dict[str, list[float]] = {m: [] for m in MODES}
    for k in range(config["warmup"] + config["repeats"]):
        for mode in MODES:
            dist.barrier()
            timer.seconds = 0.0
            start = time.perf_counter()
            run(mode)
            if k >= config["warmup"]:
                times[mode].append(time.perf_counter() - start)
                exposed[mode].append(timer.seconds)
    row = {
        "rank": dist.get_rank(),
        "replica": replica,
        "local_stages": list(step.local_stages),
        **{
            mode: {"step_s": statistics.median(times[mode]), "exposed_s": statistics.median(exposed[mode])}
            for mode in MODES
        },
    }
    rows: list[Any] = [None] * WORLD
    dist.all_gather_object(rows, row)
    return {
        "ranks": rows,
        "grad_bytes_per_rank": sum(t.numel() * 4 for s in step.local_stages for t in full[s].values()),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| rank | replica | stages | end: step ms | end: exposed ms | overlap: step ms | overlap: exposed ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["ranks"]:
        lines.append(
            f"| {r['rank']} | {r['replica']} | {tuple(r['local_stages'])} | {1e3 * r['end']['step_s']:.1f} | "
            f"{1e3 * r['end']['exposed_s']:.1f} | {1e3 * r['overlap']['step_s']:.1f} | "
            f"{1e3 * r['overlap']['exposed_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parser(__doc__, repeats="timed steps per mode (default 21, quick 3)").parse_args(argv)
    if args.quick:
        config = {"dim": 16, "hidden": 24, "batch": 8, "microbatches": 4, "repeats": 3, "warmup": 1}
    else:
        config = {"dim": 512, "hidden": 2048, "batch": 32, "microbatches": 4, "repeats": 21, "warmup": 3}
    if args.repeats:
        config["repeats"] = args.repeats
    start = time.perf_counter()
    result: dict[str, Any] = bench_vs_torch.run_ranks(WORLD, {**config, "timeout": 600}, measure)[0]
    print(f"config: {config}; torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank")
    print(f"gradient bytes per rank: {result['grad_bytes_per_rank']:,}")
    print(table(result))
    print(f"({time.perf_counter() - start:.0f} s)")
    _common.write_json(args.json, {"config": config, "torch": torch.__version__, **result}, indent=1)
    return result


if __name__ == "__main__":
    main()
