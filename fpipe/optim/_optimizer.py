"""What every optimizer of ``fpipe.optim`` shares: its state's layout, the checks, pure and in-place updates.

NOTE [optimizer state]
The state mirrors the parameters: one entry per stage, ``None`` for the stages this rank does
not hold, and for a held stage a dict of a step counter and the buffers named as in
``torch.optim`` (AdamW ``exp_avg``, ``exp_avg_sq``; SGD ``momentum_buffer``), each a pytree of
the stage's parameters' structure::

    state[s] = {"step": tensor(3.), "exp_avg": {"w": t, "b": t}, "exp_avg_sq": {"w": t, "b": t}}

So ``fpipe.save(..., optimizer_state=state)`` names a buffer ``exp_avg.<parameter name>``; with
sharded parameters its leaves are 1-D shards of the parameter's shard size, which is how save
recognises them as shards and reshards them on load (NOTE [sharded saves] in
``fpipe/_saving/_store.py``). The step is one float32 scalar per stage, equal in every stage, which save
writes once. Non-tensor leaves of the parameters (``None``, strings) get ``None`` buffers.

NOTE [torch kernels]
The arithmetic is torch's own: an update gathers the leaves of every held stage into flat lists,
each parameter once (tied copies, one memory, through the first: NOTE [one tensor, one step] in
``fpipe/optim/_aliases.py``), and makes one call of ``torch.optim``'s functional entry point
(``torch.optim.adamw.adamw``, ``torch.optim.sgd.sgd``) per weight decay group, with
``foreach``/``fused`` passed through, so the result is what ``torch.optim.AdamW`` computes for
parameters with those gradients. Those kernels take one step counter per parameter and increment
it themselves; the state keeps one per stage, so each call gets a fresh copy per parameter, and
the stage's counter is incremented once after.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from .._plural import plural
from .._pytree import PyTree, TreeSpec, broadcast_prefix, flatten, leaves_with_paths, map_tensors, stage_list, unflatten
from ._aliases import Copies, Leaf, check_writes, tied_groups, view_key

LearningRate = float | Callable[[int], float]


class Optimizer(NamedTuple):
    """A functional optimizer over per-stage parameter pytrees (``fpipe.optim.adamw``, ``fpipe.optim.sgd``).

    Leaves of ``params`` that are one tensor (the same view of one memory: the copies of a tied
    parameter that ``fpipe.split_module`` gives several stages) are one parameter, as in
    ``torch.optim``: stepped once, with one state, after checking that their gradients (summed
    by ``fpipe.sum_tied``) are equal (NOTE [one tensor, one step] in ``fpipe/optim/_aliases.py``).

    Attributes:
        init: ``state = init(params)``: zero buffers shaped like ``params`` (one pytree per
            stage, ``None`` for stages held elsewhere; tied copies share one) and step counters at 0.
        update: ``params, state = update(params, grads, state, lr=None)``: new tensors (tied
            copies: one new tensor), the arguments untouched. ``lr`` overrides the optimizer's
            learning rate for this update.
        update_: ``update_(params, grads, state, lr=None)``: the same update written into the
            tensors of ``params`` and ``state`` (no copies: for memory); memory it would write
            twice (other overlapping views, a buffer shared by two parameters) is an error.
            Returns ``None``.
    """

    init: Callable[[Sequence[PyTree]], list[PyTree]]
    update: Callable[..., tuple[list[PyTree], list[PyTree]]]
    update_: Callable[..., None]


@dataclass
class Group:
    """The leaves of one weight decay group, over all held stages, as a ``Kernel`` takes them."""

    weight_decay: float
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    buffers: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    steps: list[torch.Tensor] = field(default_factory=list)


class Kernel(Protocol):
    """One in-place call of a ``torch.optim`` functional entry point on a group's flat lists."""

    def __call__(self, group: Group, *, lr: float) -> None: ...


