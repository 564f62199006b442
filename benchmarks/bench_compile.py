"""Eager vs ``torch.compile``'d stages vs the compiled whole step under fpipe, with the same gradients.

Run::

    python benchmarks/bench_compile.py            # inductor, dim 256, 4 stages x 8 microbatches
    python benchmarks/bench_compile.py --quick    # aot_eager backend, tiny (the tests)
    python benchmarks/bench_compile.py --json out.json
    python benchmarks/bench_compile.py --whole-step-only   # the second part alone
    python benchmarks/bench_compile.py --whole-step-only --device cuda   # on a GPU (benchmarks/gpu_check.sh)
    python benchmarks/bench_compile.py --train-gpt-only   # the compiled step at examples/train_gpt.py's size

The second part times ``pipeline(..., compile=True)`` (the whole step of the process traced into
one graph, NOTE [the compiled step] in fpipe/_compile.py) in the per-call-overhead regime: 4
residual MLP stages ``h + tanh(h W1 + b1) W2`` of width 64, a batch of 64 rows in 8
microbatches, float32, against fpipe's eager step (GPipe, 1F1B, ZB-H1), the eager step with
compiled stages (1F1B) and the unsplit model (eager autograd, and forward and gradient compiled
in one graph); every row A/B interleaved (one step of each, repeated), medians of CPU time, the
first call's seconds (the compile) reported, grads checked against the eager step (rtol 1e-4).
On a GPU (``--device cuda``) the times are wall-clock, synchronized after each step.

Each stage is two residual SwiGLU blocks written as a pure function; the compiled pipeline
passes ``torch.compile(stage)`` as its stage functions (forward and backward both compiled by
AOTAutograd). Steps are timed A/B interleaved after warm-up; the sequence length then changes
for a few steps to show how many graphs dynamo builds (it recompiles once with a dynamic
length, not at every new length). Schedules: 1F1B, and ZB-H1 whose split backward cannot split
a compiled region (its ``I`` then does the whole backward, see NOTE [split backward]).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fpipe
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share
import bench_vs_torch  # its peak of allocated bytes

stage = _common.swiglu  # two blocks per stage


def loss_fn(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def timed(step: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _common.parser(__doc__, repeats="rounds of the whole-step comparison (default 41, quick 3)")
    parser.add_argument("--whole-step-only", action="store_true", help="only the compiled whole step's comparison")
    parser.add_argument("--device", default="cpu", help="where the whole-step comparison runs (default cpu)")
    parser.add_argument("--train-gpt-only", action="store_true", help="only the comparison at train_gpt's size")
    parser.add_argument("--mode", help="Inductor's mode for the whole step, e.g. reduce-overhead (CUDA graphs)")
    args = parser.parse_args(argv)
    if args.train_gpt_only:
        results: dict[str, Any] = {"train_gpt": train_gpt_size(args.quick, args.repeats)}
        _common.write_json(args.json, results)
        return results
    results = {} if args.whole_step_only else compiled_stages(args.quick)
    results["whole_step"] = whole_step(args.quick, args.repeats, torch.device(args.device), args.mode)
    _common.write_json(args.json, results)
    return results


def compiled_stages(quick: bool) -> dict[str, Any]:
    """Eager against ``torch.compile``'d stages (the first part)."""
    dim, batch, seq, repeats, backend = (16, 8, 4, 2, "aot_eager") if quick else (256, 32, 64, 7, "inductor")
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
    return results


