"""Eager vs ``torch.compile``'d stages under fpipe, after warm-up, with the same gradients.

Run::

    python benchmarks/bench_compile.py            # inductor, dim 256, 4 stages x 8 microbatches
    python benchmarks/bench_compile.py --quick    # aot_eager backend, tiny (the tests)
    python benchmarks/bench_compile.py --json out.json

Each stage is two residual SwiGLU blocks written as a pure function; the compiled pipeline
passes ``torch.compile(stage)`` as its stage functions (forward and backward both compiled by
AOTAutograd). Steps are timed A/B interleaved after warm-up; the sequence length then changes
for a few steps to show how many graphs dynamo builds (it recompiles once with a dynamic
length, not at every new length). Schedules: 1F1B, and ZB-H1 whose split backward cannot split
a compiled region (its ``I`` then does the whole backward, see NOTE [split backward]).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fpipe
from fpipe.schedules import OneFOneB, ZeroBubbleH1

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share

stage = _common.swiglu  # two blocks per stage


def loss_fn(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def timed(step: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parser(__doc__).parse_args(argv)
    dim, batch, seq, repeats, backend = (16, 8, 4, 2, "aot_eager") if args.quick else (256, 32, 64, 7, "inductor")
    torch.manual_seed(0)
    params = _common.swiglu_params(4, 2, dim)
    results: dict[str, Any] = {"config": {"dim": dim, "batch": batch, "seq": seq, "backend": backend}}
    for schedule in (OneFOneB(8), ZeroBubbleH1(8)):
        torch._dynamo.reset()
        compiled_stage = torch.compile(stage, backend=backend)
        eager = fpipe.pipeline(loss_fn, [stage] * 4, schedule)
        compiled = fpipe.pipeline(loss_fn, [compiled_stage] * 4, schedule)
        x = torch.randn(batch, seq, dim)
        start = time.perf_counter()
        compiled(params, x)  # compiles
        compile_seconds = time.perf_counter() - start
        (e_loss, e_grads), (c_loss, c_grads) = eager(params, x), compiled(params, x)
        torch.testing.assert_close(c_loss, e_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c_grads, e_grads, rtol=1e-3, atol=1e-4)
        eager_times, compiled_times = [], []
        for _ in range(repeats):
            eager_times.append(timed(eager, params, x))
            compiled_times.append(timed(compiled, params, x))
        graphs = []
        for length in (seq + 1, seq + 2, seq + 3):
            compiled(params, torch.randn(batch, length, dim))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        name = type(schedule).__name__
        results[name] = {
            "eager_ms": statistics.median(eager_times) * 1e3,
            "compiled_ms": statistics.median(compiled_times) * 1e3,
            "ratio": statistics.median(compiled_times) / statistics.median(eager_times),
            "first_compile_s": compile_seconds,
            "graphs_after_new_lengths": graphs,
            "grads_match": True,
        }
        r = results[name]
        print(
            f"{name:>14}: eager {r['eager_ms']:8.1f} ms  compiled {r['compiled_ms']:8.1f} ms  "
            f"ratio {r['ratio']:.3f}  first compile {compile_seconds:.1f} s  graphs {graphs}"
        )
    _common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
