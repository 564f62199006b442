"""``fpipe.Precision``: the dtypes a step computes in, sums gradients in and returns them in, and
dynamic loss scaling for float16 (``fpipe.LossScale``). notes/precision.md explains the choices.

NOTE [precision of a leaf]
For every real floating parameter leaf of dtype ``p`` (what the caller passes: master weights,
or the parameters themselves), a policy fixes three dtypes:

    compute     c = policy.compute or p            what the stage sees (cast once per step)
    accumulate  a = c if c is wider than policy.accumulate, else policy.accumulate
                                                   what the microbatch sum is kept in
    returned    g = policy.grads or p              what the step returns

Gradients are taken with respect to the compute copy (the cast is not differentiated: the
gradient of a float32 master weight is that of its bfloat16 copy), each microbatch's gradient
comes out of the backward in ``c``, is added to the sum in ``a`` in microbatch order, the sum is
averaged over data-parallel replicas (or reduce-scattered) in ``a``, unscaled, and cast to ``g``
once at the end. Complex leaves keep their dtype throughout; integer and bool leaves (step
counters, position tables) pass through as without a policy, uncast and without a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._pytree import PyTree, flatten, leaves_with_paths, unflatten
from ._tensor_parallel import local

FLOAT8 = frozenset(  # torch's 8-bit floating dtypes
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling for float16 compute: the policy (its state is a ``LossScaleState``).

    Each step seeds the backward with ``scale`` times the loss weight, so that small float16
    gradients do not flush to zero, and divides the summed gradients by ``scale`` before
    returning them. If any gradient of any stage on any rank is ``inf`` or ``nan``, every rank
    reports the step as skipped (``step.last_skipped``) and the scale is multiplied by
    ``backoff``; after ``interval`` steps in a row without one it is multiplied by ``growth``.
    The same rule as ``torch.amp.GradScaler``.

    Attributes:
        init: the first scale (a power of two keeps the scaling exact).
        growth: the factor applied after ``interval`` good steps in a row (> 1).
        backoff: the factor applied after a skipped step (in (0, 1)).
        interval: how many good steps in a row before the scale grows (>= 1).
    """

    init: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    def __post_init__(self) -> None:
        checks = [
            ("init", self.init, _positive_number(self.init), "a positive finite number"),
            ("growth", self.growth, _positive_number(self.growth) and self.growth > 1, "a number > 1"),
            ("backoff", self.backoff, _positive_number(self.backoff) and self.backoff < 1, "a number in (0, 1)"),
            ("interval", self.interval, _int_at_least(self.interval, 1), "an int >= 1"),
        ]
        for name, value, ok, wanted in checks:
            if not ok:
                raise ValueError(f"fpipe.LossScale: {name} must be {wanted} ({name}: {value!r}).")

    def start(self) -> LossScaleState:
        """The state of a step that has not run yet: ``init``, no good steps."""
        return LossScaleState(float(self.init), 0)

    def update(self, state: LossScaleState, skipped: bool) -> LossScaleState:
        """The state after a step that was (or was not) skipped."""
        if skipped:
            return LossScaleState(state.scale * self.backoff, 0)
        if state.good_steps + 1 >= self.interval:
            return LossScaleState(state.scale * self.growth, 0)
        return LossScaleState(state.scale, state.good_steps + 1)


@dataclass(frozen=True)
class LossScaleState:
    """Where dynamic loss scaling stands: a plain value, saved and restored as ``step.loss_scale``.

    Attributes:
        scale: the factor the next step's backward is seeded with.
        good_steps: steps in a row without ``inf``/``nan`` since the scale last changed.
    """

    scale: float
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not _positive_number(self.scale):
            raise ValueError(f"fpipe.LossScaleState: scale must be a positive finite number (scale: {self.scale!r}).")
        if not _int_at_least(self.good_steps, 0):
            raise ValueError(f"fpipe.LossScaleState: good_steps must be an int >= 0 (good_steps: {self.good_steps!r}).")


