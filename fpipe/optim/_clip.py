"""Gradient clipping by the global norm of every stage's gradients, on every rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._pytree import PyTree, map_tensors

Norm = Callable[[Sequence[PyTree]], torch.Tensor]
"""A norm function: one gradient pytree per stage to their global 2-norm (``step.global_norm``)."""


def clip_by_global_norm(
    grads: Sequence[PyTree], norm: Norm | torch.Tensor | float, /, *, max_norm: float
) -> list[PyTree]:
    """``grads`` scaled so that their global norm is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` scales.

    ``norm`` is a norm function, ``step.global_norm``, or the norm it returned,
    ``step.global_norm(grads)``: the norm of the whole pipeline's gradients, summed over the
    pipeline ranks and, with ``shard_params``, the data-parallel ranks, so every rank scales by
    the same factor. A clip is a function of the gradients and a norm function, not of a step
    (as optax's ``clip_by_global_norm`` is a transform). Conceptually::

        norm = norm(grads) if callable(norm) else norm
        scale = min(1, max_norm / (norm + 1e-6))
        return [tree_map(lambda g: g * scale, stage) for stage in grads]

    Args:
        grads: one gradient pytree per stage (``None`` for stages held elsewhere and for leaves
            without a gradient: kept as they are).
        norm: a norm function ``norm(grads) -> scalar`` (``step.global_norm``), or the global
            norm itself, a scalar tensor (or float).
        max_norm: the largest norm allowed.

    Returns:
        New gradients; ``grads`` is not modified.

    Example:
        >>> import torch, fpipe
        >>> grads = [{"w": torch.tensor([3.0, 4.0])}]
        >>> fpipe.optim.clip_by_global_norm(grads, torch.tensor(5.0), max_norm=1.0)[0]["w"]
        tensor([0.6000, 0.8000])
        >>> norm = lambda grads: torch.linalg.vector_norm(grads[0]["w"])  # one process: step.global_norm
        >>> fpipe.optim.clip_by_global_norm(grads, norm, max_norm=1.0)[0]["w"]
        tensor([0.6000, 0.8000])
    """
    if callable(norm):
        norm = norm(grads)
    if not isinstance(norm, torch.Tensor | float | int) or torch.as_tensor(norm).numel() != 1:
        raise TypeError(
            f"fpipe.optim.clip_by_global_norm: norm must be a scalar (norm: {norm!r}). "
            "Pass step.global_norm, or step.global_norm(grads)."
        )
    if not max_norm > 0:
        raise ValueError(
            f"fpipe.optim.clip_by_global_norm: max_norm must be positive (max_norm: {max_norm!r}). "
            "Leave out clipping to not clip."
        )
    scale = torch.clamp(max_norm / (torch.as_tensor(norm).reshape(()) + 1e-6), max=1.0)
    return [None if stage is None else map_tensors(lambda g: g * scale.to(g.device), stage) for stage in grads]