def make_optimizer(
    name: str,
    buffers: tuple[str, ...],
    kernel: Kernel,
    learning_rate: LearningRate,
    weight_decay: float,
    weight_decay_mask: Sequence[PyTree] | None,
) -> Optimizer:
    """The ``Optimizer`` ``fpipe.optim.<name>``: ``init``, a pure ``update`` and an in-place
    ``update_``. What tells optimizers apart is their state's ``buffers`` and their ``kernel``."""
    where = f"fpipe.optim.{name}"

    def init(params: Sequence[PyTree], /) -> list[PyTree]:
        _check_sequence(where, "params", params)
        # Tied copies get one buffer (NOTE [one tensor, one step] in fpipe/optim/_aliases.py).
        zeros = {key: Copies(torch.zeros_like) for key in buffers}
        out: list[PyTree] = []
        for s, stage in enumerate(params):
            if stage is None:
                out.append(None)
                continue
            _, leaves, tree_spec = _param_leaves(where, s, stage)
            state: dict[str, PyTree] = {"step": torch.zeros((), dtype=torch.float32)}
            for key in buffers:
                state[key] = unflatten(
                    tree_spec, [zeros[key](x) if isinstance(x, torch.Tensor) else None for x in leaves]
                )
            out.append(state)
        return out

    def update_(
        params: Sequence[PyTree], grads: Sequence[PyTree], state: Sequence[PyTree], /, *, lr: float | None = None
    ) -> None:
        held = _held_stages(where, params, grads, state)
        counters = {s: _check_state_keys(where, s, state[s], buffers) for s in held}
        leaves: list[Leaf] = []
        for s in held:
            paths, p_leaves, p_spec = _param_leaves(where, s, params[s])
            g_leaves = _same_structure(where, f"grads[{s}]", paths, p_spec, grads[s])
            b_leaves = {
                key: _same_structure(where, f"state[{s}][{key!r}]", paths, p_spec, state[s][key]) for key in buffers
            }
            decay = _decay_mask(where, s, weight_decay_mask, params[s])
            for k, (path, p) in enumerate(zip(paths, p_leaves)):
                if not isinstance(p, torch.Tensor):
                    continue  # None, strings: nothing to optimize
                leaf = Leaf(s, path, p, _check_like(where, f"grads[{s}]{path}", p, g_leaves[k]), decay[k])
                for key in buffers:
                    leaf.buffers[key] = _check_like(where, leaf.name(key), p, b_leaves[key][k])
                leaves.append(leaf)
        tied = tied_groups(where, leaves, counters)
        check_writes(where, tied, counters)
        groups: dict[bool, Group] = {}
        for first, *_ in tied:  # a tied parameter once, through its first copy
            group = groups.setdefault(
                first.decay, Group(weight_decay if first.decay else 0.0, buffers={key: [] for key in buffers})
            )
            group.params.append(first.param)
            group.grads.append(first.grad)
            for key in buffers:
                group.buffers[key].append(first.buffers[key])
            group.steps.append(counters[first.stage].detach().clone())
        rate = _learning_rate(where, learning_rate, lr, held, state)
        with torch.no_grad():
            for group in groups.values():
                kernel(group, lr=rate)
            for first, *copies in tied:  # a state with a buffer per copy: keep them equal
                for copy in copies:
                    for key, buffer in copy.buffers.items():
                        if view_key(buffer) != view_key(first.buffers[key]):
                            buffer.copy_(first.buffers[key])
            for counter in {view_key(c): c for c in counters.values()}.values():  # a shared counter once
                counter.add_(1)

    def update(
        params: Sequence[PyTree], grads: Sequence[PyTree], state: Sequence[PyTree], /, *, lr: float | None = None
    ) -> tuple[list[PyTree], list[PyTree]]:
        _held_stages(where, params, grads, state)
        copy = Copies()  # one copy per memory: tied copies stay one tensor
        new_params = [None if p is None else map_tensors(copy, p) for p in params]
        new_state = [None if t is None else map_tensors(copy, t) for t in state]
        update_(new_params, grads, new_state, lr=lr)
        return new_params, new_state

    return Optimizer(init, update, update_)


_FIX = "Pass the per-stage list that step(params, batch) takes, None for stages held elsewhere."


