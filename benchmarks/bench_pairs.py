"""Overlapped pairs against the same program run in sequence, with experts: step time, the share of
it spent waiting for all-to-alls, and the simulator's prediction.

Run::

    python benchmarks/bench_pairs.py                # pp 1 x ep 2, then pp 2 x ep 2; minutes on 2 cores
    python benchmarks/bench_pairs.py --quick        # tiny sizes, seconds (used by the tests)
    python benchmarks/bench_pairs.py --configs 2    # only pp 1 x ep 2 (2 processes); 4: pp 2 x ep 2
    python benchmarks/bench_pairs.py --json out.json

A DeepSeek-style model, float32: each stage is ``layers`` blocks of ``h + mixer(norm(h))`` (a
dense SwiGLU standing in for attention: compute with no communication) then ``h +
moe(norm(h))`` (``fpipe.moe.moe``: 8 routed SwiGLU experts, top 2, a fixed ``capacity`` so that
the only collective is the all-to-all, a shared expert), experts split over ``ep 2``. Each
configuration runs on gloo processes (127.0.0.1, one torch thread each):

- 2 processes, pp 1 x ep 2: 2 stages on the one pipeline rank, ``OneFOneB`` against
  ``Overlapped(OneFOneB)`` (Combined 1F1B with experts only);
- 4 processes, pp 2 x ep 2: ``OneFOneB`` against ``Overlapped(OneFOneB)`` (2 stages) and
  ``DualPipeV`` against ``Overlapped(DualPipeV)`` (4 stages, DualPipe's pairs), and
  ``DualPipe`` against ``Overlapped(DualPipe)`` (2 stages, each on both pipeline ranks).

For each pair of schedules, in the same processes:

1. both steps are built, and their losses and gradients checked bitwise equal;
2. a few steps of the sequential one are recorded (``fpipe.record``) and per-stage ``Costs``
   fitted (``fpipe.planning.fit_costs``); the all-to-all seconds of each action are measured too
   (below), per stage and kind;
3. steps of the two alternate, ABBA, a barrier before each; a step's time is the slower rank's.
   Per step and rank, the seconds spent waiting for the MoE exchange (``wait_tensor`` after a
   posted all-to-all, timed by a wrapper installed in this benchmark's processes only): in the
   sequential step this is the whole all-to-all (posted, then waited for at once), in the
   overlapped one what the other half of the pair did not hide. "a2a share" is that over the
   step time, the mean over ranks of the per-step medians.
4. the prediction, from the sequential recording: ``simulate`` with the fitted costs for the
   program without pairs, and for the overlapped program with each stage's ``Costs.communication``
   the mean of its F's and B's measured all-to-all seconds in ``2 x layers`` rounds
   (``communication_points``: NOTE [overlapped time] in fpipe/schedules/_simulate.py); beside
   it the bound ``max(compute sum, communication sum)`` per pair (an action's communication its
   measured all-to-all seconds, its compute its fitted duration less those), the best any
   interleaving can do when communication takes no compute, replayed through the same
   ``paired`` hook. Both assume that a collective in flight costs the cores nothing.

Also per rank: each step's CPU seconds (``time.process_time``, gloo's threads included) and,
from a few recorded overlapped steps, each pair's span against its halves' fitted durations.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # the command line, JSON output and models the benchmarks share
import bench_vs_torch  # its run_ranks (one gloo process per rank), barrier_timed and paired

EXPERTS, TOP_K = 8, 2
CONFIGS = {2: (1, 2), 4: (2, 2)}  # processes: (pp, ep)


# The model: a dense mixer (attention's stand-in) and an MoE layer per block.


def init_stage(dim: int, mixer: int, hidden: int, layers: int, g: torch.Generator) -> list[dict[str, Any]]:
    import fpipe

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[0] ** 0.5

    return [
        {
            "mixer": {"w1": normal(dim, mixer), "w3": normal(dim, mixer), "w2": normal(mixer, dim)},
            "moe": fpipe.moe.init_moe(dim, hidden, EXPERTS, generator=g),
        }
        for _ in range(layers)
    ]


def make_stage(first: bool, capacity: int) -> Any:
    import fpipe

    def stage(params: list[dict[str, Any]], x: Any) -> dict[str, torch.Tensor]:
        act = {"h": x["x"], "aux": torch.zeros(())} if first else x
        h, aux = act["h"], act["aux"]
        for block in params:
            m = block["mixer"]
            n = torch.nn.functional.rms_norm(h, h.shape[-1:])
            h = h + (torch.nn.functional.silu(n @ m["w1"]) * (n @ m["w3"])) @ m["w2"]
            n = torch.nn.functional.rms_norm(h, h.shape[-1:])
            y, stats = fpipe.moe.moe(block["moe"], n, top_k=TOP_K, capacity=capacity)
            h, aux = h + y, aux + stats.balance_loss
        return {"h": h, "aux": aux}

    return stage


def loss_fn(act: dict[str, torch.Tensor], microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((act["h"] - microbatch["y"]) ** 2).mean() + 0.01 * act["aux"]


# What the all-to-alls cost: the waits timed per step, and per (stage, kind) of the action waiting.


class ExchangeTimer:
    """Seconds spent in ``wait_tensor`` after fpipe.moe's all-to-alls (installed by ``install``).

    The executor's handlers are wrapped to name the action each thread runs (a pair's halves run
    on two threads), so each wait is charged to its action as well as to the step."""

    def __init__(self) -> None:
        self.step = 0.0
        self.by_action: dict[tuple[int, str, int], float] = {}
        self.local = threading.local()

    def install(self) -> None:
        from fpipe import _executor
        from fpipe.moe import _dispatch

        functional = _dispatch.functional
        real_wait = functional.wait_tensor

        def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = real_wait(tensor)
            seconds = time.perf_counter() - start
            self.step += seconds  # one side of a pair runs at a time: no two waits overlap
            action = getattr(self.local, "action", None)
            if action is not None:
                key = (action.stage, action.kind, action.microbatch)
                self.by_action[key] = self.by_action.get(key, 0.0) + seconds
            return out

        # this module's view of torch's functional collectives only: nothing else in the process changes
        _dispatch.functional = types.SimpleNamespace(  # type: ignore[assignment]
            all_to_all_single=functional.all_to_all_single, wait_tensor=wait_tensor
        )
        for kind, handler in list(_executor._HANDLERS.items()):
            _executor._HANDLERS[kind] = self._named(handler)

    def _named(self, handler: Any) -> Any:
        def run(executor: Any, action: Any) -> Any:
            self.local.action = action
            try:
                return handler(executor, action)
            finally:
                self.local.action = None

        return run


def rank_main(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fpipe
    from fpipe.schedules import DualPipe, DualPipeV, OneFOneB, Overlapped

    timer = ExchangeTimer()
    timer.install()
    pp, ep = CONFIGS[world_size]
    mesh = init_device_mesh("cpu", (pp, ep), mesh_dim_names=("pp", "ep"))
    replica = mesh.get_coordinate()[1]
    m = opts["microbatches"]
    dual = [(DualPipe(m), 2)] if m % 2 == 0 and m >= 4 else []  # (each of its 2 stages on both ranks)
    cases = [(OneFOneB(m), 2)] + ([(DualPipeV(m), 4), *dual] if pp == 2 else [])
    tokens = opts["batch"] * opts["seq"] // m  # per microbatch
    capacity = math.ceil(opts["capacity_factor"] * tokens * TOP_K / EXPERTS)
    g = torch.Generator().manual_seed(1 + replica)
    shape = (opts["batch"], opts["seq"], opts["dim"])
    batch = {"x": torch.randn(*shape, generator=g), "y": torch.randn(*shape, generator=g)}
    parallel = fpipe.Parallelism(mesh=mesh, timeout=opts["timeout"])
    rows = []
    for schedule, num_stages in cases:
        g = torch.Generator().manual_seed(0)  # every rank draws the same model, then keeps its experts
        full = [init_stage(opts["dim"], opts["mixer"], opts["hidden"], opts["layers"], g) for _ in range(num_stages)]
        for stage in full:
            for block in stage:
                block["moe"] = fpipe.moe.distribute_experts(block["moe"], mesh["ep"])
        stages = [make_stage(s == 0, capacity) for s in range(num_stages)]
        steps, results = {}, {}
        for name, s in (("sequential", schedule), ("overlapped", Overlapped(schedule))):
            step = fpipe.pipeline(loss_fn, stages, s, parallel=parallel)
            params = [p if i in step.local_stages else None for i, p in enumerate(full)]
            mine = batch if 0 in step.local_stages else None
            steps[name] = (step, params, mine)
            results[name] = step(params, mine)
        sequential, overlapped = steps["sequential"][0], steps["overlapped"][0]
        bitwise = torch.equal(results["sequential"][0], results["overlapped"][0]) and all(
            _equal(results["sequential"][1][i], results["overlapped"][1][i]) for i in sequential.local_stages
        )

        def run(name: str, steps: dict[str, Any] = steps) -> None:
            step, params, mine = steps[name]
            step(params, mine)

        timer.by_action.clear()
        with fpipe.record() as recording:
            for _ in range(opts["record_steps"]):
                bench_vs_torch.barrier_timed(lambda: run("sequential"))
        mine_a2a: list[Any] = [None] * dist.get_world_size()  # each rank measures its own stages' exchanges
        dist.all_gather_object(mine_a2a, dict(timer.by_action))
        with fpipe.record() as recording_pairs:
            for _ in range(opts["record_steps"]):
                bench_vs_torch.barrier_timed(lambda: run("overlapped"))
        times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
        exposed: dict[str, list[float]] = {"sequential": [], "overlapped": []}
        cpu: dict[str, list[float]] = {"sequential": [], "overlapped": []}  # this process's CPU seconds
        for r in range(opts["warmup"] + opts["repeats"]):
            for name in ("sequential", "overlapped") if r % 2 == 0 else ("overlapped", "sequential"):
                timer.step, used = 0.0, time.process_time()
                seconds = bench_vs_torch.barrier_timed(lambda name=name: run(name))
                if r >= opts["warmup"]:
                    times[name].append(seconds)
                    exposed[name].append(timer.step)
                    cpu[name].append(time.process_time() - used)
        rows.append(
            {
                "schedule": type(schedule).__name__,
                "num_stages": num_stages,
                "local_stages": list(sequential.local_stages),
                "pairs_on_rank": sum(
                    1 for a, _ in overlapped.program.pairs if a in overlapped.program.ranks[overlapped.rank]
                ),
                "bitwise": bitwise,
                "times": times,
                "exposed": exposed,
                "timelines": recording.timelines,
                "pair_timelines": recording_pairs.timelines,
                "a2a_by_action": mine_a2a,
                "pipeline_rank": overlapped.rank,
                "program": overlapped.program,
                "record_steps": opts["record_steps"],
                "points": 2 * opts["layers"],  # per F and per B: each layer's dispatch and combine
                "cpu": cpu,
            }
        )
    return _rank_result(rank, rows)


def _equal(a: Any, b: Any) -> bool:
    import optree

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    leaves_a, leaves_b = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(torch.equal(local(x), local(y)) for x, y in zip(leaves_a, leaves_b))


def _rank_result(rank: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What goes back to the parent: plain numbers; the prediction made here, where the timelines are."""
    from fpipe.planning import fit_costs

    out = []
    for row in rows:
        costs = fit_costs(row["timelines"][1:] if len(row["timelines"]) > 1 else row["timelines"])
        communication = _per_stage_kind(row["a2a_by_action"], row["record_steps"])
        out.append(
            {
                key: row[key]
                for key in (
                    "schedule",
                    "num_stages",
                    "local_stages",
                    "pairs_on_rank",
                    "bitwise",
                    "times",
                    "exposed",
                    "cpu",
                )
            }
            | {
                "costs": [
                    {"F": c.forward, "B": c.of("B"), "overhead": c.overhead, "receive": c.receive} for c in costs
                ],
                "a2a_s": {f"{s}{kind}": seconds for (s, kind), seconds in communication.items()},
                "prediction": predict(row["program"], costs, communication, row["points"]),
                "pairs": pair_spans(row["pair_timelines"], row["pipeline_rank"], costs, communication),
            }
        )
    return {"rank": rank, "rows": out}


