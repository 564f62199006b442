"""How much fpipe costs over plain autograd, in one process on CPU.

Run::

    python benchmarks/bench_overhead.py            # full sizes, about a minute on 2 cores
    python benchmarks/bench_overhead.py --quick    # tiny sizes, a few seconds (used by the tests)
    python benchmarks/bench_overhead.py --json out.json
    python benchmarks/bench_overhead.py --device cuda   # on a GPU (benchmarks/gpu_check.sh)
    python benchmarks/bench_overhead.py --per-action-only   # (c) alone, for 1 x 8, 4 x 8 and 4 x 64
    python benchmarks/bench_overhead.py --ab /tmp/old --rounds 9   # A/B of the per-action cost
    python benchmarks/bench_overhead.py --ab /tmp/old --cpu-time   # the same in CPU time (a shared machine)

``--ab TREE`` runs ``--per-action-only`` in fresh processes, alternating the fpipe found in
``TREE`` (e.g. ``mkdir /tmp/old && git archive <commit> fpipe | tar -x -C /tmp/old``) with this
checkout's, ``--rounds`` times each, and reports the medians and the range of each figure.

Three comparisons, each timed A/B interleaved (one step of A, one step of B, repeat) so that
noise from other work on the machine hits both sides alike; the table reports medians:

  (a) fpipe, 1 stage x 1 microbatch (``GPipe(1)``) vs ``loss.backward()`` on the same model;
  (b) fpipe, 4 stages x 8 microbatches (``OneFOneB(8)``) in one process vs a hand-written
      gradient accumulation loop over 8 microbatches (``(loss / 8).backward()`` each);
  (c) executor overhead per action: 4 tiny stages (``x * p`` on one element) x 64
      microbatches, step time / number of actions (``2 * stages * microbatches``), against
      autograd's own cost per action: the same multiplies and one ``backward()`` per
      microbatch, per ``2 * stages * microbatches`` (``--per-action-only``: also 1 x 8 and 4 x 8).

The model is a small Llama-ish stack of residual SwiGLU MLP blocks with RMSNorm, written as pure
functions over a dict of float32 tensors; plain autograd runs the same functions with parameters
that require grad. Before timing, fpipe's gradients are checked against the plain ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import fpipe
from fpipe.schedules import GPipe, OneFOneB

Params = dict[str, torch.Tensor]


# The model: pure functions over a dict of tensors ("<layer>.<name>" -> tensor).


def init_params(num_layers: int, dim: int, hidden: int, *, first_layer: int = 0, seed: int = 0) -> Params:
    generator = torch.Generator().manual_seed(seed + first_layer)
    params: Params = {}
    for layer in range(first_layer, first_layer + num_layers):
        params[f"{layer}.norm"] = torch.ones(dim)
        params[f"{layer}.w_gate"] = torch.randn(dim, hidden, generator=generator) / dim**0.5
        params[f"{layer}.w_up"] = torch.randn(dim, hidden, generator=generator) / dim**0.5
        params[f"{layer}.w_down"] = torch.randn(hidden, dim, generator=generator) / hidden**0.5
    return params


def layers_of(params: Params) -> list[str]:
    return sorted({key.split(".")[0] for key in params}, key=int)


def block(params: Params, layer: str, h: torch.Tensor) -> torch.Tensor:
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * params[f"{layer}.norm"]
    gate = torch.nn.functional.silu(n @ params[f"{layer}.w_gate"])
    return h + (gate * (n @ params[f"{layer}.w_up"])) @ params[f"{layer}.w_down"]


def blocks(params: Params, h: torch.Tensor) -> torch.Tensor:
    for layer in layers_of(params):
        h = block(params, layer, h)
    return h


def first_stage(params: Params, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return blocks(params, microbatch["x"])


def loss_fn(y: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((y - microbatch["target"]) ** 2).mean()


def split_params(params: Params, num_stages: int) -> list[Params]:
    layers = layers_of(params)
    per_stage = len(layers) // num_stages
    return [
        {k: v for k, v in params.items() if k.split(".")[0] in layers[s * per_stage : (s + 1) * per_stage]}
        for s in range(num_stages)
    ]


# The baselines: plain autograd on the same functions.


def plain_step(params: Params, batch: dict[str, torch.Tensor], num_microbatches: int = 1) -> tuple[float, Params]:
    """``loss.backward()`` per microbatch with the loss scaled by ``1 / num_microbatches``."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    xs = batch["x"].chunk(num_microbatches)
    targets = batch["target"].chunk(num_microbatches)
    total = torch.zeros((), device=batch["x"].device)
    for x, target in zip(xs, targets):
        loss = loss_fn(blocks(leaves, x), {"target": target}) / num_microbatches
        loss.backward()
        total = total + loss.detach()  # read once, at the end: no device sync per microbatch
    return total.item(), {k: v.grad for k, v in leaves.items()}  # type: ignore[misc]