def whole_step(
    quick: bool, repeats: int | None, device: torch.device | None = None, mode: str | None = None
) -> dict[str, Any]:
    """The compiled whole step against eager steps, compiled stages and the unsplit model (the second part)."""
    device = device or torch.device("cpu")
    width, rows, stages, microbatches = (8, 8, 2, 2) if quick else (64, 64, 4, 8)
    backend = "aot_eager" if quick else "inductor"
    repeats = repeats or (3 if quick else 41)
    torch.manual_seed(0)
    params = [{k: v.to(device) for k, v in p.items()} for p in _common.mlp_params(stages, width, width)]
    batch = {"x": torch.randn(rows, width, device=device), "y": torch.randn(rows, width, device=device)}
    fns = [_common.mlp_first] + [_common.mlp_block] * (stages - 1)
    schedules = {"GPipe": GPipe(microbatches), "1F1B": OneFOneB(microbatches), "ZB-H1": ZeroBubbleH1(microbatches)}
    torch._dynamo.reset()
    steps: dict[str, Callable[[], Any]] = {}
    first_call_s: dict[str, float] = {}
    reference = {}
    for name, schedule in schedules.items():
        eager = fpipe.pipeline(_common.mse_loss, fns, schedule)
        option = fpipe.Compile(backend, mode)  # (a mode is Inductor's: not with --quick)
        compiled = fpipe.pipeline(_common.mse_loss, fns, schedule, compile=option)
        reference[name] = eager(params, batch)
        start = time.perf_counter()
        got = compiled(params, batch)  # compiles
        first_call_s[f"whole step {name}"] = time.perf_counter() - start
        torch.testing.assert_close(got, reference[name], rtol=1e-4, atol=1e-6)
        steps[f"eager {name}"] = functools.partial(eager, params, batch)
        steps[f"whole step {name}"] = functools.partial(compiled, params, batch)
    stage_fns = [torch.compile(fn, backend=backend) for fn in (_common.mlp_first, _common.mlp_block)]
    staged = fpipe.pipeline(_common.mse_loss, stage_fns[:1] + stage_fns[1:] * (stages - 1), OneFOneB(microbatches))
    start = time.perf_counter()
    torch.testing.assert_close(staged(params, batch), reference["1F1B"], rtol=1e-4, atol=1e-6)
    first_call_s["compiled stages 1F1B"] = time.perf_counter() - start
    steps["compiled stages 1F1B"] = functools.partial(staged, params, batch)

    def unsplit(params: list[dict[str, torch.Tensor]], batch: dict[str, torch.Tensor]) -> Any:
        leaves = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in params]
        h: Any = batch
        for fn, p in zip(fns, leaves):
            h = fn(p, h)
        loss = _common.mse_loss(h, batch)
        return loss.detach(), torch.autograd.grad(loss, [t for p in leaves for t in p.values()])

    compiled_unsplit = torch.compile(unsplit, backend=backend, fullgraph=True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        start = time.perf_counter()
        compiled_unsplit(params, batch)
        first_call_s["unsplit compiled"] = time.perf_counter() - start
    steps["unsplit eager"] = functools.partial(unsplit, params, batch)
    steps["unsplit compiled"] = functools.partial(compiled_unsplit, params, batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time  # CPU time on a shared CPU machine
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for step in steps.values():  # warm-up
            step()
        for _ in range(repeats):  # A/B interleaved: one step of each, repeated
            for name, step in steps.items():
                start = clock()
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                times[name].append(clock() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    peak_kib: dict[str, float] = {}
    if not cuda:  # bytes allocated in a step and live at once, at their most (bench_vs_torch.peak_allocated)
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            for name in ("eager GPipe", "whole step GPipe", "eager 1F1B", "whole step 1F1B"):
                peak_kib[name] = bench_vs_torch.peak_allocated(steps[name]) / 1024
    actions = 2 * stages * microbatches
    results: dict[str, Any] = {
        "config": dict(width=width, rows=rows, stages=stages, microbatches=microbatches, backend=backend, mode=mode),
        "device": str(device),
        "clock": "wall" if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "cpu_ms": ms,
        "peak_kib": peak_kib,
        "first_call_s": first_call_s,
        "eager_over_whole_step": {name: ms[f"eager {name}"] / ms[f"whole step {name}"] for name in schedules},
        "whole_step_over_unsplit_compiled": ms["whole step 1F1B"] / ms["unsplit compiled"],
        "us_per_action_over_unsplit_compiled": (ms["whole step 1F1B"] - ms["unsplit compiled"]) * 1e3 / actions,
        "grads_match": True,
    }
    for name, value in ms.items():
        print(
            f"{name:>22}: {value:8.3f} ms {results['clock']}"
            + (f"   first call {first_call_s[name]:6.1f} s" if name in first_call_s else "")
        )
    print("eager / whole step:", {k: round(v, 2) for k, v in results["eager_over_whole_step"].items()})
    print("peak KiB in a step:", {k: round(v, 1) for k, v in peak_kib.items()})
    return results


def train_gpt_size(quick: bool, repeats: int | None) -> dict[str, Any]:
    """The compiled whole step at ``examples/train_gpt.py``'s size (4 stages of one GPT block,
    width 128, 4 heads, 16 sequences of 64 bytes, 1F1B x 4, bfloat16 compute with float32 sums)
    against its eager step and its eager step over compiled stages; CPU time, A/B interleaved."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_gpt  # the example's model: its stages, parameters and loss

    dim, heads, batch_size, context = (32, 2, 8, 16) if quick else (128, 4, 16, 64)
    backend = "aot_eager" if quick else "inductor"
    repeats = repeats or (3 if quick else 21)
    generator = torch.Generator().manual_seed(0)
    params = train_gpt.init_params(dim, context, 4, generator)
    tokens = torch.randint(256, (batch_size, context + 1), generator=generator)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    fns = train_gpt.make_stages(heads, 1)
    precision = fpipe.Precision(compute=torch.bfloat16)
    torch._dynamo.reset()

    def build(stages: Sequence[Any], compile: Any = False) -> Any:
        return fpipe.pipeline(train_gpt.loss_fn, stages, OneFOneB(4), precision=precision, compile=compile)

    eager = build(fns)
    sides = {
        "eager 1F1B": eager,
        "whole step 1F1B": build(fns, backend),
        "compiled stages 1F1B": build([torch.compile(fn, backend=backend) for fn in fns]),
    }
    reference = eager(params, batch)
    first_call_s = {}
    for name in ("whole step 1F1B", "compiled stages 1F1B"):
        start = time.perf_counter()
        got = sides[name](params, batch)
        first_call_s[name] = time.perf_counter() - start
        torch.testing.assert_close(got[0], reference[0], rtol=2e-2, atol=0)  # bfloat16 compute
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):  # A/B interleaved: one step of each, repeated
        for name, step in sides.items():
            start = time.process_time()
            step(params, batch)
            times[name].append(time.process_time() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, value in ms.items():
        first = f"   first call {first_call_s[name]:6.1f} s" if name in first_call_s else ""
        print(f"{name:>22}: {value:8.2f} ms cpu{first}")
    return {
        "config": {"dim": dim, "heads": heads, "batch": batch_size, "context": context, "backend": backend},
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "cpu_ms": ms,
        "first_call_s": first_call_s,
        "eager_over_whole_step": ms["eager 1F1B"] / ms["whole step 1F1B"],
        "eager_over_compiled_stages": ms["eager 1F1B"] / ms["compiled stages 1F1B"],
        "loss_close": True,
    }


if __name__ == "__main__":
    main()