def _per_stage_kind(by_rank: Sequence[dict[tuple[int, str, int], float]], steps: int) -> dict[tuple[int, str], float]:
    """Median over microbatches and the ranks that ran it of an action's all-to-all seconds per
    step, per (stage, kind)."""
    samples: dict[tuple[int, str], list[float]] = {}
    for by_action in by_rank:
        for (stage, kind, _), seconds in by_action.items():
            samples.setdefault((stage, kind), []).append(seconds / max(steps, 1))
    return {key: statistics.median(values) for key, values in samples.items()}


def predict(
    program: Any, costs: Sequence[Any], communication: dict[tuple[int, str], float], points: int
) -> dict[str, float | None]:
    """The sequential program's simulated step, and the same replay with each pair lasting
    ``max(compute sum, communication sum)`` of its halves (the module docstring, step 4); where
    ``Costs`` has a ``communication`` field (issue 37, point 4), ``simulate``'s own overlapped
    step too (``model_s``: each stage's communication the mean of its F's and B's, in ``points``
    rounds), else None.

    ``communication``: every rank's measurements of each stage's all-to-all seconds, pooled."""
    from dataclasses import fields, replace

    from fpipe.schedules import Costs, Program, simulate
    from fpipe.schedules._program import as_soon_as_possible
    from fpipe.schedules._simulate import charged, receiving_kinds

    plain = Program(program.ranks, program.num_stages, program.num_microbatches)
    receives = receiving_kinds(program.placement())
    occupied = tuple(charged(c, r) for c, r in zip(costs, receives))

    def a2a(action: Any) -> float:
        return communication.get((action.stage, action.kind), 0.0)

    def overlapped(rank: int, k: int, first: Any, second: Any, first_time: float, second_time: float) -> float:
        comm = a2a(first) + a2a(second)
        return max(first_time + second_time - comm, comm)

    _, ends = as_soon_as_possible(
        program, lambda r, k, a: occupied[a.stage].of(a.kind), lambda d: costs[d.stage].send, overlapped
    )
    sequential = simulate(plain, list(costs)).makespan
    predicted = max(max(row) for row in ends if row)
    model = None
    if "communication" in {f.name for f in fields(Costs)}:
        with_communication = []
        for s, c in enumerate(costs):
            comm = (communication.get((s, "F"), 0.0) + communication.get((s, "B"), 0.0)) / 2
            comm = min(comm, c.forward, c.backward_input, c.of("B"))  # what Costs accepts
            with_communication.append(replace(c, communication=comm, communication_points=points))
        model = simulate(program, with_communication).makespan
    return {"sequential_s": sequential, "overlapped_s": predicted, "ratio": predicted / sequential, "model_s": model}