@dataclass(frozen=True)
class Precision:
    """The dtypes of a step: ``pipeline(..., precision=fpipe.Precision(...))``.

    NOTE [precision of a leaf] in ``fpipe/_precision.py`` gives the rule for each parameter leaf.

    Attributes:
        compute: the dtype stages see their floating parameters in (``None``: the parameters'
            own). With float32 parameters and ``compute=torch.bfloat16`` (or float16) the
            parameters are master weights: each step casts them once to ``compute``, and the
            gradients are returned in float32, shaped like them.
        accumulate: the dtype per-microbatch gradients are summed in (default float32); a
            parameter computed in a wider dtype (float64) keeps its own. Gradients are averaged
            over data-parallel replicas (or reduce-scattered) in it too.
        grads: the dtype of the returned gradients (``None``: each parameter's own dtype, as
            passed). Complex leaves keep theirs.
        loss_scale: dynamic loss scaling (``fpipe.LossScale()``), for float16 compute only.

    Examples:
        >>> import torch, fpipe
        >>> policy = fpipe.Precision(compute=torch.bfloat16, accumulate=torch.float32)
        >>> policy.accumulate
        torch.float32

    Raises:
        TypeError: if a dtype field is not a ``torch.dtype`` or ``loss_scale`` not a ``LossScale``.
        ValueError: if a dtype is not a real floating dtype, float8 compute is summed in a dtype
            narrower than float32, a float8 dtype is asked for the sum or the returned grads, or
            ``loss_scale`` is given with a ``compute`` other than float16.
    """

    compute: torch.dtype | None = None
    accumulate: torch.dtype = torch.float32
    grads: torch.dtype | None = None
    loss_scale: LossScale | None = None

    def __post_init__(self) -> None:
        for name in ("compute", "accumulate", "grads"):
            value = getattr(self, name)
            if value is None and name != "accumulate":
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(f"fpipe.Precision: {name} must be a torch.dtype ({name}: {value!r}).")
            if not value.is_floating_point:
                raise ValueError(
                    f"fpipe.Precision: {name} must be a real floating dtype; gradients of {value} parameters "
                    f"do not exist ({name}: {value}). Use e.g. torch.bfloat16 or torch.float32."
                )
        for name in ("accumulate", "grads"):
            value = getattr(self, name)
            if value in FLOAT8:
                raise ValueError(
                    f"fpipe.Precision: {name} cannot be a float8 dtype ({name}: {value}). Use torch.float32."
                )
        if self.compute in FLOAT8 and self.accumulate.itemsize < 4:
            raise ValueError(
                f"fpipe.Precision: float8 compute needs gradients summed in float32 or wider "
                f"(compute: {self.compute}, accumulate: {self.accumulate}). Use accumulate=torch.float32."
            )
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScale):
            raise TypeError(
                f"fpipe.Precision: loss_scale must be an fpipe.LossScale (loss_scale: {self.loss_scale!r})."
            )
        if self.loss_scale is not None and self.compute not in (None, torch.float16):
            raise ValueError(
                f"fpipe.Precision: loss scaling is for float16 compute (compute: {self.compute}). "
                "Use compute=torch.float16, or drop loss_scale (bfloat16 has float32's range and needs none)."
            )

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter leaf of ``dtype`` is computed in."""
        return self.compute if self.compute is not None and dtype.is_floating_point else dtype

    def accumulate_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradients of a parameter leaf of ``dtype`` are summed in."""
        c = self.compute_dtype(dtype)
        return self.accumulate if c.is_floating_point and c.itemsize <= self.accumulate.itemsize else c

    def grads_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient of a parameter leaf of ``dtype`` is returned in."""
        return self.grads if self.grads is not None and dtype.is_floating_point else dtype


def check_params(precision: Precision, stage: int, stage_params: PyTree) -> None:
    """Raise ``ValueError`` if ``stage_params`` (as passed: master weights, or shards of them)
    cannot run under ``precision``, naming the stage and the leaf's key path."""
    paths, leaves, _ = leaves_with_paths(stage_params)
    for path, leaf in zip(paths, leaves):
        if not (isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point):
            continue
        c = precision.compute_dtype(leaf.dtype)
        if c in FLOAT8 and precision.accumulate_dtype(leaf.dtype).itemsize < 4:
            raise ValueError(
                f"fpipe.step: stage {stage}'s parameter {path} is {c}, whose gradients must be summed in "
                f"float32 or wider (params[{stage}]{path}: {leaf.dtype}; accumulate: {precision.accumulate}). "
                "Use fpipe.Precision(accumulate=torch.float32)."
            )
        if precision.loss_scale is not None and c != torch.float16:
            raise ValueError(
                f"fpipe.step: loss scaling is for float16 parameters, but stage {stage}'s parameter {path} is "
                f"computed in {c} (params[{stage}]{path}: {leaf.dtype}). Pass float16 parameters, or "
                "Precision(compute=torch.float16) with float32 master weights, or drop loss_scale."
            )


