"""The planner behind ``python -m fpipe plan``: every schedule's predicted step time, bubble and
peak memory per rank, from measured per-stage costs or from a transformer's shape and a device's
speed (``_cost_model.py``, NOTE [planner cost model]), each with the split of layers into stages
that is fastest for it (``_ranking.py``). ``plan`` returns the table as a value (``Plan``); the
command line prints it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .._plural import plural
from ..schedules import Costs, Overlapped, Program, simulate
from ..schedules._registry import BUILTINS, Builtin
from ._cost_model import (
    GIB,
    Device,
    Transformer,
    Unit,
    measured_units,
    model_parameters,
    tokens_per_step,
    transformer_units,
)
from ._costs_file import load_costs
from ._ranking import Candidate, PlanError, PlanRow, ranked
from ._search import search


def _units(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def costs_text(costs: Costs) -> str:
    """``costs`` in seconds, for a line above the table: ``"F 1.2 ms, I 1.3 ms, W 1.1 ms, send 10 us"``,
    then ``", overhead 20 us, receive 300 us"`` for those it has (NOTE [per-action overhead])."""
    named = [("F", costs.forward), ("I", costs.backward_input), ("W", costs.backward_weight), ("send", costs.send)]
    named += [(name, value) for name, value in (("overhead", costs.overhead), ("receive", costs.receive)) if value]
    return ", ".join(f"{name} {format_seconds(value)}" for name, value in named)


def format_seconds(t: float) -> str:
    """``t`` seconds with 4 significant digits in s, ms or us."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.4g} {unit}"
    return f"{t:.3g} s"


# The searched rows: name -> (placement, stages per rank).
#
# NOTE [searched candidates]
#     ``search``'s programs are rows of the plan beside the built-ins: without a memory limit (the
#     planner marks what does not fit; with measured costs and a memory limit, whose unit is the
#     search's, under that limit), on the stage costs of their own split and of every other
#     row's split of as many stages (so a searched row is never slower than a built-in of its
#     placement), without the exact search, so the table depends on the machine's speed only
#     where the 5 s budget runs out (not at the sizes tested).
SEARCHED: dict[str, tuple[Literal["looped", "v"], int]] = {"searched": ("looped", 1), "searched-v": ("v", 2)}
SCHEDULES: dict[str, Builtin] = {b.command: b for b in BUILTINS}  # the built-in rows, by command-line name


def offers(schedule: Builtin, v: int) -> bool:
    """Whether the planner runs ``schedule`` with ``v`` stages per rank: its own count, or any from
    2 where the count is a field (with one, an interleaved schedule is a plain one)."""
    return v == schedule.stages_per_rank or (schedule.field and v >= 2)


def candidates(
    names: Sequence[str],
    m: int,
    p: int,
    stages_per_rank: Sequence[int] | None,
    memory: float | None,
    slack: float,
    overlap: bool = False,
) -> list[Candidate]:
    """The planner's rows: each schedule of ``names`` with its own stages per rank, or with each
    of ``stages_per_rank`` it lays out (named ``"interleaved v=4"`` when it takes several); with
    ``overlap``, each program paired where that is faster (NOTE [planner overlap])."""
    found = []
    for n in names:
        looped = (n in SEARCHED and SEARCHED[n][0] == "looped") or (n in SCHEDULES and SCHEDULES[n].field)
        if stages_per_rank is None:
            tried = [SEARCHED[n][1] if n in SEARCHED else SCHEDULES[n].stages_per_rank]
        elif n in SEARCHED:
            tried = [v for v in stages_per_rank if looped or v == SEARCHED[n][1]]
        else:
            tried = [v for v in stages_per_rank if offers(SCHEDULES[n], v)]
        for v in tried:
            name = f"{n} v={v}" if looped and stages_per_rank is not None else n
            if n in SEARCHED:
                searcher = _searcher(SEARCHED[n][0], m, p, v, memory, slack, overlap)
                found.append(Candidate(name, v, searcher, adapts=True))
            else:
                found.append(Candidate(name, v, _builder(SCHEDULES[n], m, p, v, overlap)))
    return found


