"""The command line: ``python -m fpipe show SCHEDULE --ranks R --microbatches M``.

Prints a schedule's grid as simulated with the given costs, with its bubble and peak activations
per rank (in microbatches of a rank's layers, the README's unit: NOTE [activation units] in
``fpipe/schedules/_simulate.py``), and optionally writes a Chrome trace (open it in https://ui.perfetto.dev) or an SVG::

    python -m fpipe show zbv --ranks 4 --microbatches 8 --trace zbv.json --svg zbv.svg
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from ._plural import plural
from .planning import Device, Experts, PlanError, Transformer, plan
from .planning._cost_model import GIB
from .planning._plan import SEARCHED
from .planning._presets import PRESETS, Preset
from .schedules import (
    Costs,
    Interleaved1F1B,
    ScheduleError,
    chrome_trace,
    simulate,
    svg,
    terminal_grid,
)
from .schedules._pictures import legend
from .schedules._registry import BUILTINS, Builtin

# The schedules the command line knows, by their command-line names (fpipe/schedules/_registry.py).
SCHEDULES: dict[str, Builtin] = {b.command: b for b in BUILTINS}


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    out = sys.stdout if stdout is None else stdout
    args = _parser().parse_args(argv)
    if args.command == "plan" and args.preset is not None:  # its model and device become the defaults
        args = _parser(_preset_options(PRESETS[args.preset])).parse_args(argv)
    if args.command == "plan":
        return _plan(args, out)
    choice = SCHEDULES[args.schedule]
    v = choice.stages_per_rank if args.stages_per_rank is None else args.stages_per_rank
    try:
        schedule = choice.build(args.microbatches, v)
        if args.microbatch_group is not None:
            if not isinstance(schedule, Interleaved1F1B):
                raise ScheduleError(
                    f"--microbatch-group applies only to interleaved (schedule: {args.schedule}). Drop the option."
                )
            schedule = dataclasses.replace(schedule, microbatch_group=args.microbatch_group)
        program = schedule.program(args.ranks * v, args.ranks)
        costs = Costs(
            forward=args.forward,
            backward=args.backward,
            backward_input=args.input_grad,
            backward_weight=args.weight_grad,
            send=args.send,
            overhead=args.overhead,
        )
        _check_drawable(costs)
        sim = simulate(program, costs)
    except ScheduleError as error:
        print(f"python -m fpipe show: {error}", file=sys.stderr)
        return 2
    # By default, colors on a terminal, unless NO_COLOR is set (https://no-color.org) or the terminal is dumb.
    auto = out.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
    color = args.color == "always" or (args.color == "auto" and auto)
    print(
        f"{schedule}: {plural(program.num_ranks, 'rank')}, {plural(program.num_stages, 'stage')}, "
        f"{plural(program.num_microbatches, 'microbatch')}",
        file=out,
    )
    print(f"costs: {_listed(costs)}", file=out)
    print(terminal_grid(sim, color=color), file=out)
    print(legend(color=color), file=out)
    print(sim.summary(), file=out)
    if v > 1:
        print(f"(peak activations in microbatches of a rank's layers: each of its {v} stages counts 1/{v})", file=out)
    try:
        if args.trace:
            with open(args.trace, "w", encoding="utf-8") as f:
                json.dump(chrome_trace(sim), f)
            print(f"wrote {args.trace} (open it in https://ui.perfetto.dev)", file=out)
        if args.svg:
            with open(args.svg, "w", encoding="utf-8") as f:
                f.write(svg(sim))
            print(f"wrote {args.svg}", file=out)
    except OSError as error:  # a missing directory, a directory, no permission: the user's to fix
        print(f"python -m fpipe show: cannot write {error.filename}: {error.strerror}", file=sys.stderr)
        return 1
    return 0


def _parser(plan_defaults: dict[str, object] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``plan_defaults`` replace the plan options' defaults (a preset's)."""
    parser = argparse.ArgumentParser(prog="python -m fpipe", description="fpipe: pipeline schedules as data.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show = commands.add_parser(
        "show",
        help="draw a schedule with its bubble and peak memory",
        description="Simulate a schedule and print its rank x time grid, bubble and peak activations.",
        epilog="schedules: " + "; ".join(f"{name}: {c.about}" for name, c in SCHEDULES.items()),
    )
    show.add_argument("schedule", choices=sorted(SCHEDULES), metavar="SCHEDULE", help=", ".join(SCHEDULES))
    show.add_argument("--ranks", type=_positive_int, required=True, help="pipeline ranks")
    show.add_argument("--microbatches", type=_positive_int, required=True, help="microbatches per step")
    show.add_argument(
        "--stages-per-rank", type=_positive_int, default=None, help="stages per rank (default: the schedule's)"
    )
    show.add_argument(
        "--microbatch-group",
        type=_positive_int,
        default=None,
        help="interleaved: microbatches per group, Megatron-Core's microbatch_group_size_per_vp_stage (default: ranks)",
    )
    show.add_argument("--forward", type=float, default=1.0, help="cost of a forward F (default 1)")
    show.add_argument("--backward", type=float, default=None, help="cost of a fused backward B (default I + W)")
    show.add_argument("--input-grad", type=float, default=1.0, help="cost of an input-grad backward I (default 1)")
    show.add_argument("--weight-grad", type=float, default=1.0, help="cost of a weight-grad backward W (default 1)")
    show.add_argument("--send", type=float, default=0.0, help="latency of a message between ranks (default 0)")
    show.add_argument("--overhead", type=float, default=0.0, help="the runtime's cost before each action (default 0)")
    show.add_argument("--trace", metavar="PATH", help="also write a Chrome trace (JSON) for Perfetto")
    show.add_argument("--svg", metavar="PATH", help="also write an SVG picture")
    show.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="ANSI colors (default: auto)"
    )
    show.add_argument("--no-color", dest="color", action="store_const", const="never", help="same as --color never")
    plan = commands.add_parser(
        "plan",
        help="predict every schedule's step time, bubble and peak memory",
        description="Predict each schedule's step time, bubble and peak memory per rank, each with its fastest "
        "split of the layers, from measured costs (--costs) or a transformer (--layers ..., with experts: "
        "--experts ...) on a device (--tflops ...), or a published one (--preset). "
        "The cost model: NOTE [planner cost model] in fpipe/planning/_cost_model.py.",
    )
    plan.add_argument("--ranks", type=_positive_int, required=True, help="pipeline ranks")
    plan.add_argument("--microbatches", type=_positive_int, required=True, help="microbatches per step")
    plan.add_argument("--costs", metavar="PATH", help="per-stage costs saved by fpipe.planning.save_costs")
    plan.add_argument("--layers", type=_positive_int, help="transformer layers")
    plan.add_argument("--hidden", type=_positive_int, help="hidden size")
    plan.add_argument("--sequence", type=_positive_int, help="tokens per sequence")
    plan.add_argument("--vocabulary", type=_positive_int, help="vocabulary size")
    plan.add_argument("--microbatch-size", type=_positive_int, default=1, help="sequences per microbatch (default 1)")
    plan.add_argument("--layer-params", type=_positive, help="matmul parameters per layer (default 12 x hidden^2)")
    plan.add_argument("--recompute", action="store_true", help="full activation recomputation in the backward")
    plan.add_argument("--tflops", type=_positive, help="achieved TFLOP/s per rank (peak x utilization)")
    plan.add_argument("--bandwidth", type=_positive, help="GB/s between neighbouring ranks")
    plan.add_argument("--latency", type=_non_negative, default=0.0, help="microseconds per message (default 0)")
    plan.add_argument(
        "--memory",
        type=_positive,
        help="GiB per device; schedules that need more are marked. With --costs (no bytes): activations per rank "
        "in microbatches of its layers, the table's unit (1F1B's rank 0 holds one per rank)",
    )
    plan.add_argument(
        "--stages-per-rank",
        type=_positive_ints,
        help="comma-separated stages per rank to try, e.g. 1,2,4: each schedule runs with each it lays out "
        "(1: gpipe, 1f1b, zbh1, zbh2, searched; 2: the V schedules, searched-v; any: interleaved, zbinterleaved, "
        "bfs, searched). Default: each schedule's own (1, or 2)",
    )
    plan.add_argument(
        "--experts",
        type=_positive_int,
        help="routed experts per MoE layer: a mixture of experts (needs --active-experts and --expert-hidden)",
    )
    plan.add_argument("--active-experts", type=_positive_int, help="routed experts each token goes to (top-k)")
    plan.add_argument(
        "--expert-hidden", type=_positive_int, help="each expert's hidden size (a gated MLP of 3 x hidden x this)"
    )
    plan.add_argument("--shared-experts", type=_non_negative_int, default=0, help="experts every token goes to (0)")
    plan.add_argument(
        "--dense-layers", type=_non_negative_int, default=0, help="the first layers that are dense (--layer-params; 0)"
    )
    plan.add_argument(
        "--attention-params",
        type=_positive,
        help="a MoE layer's matmul parameters besides its router and experts (default 4 x hidden^2)",
    )
    plan.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a published model and device whose options become the defaults (the layout, --ranks, --microbatches, "
        "--tp, --dp, --ep, is yours): "
        + "; ".join(f"{name}: {p.about}" for name, p in PRESETS.items()).replace("%", "%%"),  # argparse's % format
    )
    plan.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel devices per pipeline rank (1)")
    plan.add_argument("--dp", type=_positive_int, default=1, help="data-parallel replicas of the pipeline (1)")
    plan.add_argument("--tp-bandwidth", type=_positive, help="GB/s of the tensor-parallel all-reduces (--bandwidth)")
    plan.add_argument("--dp-bandwidth", type=_positive, help="GB/s of the data-parallel all-reduce (--bandwidth)")
    plan.add_argument(
        "--ep",
        type=_positive_int,
        default=1,
        help="expert-parallel devices, each with its own data and 1/ep of the routed experts (1)",
    )
    plan.add_argument("--ep-bandwidth", type=_positive, help="GB/s of a device's all-to-all (--bandwidth)")
    plan.add_argument(
        "--bytes-per-param", type=_positive, default=16.0, help="bytes per parameter with its optimizer state (16)"
    )
    plan.add_argument(
        "--slack",
        type=_non_negative,
        default=0.0,
        help="the searched rows keep the program holding the least memory within this fraction of the shortest "
        "step (search's slack; 0.02 suits --costs from a recording; default 0: the shortest)",
    )
    plan.add_argument(
        "--overlap",
        action="store_true",
        help="pair each rank's adjacent F and B where faster, hiding the experts' all-to-alls behind the other's "
        "compute (Overlapped; NOTE [planner overlap] in fpipe/planning/_plan.py)",
    )
    plan.add_argument("--schedules", help="comma-separated schedules to compare (default: all)")
    plan.add_argument("--svg", metavar="PATH", help="also write the fastest fitting schedule's timeline as an SVG")
    if plan_defaults:
        plan.set_defaults(**plan_defaults)
    return parser


