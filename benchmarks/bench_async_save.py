"""What saving every k steps costs a training loop: no saving, ``fpipe.save``, ``fpipe.AsyncSaver``.

Run::

    PYTHONPATH=. python benchmarks/bench_async_save.py            # about 3 minutes on 2 busy CPU cores
    PYTHONPATH=. python benchmarks/bench_async_save.py --quick    # tiny sizes, a few seconds
    PYTHONPATH=. python benchmarks/bench_async_save.py --json out.json

One process trains a 4-stage residual MLP (float32, ``h + tanh(h W1 + b1) W2`` per stage, 1F1B,
4 microbatches) with ``fpipe.optim.adamw`` for ``--steps`` steps and saves parameters and
optimizer state every ``--every`` steps into a temporary directory (its disk: the page cache and
fsync of this machine), in three modes timed in turn, one loop each, repeated ``--repeats``
times: ``none``, ``sync`` (``fpipe.save``) and ``async`` (``AsyncSaver.save``, waited for once
after the loop). For each mode it reports the mean time per step over the loop (saves included,
and for ``async`` the final wait), the median step without a save, the mean of the
steps without a save (those an asynchronous write overlaps), the median time of the steps that
save (the call, for ``async``: the snapshot) and the final wait after the loop. Before timing it checks that the async
save loads bitwise equal to the sync one.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import optree
import torch

import fpipe
import fpipe.optim
from fpipe.schedules import OneFOneB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share

STAGES = 4
loss_fn = _common.mse_loss


def block(p: dict[str, dict[str, torch.Tensor]], h: torch.Tensor) -> torch.Tensor:
    (q,) = p.values()  # {"layers": {"<s>": ...}}: saved under global names layers.<s>.w1 ...
    (q,) = q.values()
    return h + torch.tanh(h @ q["w1"] + q["b1"]) @ q["w2"]


def first(p: dict[str, dict[str, torch.Tensor]], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return block(p, batch["x"])


def model(width: int) -> list[Any]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "layers": {
                str(s): {
                    "w1": torch.randn(width, 2 * width, generator=g) / width**0.5,
                    "b1": torch.zeros(2 * width),
                    "w2": torch.randn(2 * width, width, generator=g) / (2 * width) ** 0.5,
                }
            }
        }
        for s in range(STAGES)
    ]


def loop(mode: str, steps: int, every: int, width: int, batch_size: int, directory: str) -> dict[str, Any]:
    """One training loop in ``mode``; per-step times."""
    step = fpipe.pipeline(loss_fn, [first] + [block] * (STAGES - 1), OneFOneB(num_microbatches=4))
    params = model(width)
    opt = fpipe.optim.adamw(1e-3)
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(batch_size, width, generator=g), "y": torch.randn(batch_size, width, generator=g)}
    saver = fpipe.AsyncSaver() if mode == "async" else None
    plain, saving = [], []
    start = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        _, grads = step(params, batch)
        opt.update_(params, grads, state)
        if mode != "none" and (i + 1) % every == 0:
            if saver is not None:
                saver.save(directory, params, optimizer_state=state, metadata={"step": i + 1})
            else:
                fpipe.save(directory, params, optimizer_state=state, metadata={"step": i + 1})
            saving.append(time.perf_counter() - t0)
        else:
            plain.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if saver is not None:
        saver.wait()
    end = time.perf_counter()
    return {
        "mean_step_s": (end - start) / steps,
        "plain_steps": plain,
        "saving_steps": saving,
        "final_wait_s": end - t0,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.width, args.batch, args.repeats = 6, 3, 32, 16, 1
    torch.set_num_threads(1)
    megabytes = 3 * sum(t.numel() * t.element_size() for t in optree.tree_leaves(model(args.width))) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            loop(mode, args.every, args.every, args.width, args.batch, f"{tmp}/check-{mode}")
        template = model(args.width)
        state = fpipe.optim.adamw(1e-3).init(template)
        loaded = [fpipe.load(f"{tmp}/check-{m}", template, optimizer_state=state) for m in ("sync", "async")]
        same = all(
            torch.equal(a, b)
            for a, b in zip(optree.tree_leaves(loaded[0][:2]), optree.tree_leaves(loaded[1][:2]), strict=True)
        )
        runs: dict[str, list[dict[str, Any]]] = {"none": [], "sync": [], "async": []}
        for r in range(args.repeats):
            for mode in runs:
                runs[mode].append(loop(mode, args.steps, args.every, args.width, args.batch, f"{tmp}/{mode}-{r}"))
    results: dict[str, Any] = {
        "config": {k: getattr(args, k) for k in ("steps", "every", "width", "batch", "repeats")},
        "save_megabytes": round(megabytes, 1),
        "async_equals_sync": same,
        "machine": {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu": platform.machine()},
    }
    for mode, rows in runs.items():
        results[mode] = {
            "mean_step_s": statistics.median(row["mean_step_s"] for row in rows),
            "median_plain_step_s": statistics.median(t for row in rows for t in row["plain_steps"]),
            "mean_plain_step_s": statistics.mean(t for row in rows for t in row["plain_steps"]),
            "final_wait_s": statistics.median(row["final_wait_s"] for row in rows),
            "median_saving_step_s": (
                statistics.median(t for row in rows for t in row["saving_steps"]) if mode != "none" else None
            ),
        }
    print(f"save: {results['save_megabytes']} MB (params + AdamW state), every {args.every} of {args.steps} steps")
    print(f"async save loads bitwise equal to sync: {same}")
    print(f"{'mode':<6} {'mean step':>10} {'plain step':>11} {'(mean)':>10} {'saving step':>12} {'final wait':>11}")
    for mode in runs:
        row = results[mode]
        saving = "-" if row["median_saving_step_s"] is None else f"{row['median_saving_step_s'] * 1e3:.1f} ms"
        print(
            f"{mode:<6} {row['mean_step_s'] * 1e3:>7.1f} ms {row['median_plain_step_s'] * 1e3:>8.1f} ms "
            f"{row['mean_plain_step_s'] * 1e3:>7.1f} ms {saving:>12} {row['final_wait_s'] * 1e3:>8.1f} ms"
        )
    _common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