def _builder(choice: Builtin, m: int, p: int, v: int, overlap: bool = False) -> Callable[[tuple[Costs, ...]], Program]:
    """The program of ``choice`` with ``v`` stages per rank on ``p`` ranks, whatever the costs;
    with ``overlap``, paired (``Overlapped``: ``pair_adjacent``, or the schedule's own pairs) where
    that is faster for the costs (NOTE [planner overlap]). Built on the first call (a
    ``ScheduleError`` is the row's), paired once."""
    built: list[Program] = []  # the program, then its pairs'

    def program(costs: tuple[Costs, ...]) -> Program:
        if not built:
            built.append(choice.build(m, v).program(p * v, p))
        if not overlap or not any(c.communication for c in costs):
            return built[0]
        if len(built) == 1:
            built.append(Overlapped(choice.build(m, v)).program(p * v, p))
        return min(built, key=lambda q: simulate(q, costs).makespan)

    return program


def _searcher(
    placement: Literal["looped", "v"],
    m: int,
    p: int,
    v: int,
    memory: float | None,
    slack: float,
    overlap: bool = False,
) -> Callable[[tuple[Costs, ...]], Program]:
    """The program ``search`` finds for a split's stage costs (NOTE [searched candidates]), with
    ``v`` stages per rank, within ``memory`` activation units per rank when given, with ``slack``
    and ``overlap``."""

    def searched(costs: tuple[Costs, ...]) -> Program:
        found = search(
            p,
            m,
            costs,
            placement=placement,
            stages_per_rank=v,
            memory=memory,
            slack=slack,
            time_budget=5.0,
            exact=False,
            overlap=overlap,
        )
        return found.program

    return searched


@dataclass(frozen=True)
class Plan:
    """What ``plan`` predicts: one row per schedule, and the table ``python -m fpipe plan`` prints
    (``str(plan)``).

    Attributes:
        rows: each schedule's prediction with its fastest split, fastest first; those beyond the
            memory limit, then those that cannot run, after.
        about: one line: the ranks, microbatches and what was planned (the model, or the costs).
        costs: the costs of the units the splits group (a layer and the head, or each measured
            stage), one line per kind of unit.
        tokens: tokens per step of one pipeline, for the throughput column (``None`` for
            measured costs).
        memory: the limit per rank the rows are marked against (bytes per device for a model,
            activations in microbatches of a rank's layers for measured costs), or ``None``.
        num_ranks: pipeline ranks.
        devices_per_rank: tensor-parallel devices per rank (the throughput column is per device
            when above 1).
        expert_parallel: expert-parallel devices, each with a pipeline of its own data (the
            throughput column is per device when above 1; NOTE [planner experts]).
    """

    rows: tuple[PlanRow, ...]
    about: str
    costs: str
    tokens: float | None
    memory: float | None
    num_ranks: int
    devices_per_rank: int = 1
    expert_parallel: int = 1

    @property
    def fastest(self) -> PlanRow:
        """The first row: the fastest schedule that fits."""
        return self.rows[0]

    def table(self) -> str:
        """The rows as text: a summary per schedule, its split, and its peak memory per rank."""
        return _table(
            self.rows,
            tokens=self.tokens,
            num_ranks=self.num_ranks,
            memory=self.memory,
            devices_per_rank=self.devices_per_rank,
            per_device=self.devices_per_rank > 1 or self.expert_parallel > 1,
        )

    def __str__(self) -> str:
        return "\n".join([self.about, self.costs, self.table()])


