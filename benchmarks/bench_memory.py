"""Bytes held per rank at each action of a step: fpipe on 2 processes, in one, and torch's pipelining.

Run::

    python benchmarks/bench_memory.py              # 8 microbatches of 128 KiB activations, under a minute
    python benchmarks/bench_memory.py --quick      # tiny sizes, a few seconds (used by the tests)
    python benchmarks/bench_memory.py --actions    # also every action's figures, rank by rank
    python benchmarks/bench_memory.py --schedules GPipe 1F1B  # GPipe only when asked
    python benchmarks/bench_memory.py --json out.json

The model: residual MLP stages (``h + tanh(h W1 + b1) W2``, float32, ``_common``), 2 stages for
GPipe and 1F1B and 4 (2 per rank) for interleaved 1F1B and ZB-V, run three ways:

  - fpipe on 2 gloo processes (127.0.0.1, one torch thread each, ``Parallelism(group=WORLD)``);
  - fpipe in one process, every stage in it (``fpipe.pipeline`` without ``parallel=``);
  - ``torch.distributed.pipelining`` on the same 2 processes: ``PipelineStage``s of ``nn.Module``
    stages holding the same parameter values, run by ``ScheduleGPipe``, ``Schedule1F1B``,
    ``ScheduleInterleaved1F1B`` or ``ScheduleZBVZeroBubble`` with the same placement.

Each side is measured over a window that builds it and runs two steps (the previous step's grads
dropped before a step: ``del`` for fpipe, ``zero_grad(set_to_none=True)`` for torch); figures are
those of the second step. "Held" is what the profiler's allocation events (``profile_memory=True``)
show: bytes of torch CPU allocations made inside the window and not yet freed (so torch's receive
buffers, allocated in its first step and kept, count; the parameters, allocated before, do not),
read at the start of each of the rank's compute actions: fpipe's ``record_function`` range of the
action (before its receive), and for torch a range put around each ``forward_one_chunk``,
``backward_one_chunk`` (``I`` without ``full_backward``) and ``backward_weight_one_chunk`` (after its
receive). In one process a rank's bytes are those of allocations made inside its own stages'
actions and still live: a stage's input there is the previous stage's output, not a copy, so it is
counted once, on the producing rank. "Of which sends" (``sent``) is what fpipe's transport still
holds of the rank's sends at the start of the action (``DistributedTransport.held``: sends not
yet let go, NOTE [sends released] in fpipe/_distributed/_sends.py): part of the rank's
bytes, not more (a large leaf is sent from its own storage, which the stage's pullback may hold
too). The profiler misses frees made on the transport's sends thread, so the script keeps what
that thread waits for and frees it at the next action's start, once the thread has let it go.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fpipe
from fpipe.schedules import GPipe, Interleaved1F1B, OneFOneB, Schedule, ZeroBubbleV

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share
import bench_vs_torch  # its run_ranks: one gloo process per rank

WORLD = 2
# name -> (fpipe's schedule, stages, torch's schedule class name, the stages rank r holds)
SCHEDULES: dict[str, tuple[Callable[[int], Schedule], int, str, Callable[[int], list[int]]]] = {
    "GPipe": (GPipe, 2, "ScheduleGPipe", lambda r: [r]),
    "1F1B": (OneFOneB, 2, "Schedule1F1B", lambda r: [r]),
    "interleaved": (Interleaved1F1B, 4, "ScheduleInterleaved1F1B", lambda r: [r, r + 2]),
    "ZB-V": (ZeroBubbleV, 4, "ScheduleZBVZeroBubble", lambda r: [r, 3 - r]),
}
_ACTION = re.compile(r"(fpipe|torch) (\d+)([FBIW])(\d+)")
_STEP = "bench step 2"  # the range around the measured step


class Block(nn.Module):
    """``_common.mlp_block`` as a module: torch's stage, reading the input tensor on the first stage."""

    def __init__(self, p: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.w1, self.b1, self.w2 = (nn.Parameter(p[k].clone()) for k in ("w1", "b1", "w2"))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(h @ self.w1 + self.b1) @ self.w2


def torch_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def make_batch(opts: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rows = opts["rows"] * opts["microbatches"]
    x, y = (torch.randn(rows, opts["dim"], generator=g, dtype=torch.float32) for _ in range(2))
    return {"x": x, "y": y}


def make_params(num_stages: int, opts: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """``_common.mlp_params``, drawn in float32 whatever the default dtype (the tests' is float64)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return _common.mlp_params(num_stages, opts["dim"], opts["hidden"])
    finally:
        torch.set_default_dtype(dtype)


def stage_fns(num_stages: int) -> list[Callable[[Any, Any], Any]]:
    return [_common.mlp_first] + [_common.mlp_block] * (num_stages - 1)


# The measure.


def profiled(
    fn: Callable[[], None],
) -> tuple[list[tuple[int, int, int, str | None]], list[tuple[int, str]], tuple[int, int]]:
    """Run ``fn`` under the profiler: its CPU allocations ``(time, address, bytes (negative: a
    free), the action they ran in)``, the actions' starts ``(time, action)``, both sorted by time,
    and the span of the ``_STEP`` range."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    allocations, starts, step = [], [], (0, 0)
    stack: list[tuple[Any, str | None]] = [(n, None) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, action = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size, action))
            continue
        match = _ACTION.fullmatch(node.name)
        if match:
            action = "".join(match.groups()[1:])
            starts.append((node.start_time_ns, action))
        elif node.name == _STEP:
            step = (node.start_time_ns, node.end_time_ns)
        stack.extend((child, action) for child in node.children)
    return sorted(allocations), sorted(starts), step


def held(
    allocations: list[tuple[int, int, int, str | None]],
    starts: list[tuple[int, str]],
    step: tuple[int, int],
    owner: Callable[[str | None], int | None],
) -> dict[str, Any]:
    """Bytes live at the start of each action of the measured step, by ``owner`` (a rank, from the
    action an allocation ran in; ``None``: outside any action), and each owner's peak in the step."""
    live: dict[int, tuple[int, int | None]] = {}  # address -> (bytes, owner)
    totals: dict[int | None, int] = {}
    peaks: dict[int | None, int] = {}
    at: list[tuple[str, dict[int | None, int]]] = []
    a = 0
    for time_ns, action in [*starts, (step[1], "")]:
        while a < len(allocations) and allocations[a][0] < time_ns:
            t, ptr, size, inside = allocations[a]
            a += 1
            if size > 0:
                who = owner(inside)
                live[ptr] = (size, who)
            elif ptr in live:
                size, who = live.pop(ptr)
                size = -size
            else:
                continue  # allocated before the window
            totals[who] = totals.get(who, 0) + size
            if step[0] <= t <= step[1]:
                peaks[who] = max(peaks.get(who, 0), totals[who])
        if step[0] <= time_ns < step[1] and action:
            at.append((action, dict(totals)))
    return {"at": at, "peak": peaks}


# One rank's work.


def run_fpipe(schedule: Schedule, num_stages: int, opts: dict[str, Any], rank: int | None) -> dict[str, Any]:
    """fpipe's window on this rank (``None``: in one process, every stage here)."""
    from fpipe import _executor
    from fpipe._distributed import _sends

    params = make_params(num_stages, opts)
    batch = make_batch(opts)
    group = None if rank is None else dist.group.WORLD
    state: dict[str, Any] = {}
    sent: list[tuple[str, int]] = []

    def window() -> None:
        step = fpipe.pipeline(
            _common.mse_loss, stage_fns(num_stages), schedule, parallel=fpipe.Parallelism(group=group)
        )
        mine = [p if rank is None or s in step.local_stages else None for s, p in enumerate(params)]
        handlers, put = dict(_executor._HANDLERS), _sends.Waiter.put
        kept: list[tuple[Any, torch.Tensor]] = []
        if rank is not None:
            _sends.Waiter.put = _keeping(put, kept)  # type: ignore[method-assign]
        try:
            state["loss"], state["grads"] = step(mine, batch)
            del state["grads"]
            kept.clear()  # (the step's sends thread has let every one go)
            if rank is not None:  # what the transport holds of this rank's sends, at each action
                for kind, handler in handlers.items():
                    _executor._HANDLERS[kind] = _recording(handler, sent, kept)
            with torch.profiler.record_function(_STEP):
                state["loss"], state["grads"] = step(mine, batch)
        finally:
            _executor._HANDLERS.update(handlers)
            _sends.Waiter.put = put  # type: ignore[method-assign]

    if rank is not None:
        dist.barrier()
    allocations, starts, step = profiled(window)
    placement = schedule.program(num_stages, WORLD).placement()

    def owner(action: str | None) -> int | None:
        if rank is not None:
            return rank  # (every allocation on this process is the rank's)
        return None if action is None else placement[int(action.rstrip("0123456789")[:-1])]  # "12F3" -> 12

    result = held(allocations, starts, step, owner)
    result["sent"] = sent
    result["loss"] = float(state["loss"])
    result["grads"] = state["grads"]
    return result


def _recording(
    handler: Callable[[Any, Any], None], sent: list[tuple[str, int]], kept: list[tuple[Any, torch.Tensor]]
) -> Callable[[Any, Any], None]:
    def recorded(executor: Any, action: Any) -> None:
        sent.append((str(action), executor.transport.held()))
        kept[:] = [(waiter, t) for waiter, t in kept if _waits_for(waiter, t)]  # (freed here: ``_keeping``)
        handler(executor, action)

    return recorded


def _keeping(put: Callable[..., None], kept: list[tuple[Any, torch.Tensor]]) -> Callable[..., None]:
    """``Waiter.put``, keeping each tensor until the next action's start once the sends thread let
    it go: a free on that thread is missing from the profiler's events (it reports memory per
    thread), so the tensor is freed on the step's thread instead, before the action is read."""

    def keeping(waiter: Any, work: Any, tensor: torch.Tensor, *args: Any) -> None:
        kept.append((waiter, tensor))
        put(waiter, work, tensor, *args)

    return keeping


def _waits_for(waiter: Any, tensor: torch.Tensor) -> bool:
    with waiter._changed:
        return any(t is tensor for _, t, _, _ in waiter._queue)


def run_torch(name: str, opts: dict[str, Any], rank: int) -> dict[str, Any]:
    """torch.distributed.pipelining's window on this rank."""
    from torch.distributed import pipelining

    _, num_stages, cls, held_by = SCHEDULES[name]
    params = make_params(num_stages, opts)
    batch = make_batch(opts)
    indices = held_by(rank)
    modules = {s: Block(params[s]) for s in indices}
    state: dict[str, Any] = {}

    def build() -> Any:
        stages = [pipelining.PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in indices]
        for stage in stages:
            _ranged(stage)
        schedule_cls = getattr(pipelining, cls)
        first = stages[0] if len(stages) == 1 else stages
        return schedule_cls(first, opts["microbatches"], loss_fn=torch_loss)

    def step(schedule: Any) -> None:
        for module in modules.values():
            module.zero_grad(set_to_none=True)
        args = [batch["x"]] if 0 in indices else []
        target = batch["y"] if num_stages - 1 in indices else None
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=target, losses=losses if target is not None else None, return_outputs=False)
        if losses:
            state["loss"] = float(torch.stack(losses).detach().mean())

    def window() -> None:
        schedule = build()
        step(schedule)
        with torch.profiler.record_function(_STEP):
            step(schedule)

    dist.barrier()
    allocations, starts, span = profiled(window)
    result = held(allocations, starts, span, lambda action: rank)
    result["grads"] = {s: {k: p.grad.clone() for k, p in modules[s].named_parameters()} for s in indices}
    result["loss"] = state.get("loss")
    return result


def _ranged(stage: Any) -> None:
    """Put a ``torch sKi`` range around each of ``stage``'s compute calls."""
    s = stage.stage_index
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(i: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"torch {s}F{i}"):
            return forward(i, *args, **kwargs)

    def backward_one_chunk(i: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"torch {s}{'B' if full_backward else 'I'}{i}"):
            return backward(i, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(i: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"torch {s}W{i}"):
            return weight(i, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def rank_main(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in opts["schedules"]:
        make, num_stages, _, _ = SCHEDULES[name]
        fp = run_fpipe(make(opts["microbatches"]), num_stages, opts, rank)
        th = run_torch(name, opts, rank)
        mismatches = []
        for s, grads in th.pop("grads").items():
            for k, g in grads.items():
                if not torch.allclose(fp["grads"][s][k], g, rtol=1e-4, atol=1e-6):
                    mismatches.append(f"stage {s} {k}")
        del fp["grads"]
        out[name] = {"fpipe": fp, "torch": th, "grad_mismatches": mismatches}
    return out


# The tables.


def _row(at: list[tuple[str, dict[Any, int]]], who: Any) -> dict[str, int]:
    return {action: totals.get(who, 0) for action, totals in at}


def combine(ranks: list[dict[str, Any]], local: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Per schedule and rank: each action's bytes held on each side, and the summaries."""
    out: dict[str, Any] = {}
    for name in opts["schedules"]:
        rows = []
        for r, per_rank in enumerate(ranks):
            runs = {"fpipe": per_rank[name]["fpipe"], "one_process": local[name], "torch": per_rank[name]["torch"]}
            at = {side: _row(run["at"], r) for side, run in runs.items()}
            sent = dict(runs["fpipe"]["sent"])
            actions = [
                {"action": a, "sent": sent.get(a), **{side: at[side].get(a) for side in runs}} for a in at["fpipe"]
            ]
            rows.append(
                {
                    "rank": r,
                    "actions": actions,
                    "peak": {side: run["peak"].get(r, 0) for side, run in runs.items()},
                    "max_at_action": {side: max(at[side].values()) for side in runs},
                    "max_sent": max(sent.values(), default=0),
                    "grads_match": not per_rank[name]["grad_mismatches"],
                }
            )
        loss = {"fpipe": ranks[0][name]["fpipe"]["loss"], "one_process": local[name]["loss"]}
        loss["torch"] = next(r[name]["torch"]["loss"] for r in ranks if r[name]["torch"]["loss"] is not None)
        out[name] = {"ranks": rows, "loss": loss}
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _common.parser(__doc__)
    parser.add_argument("--actions", action="store_true", help="also print every action's figures")
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=["1F1B", "interleaved", "ZB-V"])
    args = parser.parse_args(argv)
    if args.quick:  # 64 KiB activations: they still travel from their own storage
        opts: dict[str, Any] = {"dim": 64, "hidden": 64, "rows": 256, "microbatches": 4}
    else:  # 128 KiB activations, as in issue 34
        opts = {"dim": 512, "hidden": 512, "rows": 64, "microbatches": 8}
    opts.update(schedules=args.schedules, timeout=120 if args.quick else 1800)
    start = time.perf_counter()
    torch.set_num_threads(1)
    local = {}
    for name in args.schedules:
        make, num_stages, _, _ = SCHEDULES[name]
        local[name] = run_fpipe(make(opts["microbatches"]), num_stages, opts, None)
        del local[name]["grads"]
    ranks = bench_vs_torch.run_ranks(WORLD, opts, rank_main)
    results = {
        "config": {**opts, "ranks": WORLD, "dtype": "float32", "backend": "gloo", "threads_per_rank": 1,
                   "activation_bytes": opts["rows"] * opts["dim"] * 4},
        "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()},
        "schedules": combine(ranks, local, opts),
        "wall_s": time.perf_counter() - start,
    }  # fmt: skip
    print_tables(results, actions=args.actions)
    _common.write_json(args.json, results)
    return results


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.0f}"


def print_tables(results: dict[str, Any], *, actions: bool) -> None:
    c = results["config"]
    print(
        f"torch {results['machine']['torch']}, {c['ranks']} ranks (gloo), residual MLP stages dim {c['dim']}, "
        f"hidden {c['hidden']}, {c['microbatches']} microbatches of {c['rows']} rows "
        f"({c['activation_bytes'] // 1024} KiB activations), float32; KiB held by each rank in the second step: "
        "the most at the start of an action / the peak"
    )
    print()
    print("| schedule | rank | fpipe, 2 processes | of which sends (max) | fpipe, 1 process | torch | grads |")
    print("|---|---|---|---|---|---|---|")
    for name, sched in results["schedules"].items():
        for row in sched["ranks"]:
            m, p = row["max_at_action"], row["peak"]
            print(
                f"| {name} | {row['rank']} | {_kib(m['fpipe'])} / {_kib(p['fpipe'])} | {_kib(row['max_sent'])} "
                f"| {_kib(m['one_process'])} / {_kib(p['one_process'])} | {_kib(m['torch'])} / {_kib(p['torch'])} "
                f"| {'match' if row['grads_match'] else 'DIFFER'} |"
            )
    if not actions:
        return
    for name, sched in results["schedules"].items():
        for row in sched["ranks"]:
            print()
            print(f"{name}, rank {row['rank']}: KiB held at the start of each action")
            print()
            print("| action | fpipe, 2 processes | of which sends | fpipe, 1 process | torch |")
            print("|---|---|---|---|---|")
            for a in row["actions"]:
                figures = " | ".join(_kib(a[side]) for side in ("fpipe", "sent", "one_process", "torch"))
                print(f"| {a['action']} | {figures} |")


if __name__ == "__main__":
    main()
