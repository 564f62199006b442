"""The planner behind ``python -m fpipe plan``: every schedule's predicted step time, bubble and
peak memory per rank, from measured per-stage costs or from a transformer's shape and a device's
speed, each with the split of layers into stages that is fastest for it.

NOTE [planner cost model]
    For a decoder-only transformer with ``L`` layers of ``P`` matmul parameters each (default
    ``12 h^2``: ``4 h^2`` attention, ``8 h^2`` an MLP of width ``4h``), hidden size ``h``,
    vocabulary ``V``, and a microbatch of ``b`` sequences of ``s`` tokens (``t = b s``), in
    FLOPs per microbatch (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
    on GPU Clusters", section 5.1: ``24 b s h^2 + 4 b s^2 h`` forward for ``P = 12 h^2``)::

        layer  F = 2 P t + 4 b s^2 h      (2 FLOPs per parameter and token; QK^T and AV)
               I = 2 P t + 8 b s^2 h      (the input gradients: one matmul each, both operands of
                                           the attention products)
               W = 2 P t                  (the weight gradients: one matmul each)
        head   F = I = W = 2 h V t        (on the last stage; the embedding, on the first, is a
                                           lookup: no FLOPs, only parameters)

    so ``I ~ W ~ F`` and ``B = I + W ~ 2F``. A duration is FLOPs over the device's achieved
    FLOP/s; a message carries one activation, ``t h`` values of 2 bytes: ``2 t h / bandwidth +
    latency``. Memory per rank is its parameters' ``bytes_per_param`` (16: bf16 weights and
    gradients, fp32 master weights and Adam's two moments, Rajbhandari et al. 2020) plus its
    activations at their peak, ``34 s b h`` bytes per layer and microbatch (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2 without the
    ``5 a s / h`` term that flash attention does not store; no tensor or sequence parallelism)
    and ``4 s b V`` for the head's fp32 logits. With full recomputation a layer keeps only its
    input, ``2 s b h`` bytes, and its input-gradient pass reruns the forward first: ``I += F``.

    Tensor parallelism over ``n = tp`` devices (Megatron-LM's, with sequence parallelism, as
    Korthikanti et al. and torchtitan run it): a pipeline rank is ``n`` devices, each with the
    device's FLOP/s and memory. Each computes ``1/n`` of the FLOPs, holds ``1/n`` of the
    parameters and of the activations (``34 s b h / n`` per layer), and sends its ``1/n`` of a
    message over its own link. Each layer's forward runs two all-reduces of the activation
    (``2 t h`` bytes; as all-gathers and reduce-scatters with sequence parallelism, the same
    bytes), and its input-gradient pass two more; the head's forward one all-gather and its
    input gradients one reduce-scatter. A ring all-reduce of ``x`` bytes over ``n`` devices takes
    ``2 (n-1)/n x / tp_bandwidth + latency`` (an all-gather or reduce-scatter half the bytes).
    They are not overlapped with compute (no async tensor parallelism): they add to ``F`` and
    ``I``.

    Data parallelism over ``d = dp`` replicas: after a rank's last action its gradients, 4 bytes
    per parameter (reduced in fp32), are all-reduced across the replicas, ``2 (d-1)/d x /
    dp_bandwidth``. A rank starts its reduction when its own last action ends, so the reduction
    overlaps the other ranks' drain of the pipeline, not the rank's own compute (as Megatron-LM
    and torchtitan reduce a pipeline stage's gradients once, after its last microbatch): the
    step is ``max over ranks r of (end of r's last action + r's reduction)``. ZeRO or FSDP move
    the same bytes (a reduce-scatter, then an all-gather); what they save in memory is
    ``bytes_per_param``'s to say.

    Nothing else: no kernel launch or allocator effects, no overlap of messages with compute
    beyond what ``simulate`` models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._modules import partition, split_for
from ._plural import plural
from .schedules import Costs, Program, ScheduleError, Simulation, simulate
from .schedules._action import BACKWARD, BACKWARD_WEIGHT, FORWARD

GIB = 2.0**30


class PlanError(ValueError):
    """A memory limit that no schedule fits."""


@dataclass(frozen=True)
class Unit:
    """What a split may not cut: a layer (with the embedding on the first) or the head.

    Attributes:
        name: for the table, e.g. ``"layer 3"`` or ``"head"``.
        costs: its per-microbatch durations and the latency of the message it sends.
        activation_bytes: what one microbatch leaves alive in it until its backward (``None``
            for measured costs).
        param_bytes: its parameters with their gradients and optimizer state (``None`` when
            measured).
        reduce_seconds: the data-parallel all-reduce of its gradients after the step's last
            action on its rank (NOTE [planner cost model]; 0 without data parallelism).
    """

    name: str
    costs: Costs
    activation_bytes: float | None = None
    param_bytes: float | None = None
    reduce_seconds: float = 0.0


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape (NOTE [planner cost model]).

    Attributes:
        layers: transformer layers.
        hidden: hidden size ``h``.
        sequence: tokens per sequence ``s``.
        vocabulary: vocabulary size ``V``.
        microbatch_size: sequences per microbatch ``b``.
        layer_params: matmul parameters per layer (default ``12 h^2``).
        recompute: whether each layer's backward recomputes its forward (full activation
            checkpointing): ``I`` gains an ``F`` and a layer keeps only its input, ``2 s b h`` bytes.
    """

    layers: int
    hidden: int
    sequence: int
    vocabulary: int
    microbatch_size: int
    layer_params: float | None = None
    recompute: bool = False