def plan(
    num_ranks: int,
    num_microbatches: int,
    *,
    costs: Sequence[Costs] | str | os.PathLike[str] | None = None,
    model: Transformer | None = None,
    device: Device | None = None,
    memory: float | None = None,
    stages_per_rank: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    slack: float = 0.0,
    overlap: bool = False,
) -> Plan:
    """Every schedule's predicted step time, bubble and peak memory per rank, each with the split
    of the layers into stages that is fastest for it (what ``python -m fpipe plan`` prints).

    Conceptually::

        units = transformer_units(model, device) if model else measured_units(costs)
        for schedule in schedules:                        # the built-ins, searched, searched-v
            for v in stages_per_rank:                     # those it lays out
                split = split_for(schedule.program(...), units)   # NOTE [schedule-aware split]
                rows.append(simulate(schedule.program(stage_costs(split)), stage_costs(split)))
        rows.sort(key=(fits memory, step))

    Args:
        num_ranks: pipeline ranks.
        num_microbatches: microbatches per step.
        costs: measured per-stage costs (``fit_costs``), or the path of a file ``save_costs``
            wrote; each a unit a split may group with its neighbours. Either this, or ``model``
            and ``device``.
        model: a decoder-only transformer's shape (NOTE [planner cost model] in
            ``fpipe/planning/_cost_model.py``), with its experts if any (NOTE [planner experts]:
            active parameters for compute, a device's share of all of them for memory, the
            all-to-alls in ``F`` and ``I``).
        device: what a device does; its ``memory`` is the limit the rows are marked against.
        memory: with ``costs``, the activations a rank may hold, in microbatches of its layers
            (the unit of ``Simulation.peak_activations``), also the searched rows' limit.
        stages_per_rank: the stages per rank to try each schedule with, where it lays them out
            (default: each schedule's own).
        schedules: the rows, by the command line's names (``"1f1b"``, ``"zbv"``, ``"searched"``,
            ``"searched-v"``; default: every built-in, then the two searched).
        slack: the searched rows keep the program holding the least memory within this fraction
            of the shortest simulated step (``search``'s ``slack``).
        overlap: each row's program with its adjacent forwards and backwards paired where that
            is faster, the experts' all-to-alls hidden behind the other half's compute (NOTE
            [planner overlap]); such a row is named ``"dualpipev overlapped"``.

    Example:
        >>> from fpipe.planning import plan
        >>> from fpipe.schedules import Costs
        >>> heavy_last = [Costs()] * 3 + [Costs(forward=2, backward_input=2, backward_weight=2)]
        >>> found = plan(2, 4, costs=heavy_last, schedules=["1f1b", "zbh1"])
        >>> print(found.table())  # seconds: the costs' unit
        schedule  stages  step  vs best  bubble  peak/rank (microbatches)
        zbh1      2       37 s  1.000x   18.9%   2
        1f1b      2       39 s  1.054x   23.1%   2
        units per stage:
          zbh1: 0-2 | 3
          1f1b: 0-2 | 3
        peak memory per rank (microbatches of a rank's layers), rank 0 first:
          zbh1: 2 2
          1f1b: 2 1

    Raises:
        PlanError: for unknown schedules, none that lays out ``stages_per_rank``, none that can
            run (the message says what would), or none within the memory limit (the message
            names the least any needs).
        ScheduleError: for costs, a model or a device that cannot be planned.
        ValueError: for both or neither of ``costs`` and ``model``, a ``model`` without a
            ``device``, ``memory`` with a model (the limit is ``device.memory``), or experts the
            device cannot hold (routed experts not a multiple of ``device.ep``, ``ep`` above 1
            without experts).
        OSError: if the costs' file cannot be read.
    """
    if (costs is None) == (model is None) or (model is not None and device is None):
        raise ValueError(
            "fpipe.planning.plan: pass measured costs (costs=...), or a model and a device (model=..., device=...) "
            f"(costs: {'given' if costs is not None else None}, model: {model}, device: {device})."
        )
    if model is not None and memory is not None:
        raise ValueError(
            f"fpipe.planning.plan: with a model the memory limit is the device's (memory: {memory}). "
            "Pass Device(..., memory=bytes) instead."
        )
    known = [*SCHEDULES, *SEARCHED]
    names = known if schedules is None else list(schedules)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PlanError(
            f"python -m fpipe plan: unknown schedules {', '.join(unknown)} (--schedules: {','.join(names)}). "
            f"Choose from {', '.join(known)}."
        )
    p, m = num_ranks, num_microbatches
    measured = costs is not None
    limit = memory if measured else device.memory if device is not None else None
    # With measured costs, memory is in activation units (no bytes), which the search takes as its limit.
    rows_of = candidates(names, m, p, stages_per_rank, limit if measured else None, slack, overlap)
    if not rows_of:
        tried = ",".join(str(v) for v in stages_per_rank or ())
        raise PlanError(
            f"python -m fpipe plan: no schedule of {', '.join(names)} lays out {tried} stages per rank "
            f"(--stages-per-rank: {tried}). Try 1, 2, or a looped schedule (interleaved, zbinterleaved, bfs)."
        )
    if model is not None and device is not None:
        units = transformer_units(model, device)
        tokens: float | None = tokens_per_step(model, m)
        about = (
            f"{plural(model.layers, 'layer')}, hidden {model.hidden}, vocabulary {model.vocabulary}, "
            f"{model.microbatch_size} x {model.sequence} tokens per microbatch"
        )
        if model.experts is not None:
            about += "; " + _experts_text(model)
        if device.tp > 1 or device.dp > 1 or device.ep > 1:
            ep = f", ep {device.ep}: {p * device.tp * device.dp * device.ep:,} devices" if device.ep > 1 else ""
            about += f"; tp {device.tp}, dp {device.dp}{ep} (per device: TFLOP/s, memory, tokens/s)"
        costs_line = _layers_text(model, units)
        devices = device.tp
        expert_parallel = device.ep
    else:
        if isinstance(costs, (str, os.PathLike)):
            per_stage, source = load_costs(costs), f" ({os.fspath(costs)})"
        else:
            per_stage, source = tuple(costs or ()), ""
        units, tokens = measured_units(per_stage), None
        about = f"measured costs of {plural(len(units), 'stage')}{source}"
        costs_line = "\n".join(f"stage {s}: {costs_text(u.costs)}" for s, u in enumerate(units))
        devices, expert_parallel = 1, 1
    if overlap:
        units, hiding = overlapping(units)
        about += (
            "; overlap: F and B paired where faster, the all-to-alls hidden behind the other's compute"
            if hiding
            else "; overlap: nothing to hide (no all-to-all), no pairs"
        )
    rows = ranked(units, p, rows_of, memory=limit)
    rows = [replace(r, name=f"{r.name} overlapped") if r.simulation and r.simulation.program.pairs else r for r in rows]
    return Plan(
        rows=tuple(rows),
        about=f"{plural(p, 'rank')}, {plural(m, 'microbatch')}; {about}",
        costs=costs_line,
        tokens=tokens,
        memory=limit,
        num_ranks=p,
        devices_per_rank=devices,
        expert_parallel=expert_parallel,
    )


