"""How much of the data-parallel gradient reduction a step still waits for: at the end, or overlapped.

Run::

    python benchmarks/bench_reduction.py            # 4 gloo processes, dp 2 x pp 2, about a minute
    python benchmarks/bench_reduction.py --quick    # tiny sizes, a few seconds
    python benchmarks/bench_reduction.py --json out.json

Four processes (gloo, 127.0.0.1, one torch thread each) on a dp 2 x pp 2 mesh run 4 residual
MLP stages (``h + tanh(h W1 + b1) W2``, float32), ``Interleaved1F1B`` with 2 stages per rank,
replicated parameters, in two modes timed A/B interleaved (one step of each in turn):

- ``end``: the replicated run as it was, every gradient in one all-reduce per dtype after the
  pipeline (``ReplicatedRuns`` without a ``Reduce``);
- ``overlap``: each stage's all-reduce posted at its last action (NOTE [reduction overlap] in
  fpipe/_distributed/_runtime.py), waited for when the row is done.

Per rank it reports the median step time and the median exposed reduction time: the seconds the
step spends, after its last action, waiting for the gradients' reduction and the loss's average
(``ReplicatedRuns.finish`` plus ``_average_replicas``). Both modes' grads are checked bitwise equal.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import queue as queue_module
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fpipe
from fpipe.schedules import Interleaved1F1B

WORLD = 4
MODES = ("end", "overlap")


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


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Both modes on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from fpipe import _api, _run
    from fpipe._distributed import _runtime

    timer = _Timer()
    _run.ReplicatedRuns.finish = timer.wrap(_run.ReplicatedRuns.finish)  # type: ignore[method-assign]
    _runtime._average_replicas = timer.wrap(_runtime._average_replicas)
    overlapping = _api.replica_mean

    def use(mode: str) -> None:
        _api.replica_mean = overlapping if mode == "overlap" else lambda topology, timeout, **_: None  # type: ignore[assignment]

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    num_stages = 4
    stages = [first] + [block] * (num_stages - 1)
    step = fpipe.pipeline(loss_fn, stages, Interleaved1F1B(config["microbatches"], stages_per_rank=2), mesh=mesh)
    full = init_params(num_stages, config["dim"], config["hidden"])
    params = [p if s in step.local_stages else None for s, p in enumerate(full)]
    g = torch.Generator().manual_seed(1 + replica)
    batch = {"x": torch.randn(config["batch"], config["dim"], generator=g)}
    batch["y"] = torch.randn(config["batch"], config["dim"], generator=g)
    mine = batch if step.rank == 0 else None

    results = {}
    for mode in MODES:
        use(mode)
        results[mode] = step(params, mine)
    for s in step.local_stages:
        for k in full[s]:
            assert torch.equal(results["end"][1][s][k], results["overlap"][1][s][k]), (s, k)
    assert torch.equal(results["end"][0], results["overlap"][0])

    times: dict[str, list[float]] = {m: [] for m in MODES}
    exposed: dict[str, list[float]] = {m: [] for m in MODES}
    for k in range(config["warmup"] + config["repeats"]):
        for mode in MODES:
            use(mode)
            dist.barrier()
            timer.seconds = 0.0
            start = time.perf_counter()
            step(params, mine)
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


def _rank(rank: int, port: int, config: dict[str, Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        result = measure(config)
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(result, buffer)
            queue.put(buffer.getvalue())
    finally:
        dist.destroy_process_group()


def run(config: dict[str, Any]) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, config, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600
    try:
        while True:  # a rank that dies fails the run at once instead of leaving it waiting
            try:
                payload = queue.get(timeout=1)
                break
            except queue_module.Empty:
                failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"bench_reduction: ranks failed or hung (exit codes: {failed})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    result: dict[str, Any] = torch.load(io.BytesIO(payload), weights_only=False)
    return result


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (seconds)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, help="timed steps per mode (default 21, quick 3)")
    args = parser.parse_args(argv)
    if args.quick:
        config = {"dim": 16, "hidden": 24, "batch": 8, "microbatches": 4, "repeats": 3, "warmup": 1}
    else:
        config = {"dim": 512, "hidden": 2048, "batch": 32, "microbatches": 4, "repeats": 21, "warmup": 3}
    if args.repeats:
        config["repeats"] = args.repeats
    start = time.perf_counter()
    result = run(config)
    print(f"config: {config}; torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank")
    print(f"gradient bytes per rank: {result['grad_bytes_per_rank']:,}")
    print(table(result))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "torch": torch.__version__, **result}, f, indent=1)
    return result


if __name__ == "__main__":
    main()
