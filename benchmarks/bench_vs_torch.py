"""fpipe against ``torch.distributed.pipelining`` on 2 processes (gloo, CPU, one thread each).

Run::

    python benchmarks/bench_vs_torch.py            # full sizes, about 8 minutes on 2 busy cores
    python benchmarks/bench_vs_torch.py --quick    # tiny sizes, a few seconds (used by the tests)
    python benchmarks/bench_vs_torch.py --json out.json
    python benchmarks/bench_vs_torch.py --cprofile DIR   # also cProfile a few steps of each side
    python benchmarks/bench_vs_torch.py --per-action-only   # only the runtime cost per action (item 3)

One command spawns 2 ranks joined by a gloo process group on 127.0.0.1 (a free port), each with
``torch.set_num_threads(1)``. Both ranks build the same Llama-style decoder (token embedding,
RMSNorm, causal attention with RoPE, SwiGLU MLP, final norm and LM head, cross-entropy),
split in 2 stages (the embedding and the first half of the layers on rank 0, the rest and the
head on rank 1), twice over:

  - fpipe: pure functions over dicts of tensors (``F.linear``, ``F.rms_norm``, ...), run by
    ``fpipe.pipeline(loss_fn, stages, schedule, parallel=fpipe.Parallelism(group=WORLD))``;
  - torch: the equivalent ``nn.Module`` stages (``nn.Linear``, ``nn.RMSNorm``, ...) in a
    ``PipelineStage`` run by ``ScheduleGPipe`` or ``Schedule1F1B``.

fpipe's params are the torch modules' own parameter tensors (detached), so both sides compute on
the same numbers. For each schedule (GPipe, 1F1B) and microbatch count (4, 8):

  1. grads: one step of each from no grads; on each rank fpipe's grads are compared with the
     torch stage module's ``.grad`` (``assert_close``, rtol 1e-3, atol 1e-5), and the losses;
  2. memory: the peak of torch CPU allocations on each rank, over a window that builds the side
     (torch's ``PipelineStage`` allocates its receive buffers in its first step) and runs two
     steps, measured with the profiler's allocation events (``profile_memory=True``): bytes
     allocated inside the window and still live, at their highest. The parameters, allocated
     before, are not counted on either side; grads, activations, buffers and messages are;
  3. time: steps timed A/B interleaved, ABBA (fpipe, torch, torch, fpipe, ...), each step
     preceded by a barrier; a step's time is the slower rank's; the table reports medians, the
     ratio of the medians, the median and quartiles of the per-round ratios (the two steps of a
     round run back to back, so a slow spell of a shared machine hits both) and the ratio of
     the fastest steps.

Both sides drop the previous step's grads before a step (``zero_grad(set_to_none=True)`` for
torch, ``del grads`` for fpipe), both get the batch on the first rank and the targets on the
last one, and torch's schedule runs with ``return_outputs=False`` (fpipe returns no outputs).

Then (item 4) a few untimed fpipe steps run under ``fpipe.record()``, and the idle fraction of
each rank is set against ``fpipe.schedules.simulate``'s prediction (see ``bubble_analysis``).
Last (item 3, distributed), the runtime's own cost per action on both sides: tiny stages
(``x * p`` on one element) and many microbatches, so a step is all messages and bookkeeping
(see ``run_per_action``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import math
import os
import platform
import queue as queue_module
import resource
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

Params = dict[str, torch.Tensor]
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (4, 8)
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-5


# The model, twice: pure functions over a dict of tensors (fpipe) and nn.Modules (torch).
# Parameter names are the modules' own, e.g. "layers.3.wq.weight".


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: ``cos`` and ``sin`` of shape ``(seq, head_dim)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    b, t, d = q.shape
    q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, d)


def block_fn(p: Params, prefix: str, h: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim = h.shape[-1]
    x = F.rms_norm(h, (dim,), p[prefix + "attn_norm.weight"], 1e-6)
    q, k, v = (F.linear(x, p[prefix + name + ".weight"]) for name in ("wq", "wk", "wv"))
    h = h + F.linear(attention(q, k, v, heads, cos, sin), p[prefix + "wo.weight"])
    x = F.rms_norm(h, (dim,), p[prefix + "mlp_norm.weight"], 1e-6)
    gate = F.silu(F.linear(x, p[prefix + "w_gate.weight"]))
    return h + F.linear(gate * F.linear(x, p[prefix + "w_up.weight"]), p[prefix + "w_down.weight"])


def stage_fn(cfg: dict[str, int], layers: Sequence[int], first: bool, last: bool) -> Callable[[Params, Any], Any]:
    """fpipe's stage: ``fn(params, x)``; ``x`` is the microbatch on the first stage."""
    cos, sin = rope_tables(cfg["seq"], cfg["dim"] // cfg["heads"])
    heads, dim = cfg["heads"], cfg["dim"]

    def fn(p: Params, x: Any) -> torch.Tensor:
        h = F.embedding(x["tokens"], p["embed.weight"]) if first else x
        for layer in layers:
            h = block_fn(p, f"layers.{layer}.", h, heads, cos, sin)
        if last:
            h = F.linear(F.rms_norm(h, (dim,), p["norm.weight"], 1e-6), p["head.weight"])
        return h

    return fn


def fpipe_loss(logits: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), microbatch["targets"].flatten())