_MODEL = ("layers", "hidden", "sequence", "vocabulary", "tflops", "bandwidth")
# The model and device options that have defaults: with --costs, any of them set is refused too.
_MODEL_DEFAULTS: dict[str, object] = {
    "microbatch_size": 1,
    "layer_params": None,
    "recompute": False,
    "latency": 0.0,
    "bytes_per_param": 16.0,
    "tp": 1,
    "dp": 1,
    "tp_bandwidth": None,
    "dp_bandwidth": None,
    "experts": None,
    "active_experts": None,
    "expert_hidden": None,
    "shared_experts": 0,
    "dense_layers": 0,
    "attention_params": None,
    "ep": 1,
    "ep_bandwidth": None,
    "preset": None,
}
# The options of a mixture of experts besides --experts, and their defaults.
_EXPERT_OPTIONS: dict[str, object] = {
    name: _MODEL_DEFAULTS[name]
    for name in ("active_experts", "expert_hidden", "shared_experts", "dense_layers", "attention_params")
}


def _preset_options(preset: Preset) -> dict[str, object]:
    """A preset's model and device as the plan options' values, in the command line's units."""
    model, device, experts = preset.model, preset.device, preset.model.experts

    def scaled(value: float | None, unit: float) -> float | None:
        return None if value is None else value / unit

    options: dict[str, object] = {
        "layers": model.layers,
        "hidden": model.hidden,
        "sequence": model.sequence,
        "vocabulary": model.vocabulary,
        "microbatch_size": model.microbatch_size,
        "layer_params": model.layer_params,
        "recompute": model.recompute,
        "tflops": device.flops / 1e12,
        "bandwidth": device.bandwidth / 1e9,
        "latency": device.latency / 1e-6,
        "memory": scaled(device.memory, GIB),
        "bytes_per_param": device.bytes_per_param,
        "tp_bandwidth": scaled(device.tp_bandwidth, 1e9),
        "dp_bandwidth": scaled(device.dp_bandwidth, 1e9),
        "ep_bandwidth": scaled(device.ep_bandwidth, 1e9),
    }
    if experts is not None:
        options |= {
            "experts": experts.routed,
            "active_experts": experts.active,
            "expert_hidden": experts.hidden,
            "shared_experts": experts.shared,
            "dense_layers": experts.dense_layers,
            "attention_params": experts.attention_params,
        }
    return options