def overlapping(units: Sequence[Unit]) -> tuple[list[Unit], bool]:
    """``units`` with each layer's all-to-alls as its ``communication``, and whether any has some.

    NOTE [planner overlap]
        With ``overlap``, a MoE layer's ``F`` and ``I`` keep their all-to-all seconds
        (``Unit.all_to_all``, NOTE [planner experts]) as ``Costs.communication``, two points each
        (the dispatch and the combine); a stage sums its layers' (``_ranking._stage_costs``).
        Each row's program is then paired (``Overlapped``, or ``search(overlap=True)`` for
        the searched rows) and kept where ``simulate`` finds it faster (NOTE [overlapped time]
        in ``fpipe/schedules/_simulate.py``), for the split found for it. With ``recompute`` the
        recomputed forward's all-to-alls in ``I`` count as compute (one ``communication`` for
        ``F`` and ``I``): that part is not hidden. The tensor-parallel all-reduces and the
        pipeline's own messages are not communication here (fpipe's runtime overlaps the expert
        exchanges only).
    """
    out = [
        replace(u, costs=replace(u.costs, communication=u.all_to_all, communication_points=2)) if u.all_to_all else u
        for u in units
    ]
    return out, any(u.all_to_all for u in units)


def _experts_text(model: Transformer) -> str:
    """One clause on a model's experts and parameters, for the line above the table."""
    experts = model.experts
    assert experts is not None
    total, active = model_parameters(model)
    shared = f", {experts.shared} shared" if experts.shared else ""
    dense = f", {plural(experts.dense_layers, 'dense layer')} first" if experts.dense_layers else ""
    return (
        f"{experts.routed} routed experts (top-{experts.active}{shared}, hidden {experts.hidden}){dense}; "
        f"{_count(total)} parameters, {_count(active)} active"
    )


