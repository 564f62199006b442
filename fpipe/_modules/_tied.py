"""``fpipe.sum_tied``: add up the gradients of a parameter shared by several stages.

When one parameter is used by modules in different stages (tied input and output embeddings),
``fpipe.split_module`` gives each of those stages its own copy under the same name, and each
stage's gradient holds only its own uses. The gradient of the shared parameter is their sum::

    stage 0: {"embed.weight": g0, ...}         stage 0: {"embed.weight": g0 + g3, ...}
    stage 3: {"embed.weight": g3, ...}   ==>   stage 3: {"embed.weight": g0 + g3, ...}

After the sum, every copy holds the same gradient. ``fpipe.optim`` steps copies that are one
memory (``split_module``'s aliases, in one process or on one rank) once and copies in separate
processes alike, so the copies stay equal and equal the unsplit model's parameter under
``torch.optim``; an optimizer that stepped each leaf on its own would move aliased copies once
per copy (NOTE [one tensor, one step] in ``fpipe/optim/_aliases.py``).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._distributed import all_reduce_sum, resolve_topology
from .._errors import DEFAULT_TIMEOUT
from .._pytree import stage_list


def sum_tied(
    grads: Sequence[Mapping[str, torch.Tensor | None] | None],
    /,
    *,
    params: Sequence[Mapping[str, torch.Tensor]] | None = None,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[dict[str, torch.Tensor | None] | None]:
    """Sum the gradients of names that appear in several stages; every stage gets the sum.

    Args:
        grads: one dict per stage, as a step returns them for parameters from
            ``fpipe.split_module`` (``None`` for stages held by other ranks).
        params: the parameter dicts of *every* stage, as ``split_module`` returned them (only
            names, shapes and dtypes are read). Needed with ``group``; without it, the tied names
            are read from ``grads``.
        group: a ``torch.distributed`` process group whose ranks together hold every stage (the
            pipeline's group). Every rank of it must call ``sum_tied`` with its own ``grads``;
            the tied gradients are summed with one all-reduce per dtype, ranks holding no copy of
            a name contributing zeros. Without ``group``, all stages are summed in this process.
        timeout: with ``group``, seconds a rank waits for the others at each all-reduce before
            raising ``fpipe.PipelineTimeoutError`` (as ``fpipe.pipeline``'s ``timeout=``).

    Returns:
        A new list like ``grads``: the tied names' entries replaced by the sum over stages (in
        stage order in one process), each stage with its own tensor; other entries unchanged.
        Copies in different dtypes (a stage cast to float32) are added in their promoted dtype
        (``torch.promote_types``, read from ``params`` when given, so every rank agrees), and each
        stage gets the sum in its own gradient's dtype and on its own device. ``grads`` is not
        mutated.

    Conceptually, in one process::

        for name in names used by several stages:
            total = sum(grads[s][name] for s in stages using name)
            for s in stages using name: grads[s][name] = total.clone()

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        >>> model[1].weight = model[0].weight  # tied input and output embeddings
        >>> stages, params = fpipe.split_module(model, ["0", "1"])
        >>> list(params[1])  # the tied weight, under its first name
        ['0.weight']
        >>> step = fpipe.pipeline(lambda y, t: y.logsumexp(-1).mean(), stages, fpipe.schedules.GPipe(2))
        >>> loss, grads = step(params, torch.tensor([[1, 2], [3, 4]]))
        >>> grads = fpipe.sum_tied(grads)  # each copy: stage 0's part + stage 1's part
        >>> torch.equal(grads[0]["0.weight"], grads[1]["0.weight"])
        True

    Raises:
        TypeError: if ``grads`` or ``params`` is not a list, or a stage's gradients are not a dict.
        ValueError: if ``group`` is given without ``params``, the lengths disagree, or the copies
            of a tied name disagree in shape.
    """
    stage_list("fpipe.sum_tied", "grads", grads, each="dict")
    for s, g in enumerate(grads):
        if g is not None and not isinstance(g, Mapping):
            raise TypeError(
                f"fpipe.sum_tied: the gradients of stage {s} are a {type(g).__name__}, not a dict from parameter "
                "names to tensors. sum_tied works on stages built by fpipe.split_module."
            )
    layout: Sequence[Mapping[str, Any] | None] = grads if params is None else params
    if params is not None:
        fix = "Pass the parameters of every stage, as split_module returned them."
        stage_list("fpipe.sum_tied", "params", params, len(grads), against="grads", each="dict", fix=fix)
    if group is not None and params is None:
        raise ValueError(
            "fpipe.sum_tied: with group=, pass params= (every stage's parameters as split_module returned them), "
            "so each rank knows which names are tied without seeing the other ranks' gradients."
        )
    holders: dict[str, list[int]] = defaultdict(list)
    for s, tree in enumerate(layout):
        for name in tree or {}:
            holders[name].append(s)
    tied = {name: stages for name, stages in holders.items() if len(stages) > 1}
    result: list[dict[str, torch.Tensor | None] | None] = [None if g is None else dict(g) for g in grads]
    if not tied:
        return result
    totals = _local_sums(tied, result, layout)
    if group is not None:  # the tied names' order, from the same params, is the same on every rank
        topology = resolve_topology(None, group)
        assert topology is not None
        all_reduce_sum(topology, group, list(totals.values()), timeout, "the other ranks' tied gradients")
    for name, total in totals.items():
        for s in tied[name]:
            entry = result[s]
            if entry is not None and (own := entry.get(name)) is not None:
                entry[name] = total.to(device=own.device, dtype=own.dtype, copy=True)
    return result


def _local_sums(
    tied: dict[str, list[int]],
    grads: list[dict[str, torch.Tensor | None] | None],
    layout: Sequence[Mapping[str, Any] | None],
) -> dict[str, torch.Tensor]:
    """Per tied name, the sum of this process's copies in stage order (zeros when it has none).

    The sum is in the promoted dtype of the copies in ``layout``, the same on every rank. A name
    whose copies are all ``None`` (in ``grads`` without ``params``) has nothing to sum.
    """
    totals: dict[str, torch.Tensor] = {}
    for name, stages in tied.items():
        copies = [(s, t) for s in stages if (held := layout[s]) is not None and (t := held.get(name)) is not None]
        parts = [(s, g) for s in stages if (tree := grads[s]) is not None and (g := tree.get(name)) is not None]
        shapes = sorted({(s, tuple(t.shape)) for s, t in [*copies, *parts]})
        if len({shape for _, shape in shapes}) > 1:
            listing = ", ".join(f"stage {s}: {shape}" for s, shape in shapes)
            raise ValueError(
                f"fpipe.sum_tied: the copies of {name!r} disagree in shape ({listing}), so they are not one "
                "tied parameter. Give different parameters different names, as split_module does."
            )
        if not copies:
            continue
        dtype = functools.reduce(torch.promote_types, (t.dtype for _, t in copies))
        if parts:
            total = parts[0][1].to(dtype=dtype, copy=True)
            for _, g in parts[1:]:
                total += g.to(device=total.device, dtype=dtype)
        else:
            total = torch.zeros(copies[0][1].shape, dtype=dtype)
        totals[name] = total
    return totals