def _check_sequence(where: str, name: str, value: object) -> None:
    stage_list(where, name, value, got=name, fix=_FIX)


def _held_stages(where: str, params: Sequence[PyTree], grads: Sequence[PyTree], state: Sequence[PyTree]) -> list[int]:
    """The stages this rank holds (``params[s]`` not ``None``), after checking the three lists agree."""
    _check_sequence(where, "params", params)
    for name, value in [("grads", grads), ("state", state)]:
        stage_list(where, name, value, len(params), against="params", got=name, fix=_FIX)
    held = [s for s, p in enumerate(params) if p is not None]
    for s in held:
        for name, value in [("grads", grads), ("state", state)]:
            if value[s] is None:
                fix = (
                    "Pass the grads step(params, batch) returned." if name == "grads" else "Build it with init(params)."
                )
                raise ValueError(f"{where}: stage {s} has parameters but no {name} ({name}[{s}]: None). {fix}")
    return held


def _param_leaves(where: str, s: int, stage: PyTree) -> tuple[list[str], list[object], TreeSpec]:
    """The stage's key paths, leaves and structure, after checking its tensors are floating point."""
    paths, leaves, spec = leaves_with_paths(stage)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{where}: stage {s} has a parameter that is not floating point (params[{s}]{path}: {leaf.dtype}). "
                "Keep integer and bool tensors out of the parameters you optimize (a buffer, a constant in the stage)."
            )
    return paths, leaves, spec


def _check_state_keys(where: str, s: int, stage_state: PyTree, buffers: tuple[str, ...]) -> torch.Tensor:
    """The stage's step counter, after checking the state's keys."""
    expected = {"step", *buffers}
    if not isinstance(stage_state, dict) or set(stage_state) != expected:
        found = sorted(stage_state) if isinstance(stage_state, dict) else type(stage_state).__name__
        raise ValueError(
            f"{where}: the state of stage {s} does not have the keys {sorted(expected)} (state[{s}]: {found}). "
            "Build the state with this optimizer's init(params)."
        )
    step = stage_state["step"]
    if not isinstance(step, torch.Tensor) or step.shape != ():
        raise ValueError(
            f"{where}: the step counter of stage {s} is not a scalar tensor (state[{s}]['step']: {step!r}). "
            "Build the state with this optimizer's init(params)."
        )
    if step.is_complex() or step.dtype == torch.bool or not (0 <= step.item() < math.inf) or step.item() % 1:
        raise ValueError(
            f"{where}: the step counter of stage {s} must be a whole number >= 0 (state[{s}]['step']: {step!r}). "
            "Build the state with this optimizer's init(params), or load a saved one."
        )
    return step


def _same_structure(where: str, name: str, paths: list[str], spec: object, tree: PyTree) -> list[object]:
    """The leaves of ``tree``, after checking it has the structure of the parameters (``spec``)."""
    other_paths, leaves, other_spec = leaves_with_paths(tree)
    if other_spec != spec:
        extra = sorted(set(other_paths) - set(paths))
        missing = sorted(set(paths) - set(other_paths))
        parts = [f"{what}: {found}" for what, found in [("not in params", extra), ("missing", missing)] if found]
        detail = "; ".join(parts) or f"{other_spec} != {spec}"
        raise ValueError(
            f"{where}: {name} does not have the structure of the parameters ({name}: {detail}). "
            "Pass gradients and state made for these parameters (a state from init(params), loaded with fpipe.load)."
        )
    return leaves


def _check_like(where: str, name: str, param: torch.Tensor, leaf: object) -> torch.Tensor:
    """``leaf`` after checking it is a tensor of ``param``'s shape and dtype."""
    if not isinstance(leaf, torch.Tensor) or leaf.shape != param.shape or leaf.dtype != param.dtype:
        found = f"{leaf.dtype} {list(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
        raise ValueError(
            f"{where}: {name} is not a tensor of its parameter's dtype and shape "
            f"({name}: {found}, parameter: {param.dtype} {list(param.shape)}). "
            "Pass gradients and state made for these parameters (sharded params take sharded grads and state)."
        )
    return leaf


