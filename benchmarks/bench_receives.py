"""Receives posted ahead of need against receives posted when needed (NOTE [receives ahead]).

Run::

    python benchmarks/bench_receives.py            # full sizes, about 3 minutes on 2 cores
    python benchmarks/bench_receives.py --quick    # tiny sizes, seconds (used by the tests)
    python benchmarks/bench_receives.py --json out.json

fpipe's distributed transport posts the receives of a message whose channel carries large
leaves (activations, cotangents) as soon as the previous message from that peer has been read
(``fpipe/_distributed/_wire.py``, NOTE [receives ahead]). This benchmark measures that design decision: 2
gloo processes, one thread each, the Llama-style model and split of ``bench_vs_torch.py``, and
for each schedule two fpipe steps, one as shipped ("ahead") and one with every receive posted
when needed ("needed": ``Encoder.ahead`` and ``Decoder.ahead`` patched to ``False`` on both
ranks, so both sides agree), timed A/B interleaved (ABBA, a barrier before each step, the slower
rank's time). It reports the median of the per-round ratios ahead / needed with quartiles, and
the ratio of the fastest steps.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line and JSON output the benchmarks share
import bench_vs_torch as model  # the same model, split and process helpers


def rank_main(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import fpipe
    import fpipe._distributed._wire as wire
    from fpipe.schedules import GPipe, OneFOneB

    cfg = opts["model"]
    module = model.build_stage_module(cfg, rank, world_size)
    stages = [
        model.stage_fn(cfg, model.stage_layers(cfg, s, world_size), s == 0, s == world_size - 1)
        for s in range(world_size)
    ]
    batch = model.make_batch(cfg)
    own = {name: p.detach() for name, p in module.named_parameters()}
    params = [own if s == rank else None for s in range(world_size)]
    shipped = (wire.Encoder.ahead, wire.Decoder.ahead)
    needed = property(lambda self: False)
    rows = []
    for name, m in opts["configs"]:
        schedule = GPipe(m) if name == "gpipe" else OneFOneB(m)
        step = fpipe.pipeline(model.fpipe_loss, stages, schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD))

        def with_receives(ahead: bool, step: Any = step) -> Callable[[], None]:
            def run() -> None:
                wire.Encoder.ahead, wire.Decoder.ahead = shipped if ahead else (needed, needed)
                step(params, batch)

            return run

        times = model.abba({"ahead": with_receives(True), "needed": with_receives(False)}, 1, opts["repeats"])
        wire.Encoder.ahead, wire.Decoder.ahead = shipped
        rows.append({"schedule": name, "microbatches": m, "times": times})
    return {"rank": rank, "rows": rows}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parser(__doc__, repeats="timed rounds per config (default 14, quick 2)").parse_args(argv)
    if args.quick:
        cfg = {"dim": 32, "heads": 4, "hidden": 64, "layers": 4, "vocab": 64, "seq": 8, "batch": 8}
    else:
        cfg = {"dim": 256, "heads": 8, "hidden": 704, "layers": 8, "vocab": 512, "seq": 128, "batch": 32}
    opts = {
        "model": cfg,
        "repeats": args.repeats or (2 if args.quick else 14),
        "configs": [("gpipe", 8), ("1f1b", 8), ("1f1b", 4)],
    }
    ranks = model.run_ranks(2, {**opts, "timeout": 900}, rank_main)
    results: dict[str, Any] = {"config": {**cfg, "repeats": opts["repeats"], "quick": args.quick}, "rows": []}
    for per_rank in zip(*(r["rows"] for r in ranks)):
        steps = {mode: [max(ts) for ts in zip(*(r["times"][mode] for r in per_rank))] for mode in ("ahead", "needed")}
        results["rows"].append(
            {
                "schedule": per_rank[0]["schedule"],
                "microbatches": per_rank[0]["microbatches"],
                "median_s": {mode: statistics.median(ts) for mode, ts in steps.items()},
                "paired": model.paired(steps["ahead"], steps["needed"]),
            }
        )
    print(f"torch {torch.__version__}, 2 ranks (gloo, 1 thread each), {opts['repeats']} rounds (ABBA)")
    print()
    print("| schedule | mb | ahead ms | needed ms | ahead / needed, per round: median [q1, q3] | of minimums |")
    print("|---|---|---|---|---|---|")
    for row in results["rows"]:
        a, n, p = row["median_s"]["ahead"] * 1e3, row["median_s"]["needed"] * 1e3, row["paired"]
        print(
            f"| {row['schedule']} | {row['microbatches']} | {a:.1f} | {n:.1f} "
            f"| {model.spread(p)} | {p['of_minimums']:.3f} |"
        )
    _common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