# Timing.


def interleaved(
    fns: Sequence[Callable[[], Any]],
    repeats: int,
    warmup: int,
    device: torch.device | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Seconds per call of each function, calling them in turn ``repeats`` times (on CUDA, each
    call waits for the device before the clock stops); ``clock``: wall time, or with
    ``time.process_time`` the CPU time of this process (on a shared machine, wall time also
    counts the time other processes hold the cores, more of it the longer a call lasts)."""
    if device is not None and device.type == "cuda":
        fns = [_synchronized(fn, device) for fn in fns]
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            start = clock()
            fn()
            times[k].append(clock() - start)
    return times


def _synchronized(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    def call() -> Any:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def check_grads(fpipe_grads: Sequence[Params], plain_grads: Params) -> None:
    merged = {k: v for stage in fpipe_grads for k, v in stage.items()}
    assert merged.keys() == plain_grads.keys()
    for key in plain_grads:
        torch.testing.assert_close(merged[key], plain_grads[key], rtol=1e-4, atol=1e-5, msg=f"grad of {key} differs")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (seconds)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, help="timed steps per side (default 21, quick 3)")
    parser.add_argument("--device", default="cpu", help="where parameters and batches live (default cpu)")
    parser.add_argument("--per-action-only", action="store_true", help="only (c), for 1 x 8, 4 x 8 and 4 x 64")
    parser.add_argument("--ab", metavar="TREE", help="A/B of --per-action-only: TREE's fpipe against this one")
    parser.add_argument("--rounds", type=int, default=9, help="processes per side with --ab (default 9)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="with --per-action-only or --ab: CPU time of the process, not wall time"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.ab:
        return ab(args.ab, args.rounds, args.repeats, args.json, quick=args.quick, cpu_time=args.cpu_time)
    if args.per_action_only:
        repeats = args.repeats or (3 if args.quick else 41)
        configs = [(1, 2), (2, 2)] if args.quick else [(1, 8), (4, 8), (4, 64)]
        clock = time.process_time if args.cpu_time else time.perf_counter
        rows = [per_action(s, m, repeats, 3, device, clock) for s, m in configs]
        for row in rows:
            print(
                f"{row['stages']} x {row['microbatches']}: {row['us_per_action']:.2f} us/action, autograd's own "
                f"{row['plain_us_per_action']:.2f}, ratio {row['ratio']:.2f}"
            )
        only = {"per_action_only": rows, "torch": torch.__version__, "python": platform.python_version()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(only, f, indent=2)
        return only

    if args.quick:
        dim, hidden, num_layers, batch_size, seq = 16, 32, 4, 8, 4
        repeats, warmup, tiny_microbatches = 3, 1, 8
    else:
        dim, hidden, num_layers, batch_size, seq = 256, 512, 4, 32, 64
        repeats, warmup, tiny_microbatches = 21, 3, 64
    repeats = args.repeats or repeats
    num_stages, num_microbatches, tiny_stages = 4, 8, 4

    params = {k: v.to(device) for k, v in init_params(num_layers, dim, hidden).items()}
    generator = torch.Generator().manual_seed(1)
    batch = {
        "x": torch.randn(batch_size, seq, dim, generator=generator).to(device),
        "target": torch.randn(batch_size, seq, dim, generator=generator).to(device),
    }
    results: dict[str, Any] = {
        "config": {
            "dim": dim,
            "hidden": hidden,
            "layers": num_layers,
            "batch": batch_size,
            "seq": seq,
            "dtype": "float32",
            "repeats": repeats,
            "warmup": warmup,
            "quick": args.quick,
            "device": str(device),
        },
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
    }

    # (a) 1 stage x 1 microbatch vs loss.backward().
    step_1 = fpipe.pipeline(loss_fn, [first_stage], GPipe(1))
    loss_f, grads_f = step_1([params], batch)
    loss_p, grads_p = plain_step(params, batch)
    check_grads(grads_f, grads_p)
    torch.testing.assert_close(loss_f.item(), loss_p, rtol=1e-5, atol=1e-6)
    fp, pl = interleaved([lambda: step_1([params], batch), lambda: plain_step(params, batch)], repeats, warmup, device)
    results["one_stage"] = {
        "fpipe": summary(fp),
        "plain": summary(pl),
        "ratio": statistics.median(fp) / statistics.median(pl),
        "grads_match": True,
    }

    # (b) 4 stages x 8 microbatches (1F1B, one process) vs hand-written accumulation.
    stages = [first_stage] + [blocks] * (num_stages - 1)
    stage_params = split_params(params, num_stages)
    step_4 = fpipe.pipeline(loss_fn, stages, OneFOneB(num_microbatches))
    loss_f, grads_f = step_4(stage_params, batch)
    loss_p, grads_p = plain_step(params, batch, num_microbatches)
    check_grads(grads_f, grads_p)
    torch.testing.assert_close(loss_f.item(), loss_p, rtol=1e-5, atol=1e-6)
    fp, pl = interleaved(
        [lambda: step_4(stage_params, batch), lambda: plain_step(params, batch, num_microbatches)],
        repeats,
        warmup,
        device,
    )
    results["four_stages"] = {
        "microbatches": num_microbatches,
        "fpipe": summary(fp),
        "plain": summary(pl),
        "ratio": statistics.median(fp) / statistics.median(pl),
        "grads_match": True,
    }

    # (c) Executor overhead per action on tiny stages.
    results["per_action"] = per_action(tiny_stages, tiny_microbatches, repeats, warmup, device)

    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def per_action(
    num_stages: int,
    num_microbatches: int,
    repeats: int,
    warmup: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """(c): fpipe's cost per action on ``num_stages`` tiny stages (``x * p`` on one element) x
    ``num_microbatches`` (1F1B), and autograd's own on the same multiplies, interleaved."""
    tiny = [lambda p, x: x * p] * num_stages
    step_tiny = fpipe.pipeline(lambda y, mb: y.mean(), tiny, OneFOneB(num_microbatches))
    tiny_params = [torch.full((1,), 1.0 + s / 10, device=device) for s in range(num_stages)]
    tiny_batch = torch.randn(num_microbatches, 1, generator=torch.Generator().manual_seed(2)).to(device)

    def plain_tiny() -> None:  # the autograd floor: the same multiplies, one backward per microbatch
        leaves = [p.detach().requires_grad_() for p in tiny_params]
        for x in tiny_batch.chunk(num_microbatches):
            for p in leaves:
                x = x * p
            (x.mean() / num_microbatches).backward()

    tt, tp = interleaved([lambda: step_tiny(tiny_params, tiny_batch), plain_tiny], repeats, warmup, device, clock)
    num_actions = 2 * num_stages * num_microbatches
    return {
        "stages": num_stages,
        "microbatches": num_microbatches,
        "actions": num_actions,
        "step": summary(tt),
        "us_per_action": statistics.median(tt) / num_actions * 1e6,
        "plain_step": summary(tp),
        "plain_us_per_action": statistics.median(tp) / num_actions * 1e6,
        "ratio": statistics.median(tt) / statistics.median(tp),
    }


def ab(
    tree: str, rounds: int, repeats: int | None, out: str | None, *, quick: bool = False, cpu_time: bool = False
) -> dict[str, Any]:
    """``--per-action-only`` in fresh processes, ``tree``'s fpipe and this checkout's alternated
    ``rounds`` times; per side and config, the median and range of us per action and of the ratio."""
    here = str(Path(__file__).resolve().parent.parent)
    sides = {"before": str(Path(tree).resolve()), "after": here}
    runs: dict[str, list[list[dict[str, Any]]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(rounds):
            for side in sides if k % 2 == 0 else reversed(list(sides)):
                path = os.path.join(scratch, f"{side}{k}.json")
                command = [sys.executable, __file__, "--per-action-only", "--json", path]
                command += ["--repeats", str(repeats)] if repeats else []
                command += ["--quick"] if quick else []
                command += ["--cpu-time"] if cpu_time else []
                env = {**os.environ, "PYTHONPATH": sides[side]}
                subprocess.run(command, check=True, env=env, cwd=scratch, stdout=subprocess.DEVNULL)
                with open(path) as f:
                    runs[side].append(json.load(f)["per_action_only"])
    table = []
    for c, first in enumerate(runs["after"][0]):
        row: dict[str, Any] = {"stages": first["stages"], "microbatches": first["microbatches"]}
        for side in sides:
            for key in ("us_per_action", "plain_us_per_action", "ratio"):
                values = [run[c][key] for run in runs[side]]
                row[f"{side}_{key}"] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        table.append(row)
    clock = "cpu" if cpu_time else "wall"
    print(f"per action ({clock} time), {rounds} processes per side, alternated (median [min, max])")
    print("| stages x mb | side | fpipe us/action | autograd us/action | ratio |")
    print("|---|---|---|---|---|")
    for row in table:
        for side in sides:
            cells = [row[f"{side}_{key}"] for key in ("us_per_action", "plain_us_per_action", "ratio")]
            text = [f"{v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]" for v in cells]
            print(f"| {row['stages']} x {row['microbatches']} | {side} | {' | '.join(text)} |")
    results = {"ab": table, "rounds": rounds, "before": sides["before"], "clock": clock, "torch": torch.__version__}
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    return results


def print_table(results: dict[str, Any]) -> None:
    a, b, c = results["one_stage"], results["four_stages"], results["per_action"]
    m = results["machine"]
    print(f"torch {m['torch']}, {m['torch_threads']} threads, config {results['config']}")  # with the device
    print("grads match plain autograd (assert_close rtol=1e-4, atol=1e-5): 1 stage yes, 4 stages yes")
    print()
    print(f"| {'comparison':<48} | {'fpipe ms':>9} | {'plain ms':>9} | {'ratio':>6} | target  |")
    print(f"|{'-' * 50}|{'-' * 11}|{'-' * 11}|{'-' * 8}|---------|")
    for name, row, target in [
        ("(a) 1 stage x 1 mb vs loss.backward()", a, "<= 1.05"),
        (f"(b) 4 stages x {b['microbatches']} mb vs hand-written accumulation", b, "<= 1.10"),
    ]:
        f, p = row["fpipe"]["median_s"] * 1e3, row["plain"]["median_s"] * 1e3
        print(f"| {name:<48} | {f:>9.2f} | {p:>9.2f} | {row['ratio']:>6.3f} | {target} |")
    print()
    print(
        f"(c) {c['stages']} tiny stages x {c['microbatches']} mb = {c['actions']} actions: "
        f"step {c['step']['median_s'] * 1e3:.2f} ms, {c['us_per_action']:.1f} us/action (target < 50); "
        f"plain autograd on the same: {c['plain_us_per_action']:.1f} us per forward or backward"
    )


if __name__ == "__main__":
    main()
