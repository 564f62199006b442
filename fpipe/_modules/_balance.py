"""``fpipe.balance``: choose contiguous split points that even out the stages' costs.

A pipeline runs at the pace of its slowest stage, so the layers ``0..n-1`` are cut into
``num_stages`` contiguous runs minimizing the largest run's cost (``fpipe.planning.partition``),
or, given a schedule, minimizing the simulated step time (``fpipe.planning.split_for``). This
module is the adapter: it turns layers (modules or costs, in a list or by name) into costs and
the chosen runs back into indices or names.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any, Literal, overload

import torch
from torch import nn

from .._plural import brief
from .._pytree import flatten, is_differentiable, map_tensors
from ..planning import partition, split_for
from ..schedules import Costs, Schedule
from ._split import Adapter, adapter_map, lookup

Containers = nn.Sequential | nn.ModuleList | nn.ModuleDict
Layers = Sequence[nn.Module] | Sequence[float] | Mapping[str, nn.Module] | Mapping[str, float] | Containers


@overload
def balance(
    layers: Sequence[nn.Module] | Sequence[float],
    num_stages: int,
    /,
    *,
    by: Literal["params", "time"] = ...,
    sample_input: Any = ...,
    call: Adapter | Mapping[str, Adapter] | None = ...,
    repeats: int = ...,
    schedule: Schedule | None = ...,
    num_ranks: int | None = ...,
    backward: Sequence[float] | None = ...,
    send: float = ...,
) -> list[range]: ...


@overload
def balance(
    layers: Mapping[str, nn.Module] | Mapping[str, float] | Containers,
    num_stages: int,
    /,
    *,
    by: Literal["params", "time"] = ...,
    sample_input: Any = ...,
    call: Adapter | Mapping[str, Adapter] | None = ...,
    repeats: int = ...,
    schedule: Schedule | None = ...,
    num_ranks: int | None = ...,
    backward: Sequence[float] | None = ...,
    send: float = ...,
) -> list[list[str]]: ...


def balance(
    layers: Layers,
    num_stages: int,
    /,
    *,
    by: Literal["params", "time"] = "params",
    sample_input: Any = None,
    call: Adapter | Mapping[str, Adapter] | None = None,
    repeats: int = 3,
    schedule: Schedule | None = None,
    num_ranks: int | None = None,
    backward: Sequence[float] | None = None,
    send: float = 0.0,
) -> list[range] | list[list[str]]:
    """Cut ``layers`` into ``num_stages`` contiguous stages minimizing the costliest stage, or,
    given a ``schedule``, its simulated step time.

    With a schedule, each layer's cost is its forward ``F`` and its backward costs ``2F``
    (``backward=`` gives them), split into equal ``I`` and ``W`` for schedules that split it;
    every message between ranks takes ``send``. The split minimizes
    ``fpipe.schedules.simulate(schedule.program(num_stages, num_ranks), stage_costs).makespan``:
    exactly when there are at most 20,000 splits, else by a local search from the min-max split
    that never does worse (NOTE [schedule-aware split] in ``fpipe/planning/_schedule_split.py``).
    ``by="time"`` measures a layer's forward and backward together: the time counts as ``3F``.

    Args:
        layers: the layers in order: modules, or their costs as non-negative numbers. A list
            gives ``range``s of indices; a dict from names to modules or costs gives lists of
            names, ready for ``fpipe.split_module``; an ``nn.Sequential``, ``nn.ModuleList`` or
            ``nn.ModuleDict`` gives lists of its children's names (``"0"``, ``"1"``, ...), ready
            for ``fpipe.split_module`` of that module itself.
        num_stages: how many stages; at most ``len(layers)`` (no stage is empty).
        by: how modules are costed. ``"params"``: the number of trainable parameter elements.
            ``"time"``: the median wall time of a forward and a backward of each layer on
            ``sample_input``, chained (each layer gets the previous one's output), after one
            warm-up run. The layers' ``.grad``, buffers (BatchNorm statistics) and the random
            state are as they were before. Ignored when costs are given.
        sample_input: the first layer's input, for ``by="time"``.
        call: for ``by="time"``, how each layer is called, as in ``fpipe.split_module``: an
            adapter ``call(module, x) -> x`` or a dict of adapters keyed by layer name (a list's
            layers are named ``"0"``, ``"1"``, ...). Default ``module(x)``.
        repeats: timed runs per layer for ``by="time"``.
        schedule: the schedule whose simulated step time the split minimizes (``None``: the
            costliest stage), e.g. ``fpipe.schedules.OneFOneB(8)``.
        num_ranks: with a schedule, the ranks its program lays the stages on (``None``: the
            schedule's default).
        backward: with a schedule, each layer's backward cost, in the order of ``layers``
            (default: twice its forward cost).
        send: with a schedule, the latency of a message between ranks, in the costs' unit.

    Returns:
        One entry per stage: ``range(start, stop)`` for a list, a list of names for a dict.

    Examples:
        >>> fpipe.balance([1, 1, 1, 1, 4], 2)
        [range(0, 4), range(4, 5)]
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> fpipe.balance(model, 2)
        [['0', '1'], ['2']]
        >>> stages, params = fpipe.split_module(model, fpipe.balance(model, 2))  # names split_module takes
        >>> [sorted(p) for p in params]
        [['0.bias', '0.weight'], ['2.bias', '2.weight']]
        >>> costs = [8, 11, 2, 1, 18, 5, 4, 11]  # torch's test_partition; a heavy stage is cheapest first
        >>> fpipe.balance(costs, 4)
        [range(0, 1), range(1, 4), range(4, 5), range(5, 8)]
        >>> fpipe.balance(costs, 4, schedule=fpipe.schedules.OneFOneB(8))  # 573 against 600 above
        [range(0, 3), range(3, 5), range(5, 6), range(6, 8)]

    Raises:
        TypeError: for layers that are neither modules nor numbers, a bad ``by``, or a ``schedule``
            that is not a schedule value (a class such as ``OneFOneB``, a name).
        ValueError: for negative or non-finite costs, more stages than layers, a missing
            ``sample_input`` or ``repeats < 1``; with a schedule, for costs that are not
            positive, a ``backward`` of another length, a negative ``send``, or schedule
            options without a schedule.
        ScheduleError: a ``ValueError`` too: for a schedule that cannot lay out the stages.
    """
    if isinstance(layers, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        layers = dict(layers.named_children())  # names, as split_module of the container takes them
    names = list(layers) if isinstance(layers, Mapping) else [str(i) for i in range(len(layers))]
    items = list(layers.values()) if isinstance(layers, Mapping) else list(layers)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= len(items):
        raise ValueError(
            f"fpipe.balance: num_stages must be between 1 and the number of layers, {len(items)} "
            f"(num_stages: {num_stages!r}). Every stage needs at least one layer."
        )
    if by not in ("params", "time"):
        raise TypeError(f'fpipe.balance: by must be "params" or "time" (by: {brief(by)}). Pass one of the two.')
    if isinstance(schedule, type):
        raise TypeError(
            f"fpipe.balance: schedule is the class {schedule.__name__}, not a schedule (schedule: {brief(schedule)}). "
            f"Call it with the number of microbatches, e.g. schedule={schedule.__name__}(num_microbatches=8)."
        )
    if schedule is not None and not callable(getattr(schedule, "program", None)):
        raise TypeError(
            f"fpipe.balance: schedule must be a schedule value such as OneFOneB(num_microbatches=8) "
            f"(schedule: {brief(schedule)}). Pass one from fpipe.schedules, or None to even out the stages' costs."
        )
    if all(isinstance(c, Real) and not isinstance(c, bool) for c in items):
        costs = [float(c) for c in items]  # type: ignore[arg-type]
    elif all(isinstance(m, nn.Module) for m in items):
        modules: list[nn.Module] = items  # type: ignore[assignment]
        if by == "params":
            costs = [float(sum(p.numel() for p in m.parameters() if p.requires_grad)) for m in modules]
        else:
            costs = _times(names, modules, sample_input, adapter_map("balance", call), repeats)
    else:
        kinds = sorted({type(c).__name__ for c in items})
        raise TypeError(f"fpipe.balance: layers must be all modules or all numbers (got: {', '.join(kinds)}).")
    for name, c in zip(names, costs):
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"fpipe.balance: the cost of layer {name!r} is {c}; costs must be finite and >= 0.")
    if schedule is None:
        if num_ranks is not None or backward is not None or send != 0.0:
            raise ValueError(
                "fpipe.balance: num_ranks, backward and send describe a schedule's step "
                f"(num_ranks: {num_ranks!r}, backward: {backward!r}, send: {send!r}). Pass schedule= too."
            )
        bounds = partition(costs, num_stages)
    else:
        if by == "time" and not all(isinstance(c, Real) for c in items):
            costs = [c / 3 for c in costs]  # a measured forward and backward: F + 2F
        program = schedule.program(num_stages, num_ranks)
        bounds = split_for(program, _layer_costs(names, costs, backward, send))
    if isinstance(layers, Mapping):
        return [names[r.start : r.stop] for r in bounds]
    return bounds


def _layer_costs(names: list[str], forward: list[float], backward: Sequence[float] | None, send: float) -> list[Costs]:
    """Each layer's ``Costs`` for the schedule-aware split, or an error naming the layer."""
    if backward is None:
        backward = [2 * c for c in forward]
    elif isinstance(backward, (str, bytes)) or not isinstance(backward, Sequence) or len(backward) != len(forward):
        raise ValueError(
            f"fpipe.balance: backward must be a list of one cost per layer (layers: {len(forward)}, "
            f"backward: {backward!r})."
        )
    if isinstance(send, bool) or not isinstance(send, Real) or not (math.isfinite(send) and send >= 0):
        raise ValueError(f"fpipe.balance: send must be a finite number >= 0 (send: {send!r}).")
    layers = []
    for name, f, b in zip(names, forward, backward):
        ok = all(isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in (f, b))
        if not ok:
            raise ValueError(
                f"fpipe.balance: with a schedule, every cost must be a finite number > 0 (layer {name!r}: "
                f"forward {f!r}, backward {b!r}). Give a layer without work a small cost, or merge it into a neighbor."
            )
        layers.append(Costs(forward=f, backward_input=b / 2, backward_weight=b / 2, backward=b, send=float(send)))
    return layers


def _times(
    names: list[str], modules: list[nn.Module], sample_input: Any, adapters: Mapping[str, Adapter], repeats: int
) -> list[float]:
    """Median seconds of a forward and backward of each layer, chained from ``sample_input``."""
    if sample_input is None:
        raise ValueError('fpipe.balance: by="time" needs sample_input=, the first layer\'s input (e.g. one batch).')
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"fpipe.balance: repeats must be a positive int (repeats: {repeats!r}).")
    x, costs = sample_input, []
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [t for t in flatten(sample_input)[0] if isinstance(t, torch.Tensor)]
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):  # a timing run's dropout draws no numbers of the user's
        for name, module in zip(names, modules):
            adapter = lookup(adapters, name)
            saved = [(b, b.clone()) for b in module.buffers()]  # a timing run is no training step
            runs = [_run(adapter, module, x) for _ in range(repeats + 1)]
            with torch.no_grad():
                for b, before in saved:
                    b.copy_(before)
            costs.append(statistics.median(seconds for seconds, _ in runs[1:]))
            x = runs[-1][1]
    return costs


def _run(adapter: Adapter, module: nn.Module, x: Any) -> tuple[float, Any]:
    """One timed forward and backward of ``adapter(module, x)``; returns the seconds and the output."""
    x = map_tensors(lambda t: t.detach().requires_grad_() if is_differentiable(t) else t, x)
    inputs = [t for t in flatten(x)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs += [p for p in module.parameters() if p.requires_grad]
    _synchronize(inputs)
    start = time.perf_counter()
    with torch.enable_grad():
        y = adapter(module, x)
    outputs = [t for t in flatten(y)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if outputs and inputs:  # autograd.grad, not backward: the modules' .grad stay untouched
        torch.autograd.grad(outputs, inputs, [torch.ones_like(t) for t in outputs], allow_unused=True)
    _synchronize(outputs)
    return time.perf_counter() - start, map_tensors(lambda t: t.detach(), y)


def _synchronize(tensors: Sequence[torch.Tensor]) -> None:
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