def _decay_mask(where: str, s: int, mask: Sequence[PyTree] | None, stage_params: PyTree) -> list[bool]:
    """Whether each leaf of the stage's parameters gets weight decay (all of them without a mask)."""
    leaves = flatten(stage_params)[0]
    if mask is None:
        return [True] * len(leaves)
    if len(mask) <= s:
        raise ValueError(
            f"{where}: weight_decay_mask has no entry for stage {s} (weight_decay_mask: {plural(len(mask), 'entry')}). "
            "Pass one bool pytree per stage."
        )
    try:
        flags = broadcast_prefix(mask[s], stage_params)
    except ValueError as error:
        raise ValueError(
            f"{where}: weight_decay_mask[{s}] is not a prefix of the stage's parameters ({error}). "
            "Give a bool (or a tree of bools) for each parameter."
        ) from error
    if not all(isinstance(f, bool) for f in flags):
        raise TypeError(
            f"{where}: weight_decay_mask[{s}] has leaves that are not bools "
            f"(weight_decay_mask[{s}]: {mask[s]!r}). Use True for decay, False for none."
        )
    return flags


def _learning_rate(
    where: str, learning_rate: LearningRate, lr: float | None, held: list[int], state: Sequence[PyTree]
) -> float:
    """``lr`` if given, else the optimizer's rate, a schedule evaluated at the number of updates
    done; checked as ``torch.optim`` checks a rate (``check_rate``)."""
    if lr is not None:
        return check_rate(where, "lr", lr)
    if not callable(learning_rate):
        return learning_rate
    counts = {int(state[s]["step"]) for s in held}
    if len(counts) > 1:
        raise ValueError(
            f"{where}: the stages' step counters differ (steps: {sorted(counts)}), so the schedule has no single step. "
            "Update every stage together, or pass lr= explicitly."
        )
    step = counts.pop() if counts else 0
    return check_rate(where, f"learning_rate({step})", learning_rate(step))


def check_learning_rate(name: str, learning_rate: object) -> None:
    """Raise ``TypeError`` unless ``learning_rate`` is a number or a schedule (a callable), and
    ``ValueError`` for a number that is negative, nan or infinite (``check_rate``)."""
    if isinstance(learning_rate, bool) or not (isinstance(learning_rate, (int, float)) or callable(learning_rate)):
        raise TypeError(
            f"fpipe.optim.{name}: learning_rate must be a float or a function of the step "
            f"(learning_rate: {learning_rate!r}). Pass e.g. 1e-3 or fpipe.optim.warmup_cosine(...)."
        )
    if not callable(learning_rate):
        check_rate(f"fpipe.optim.{name}", "learning_rate", learning_rate)


def check_rate(where: str, name: str, rate: object) -> float:
    """``rate`` as a float, if it is a finite number >= 0 (``torch.optim`` refuses a negative or
    nan rate; an infinite one would make every parameter inf or nan).

    Raises:
        TypeError, ValueError: otherwise.
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"{where}: {name} must be a float ({name}: {rate!r}). Pass e.g. 1e-3.")
    if not 0 <= rate < math.inf:
        raise ValueError(f"{where}: {name} must be a finite number >= 0 ({name}: {rate!r}). Pass e.g. 1e-3.")
    return float(rate)


def check_options(where: str, options: dict[str, float], *, below_one: tuple[str, ...] = ()) -> None:
    """Check an optimizer's numeric options as ``torch.optim`` does: each a finite number >= 0,
    and those named in ``below_one`` (AdamW's betas) also < 1.

    Raises:
        TypeError: an option that is not a number.
        ValueError: one out of its range, naming it, its value and the range.
    """
    for name, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where}: {name} must be a float ({name}: {value!r}).")
        high = 1.0 if name in below_one else math.inf
        if not 0 <= value < high:
            needed = "in [0, 1)" if name in below_one else "a finite number >= 0"
            raise ValueError(f"{where}: {name} must be {needed}, as torch.optim requires ({name}: {value!r}).")
