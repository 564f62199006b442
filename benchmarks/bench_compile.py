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

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fpipe
from fpipe.schedules import OneFOneB, ZeroBubbleH1


def stage(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    for k in range(2):
        x = torch.nn.functional.rms_norm(h, h.shape[-1:])
        h = h + (torch.nn.functional.silu(x @ params[f"{k}.gate"]) * (x @ params[f"{k}.up"])) @ params[f"{k}.down"]
    return h


def loss_fn(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def timed(step: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    dim, batch, seq, repeats, backend = (16, 8, 4, 2, "aot_eager") if args.quick else (256, 32, 64, 7, "inductor")
    torch.manual_seed(0)
    params = [
        {
            f"{k}.{name}": torch.randn(*shape) / shape[0] ** 0.5
            for k in range(2)
            for name, shape in (("gate", (dim, 2 * dim)), ("up", (dim, 2 * dim)), ("down", (2 * dim, dim)))
        }
        for _ in range(4)
    ]
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
