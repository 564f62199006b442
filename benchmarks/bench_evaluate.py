"""What a forward-only step costs: ``step.evaluate`` against a training step, time and memory.

Run::

    python benchmarks/bench_evaluate.py            # dim 256, 4 stages of 2 blocks, 8 microbatches
    python benchmarks/bench_evaluate.py --quick    # tiny, for the tests
    python benchmarks/bench_evaluate.py --json out.json

A 4-stage model of residual SwiGLU blocks runs, in one process, GPipe and 1F1B with 8
microbatches: ``step(params, batch)`` (forwards and backwards) and ``step.evaluate(params,
batch)`` (forwards alone, no graph). Time is the median CPU time of the process over several
calls, on one intra-op thread (wall time swings with other load on a shared machine). Memory is the peak of
activation bytes alive at once, counted exactly: every stage output and every tensor autograd
saves for a backward (parameters excluded), from its creation until it is freed (weak
references). A training step's peak grows with the microbatches the schedule keeps in flight
(all of them for GPipe); an evaluation's is one microbatch's outputs per stage boundary.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fpipe
from fpipe.schedules import GPipe, OneFOneB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share

block = _common.swiglu


class Census:
    """Bytes of activations alive, and their peak: stage outputs and tensors saved for backward."""

    def __init__(self, params: Sequence[dict[str, torch.Tensor]]) -> None:
        self.live = 0
        self.peak = 0
        self._params = {t.untyped_storage().data_ptr() for p in params for t in p.values()}

    def _count(self, owner: object, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(owner, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def output(self, t: torch.Tensor) -> None:
        self._count(t, t.untyped_storage().nbytes())

    def pack(self, t: torch.Tensor) -> Any:
        holder = _Holder(t)
        if t.untyped_storage().data_ptr() not in self._params:
            self._count(holder, t.untyped_storage().nbytes())
        return holder

    def watch(self, fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        def stage(p: Any, x: Any) -> torch.Tensor:
            y = fn(p, x)
            self.output(y)
            return y

        return stage


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def measure(call: Callable[[], Any], repeats: int) -> float:
    """The median CPU time of this process per call (one intra-op thread: steady on a shared machine)."""
    call()  # warm up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parser(__doc__).parse_args(argv)
    dim, blocks, batch, seq, repeats = (16, 1, 8, 4, 2) if args.quick else (256, 2, 16, 64, 5)
    num_stages, num_microbatches = 4, 8
    torch.manual_seed(0)
    torch.set_num_threads(1)
    params = _common.swiglu_params(num_stages, blocks, dim)
    data = {"x": torch.randn(batch, seq, dim), "y": torch.randn(batch, seq, dim)}

    def first(p: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return block(p, mb["x"])

    loss_fn = _common.mse_loss
    results: dict[str, Any] = {"dim": dim, "blocks_per_stage": blocks, "batch": [batch, seq], "stages": num_stages}
    results["microbatches"] = num_microbatches
    for schedule in (GPipe(num_microbatches), OneFOneB(num_microbatches)):
        name = type(schedule).__name__
        step = fpipe.pipeline(loss_fn, [first, block, block, block], schedule)
        train_s = measure(lambda step=step: step(params, data), repeats)
        eval_s = measure(lambda step=step: step.evaluate(params, data), repeats)
        peaks = {}
        for kind in ("train", "evaluate"):
            census = Census(params)
            watched = fpipe.pipeline(loss_fn, [census.watch(first)] + [census.watch(block)] * 3, schedule)
            with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda holder: holder.tensor):
                watched(params, data) if kind == "train" else watched.evaluate(params, data)
            peaks[kind] = census.peak
        trained, _ = step(params, data)
        results[name] = {
            "train_ms": train_s * 1e3,
            "evaluate_ms": eval_s * 1e3,
            "time_ratio": eval_s / train_s,
            "train_peak_MiB": peaks["train"] / 2**20,
            "evaluate_peak_MiB": peaks["evaluate"] / 2**20,
            "memory_ratio": peaks["evaluate"] / peaks["train"],
            "loss_match": bool(torch.equal(step.evaluate(params, data), trained)),
        }
    sizes = f"dim {dim}, batch {batch} x {seq}, {num_microbatches} microbatches"
    print(f"{num_stages} stages x {blocks} SwiGLU blocks, {sizes}, one thread")
    print(
        f"{'schedule':<10} {'train ms':>9} {'eval ms':>8} {'ratio':>6} {'train MiB':>10} {'eval MiB':>9} {'ratio':>6}"
    )
    for name in ("GPipe", "OneFOneB"):
        r = results[name]
        print(
            f"{name:<10} {r['train_ms']:>9.1f} {r['evaluate_ms']:>8.1f} {r['time_ratio']:>6.2f} "
            f"{r['train_peak_MiB']:>10.2f} {r['evaluate_peak_MiB']:>9.2f} {r['memory_ratio']:>6.2f}"
        )
    _common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