def torch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(h)
        h = h + self.wo(attention(self.wq(x), self.wk(x), self.wv(x), self.heads, cos, sin))
        x = self.mlp_norm(h)
        out: torch.Tensor = h + self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return out


class Stage(nn.Module):
    """torch's stage: the embedding (first), some blocks, the final norm and head (last)."""

    def __init__(self, cfg: dict[str, int], layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        dim, vocab = cfg["dim"], cfg["vocab"]
        self.first, self.last = first, last
        if first:
            self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, cfg["heads"], cfg["hidden"]) for i in layers})
        if last:
            self.norm = nn.RMSNorm(dim, eps=1e-6)
            self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(cfg["seq"], dim // cfg["heads"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.first else x
        for block in self.layers.values():
            h = block(h, self.cos, self.sin)
        return self.head(self.norm(h)) if self.last else h


def stage_layers(cfg: dict[str, int], stage: int, num_stages: int) -> list[int]:
    per_stage = cfg["layers"] // num_stages
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def build_stage_module(cfg: dict[str, int], stage: int, num_stages: int) -> Stage:
    torch.manual_seed(1000 + stage)
    module = Stage(cfg, stage_layers(cfg, stage, num_stages), stage == 0, stage == num_stages - 1)
    with torch.no_grad():  # small weights, so 8 layers stay well-conditioned
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.normal_(0.0, 0.02 if "embed" in name else 1.0 / math.sqrt(p.shape[-1]))
    return module


def make_batch(cfg: dict[str, int]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=generator)
    return {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1)}


# One rank's work.


def peak_allocated(fn: Callable[[], None]) -> int:
    """Peak bytes of torch CPU allocations made while ``fn`` runs and still live at that moment.

    The profiler reports, with each allocation and free, the running total of bytes allocated
    while memory profiling was on and not yet freed; the peak is its maximum over the window
    less its value when the window opened.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int, int]] = []
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        stack.extend(node.children)
    if not events:
        return 0
    events.sort()
    baseline = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - baseline


def barrier_timed(fn: Callable[[], None]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def abba(sides: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Time two sides A/B interleaved, ABBA (A, B, B, A, ...), each step after a barrier."""
    for _ in range(warmup):
        for fn in sides.values():
            barrier_timed(fn)
    a, b = sides
    times: dict[str, list[float]] = {a: [], b: []}
    for r in range(repeats):
        for side in (a, b) if r % 2 == 0 else (b, a):
            times[side].append(barrier_timed(sides[side]))
    return times