def pair_spans(
    timelines: Sequence[Any], r: int, costs: Sequence[Any], communication: dict[tuple[int, str], float]
) -> Any:
    """Per pair of pipeline rank ``r`` (``"0F1&0B0"``), the median recorded span of the pair, the
    sum of its halves' fitted (sequential) durations, and ``max(compute sum, communication
    sum)``, in seconds."""
    spans: dict[tuple[Any, Any], list[float]] = {}
    for timeline in timelines:
        program = timeline.program
        partner = dict(program.pairs)
        for k, action in enumerate(program.ranks[r]):
            second = partner.get(action)
            if second is not None:
                spans.setdefault((action, second), []).append(timeline.ends[r][k] - timeline.starts[r][k])
    out = {}
    for (first, second), values in spans.items():
        halves = costs[first.stage].of(first.kind) + costs[second.stage].of(second.kind)
        comm = communication.get((first.stage, first.kind), 0.0) + communication.get((second.stage, second.kind), 0.0)
        out[f"{first}&{second}"] = {
            "span_s": statistics.median(values),
            "halves_s": halves,
            "bound_s": max(halves - comm, comm),
        }
    return out


# Summary over ranks.


def summarize(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per schedule pair: the slower rank's step times, medians, their ratio, the per-round
    ratios, the a2a share before and after, and the prediction (rank 0's)."""
    out = []
    for k, row in enumerate(ranks[0]["rows"]):
        per_rank = [r["rows"][k] for r in ranks]
        steps = {
            name: [max(r["times"][name][j] for r in per_rank) for j in range(len(row["times"][name]))]
            for name in ("sequential", "overlapped")
        }
        medians = {name: statistics.median(v) for name, v in steps.items()}
        share = {
            name: statistics.mean(
                statistics.median(r["exposed"][name]) / statistics.median(r["times"][name]) for r in per_rank
            )
            for name in ("sequential", "overlapped")
        }
        a2a_ms = {
            name: statistics.mean(1e3 * statistics.median(r["exposed"][name]) for r in per_rank)
            for name in ("sequential", "overlapped")
        }
        predictions = [r["prediction"] for r in per_rank]
        cpu_ms = {
            name: statistics.mean(1e3 * statistics.median(r["cpu"][name]) for r in per_rank)
            for name in ("sequential", "overlapped")
        }
        models = [p["model_s"] for p in predictions]
        out.append(
            {
                "schedule": row["schedule"],
                "num_stages": row["num_stages"],
                "bitwise": all(r["bitwise"] for r in per_rank),
                "sequential_ms": 1e3 * medians["sequential"],
                "overlapped_ms": 1e3 * medians["overlapped"],
                "ratio": medians["overlapped"] / medians["sequential"],
                "per_round": bench_vs_torch.paired(steps["overlapped"], steps["sequential"]),
                "a2a_share": share,
                "a2a_ms_per_rank": a2a_ms,
                "predicted_ratio": max(p["overlapped_s"] for p in predictions)
                / max(p["sequential_s"] for p in predictions),
                "predicted_ms": {
                    "sequential": 1e3 * max(p["sequential_s"] for p in predictions),
                    "overlapped": 1e3 * max(p["overlapped_s"] for p in predictions),
                },
                "simulated_ratio": None
                if None in models
                else max(models) / max(p["sequential_s"] for p in predictions),
                "cpu_ms_per_rank": cpu_ms,
                "ranks": per_rank,
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _common.parser(__doc__, repeats="timed rounds per schedule pair (default 12, quick 2)")
    parser.add_argument("--configs", type=int, nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    parser.add_argument("--dim", type=int, help="model width (default 512, quick 16)")
    args = parser.parse_args(argv)
    if args.quick:
        opts = {"dim": 16, "mixer": 16, "hidden": 8, "layers": 1, "batch": 8, "seq": 4, "microbatches": 4}
        opts |= {"repeats": 2, "warmup": 1, "record_steps": 1, "timeout": 120}
    else:
        opts = {"dim": 512, "mixer": 256, "hidden": 64, "layers": 2, "batch": 16, "seq": 64, "microbatches": 4}
        opts |= {"repeats": 12, "warmup": 2, "record_steps": 3, "timeout": 1200}
    opts["capacity_factor"] = 1.25
    if args.repeats:
        opts["repeats"] = args.repeats
    if args.dim:
        opts["dim"] = args.dim
    started = time.perf_counter()
    results: dict[str, Any] = {
        "config": {**opts, "experts": EXPERTS, "top_k": TOP_K, "torch": torch.__version__},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version()},
    }
    for world in args.configs:
        ranks = bench_vs_torch.run_ranks(world, opts, rank_main)
        pp, ep = CONFIGS[world]
        results[f"pp{pp}xep{ep}"] = summarize(ranks)
    results["machine"]["load_average_after"] = os.getloadavg()
    print(f"config: {results['config']}; load average {results['machine']['load_average']}")
    print(
        "| mesh | schedule | bitwise | sequential ms | overlapped ms | overlapped / sequential (per round) "
        "| a2a share: sequential | overlapped | CPU ms per rank: sequential | overlapped "
        "| predicted: max(compute, a2a) | simulate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in (k for k in results if k.startswith("pp")):
        for row in results[key]:
            simulated = "-" if row["simulated_ratio"] is None else f"{row['simulated_ratio']:.3f}"
            share, cpu = row["a2a_share"], row["cpu_ms_per_rank"]
            print(
                f"| {key} | {row['schedule']} | {row['bitwise']} | {row['sequential_ms']:.1f} | "
                f"{row['overlapped_ms']:.1f} | {row['ratio']:.3f} ({row['per_round']['median']:.3f}) | "
                f"{share['sequential']:.1%} | {share['overlapped']:.1%} | {cpu['sequential']:.0f} | "
                f"{cpu['overlapped']:.0f} | {row['predicted_ratio']:.3f} | {simulated} |"
            )
    print(f"({time.perf_counter() - started:.0f} s)")
    _common.write_json(args.json, results, indent=1)
    return results


if __name__ == "__main__":
    main()
