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
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from ._plural import plural
from .schedules import (
    Costs,
    DualPipeV,
    GPipe,
    Interleaved1F1B,
    InterleavedZeroBubble,
    LoopedBFS,
    OneFOneB,
    Schedule,
    ScheduleError,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
    chrome_trace,
    simulate,
    svg,
    terminal_grid,
)
from .schedules._pictures import legend


@dataclass(frozen=True)
class _Choice:
    """A schedule the command line knows: how to build it and its default stages per rank."""

    make: Callable[[int, int], Schedule]
    stages_per_rank: int
    about: str


SCHEDULES: dict[str, _Choice] = {
    "gpipe": _Choice(lambda m, v: GPipe(m), 1, "GPipe: all forwards, then all backwards"),
    "1f1b": _Choice(lambda m, v: OneFOneB(m), 1, "1F1B (PipeDream-flush)"),
    "interleaved": _Choice(
        lambda m, v: Interleaved1F1B(m, stages_per_rank=v), 2, "Megatron's interleaved 1F1B, looped placement"
    ),
    "zbinterleaved": _Choice(
        lambda m, v: InterleavedZeroBubble(m, stages_per_rank=v),
        2,
        "interleaved zero bubble (torch's), looped placement",
    ),
    "zbh1": _Choice(lambda m, v: ZeroBubbleH1(m), 1, "ZB-H1: 1F1B with deferred weight gradients"),
    "zbh2": _Choice(lambda m, v: ZeroBubbleH2(m), 1, "ZB-H2: ZB-H1 with a longer warm-up, 2p-1 activations"),
    "zbv": _Choice(lambda m, v: ZeroBubbleV(m), 2, "ZB-V: two stages per rank in a V"),
    "bfs": _Choice(lambda m, v: LoopedBFS(m, stages_per_rank=v), 2, "looped breadth-first"),
    "dualpipev": _Choice(lambda m, v: DualPipeV(m), 2, "DualPipeV: DeepSeek's DualPipe in a V, overlaps run in order"),
}


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    out = sys.stdout if stdout is None else stdout
    args = _parser().parse_args(argv)
    choice = SCHEDULES[args.schedule]
    v = choice.stages_per_rank if args.stages_per_rank is None else args.stages_per_rank
    try:
        schedule = choice.make(args.microbatches, v)
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


def _parser() -> argparse.ArgumentParser:
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
    show.add_argument("--trace", metavar="PATH", help="also write a Chrome trace (JSON) for Perfetto")
    show.add_argument("--svg", metavar="PATH", help="also write an SVG picture")
    show.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="ANSI colors (default: auto)"
    )
    show.add_argument("--no-color", dest="color", action="store_const", const="never", help="same as --color never")
    return parser


def _check_drawable(costs: Costs) -> None:
    """Costs a terminal grid can draw: between 1e-6 and 1e6, within a factor 1000 of each other
    (one column is at least 1/8 of the shortest action, so the grid's width follows the ratio)."""
    values = [costs.forward, costs.of("B"), costs.backward_input, costs.backward_weight]
    values += [costs.send] if costs.send > 0 else []
    if min(values) < 1e-6 or max(values) > 1e6 or max(values) > 1000 * min(values):
        raise ScheduleError(
            f"costs must lie between 1e-6 and 1e6 and within a factor 1000 of each other, for the grid to fit "
            f"a terminal ({_listed(costs)}). Costs are relative: scale them."
        )


def _listed(costs: Costs) -> str:
    return (
        f"F {costs.forward:g}, B {costs.of('B'):g}, I {costs.backward_input:g}, "
        f"W {costs.backward_weight:g}, send {costs.send:g}"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