class CastGrads(NamedTuple):
    """What ``unscale_and_cast`` returns."""

    grads: list[PyTree]  # the returned gradients, one pytree per stage
    found_inf_nan: bool  # whether any of this rank's is ``inf`` or ``nan`` (looked for only with a scale)


class Unscaled(NamedTuple):
    """What ``unscale`` (and ``Strategy.unscale``) returns."""

    grads: list[PyTree]  # the returned gradients, one pytree per stage
    loss_scale: LossScaleState | None  # the next loss scaling state (``None`` without loss scaling)
    skipped: bool  # whether the step is skipped: some rank found an ``inf`` or ``nan``


def unscale_and_cast(
    precision: Precision,
    params: Sequence[PyTree],
    grads: list[PyTree],
    local_stages: Sequence[int],
    scale: float | None,
) -> CastGrads:
    """The returned gradients: the sums (in the accumulation dtype) divided by ``scale`` and cast
    to the returned dtype, and whether any of this rank's is ``inf`` or ``nan`` (only looked for
    with a ``scale``). For a DTensor gradient only this rank's local piece is looked at: the
    caller agrees with the other tensor-parallel ranks (NOTE [an agreed inf/nan check] in
    fpipe/_distributed/_collectives.py)."""
    found = False
    out = list(grads)
    for s in local_stages:
        if grads[s] is None:
            continue
        leaves, spec = flatten(grads[s])
        done: list[torch.Tensor | None] = []
        for p, g in zip(flatten(params[s])[0], leaves):
            if g is not None:
                g = (g if scale is None else g / scale).to(precision.grads_dtype(p.dtype))
                found = found or (scale is not None and not bool(torch.isfinite(local(g)).all()))
            done.append(g)
        out[s] = unflatten(spec, done)
    return CastGrads(out, found)


def unscale(
    precision: Precision,
    params: Sequence[PyTree],
    grads: list[PyTree],
    local_stages: Sequence[int],
    state: LossScaleState | None,
    agree: Callable[[bool], bool],
) -> Unscaled:
    """The returned gradients, the next loss scaling state and whether the step is skipped.

    The summed gradients are unscaled and cast (``unscale_and_cast``); under loss scaling (``state``
    given), ``agree(found)`` turns this rank's ``inf``/``nan`` finding into every rank's (NOTE [an
    agreed inf/nan check]; in one process it is the finding itself) and the state moves by the
    policy's rule. The state is returned, not kept: the caller holds it (``step.loss_scale``).
    """
    scaling = precision.loss_scale
    grads, found = unscale_and_cast(precision, params, grads, local_stages, None if state is None else state.scale)
    if state is None or scaling is None:
        return Unscaled(grads, state, False)
    skipped = agree(found)
    return Unscaled(grads, scaling.update(state, skipped), skipped)


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