def _count(n: float) -> str:
    """``n`` with 4 significant digits and a suffix: ``"671B"``, ``"37.55B"``, ``"1.2M"``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def _layers_text(model: Transformer, units: Sequence[Unit]) -> str:
    """The costs of a layer and of the head (of a dense and a MoE layer, with experts)."""
    head = f"head: {costs_text(units[-1].costs)}"
    if model.experts is None:
        return f"layer: {costs_text(units[0].costs)}; {head}"
    dense = model.experts.dense_layers
    moe = units[dense]
    exchange = f" (all-to-all {format_seconds(moe.all_to_all)} of F and of I)" if moe.all_to_all else ""
    lines = [f"dense layer: {costs_text(units[0].costs)}"] if dense else []
    return "; ".join([*lines, f"MoE layer: {costs_text(moe.costs)}{exchange}", head])


def _table(
    rows: Sequence[PlanRow],
    *,
    tokens: float | None,
    num_ranks: int,
    memory: float | None,
    devices_per_rank: int = 1,
    per_device: bool = False,
) -> str:
    """The rows as text: a summary per schedule, its split, and its peak memory per rank.

    ``tokens`` (per step of one pipeline) gives a throughput column: per rank, or per device
    when a rank has ``devices_per_rank > 1`` (tensor parallelism) or ``per_device``; and the
    device-hours a trillion tokens take at that rate (``1e12 / throughput / 3600``)."""
    best = next((r.step for r in rows if r.simulation is not None and r.fits(memory)), None)
    measured = any(r.simulation is not None and r.peak_bytes is None for r in rows)
    unit = "microbatches of a rank's layers" if measured else "GiB"
    header = [
        "schedule",
        "stages",
        "step",
        "vs best",
        "bubble",
        "peak/rank" + (" (microbatches)" if measured else " (GiB)"),
    ]
    per = "device" if devices_per_rank > 1 or per_device else "rank"
    header += [f"tokens/s/{per}", f"{per}-hours/1T tokens"] if tokens is not None else []
    header += ["fits"] if memory is not None else []
    lines, splits, peaks, errors = [header], [], [], []
    for row in rows:
        if row.simulation is None:
            errors.append(f"  {row.name}: {row.error}")
            continue
        sim = row.simulation
        peak = max(sim.peak_activations) if measured else max(row.peak_bytes or (0.0,)) / GIB
        cells = [
            row.name,
            str(len(row.stages)),
            format_seconds(row.step),
            f"{row.step / best:.3f}x" if best else "-",
            f"{sim.bubble_fraction:.1%}",
            f"{peak:.3g}",
        ]
        if tokens is not None:
            rate = tokens / row.step / num_ranks / devices_per_rank
            hours = 1e12 / rate / 3600
            cells += [f"{rate:,.0f}", f"{hours:,.0f}" if hours >= 1000 else f"{hours:.4g}"]
        cells += ["yes" if row.fits(memory) else "no"] if memory is not None else []
        lines.append(cells)
        splits.append(f"  {row.name}: " + " | ".join(_units(r) for r in row.stages))
        per_rank = sim.peak_activations if measured else tuple(b / GIB for b in row.peak_bytes or ())
        peaks.append(f"  {row.name}: " + " ".join(f"{x:.3g}" for x in per_rank))
    widths = [max(len(line[k]) for line in lines if k < len(line)) for k in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(
        [*text, "units per stage:", *splits, f"peak memory per rank ({unit}), rank 0 first:", *peaks]
        + (["cannot run:", *errors] if errors else [])
    )
