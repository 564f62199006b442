"""Compiled rows on 2 processes: fpipe's compiled step against its eager step, compiled stages
and ``torch.distributed.pipelining`` (gloo, CPU, one thread per rank).

Run::

    python benchmarks/bench_compile_ranks.py            # Inductor, two sizes, about 10 minutes on 2 busy cores
    python benchmarks/bench_compile_ranks.py --quick    # aot_eager, tiny (the tests)
    python benchmarks/bench_compile_ranks.py --json out.json

The model and split are ``bench_vs_torch.py``'s (a Llama-style decoder, half the layers on each
rank, the batch on both ranks), at two sizes: "small" (width 64, 4 layers, 16 sequences of 16
tokens: the per-call-overhead regime) and "large" (``bench_vs_torch.py``'s full size: width 256,
8 layers, 32 sequences of 128 tokens); 1F1B with 8 microbatches. Each rank times five sides, one
step of each per round, in an order reversed every other round, each step after a barrier; a
step's time is the slower rank's:

  - fpipe eager: ``pipeline(..., parallel=Parallelism(group=WORLD))``;
  - fpipe compiled rows: the same with ``compile=`` (NOTE [compiled rows] in
    fpipe/_distributed/_compiled.py: each rank's row one graph, its messages inside it);
  - fpipe compiled stages: the eager step over ``torch.compile``'d stage functions;
  - torch eager: ``PipelineStage`` and ``Schedule1F1B`` over the equivalent ``nn.Module``;
  - torch compiled stages: the same over the ``torch.compile``'d module.

It reports medians (ms), each side's median per-round ratio to fpipe eager, the first call's
seconds of the compiled sides (fpipe's compiled rows: the call that compiles, after the one that
learns the layouts), and checks the compiled rows' loss and grads against fpipe's eager step
(rtol 1e-4) and fpipe's against torch's (rtol 1e-3).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line and JSON output the benchmarks share
import bench_vs_torch as model  # the model, its split and the process helpers

SIZES = {
    "small": {"dim": 64, "heads": 4, "hidden": 128, "layers": 4, "vocab": 128, "seq": 16, "batch": 16},
    "large": {"dim": 256, "heads": 8, "hidden": 704, "layers": 8, "vocab": 512, "seq": 128, "batch": 32},
    "tiny": {"dim": 16, "heads": 2, "hidden": 32, "layers": 2, "vocab": 32, "seq": 4, "batch": 8},
}
MICROBATCHES = 8


def rank_main(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    return {size: one_size(rank, world_size, SIZES[size], opts["backend"], opts["repeats"]) for size in opts["sizes"]}


def one_size(rank: int, world_size: int, cfg: dict[str, int], backend: str, repeats: int) -> dict[str, Any]:
    """This rank's step times of every side at one size, and the compiled sides' first calls."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import fpipe
    from fpipe.schedules import OneFOneB

    torch._dynamo.reset()
    module = model.build_stage_module(cfg, rank, world_size)
    fns = [
        model.stage_fn(cfg, model.stage_layers(cfg, s, world_size), s == 0, s == world_size - 1)
        for s in range(world_size)
    ]
    batch = model.make_batch(cfg)
    own = {name: p.detach() for name, p in module.named_parameters()}
    params = [own if s == rank else None for s in range(world_size)]
    parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=1800)
    schedule = OneFOneB(MICROBATCHES)
    eager = fpipe.pipeline(model.fpipe_loss, fns, schedule, parallel=parallel)
    rows = fpipe.pipeline(model.fpipe_loss, fns, schedule, parallel=parallel, compile=backend)
    staged_fns = [torch.compile(fn, backend=backend) for fn in fns]
    staged = fpipe.pipeline(model.fpipe_loss, staged_fns, schedule, parallel=parallel)
    compiled_module = torch.compile(module, backend=backend)
    torch_schedules = {
        "torch eager": Schedule1F1B(
            PipelineStage(module, rank, world_size, torch.device("cpu")), MICROBATCHES, loss_fn=model.torch_loss
        ),
        "torch compiled stages": Schedule1F1B(
            PipelineStage(compiled_module, rank, world_size, torch.device("cpu")),  # type: ignore[arg-type]
            MICROBATCHES,
            loss_fn=model.torch_loss,
        ),
    }

    def fpipe_side(step: Any) -> Callable[[], Any]:
        return lambda: step(params, batch)

    def torch_side(schedule: Any) -> Callable[[], Any]:
        def run() -> Any:
            module.zero_grad(set_to_none=True)
            if rank == 0:
                return schedule.step(batch["tokens"], return_outputs=False)
            return schedule.step(target=batch["targets"], return_outputs=False)

        return run

    sides = {
        "fpipe eager": fpipe_side(eager),
        "fpipe compiled rows": fpipe_side(rows),
        "fpipe compiled stages": fpipe_side(staged),
        **{name: torch_side(schedule) for name, schedule in torch_schedules.items()},
    }
    reference = eager(params, batch)
    rows(params, batch)  # learns the layouts (NOTE [compiled rows])
    first_call_s = {}
    for name in ("fpipe compiled rows", "fpipe compiled stages", "torch compiled stages"):
        dist.barrier()
        start = time.perf_counter()
        got = sides[name]()
        first_call_s[name] = time.perf_counter() - start
        if name == "fpipe compiled rows":
            torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-6)
    torch_side(torch_schedules["torch eager"])()
    torch_grads = {n: p.grad for n, p in module.named_parameters()}
    torch.testing.assert_close(reference[1][rank], torch_grads, rtol=1e-3, atol=1e-5)
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(model.barrier_timed(sides[name]))
    return {"times": times, "first_call_s": first_call_s}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parser(__doc__, repeats="timed rounds per size (default 21, quick 2)").parse_args(argv)
    sizes = ["tiny"] if args.quick else ["small", "large"]
    opts = {
        "sizes": sizes,
        "backend": "aot_eager" if args.quick else "inductor",
        "repeats": args.repeats or (2 if args.quick else 21),
        "timeout": 3600,
    }
    ranks = model.run_ranks(2, opts, rank_main)
    results: dict[str, Any] = {
        "config": {"sizes": {s: SIZES[s] for s in sizes}, "microbatches": MICROBATCHES, **opts},
        "machine": {"torch": torch.__version__, "cpus": os.cpu_count()},
        "sizes": {},
    }
    print(f"torch {torch.__version__}, 2 ranks (gloo, 1 thread each), 1F1B x {MICROBATCHES}, backend {opts['backend']}")
    print()
    print("| size | side | median ms | / fpipe eager, per round: median [q1, q3] | first call s |")
    print("|---|---|---|---|---|")
    for size in sizes:
        steps = {
            name: [max(ts) for ts in zip(*(r[size]["times"][name] for r in ranks))] for name in ranks[0][size]["times"]
        }
        first = {name: max(r[size]["first_call_s"][name] for r in ranks) for name in ranks[0][size]["first_call_s"]}
        row = {
            "median_ms": {name: statistics.median(ts) * 1e3 for name, ts in steps.items()},
            "over_fpipe_eager": {name: model.paired(ts, steps["fpipe eager"]) for name, ts in steps.items()},
            "first_call_s": first,
            "grads_match": True,
        }
        results["sizes"][size] = row
        for name, ms in row["median_ms"].items():
            seconds = f"{first[name]:.1f}" if name in first else "-"
            print(f"| {size} | {name} | {ms:.2f} | {model.spread(row['over_fpipe_eager'][name])} | {seconds} |")
    _common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