def rank_main(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    cfg = opts["model"]
    num_stages = world_size
    module = build_stage_module(cfg, rank, num_stages)
    stages = [stage_fn(cfg, stage_layers(cfg, s, num_stages), s == 0, s == num_stages - 1) for s in range(num_stages)]
    batch = make_batch(cfg)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    configs = []
    for schedule_name in opts["schedules"]:
        for m in opts["microbatches"]:
            configs.append(run_config(rank, world_size, opts, module, stages, batch, schedule_name, m))
            if rank == 0 and opts["progress"]:
                print(f"  done: {schedule_name}, {m} microbatches", file=sys.stderr, flush=True)
    rss = {"start": rss_before, "end": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    per_action = [run_per_action(rank, world_size, opts, name) for name in opts["schedules"]]
    return {"rank": rank, "configs": configs, "maxrss_kib": rss, "per_action": per_action}


class TinyStage(nn.Module):
    """``x * p`` on one element: a stage whose compute is negligible next to the runtime's."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.p


def tiny_stage(p: Params, x: Any) -> torch.Tensor:
    return x * p["p"]


def tiny_loss_fpipe(y: torch.Tensor, microbatch: Any) -> torch.Tensor:
    return y.sum()


def tiny_loss_torch(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return y.sum()


def run_per_action(rank: int, world_size: int, opts: dict[str, Any], schedule_name: str) -> dict[str, Any]:
    """Runtime overhead per action (item 3), distributed: tiny stages, many microbatches, both sides.

    Each rank runs ``2 m`` actions per step (a forward and a backward per microbatch), so a
    step's time over ``2 m`` is what one action costs the runtime, messages included.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import fpipe
    from fpipe.schedules import GPipe, OneFOneB

    m = opts["per_action_microbatches"]
    last = world_size - 1
    module = TinyStage()
    params: list[Params | None] = [{"p": module.p.detach()} if s == rank else None for s in range(world_size)]
    batch = torch.ones(m, 1)
    schedule = GPipe(m) if schedule_name == "gpipe" else OneFOneB(m)
    torch_cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    step = fpipe.pipeline(
        tiny_loss_fpipe, [tiny_stage] * world_size, schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD)
    )
    torch_schedule = torch_cls(PipelineStage(module, rank, world_size, torch.device("cpu")), m, loss_fn=tiny_loss_torch)

    def fpipe_step() -> None:
        step(params, batch)

    def torch_step() -> None:
        module.zero_grad(set_to_none=True)
        if rank == 0:
            torch_schedule.step(batch, return_outputs=False)
        elif rank == last:
            torch_schedule.step(target=batch, return_outputs=False)
        else:
            torch_schedule.step(return_outputs=False)

    times = abba({"fpipe": fpipe_step, "torch": torch_step}, max(opts["warmup"], 1), opts["per_action_repeats"])
    return {"schedule": schedule_name, "microbatches": m, "actions_per_rank": 2 * m, "times": times}


def run_config(
    rank: int,
    world_size: int,
    opts: dict[str, Any],
    module: Stage,
    stages: list[Callable[[Params, Any], Any]],
    batch: dict[str, torch.Tensor],
    schedule_name: str,
    m: int,
) -> dict[str, Any]:
    """One schedule and microbatch count on this rank: grads, memory, time, bubble."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import fpipe
    from fpipe.schedules import GPipe, OneFOneB

    num_stages, last = world_size, world_size - 1
    names = [name for name, _ in module.named_parameters()]
    own = {name: p.detach() for name, p in module.named_parameters()}  # shares storage with the module
    params: list[Params | None] = [own if s == rank else None for s in range(num_stages)]
    schedule = GPipe(m) if schedule_name == "gpipe" else OneFOneB(m)
    torch_cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    state: dict[str, Any] = {}

    def build_fpipe() -> None:
        state["step"] = fpipe.pipeline(fpipe_loss, stages, schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD))

    def fpipe_step() -> None:
        state.pop("grads", None)
        state["loss"], state["grads"] = state["step"](params, batch)

    def build_torch() -> None:
        stage = PipelineStage(module, rank, num_stages, torch.device("cpu"))
        state["schedule"] = torch_cls(stage, m, loss_fn=torch_loss)

    def torch_step() -> None:
        module.zero_grad(set_to_none=True)
        if rank == 0:
            state["schedule"].step(batch["tokens"], return_outputs=False)
        elif rank == last:
            losses: list[torch.Tensor] = []
            state["schedule"].step(target=batch["targets"], losses=losses, return_outputs=False)
            state["torch_losses"] = [loss.detach() for loss in losses]
        else:
            state["schedule"].step(return_outputs=False)

    # 1: grads after one step of each, from no grads.
    module.zero_grad(set_to_none=True)
    build_fpipe()
    fpipe_step()
    fg = {k: g.clone() for k, g in state.pop("grads")[rank].items()}
    build_torch()
    torch_step()
    tg = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    fpipe_loss_value = float(state["loss"])
    torch_loss_value = float(torch.stack(state["torch_losses"]).mean()) if rank == last else None
    assert sorted(fg) == sorted(tg) == sorted(names), (sorted(fg), sorted(tg))
    max_abs = max(float((fg[n] - tg[n]).abs().max()) for n in names)
    max_ref = max(float(tg[n].abs().max()) for n in names)
    mismatches = []
    for n in names:
        try:
            torch.testing.assert_close(fg[n], tg[n], rtol=GRAD_RTOL, atol=GRAD_ATOL)
        except AssertionError as error:
            mismatches.append(f"rank {rank}, {n}: {str(error).splitlines()[0]}")
    del fg, tg
    state.clear()
    module.zero_grad(set_to_none=True)

    # 2: peak memory over a window that builds the side and runs 2 steps.
    def fpipe_window() -> None:
        build_fpipe()
        fpipe_step()
        fpipe_step()

    def torch_window() -> None:
        build_torch()
        torch_step()
        torch_step()

    dist.barrier()
    fpipe_peak = peak_allocated(fpipe_window)
    state.pop("grads")
    dist.barrier()
    torch_peak = peak_allocated(torch_window)
    module.zero_grad(set_to_none=True)

    # 3: time, ABBA.
    sides = {"fpipe": fpipe_step, "torch": torch_step}
    times = abba(sides, opts["warmup"], opts["repeats"])

    # 4: the bubble, from fpipe's recorded timelines (untimed steps: recording gathers them).
    bubble = None
    if hasattr(fpipe, "record") and opts["record_steps"]:
        with fpipe.record() as recording:
            recorded_steps = [barrier_timed(fpipe_step) for _ in range(opts["record_steps"])]
        bubble = {**bubble_analysis(recording.timelines), "step_s": recorded_steps}

    if opts["cprofile"]:
        for side, fn in sides.items():
            profiler = cProfile.Profile()
            dist.barrier()
            profiler.enable()
            for _ in range(3):
                fn()
            profiler.disable()
            profiler.dump_stats(os.path.join(opts["cprofile"], f"{schedule_name}_m{m}_{side}_rank{rank}.prof"))

    state.clear()
    module.zero_grad(set_to_none=True)
    dist.barrier()
    return {
        "schedule": schedule_name,
        "microbatches": m,
        "times": times,
        "peak_bytes": {"fpipe": fpipe_peak, "torch": torch_peak},
        "loss": {"fpipe": fpipe_loss_value, "torch": torch_loss_value},
        "grads": {"max_abs_diff": max_abs, "max_abs": max_ref, "mismatches": mismatches},
        "bubble": bubble,
    }


def bubble_analysis(timelines: Sequence[Any]) -> dict[str, Any]:
    """Measured idle fraction per rank against ``fpipe.schedules.simulate``'s predictions.

    A recorded action runs from when its inputs have arrived (the executor starts its clock
    after the receive) to when it returns, so a wait for an activation or a cotangent from the
    other rank is idle time, as in a simulation. Measured figures per rank, medians over the
    recorded steps:

      - ``recorded``: ``1 - sum(action durations) / makespan``, as ``Simulation.bubble_fractions``
        gives it for the recorded timeline;
      - ``estimated``: an action of a kind on a rank is charged the shortest duration of that
        (rank, kind) over every recorded step, which takes out the noise of slow runs.

    Predictions, from ``simulate``:

      - ``fitted``: ``simulate(program, fit_costs(timelines))``: per-stage costs (the median
        duration of each stage's ``F`` and ``B``) and the median message latency, all read off
        the recorded steps; ``fitted_error`` is ``|recorded - fitted| / recorded`` per rank;
      - ``simulated``: one ``Costs(forward=F, backward=B)`` for every stage, ``F`` and ``B`` the
        estimated costs averaged over ranks, no latency;
      - ``textbook``: ``Costs(backward=2)``, which gives ``(p-1)/(m+p-1)``;
      - ``replayed``: ``replay(timeline, send=latency)`` per recorded step, the simulator's rule
        run on each action's own measured duration (``latency``: the median of the fitted
        ``send``), medians over the steps; ``replayed_error`` as ``fitted_error``. Where
        ``fitted`` tests fixed per-stage costs, this tests the runtime: whether it idles only
        where the schedule's dependencies and the actions' durations make it.

    And each recorded step's critical path, ``critical_path_s``: the makespan of
    ``fpipe.schedules.replay(timeline)``, the step's own actions with their measured durations
    rerun with free messages and nothing between actions: the step as long as the schedule and
    the stages' compute make it. No runtime running these actions in this order takes less.
    """
    from fpipe.planning import fit_costs
    from fpipe.schedules import Costs, replay, simulate

    program = timelines[0].program
    durations: dict[tuple[int, str], list[float]] = {}
    for t in timelines:
        for r, row in enumerate(program.ranks):
            for action, start, end in zip(row, t.starts[r], t.ends[r]):
                durations.setdefault((r, action.kind), []).append(end - start)
    cost = {key: min(values) for key, values in durations.items()}
    recorded, estimated, makespans = [], [], []
    for t in timelines:
        span = t.makespan
        makespans.append(span)
        recorded.append(t.bubble_fractions)
        estimated.append(
            tuple(1 - sum(cost[r, action.kind] for action in row) / span for r, row in enumerate(program.ranks))
        )
    kinds = sorted({kind for _, kind in cost})
    mean_cost = {kind: statistics.mean(c for (_, k), c in cost.items() if k == kind) for kind in kinds}
    predicted = simulate(program, Costs(forward=mean_cost["F"], backward=mean_cost["B"]))
    textbook = simulate(program, Costs(backward=2))
    recorded_median = [statistics.median(x) for x in zip(*recorded)]
    costs = fit_costs(timelines)
    fitted = simulate(program, costs)
    latency = statistics.median(c.send for c in costs)
    replayed = [statistics.median(x) for x in zip(*(replay(t, send=latency).bubble_fractions for t in timelines))]

    def errors(predicted: Sequence[float]) -> list[float]:
        return [abs(r - p) / r if r else (0.0 if p == r else math.inf) for r, p in zip(recorded_median, predicted)]

    return {
        "steps": len(timelines),
        "makespan_s": statistics.median(makespans),
        "cost_s": {f"rank{r}.{kind}": c for (r, kind), c in sorted(cost.items())},
        "median_duration_s": {f"rank{r}.{kind}": statistics.median(v) for (r, kind), v in sorted(durations.items())},
        "recorded": recorded_median,
        "estimated": [statistics.median(x) for x in zip(*estimated)],
        "simulated": list(predicted.bubble_fractions),
        "simulated_makespan_s": predicted.makespan,
        "textbook": list(textbook.bubble_fractions),
        "fitted": list(fitted.bubble_fractions),
        "fitted_makespan_s": fitted.makespan,
        "critical_path_s": [replay(t).makespan for t in timelines],
        "fitted_costs_s": [{"forward": c.forward, "backward": c.of("B"), "send": c.send} for c in costs],
        "fitted_error": errors(fitted.bubble_fractions),
        "replayed": replayed,
        "replayed_error": errors(replayed),
    }


# Processes: a copy of what tests/_multiprocess.py does (benchmarks do not import from tests/).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bootstrap(rank: int, world_size: int, port: int, opts: dict[str, Any], queue: Any, fn: Callable[..., Any]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=opts["timeout"])
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        queue.put((rank, True, fn(rank, world_size, opts)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, opts: dict[str, Any], fn: Callable[..., Any] = rank_main) -> list[dict[str, Any]]:
    """``[fn(rank, world_size, opts) for rank in ranks]``, each in its own gloo process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    args = [(r, world_size, port, opts, queue, fn) for r in range(world_size)]
    procs = [ctx.Process(target=_bootstrap, args=a) for a in args]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=opts["timeout"])
            if ok:
                results[rank] = payload
            else:
                failures.append(f"rank {rank}:\n{payload}")
    except queue_module.Empty:
        failures.append(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {opts['timeout']} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RuntimeError("bench_vs_torch.run_ranks: a rank failed\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]


# Summary.


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def paired(fpipe_steps: list[float], torch_steps: list[float]) -> dict[str, float]:
    """fpipe / torch per ABBA round (the two steps of a round ran back to back, so a slow spell of
    the machine hits both): median and quartiles of those ratios, and the ratio of the minimums."""
    ratios = sorted(f / t for f, t in zip(fpipe_steps, torch_steps))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": median, "q1": q1, "q3": q3, "of_minimums": min(fpipe_steps) / min(torch_steps)}


def bound(critical_paths: list[float], recorded_steps: list[list[float]], row: dict[str, Any]) -> dict[str, float]:
    """How close fpipe's steps come to their critical paths, and the fpipe/torch ratio that leaves.

    ``step_over_critical_path``: over the recorded steps, the median of each step's wall time (the
    slower rank's, from the barrier to the step's return, recording included) over its critical
    path. ``floor``: the per-round fpipe/torch ratio divided by it: the fpipe/torch ratio of a
    runtime whose steps took no more than their critical paths, torch's steps staying as they were.
    """
    walls = [max(ts) for ts in zip(*recorded_steps)]
    over = statistics.median(w / c for w, c in zip(walls, critical_paths))
    return {
        "critical_path_s": statistics.median(critical_paths),
        "recorded_step_s": statistics.median(walls),
        "step_over_critical_path": over,
        "floor": row["paired_ratio"]["median"] / over,
    }


def combine(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config: step time = the slower rank's, per step; memory and grads per rank."""
    rows = []
    for per_rank in zip(*(r["configs"] for r in ranks)):
        first = per_rank[0]
        row: dict[str, Any] = {"schedule": first["schedule"], "microbatches": first["microbatches"]}
        steps = {}
        for side in ("fpipe", "torch"):
            steps[side] = [max(ts) for ts in zip(*(c["times"][side] for c in per_rank))]
            row[side] = summary(steps[side])
            row[side]["per_rank_median_s"] = [statistics.median(c["times"][side]) for c in per_rank]
        row["ratio"] = row["fpipe"]["median_s"] / row["torch"]["median_s"]
        row["paired_ratio"] = paired(steps["fpipe"], steps["torch"])
        row["peak_bytes"] = {side: [c["peak_bytes"][side] for c in per_rank] for side in ("fpipe", "torch")}
        row["peak_ratio"] = [
            c["peak_bytes"]["fpipe"] / c["peak_bytes"]["torch"] if c["peak_bytes"]["torch"] else None for c in per_rank
        ]
        row["loss"] = {"fpipe": first["loss"]["fpipe"], "torch": per_rank[-1]["loss"]["torch"]}
        row["loss_match"] = math.isclose(row["loss"]["fpipe"], row["loss"]["torch"], rel_tol=1e-4, abs_tol=1e-6)
        row["grads"] = {
            "max_abs_diff": [c["grads"]["max_abs_diff"] for c in per_rank],
            "max_abs": [c["grads"]["max_abs"] for c in per_rank],
            "mismatches": [m for c in per_rank for m in c["grads"]["mismatches"]],
        }
        row["grads_match"] = not row["grads"]["mismatches"]
        row["bubble"] = first["bubble"]
        if first["bubble"]:
            row["bound"] = bound(first["bubble"]["critical_path_s"], [c["bubble"]["step_s"] for c in per_rank], row)
        rows.append(row)
    return rows


def combine_per_action(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per schedule: microseconds per action of each side (the slower rank's step / its actions)."""
    rows = []
    for per_rank in zip(*(r["per_action"] for r in ranks)):
        first = per_rank[0]
        row: dict[str, Any] = {k: first[k] for k in ("schedule", "microbatches", "actions_per_rank")}
        steps = {}
        for side in ("fpipe", "torch"):
            steps[side] = [max(ts) for ts in zip(*(c["times"][side] for c in per_rank))]
            row[side] = summary(steps[side])
            row[side]["us_per_action"] = row[side]["median_s"] / first["actions_per_rank"] * 1e6
        row["ratio"] = row["fpipe"]["median_s"] / row["torch"]["median_s"]
        row["paired_ratio"] = paired(steps["fpipe"], steps["torch"])
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (seconds)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, help="timed steps per side and config (default 9, quick 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps per side and config (default 1, quick 1)")
    parser.add_argument("--cprofile", metavar="DIR", help="also cProfile 3 steps of each side per rank into DIR")
    parser.add_argument("--record-steps", type=int, default=5, help="fpipe steps recorded for the bubble (0: skip)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="default: both")
    parser.add_argument("--microbatches", nargs="+", type=int, default=list(MICROBATCHES), help="default: 4 8")
    parser.add_argument("--per-action-only", action="store_true", help="only the per-action overhead (item 3)")
    args = parser.parse_args(argv)

    if args.quick:
        model = {"dim": 32, "heads": 4, "hidden": 64, "layers": 4, "vocab": 64, "seq": 8, "batch": 8}
        repeats, warmup = 2, 1
    else:
        model = {"dim": 256, "heads": 8, "hidden": 704, "layers": 8, "vocab": 512, "seq": 128, "batch": 32}
        repeats, warmup = 9, 1
    repeats = args.repeats or repeats
    warmup = warmup if args.warmup is None else args.warmup
    if args.cprofile:
        os.makedirs(args.cprofile, exist_ok=True)
    opts = {
        "model": model,
        "repeats": repeats,
        "warmup": warmup,
        "schedules": args.schedules,
        "microbatches": [] if args.per_action_only else args.microbatches,
        "cprofile": args.cprofile,
        "timeout": 120 if args.quick else 3600,
        "progress": not args.quick,
        "record_steps": args.record_steps,
        "per_action_microbatches": 16 if args.quick else 128,
        "per_action_repeats": repeats if args.quick else 4 * repeats + 1,
    }
    start = time.perf_counter()
    ranks = run_ranks(2, opts)
    results: dict[str, Any] = {
        "config": {
            **model,
            "dtype": "float32",
            "ranks": 2,
            "backend": "gloo",
            "threads_per_rank": 1,
            "repeats": repeats,
            "warmup": warmup,
            "quick": args.quick,
            "grad_tolerance": {"rtol": GRAD_RTOL, "atol": GRAD_ATOL},
            "memory": "peak torch CPU allocations (profiler, profile_memory=True) over build + 2 steps, per rank",
        },
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "configs": combine(ranks),
        "per_action": combine_per_action(ranks),
        "maxrss_kib": [r["maxrss_kib"] for r in ranks],
        "wall_s": time.perf_counter() - start,
    }
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def spread(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]"


def print_table(results: dict[str, Any]) -> None:
    c, m = results["config"], results["machine"]
    print(
        f"torch {m['torch']}, 2 ranks (gloo, 1 thread each), dim {c['dim']}, {c['layers']} layers, "
        f"seq {c['seq']}, batch {c['batch']}, vocab {c['vocab']}, float32; {c['repeats']} repeats (ABBA), medians"
    )
    print()
    print(
        "| schedule | mb | fpipe ms | torch ms | fpipe/torch | paired: median [q1, q3] | of minimums "
        "| peak MiB fpipe r0/r1 | peak MiB torch r0/r1 | peak fpipe/torch r0/r1 | grads |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results["configs"]:
        f, t = row["fpipe"]["median_s"] * 1e3, row["torch"]["median_s"] * 1e3
        pf = "/".join(f"{b / 2**20:.1f}" for b in row["peak_bytes"]["fpipe"])
        pt = "/".join(f"{b / 2**20:.1f}" for b in row["peak_bytes"]["torch"])
        pr = "/".join("-" if r is None else f"{r:.2f}" for r in row["peak_ratio"])
        diff = max(row["grads"]["max_abs_diff"])
        grads = f"match (max diff {diff:.1e})" if row["grads_match"] else "DIFFER"
        print(
            f"| {row['schedule']} | {row['microbatches']} | {f:.1f} | {t:.1f} | {row['ratio']:.3f} "
            f"| {spread(row['paired_ratio'])} | {row['paired_ratio']['of_minimums']:.3f} "
            f"| {pf} | {pt} | {pr} | {grads} |"
        )
    print()
    rss = ", ".join(f"rank {r}: {x['end'] / 1024:.0f} MiB" for r, x in enumerate(results["maxrss_kib"]))
    print(f"process RSS high-water mark (both sides, whole run): {rss}")
    print()
    print("runtime overhead per action (item 3): tiny stages (x * p on one element), 2 ranks, both sides")
    print()
    print(
        "| schedule | mb | actions per rank | fpipe us/action | torch us/action | fpipe/torch "
        "| paired: median [q1, q3] |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in results["per_action"]:
        print(
            f"| {row['schedule']} | {row['microbatches']} | {row['actions_per_rank']} "
            f"| {row['fpipe']['us_per_action']:.0f} | {row['torch']['us_per_action']:.0f} | {row['ratio']:.2f} "
            f"| {spread(row['paired_ratio'])} |"
        )
    rows = [row for row in results["configs"] if row["bubble"]]
    if not rows:
        print("bubble: skipped (this fpipe has no fpipe.record(), or --record-steps 0)")
    else:
        print()
        print(
            "bubble (fpipe, idle fraction of the step per rank r0/r1, medians over the recorded steps; recorded: "
            "from fpipe.record() (waiting for a peer is idle); fitted: simulate(program, fit_costs(recorded)), "
            "per-stage median F and B and the median message latency; error: |recorded - fitted| / recorded; "
            "uniform: one Costs(F, B) averaged over ranks, no latency; textbook: T_B = 2 T_F; replayed: "
            "replay(recorded, send=median fitted latency), each action with its own duration)"
        )
        print()
        print(
            "| schedule | mb | F ms r0/r1 | B ms r0/r1 | send ms | recorded | fitted | error | uniform | textbook "
            "| replayed | error |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")

        def pair(values: Sequence[float], scale: float = 1.0, fmt: str = ".2f") -> str:
            return "/".join(f"{v * scale:{fmt}}" for v in values)

        for row in rows:
            b = row["bubble"]
            costs = b["fitted_costs_s"]
            f = [c["forward"] for c in costs]
            bw = [c["backward"] for c in costs]
            send = [c["send"] for c in costs]
            print(
                f"| {row['schedule']} | {row['microbatches']} | {pair(f, 1e3, '.0f')} | {pair(bw, 1e3, '.0f')} "
                f"| {pair(send, 1e3, '.1f')} | {pair(b['recorded'])} | {pair(b['fitted'])} "
                f"| {pair(b['fitted_error'], 100, '.0f')} % | {pair(b['simulated'])} | {pair(b['textbook'])} "
                f"| {pair(b['replayed'])} | {pair(b['replayed_error'], 100, '.0f')} % |"
            )
        print()
        print(
            "critical path: fpipe.schedules.replay(recorded timeline), each recorded step's actions with their "
            "own durations, messages free, nothing between actions; recorded: those steps' wall time (slower rank); "
            "floor: fpipe/torch (per-round median) / (recorded / critical path), the ratio of a runtime that "
            "costs nothing beyond the critical path"
        )
        print()
        print(
            "| schedule | mb | critical path ms | recorded step ms | recorded / critical path | floor for fpipe/torch |"
        )
        print("|---|---|---|---|---|---|")
        for row in rows:
            b = row["bound"]
            print(
                f"| {row['schedule']} | {row['microbatches']} | {b['critical_path_s'] * 1e3:.1f} "
                f"| {b['recorded_step_s'] * 1e3:.1f} | {b['step_over_critical_path']:.3f} | {b['floor']:.3f} |"
            )
    for row in results["configs"]:
        if not row["grads_match"]:
            print(f"grads differ for {row['schedule']} x {row['microbatches']}:")
            print(*row["grads"]["mismatches"], sep="\n")


if __name__ == "__main__":
    main()