def _set_options(args: argparse.Namespace, defaults: dict[str, object]) -> list[str]:
    """The options of ``defaults`` that ``args`` sets to something else."""
    return [name for name, default in defaults.items() if getattr(args, name) != default]


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    """``python -m fpipe plan``: the table of ``fpipe.planning.plan`` for the arguments, printed."""
    known_names = [*SCHEDULES, *SEARCHED]
    names = known_names if args.schedules is None else args.schedules.split(",")
    unknown = [n for n in names if n not in known_names]
    missing = [f"--{n}" for n in _MODEL if getattr(args, n) is None]
    problem = None
    if unknown:
        known = ", ".join(known_names)
        problem = f"unknown schedules {', '.join(unknown)} (--schedules: {args.schedules}). Choose from {known}"
    elif args.costs is None and missing:
        problem = f"a model needs {', '.join(missing)}, or measured costs (--costs PATH)"
    elif args.costs is not None and (len(missing) < len(_MODEL) or _set_options(args, _MODEL_DEFAULTS)):
        problem = "--costs gives the costs: drop the model and device options"
    else:
        problem = _experts_problem(args)
    if problem:
        print(f"python -m fpipe plan: {problem}.", file=sys.stderr)
        return 2
    try:
        found = plan(  # the experts are checked here (Experts, and against the device's ep): a ValueError
            args.ranks,
            args.microbatches,
            costs=args.costs,
            model=None if args.costs is not None else _model(args),
            device=None if args.costs is not None else _device(args),
            memory=args.memory if args.costs is not None else None,
            stages_per_rank=args.stages_per_rank,
            schedules=names,
            slack=args.slack,
            overlap=args.overlap,
        )
    except (ValueError, ScheduleError) as error:  # PlanError is a ValueError; the others: a model or device refused
        message = str(error)
        print(message if isinstance(error, PlanError) else f"python -m fpipe plan: {message}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"python -m fpipe plan: cannot read {error.filename}: {error.strerror}", file=sys.stderr)
        return 1
    print(found, file=out)
    fastest = found.fastest.simulation
    if args.svg and fastest is not None:
        try:
            with open(args.svg, "w", encoding="utf-8") as f:
                f.write(svg(fastest, unit_width=1200 / fastest.makespan))
        except OSError as error:
            print(f"python -m fpipe plan: cannot write {error.filename}: {error.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {args.svg} ({found.fastest.name})", file=out)
    return 0


def _experts_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the mixture-of-experts options, in their names, or ``None``."""
    if args.experts is None:
        given = [f"--{name.replace('_', '-')}" for name in _set_options(args, _EXPERT_OPTIONS)]
        given += ["--ep"] if args.ep != 1 else []
        verb = "needs" if len(given) == 1 else "need"
        return f"{', '.join(given)} {verb} a mixture of experts (--experts N)" if given else None
    needed = {"--active-experts": args.active_experts, "--expert-hidden": args.expert_hidden}
    missing = [name for name, value in needed.items() if value is None]
    if missing:
        return f"a mixture of experts needs {', '.join(missing)}"
    if args.active_experts > args.experts:
        return (
            f"a token goes to at most every routed expert (--active-experts: {args.active_experts}, --experts: "
            f"{args.experts}). Use --active-experts {args.experts} or fewer"
        )
    if args.experts % args.ep:
        return (
            f"the routed experts do not divide among the expert-parallel devices (--experts: {args.experts}, "
            f"--ep: {args.ep}). Use an --ep that divides {args.experts}"
        )
    return None


def _model(args: argparse.Namespace) -> Transformer:
    """The transformer of the command line's model options."""
    experts = None
    if args.experts is not None:
        experts = Experts(
            args.experts,
            args.active_experts,
            args.expert_hidden,
            args.shared_experts,
            args.dense_layers,
            args.attention_params,
        )
    return Transformer(
        args.layers,
        args.hidden,
        args.sequence,
        args.vocabulary,
        args.microbatch_size,
        args.layer_params,
        args.recompute,
        experts,
    )


def _device(args: argparse.Namespace) -> Device:
    """The device of the command line's options, in the planner's units (FLOP/s, bytes, seconds)."""
    return Device(
        args.tflops * 1e12,
        args.bandwidth * 1e9,
        args.latency * 1e-6,
        None if args.memory is None else args.memory * GIB,
        args.bytes_per_param,
        tp=args.tp,
        dp=args.dp,
        tp_bandwidth=None if args.tp_bandwidth is None else args.tp_bandwidth * 1e9,
        dp_bandwidth=None if args.dp_bandwidth is None else args.dp_bandwidth * 1e9,
        ep=args.ep,
        ep_bandwidth=None if args.ep_bandwidth is None else args.ep_bandwidth * 1e9,
    )


def _check_drawable(costs: Costs) -> None:
    """Costs a terminal grid can draw: between 1e-6 and 1e6, within a factor 1000 of each other
    (one column is at least 1/8 of the shortest action, so the grid's width follows the ratio)."""
    values = [costs.forward, costs.of("B"), costs.backward_input, costs.backward_weight]
    values += [x for x in (costs.send, costs.overhead) if x > 0]
    if min(values) < 1e-6 or max(values) > 1e6 or max(values) > 1000 * min(values):
        raise ScheduleError(
            f"costs must lie between 1e-6 and 1e6 and within a factor 1000 of each other, for the grid to fit "
            f"a terminal ({_listed(costs)}). Costs are relative: scale them."
        )


def _listed(costs: Costs) -> str:
    return (
        f"F {costs.forward:g}, B {costs.of('B'):g}, I {costs.backward_input:g}, "
        f"W {costs.backward_weight:g}, send {costs.send:g}"
        + (f", overhead {costs.overhead:g}" if costs.overhead else "")
    )


def _positive(text: str) -> float:
    return _number(text, positive=True)


def _non_negative(text: str) -> float:
    return _number(text, positive=False)


def _number(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise argparse.ArgumentTypeError(f"expected a finite {kind} number, got {text!r}")
    return value


def _positive_ints(text: str) -> list[int]:
    """``"1,2,4"`` as ``[1, 2, 4]``: positive ints, each once, in the order given."""
    values = [_positive_int(part) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, each once, got {text!r}")
    return values


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