@dataclass(frozen=True)
class Device:
    """What one device can do, and how a pipeline rank's devices are grouped.

    Attributes:
        flops: achieved FLOP/s of a device (peak times the utilization expected).
        bandwidth: bytes per second between neighbouring ranks (per device).
        latency: seconds per message or collective on top of its size over the bandwidth.
        memory: bytes per device for parameters, optimizer state and activations (``None``: no limit).
        bytes_per_param: bytes each parameter costs with its gradient and optimizer state.
        tp: tensor-parallel devices per pipeline rank (NOTE [planner cost model]).
        dp: data-parallel replicas of the pipeline.
        tp_bandwidth: bytes per second of the tensor-parallel all-reduces (``None``: ``bandwidth``).
        dp_bandwidth: bytes per second of the data-parallel all-reduce (``None``: ``bandwidth``).
    """

    flops: float
    bandwidth: float
    latency: float = 0.0
    memory: float | None = None
    bytes_per_param: float = 16.0
    tp: int = 1
    dp: int = 1
    tp_bandwidth: float | None = None
    dp_bandwidth: float | None = None


GRADIENT_BYTES = 4.0  # per parameter in the data-parallel reduction (fp32)


def all_reduce_seconds(size: float, devices: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``size`` bytes over ``devices``: ``2 (n-1)/n size / bandwidth + latency``
    (0 on one device)."""
    return 0.0 if devices == 1 else 2.0 * (devices - 1) / devices * size / bandwidth + latency


def transformer_units(model: Transformer, device: Device) -> list[Unit]:
    """The layers and the head of ``model`` on ``device`` (NOTE [planner cost model]): per pipeline
    rank, ``device.tp`` devices; bytes per device."""
    h, s, b, vocabulary = model.hidden, model.sequence, model.microbatch_size, model.vocabulary
    t = b * s
    n = device.tp
    flops = device.flops * n
    params = 12.0 * h * h if model.layer_params is None else model.layer_params
    send = 2.0 * t * h / n / device.bandwidth + device.latency
    tp_bandwidth = device.bandwidth if device.tp_bandwidth is None else device.tp_bandwidth
    dp_bandwidth = device.bandwidth if device.dp_bandwidth is None else device.dp_bandwidth
    tp_all_reduce = all_reduce_seconds(2.0 * t * h, n, tp_bandwidth, device.latency)
    tp_gather = 0.0 if n == 1 else (n - 1) / n * 2.0 * t * h / tp_bandwidth + device.latency
    forward = (2 * params * t + 4 * b * s * s * h) / flops
    layer = Costs(
        forward=forward + 2 * tp_all_reduce,
        backward_input=(2 * params * t + 8 * b * s * s * h) / flops
        + (forward + 2 * tp_all_reduce if model.recompute else 0.0)
        + 2 * tp_all_reduce,
        backward_weight=2 * params * t / flops,
        send=send,
    )
    head = 2.0 * h * vocabulary * t / flops
    embedding = h * vocabulary / n  # parameters per device

    def reduce(count: float) -> float:
        return all_reduce_seconds(GRADIENT_BYTES * count, device.dp, dp_bandwidth, 0.0)

    units = [
        Unit(
            f"layer {i}",
            layer,
            (2.0 if model.recompute else 34.0) * s * b * h / n,
            (params / n + (embedding if i == 0 else 0)) * device.bytes_per_param,
            reduce(params / n + (embedding if i == 0 else 0)),
        )
        for i in range(model.layers)
    ]
    units.append(
        Unit(
            "head",
            Costs(forward=head + tp_gather, backward_input=head + tp_gather, backward_weight=head, send=send),
            4.0 * s * b * vocabulary / n,
            embedding * device.bytes_per_param,
            reduce(embedding),
        )
    )
    return units


def measured_units(costs: Sequence[Costs]) -> list[Unit]:
    """Measured per-stage costs (``fpipe.schedules.load_costs``) as units a split may regroup."""
    return [Unit(f"stage {s}", c) for s, c in enumerate(costs)]


@dataclass(frozen=True)
class Candidate:
    """A schedule the planner tries.

    Attributes:
        name: its name in the table.
        stages_per_rank: stages per rank of its placement.
        program: builds its program from the per-stage costs of a split (built-in schedules
            ignore them); raises ``ScheduleError`` when it cannot lay out the stages.
        adapts: whether ``program`` depends on the costs (a searched program): then the
            planner also tries it on every other candidate's split of the same stage count.
    """

    name: str
    stages_per_rank: int
    program: Callable[[tuple[Costs, ...]], Program]
    adapts: bool = False


@dataclass(frozen=True)
class Row:
    """One schedule's prediction, or why there is none.

    Attributes:
        name: the candidate's name.
        stages: the units of each stage, as ranges (empty when ``error`` is set).
        simulation: the step simulated with those stages (``None`` when ``error`` is set).
        peak_bytes: per rank, parameters plus activations at their peak (``None`` for
            measured costs, or when ``error`` is set).
        error: why the schedule cannot run here, or ``None``.
        step: the predicted step: the simulation's makespan, or later where a rank's
            data-parallel reduction ends after it (NOTE [planner cost model]); 0 with ``error``.
    """

    name: str
    stages: tuple[range, ...] = ()
    simulation: Simulation | None = None
    peak_bytes: tuple[float, ...] | None = None
    error: str | None = None
    step: float = 0.0

    def peak(self) -> float | None:
        """The largest rank's peak memory: bytes, or for measured costs (no bytes) activations in
        microbatches of a rank's layers (NOTE [activation units]); ``None`` with ``error``."""
        if self.simulation is None:
            return None
        return max(self.peak_bytes) if self.peak_bytes is not None else max(self.simulation.peak_activations)

    def fits(self, memory: float | None) -> bool:
        """Whether it runs within ``memory`` per rank, in ``peak``'s unit (always, without a limit)."""
        peak = self.peak()
        return peak is not None and (memory is None or peak <= memory)


def plan(
    units: Sequence[Unit], num_ranks: int, candidates: Sequence[Candidate], *, memory: float | None = None
) -> list[Row]:
    """Each candidate's prediction with its fastest split of ``units`` (NOTE [schedule-aware split]
    in ``fpipe/_modules/_schedule_split.py``), fastest first; those beyond ``memory`` per rank
    (bytes, or for measured units activations in microbatches of a rank's layers: ``Row.peak``),
    then those that cannot run, after.

    A candidate's program is built for the min-max split's stage costs, split for, and rebuilt
    for the chosen split's costs (the same program, for a built-in schedule).

    Raises:
        PlanError: when no candidate can run (the message says what would: fewer ranks, more
            layers, or the first candidate's own error), or when ``memory`` is given and no
            candidate fits it (the message names the least memory any candidate needs).
    """
    rows = [_row(units, num_ranks, c) for c in candidates]
    rows = [_on_other_splits(units, c, row, rows) if c.adapts else row for c, row in zip(candidates, rows)]

    def key(row: Row) -> tuple[int, float]:
        if row.simulation is None:
            return 2, 0.0
        return (0 if row.fits(memory) else 1), row.step

    rows.sort(key=key)
    if rows and all(r.simulation is None for r in rows):
        raise PlanError(_none_runs(units, num_ranks, candidates, rows))
    if memory is not None and rows and not rows[0].fits(memory):
        sized = [(peak, r.name) for r in rows if (peak := r.peak()) is not None]
        if sized:
            least, name = min(sized)
            measured = any(r.simulation is not None and r.peak_bytes is None for r in rows)
            scale, unit = (1.0, "microbatches of a rank's layers") if measured else (GIB, "GiB")
            raise PlanError(
                "python -m fpipe plan: no schedule fits in the memory of a rank "
                f"(memory: {memory / scale:.4g} {unit}); the least any needs is {least / scale:.4g} {unit} ({name}). "
                "Use more ranks, smaller or fewer microbatches, or more memory."
            )
    return rows


def _none_runs(units: Sequence[Unit], num_ranks: int, candidates: Sequence[Candidate], rows: Sequence[Row]) -> str:
    """One line: why no candidate runs, and what would (fewer ranks or more layers, when every
    candidate needs more stages than there are units; else the first candidate's own error)."""
    fewest = min(candidates, key=lambda c: c.stages_per_rank)
    need = num_ranks * fewest.stages_per_rank
    if need <= len(units):  # some candidate had the units it needs and refused for its own reason
        row = next(r for r in rows if not (r.error or "").startswith("needs "))
        return f"python -m fpipe plan: no schedule can run here ({row.name}: {row.error})"
    head = 1 if units and units[-1].name == "head" else 0
    have = f"{plural(len(units) - head, 'layer')} and the head" if head else plural(len(units), "measured stage")
    more = f"a model of at least {plural(need - head, 'layer')}" if head else f"the costs of {need} stages"
    ranks = len(units) // fewest.stages_per_rank
    fewer = f"at most {plural(ranks, 'rank')}, or " if ranks else ""
    return (
        f"python -m fpipe plan: no schedule can run: on {plural(num_ranks, 'rank')} each needs at least "
        f"{need} stages ({fewest.name}: {fewest.stages_per_rank} per rank) and there are "
        f"{plural(len(units), 'unit')} to split ({have}). Use {fewer}{more}."
    )


def _row(units: Sequence[Unit], num_ranks: int, candidate: Candidate) -> Row:
    num_stages = num_ranks * candidate.stages_per_rank
    if num_stages > len(units):
        return Row(candidate.name, error=f"needs {num_stages} stages, has {len(units)} units to split")
    layers = [u.costs for u in units]
    try:
        base = partition([c.forward + c.of(BACKWARD) for c in layers], num_stages)
        stages = split_for(candidate.program(_stage_costs(units, base)), layers)
        costs = _stage_costs(units, stages)
        program = candidate.program(costs)
    except ScheduleError as error:
        return Row(candidate.name, error=str(error))
    return _predicted(units, candidate.name, tuple(stages), program, costs)


def _predicted(
    units: Sequence[Unit], name: str, stages: tuple[range, ...], program: Program, costs: tuple[Costs, ...]
) -> Row:
    """The row of ``program`` run on ``stages``: simulated, its step extended by the ranks'
    data-parallel reductions (NOTE [planner cost model])."""
    simulation = simulate(program, costs)
    step = simulation.makespan
    if any(u.reduce_seconds for u in units):
        reduce = [
            sum(units[k].reduce_seconds for s in program.stages_of(r) for k in stages[s])
            for r in range(len(program.ranks))
        ]
        step = max(max(ends, default=0.0) + seconds for ends, seconds in zip(simulation.ends, reduce))
    return Row(name, stages, simulation, _peak_bytes(units, stages, program), step=step)


def _on_other_splits(units: Sequence[Unit], candidate: Candidate, row: Row, rows: Sequence[Row]) -> Row:
    """``row``, or ``candidate`` built for another row's split of as many stages where that is
    faster: a program searched for a split's costs is never slower than a built-in on that split
    (NOTE [searched candidates] in ``fpipe/_cli.py``)."""
    best = row
    for other in rows:
        if other.simulation is None or best.simulation is None or len(other.stages) != len(best.stages):
            continue
        costs = _stage_costs(units, other.stages)
        try:
            program = candidate.program(costs)
        except ScheduleError:
            continue
        row = _predicted(units, candidate.name, other.stages, program, costs)
        if row.step < best.step:
            best = row
    return best


def _stage_costs(units: Sequence[Unit], stages: Sequence[range]) -> tuple[Costs, ...]:
    """Each stage's ``Costs``: its units' durations summed, the last unit's message, and the
    largest of their overheads and receive costs (a stage's action is one dispatch and takes at
    most one message, whatever units it runs)."""
    return tuple(
        Costs(
            forward=sum(units[k].costs.forward for k in r),
            backward_input=sum(units[k].costs.backward_input for k in r),
            backward_weight=sum(units[k].costs.backward_weight for k in r),
            backward=sum(units[k].costs.of(BACKWARD) for k in r),
            send=units[r.stop - 1].costs.send,
            overhead=max(units[k].costs.overhead for k in r),
            receive=max(units[k].costs.receive for k in r),
        )
        for r in stages
    )


def _peak_bytes(units: Sequence[Unit], stages: Sequence[range], program: Program) -> tuple[float, ...] | None:
    """Per rank, its stages' parameters plus the most activation bytes alive at once (an
    activation lives from its ``F`` to its ``B`` or ``W``, as ``Simulation.peak_activations``)."""
    activations, params = [], []
    for r in stages:
        a, p = [units[k].activation_bytes for k in r], [units[k].param_bytes for k in r]
        if any(x is None for x in (*a, *p)):
            return None
        activations.append(sum(x for x in a if x is not None))
        params.append(sum(x for x in p if x is not None))
    peaks = []
    for rank, row in enumerate(program.ranks):
        alive, peak = 0.0, 0.0
        for action in row:
            if action.kind == FORWARD:
                alive += activations[action.stage]
                peak = max(peak, alive)
            elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
                alive -= activations[action.stage]
        peaks.append(sum(params[s] for s in program.stages_of(rank)) + peak)
    return tuple(peaks)


def table(
    rows: Sequence[Row], *, tokens: float | None, num_ranks: int, memory: float | None, devices_per_rank: int = 1
) -> str:
    """The rows as text: a summary per schedule, its split, and its peak memory per rank.

    ``tokens`` (per step of one pipeline) gives a throughput column: per rank, or per device
    when a rank has ``devices_per_rank > 1`` (tensor parallelism)."""
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
    header += [f"tokens/s/{'rank' if devices_per_rank == 1 else 'device'}"] if tokens is not None else []
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
        cells += [f"{tokens / row.step / num_ranks / devices_per_rank:,.0f}"] if tokens is not None else []
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


def tokens_per_step(model: Transformer, num_microbatches: int) -> float:
    """Tokens one step of the pipeline trains on."""
    return float(model.microbatch_size * model.sequence * num_microbatches)
