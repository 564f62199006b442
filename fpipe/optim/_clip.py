"""Gradient clipping by the global norm of every stage's gradients, on every rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._pytree import PyTree, leaves_with_names, map_tensors, stage_list, unflatten

Norm = Callable[[Sequence[PyTree]], torch.Tensor]
"""A norm function: one gradient pytree per stage to their global 2-norm (``step.global_norm``)."""


def clip_by_global_norm(
    grads: Sequence[PyTree],
    norm: Norm | torch.Tensor | float,
    /,
    *,
    max_norm: float,
    params: Sequence[PyTree] | None = None,
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
        params: with tied parameters (a name in several stages, as ``fpipe.split_module`` gives
            an embedding shared by the first and last stages), the parameters of *every* stage,
            as ``split_module`` returned them (only the names are read; as ``fpipe.sum_tied``'s
            ``params``). The norm function then gets ``grads`` with each tied name's gradient in
            its first stage only (``None`` in the others), so a tied gradient counts once, as
            ``clip_grad_norm_`` counts the unsplit model's one tensor; without ``params`` each
            copy counts. Needs a norm function.

    Returns:
        New gradients; ``grads`` is not modified.

    Examples:
        >>> import torch, fpipe
        >>> grads = [{"w": torch.tensor([3.0, 4.0])}]
        >>> fpipe.optim.clip_by_global_norm(grads, torch.tensor(5.0), max_norm=1.0)[0]["w"]
        tensor([0.6000, 0.8000])
        >>> norm = lambda grads: torch.linalg.vector_norm(grads[0]["w"])  # one process: step.global_norm
        >>> fpipe.optim.clip_by_global_norm(grads, norm, max_norm=1.0)[0]["w"]
        tensor([0.6000, 0.8000])
    """
    if params is not None:
        if not callable(norm):
            raise TypeError(
                f"fpipe.optim.clip_by_global_norm: params= needs a norm function, to leave the tied copies out of "
                f"the norm (norm: {type(norm).__name__}). Pass step.global_norm, not its value."
            )
        norm = norm(_first_copies(grads, params))
    elif callable(norm):
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


def _first_copies(grads: Sequence[PyTree], params: Sequence[PyTree]) -> list[PyTree]:
    """``grads`` with the leaves of names already held by an earlier stage of ``params`` (the
    copies of a tied parameter, NOTE [names] in ``fpipe/_saving/_save.py``) set to ``None``."""
    where = "fpipe.optim.clip_by_global_norm"
    stage_list(where, "grads", grads, fix="Pass the per-stage list that step(params, batch) returns.")
    fix = "Pass the parameters of every stage, as split_module returned them."
    stage_list(where, "params", params, len(grads), against="grads", fix=fix)
    seen: set[str] = set()
    out: list[PyTree] = []
    for stage_grads, stage_params in zip(grads, params):
        names = set() if stage_params is None else set(_names(leaves_with_names(stage_params).names))
        copies, seen = names & seen, seen | names
        if stage_grads is None or not copies:
            out.append(stage_grads)
            continue
        flat = leaves_with_names(stage_grads)
        out.append(unflatten(flat.spec, [None if n in copies else x for n, x in zip(_names(flat.names), flat.leaves)]))
    return out


def _names(parts: Sequence[tuple[str, ...]]) -> list[str]:
    """Leaves' names from their name parts (``leaves_with_names``): joined by ``.``, as ``fpipe.save`` names them."""
    return [".".join(p) for p in parts]
