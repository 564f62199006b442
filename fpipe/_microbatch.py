"""Splitting a batch pytree into microbatches, and gathering per-microbatch results back.

Each tensor leaf is split along its batch dimension (``batch_dims``: an int for every leaf, or a
prefix pytree of ints and ``None``; ``None`` passes the leaf whole to every microbatch, e.g. a RoPE
table). Non-tensor leaves always pass whole. ``torch.tensor_split`` gives sizes that differ by at
most one, larger first: 10 examples in 4 microbatches are 3, 3, 2, 2. Pieces are views of the
detached input where they are contiguous, else contiguous copies (as the wire would deliver them
to the last stage: NOTE [boundary layout] in fpipe/_stage.py); no user tensor is mutated or made
part of a graph.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._plural import plural
from ._pytree import PyTree, boundary_layout, broadcast_prefix, detached, flatten, leaves_with_paths, unflatten


class Microbatches:
    """A batch given as its microbatches, for ``step`` and ``step.evaluate`` to take as they are.

    ``step(params, fpipe.Microbatches([mb0, mb1, ...]))`` runs microbatch ``i`` as given, instead
    of cutting a batch with ``torch.tensor_split``: their shapes may differ (packed sequences of
    different lengths, bucketed batches), and there must be as many as the schedule has. Each
    counts by its number of examples (the size of its leaves along ``batch_dims``), or by
    ``weight_fn`` when the pipeline has one; ``step.evaluate(..., outputs=True)`` returns their
    outputs as a list, one per microbatch.

    Examples:
        >>> import torch, fpipe
        >>> batch = fpipe.Microbatches([torch.zeros(2, 5), torch.zeros(3, 7)])  # two lengths
        >>> len(batch)
        2
    """

    def __init__(self, microbatches: Sequence[PyTree], /) -> None:
        if isinstance(microbatches, (str, bytes)) or not isinstance(microbatches, Sequence) or not microbatches:
            raise TypeError(
                f"fpipe.Microbatches: give a non-empty list of microbatch pytrees (got: {type(microbatches).__name__})."
            )
        self.microbatches = tuple(microbatches)

    def __len__(self) -> int:
        return len(self.microbatches)

    def __repr__(self) -> str:
        return f"fpipe.Microbatches({plural(len(self), 'microbatch')})"


def split(batch: PyTree, num_microbatches: int, batch_dims: PyTree) -> tuple[list[PyTree], list[int]]:
    """Split ``batch`` into ``num_microbatches`` pytrees of the same structure, and their sizes;
    a ``Microbatches`` batch is taken as it is (each microbatch checked and laid out alone).

    Raises:
        ValueError: if ``batch_dims`` is not a prefix of ``batch``, a dim is out of range, the
            split leaves disagree on the batch size (listed by size and key path), the batch
            is smaller than ``num_microbatches``, or ``Microbatches`` are not as many.
    """
    if isinstance(batch, Microbatches):
        if len(batch) != num_microbatches:
            raise ValueError(
                f"fpipe.step: the batch has {plural(len(batch), 'microbatch')} but the schedule runs "
                f"{num_microbatches} "
                f"(len(batch): {len(batch)}). Give fpipe.Microbatches one microbatch per microbatch of the schedule."
            )
        each = [split(mb, 1, batch_dims) for mb in batch.microbatches]
        return [mbs[0] for mbs, _ in each], [sizes[0] for _, sizes in each]
    leaves, spec = flatten(batch)  # key paths only for an error (``_paths``): they cost more than the split
    try:
        # One int (or None) for every leaf, the default, needs no matching against the batch.
        one = batch_dims is None or type(batch_dims) is int
        dims = [batch_dims] * len(leaves) if one else broadcast_prefix(batch_dims, batch)
    except ValueError as error:
        raise ValueError(
            f"fpipe.step: batch_dims does not match the batch structure ({error}). Give one int "
            "(or None) for the whole batch, or a prefix pytree of the batch with an int or None per subtree."
        ) from None
    by_size: dict[int, list[int]] = defaultdict(list)  # leaf indices by size along their dim
    split_dims: list[int | None] = []
    for k, (leaf, dim) in enumerate(zip(leaves, dims)):
        if dim is None or not isinstance(leaf, torch.Tensor):
            split_dims.append(None)
            continue
        if isinstance(dim, bool) or not isinstance(dim, int) or not -leaf.dim() <= dim < leaf.dim():
            raise ValueError(
                f"fpipe.step: cannot split batch leaf {_paths(batch)[k]} of shape {tuple(leaf.shape)} along "
                f"dim {dim!r}. Give a dim in range for it in batch_dims, or None to pass it whole."
            )
        split_dims.append(dim % leaf.dim())
        by_size[leaf.shape[dim]].append(k)
    # Detached; leaves passed whole laid out as the wire delivers them here, split ones piece by
    # piece below (NOTE [boundary layout] in fpipe/_stage.py), so no leaf is copied twice.
    leaves = [
        (boundary_layout(detached(leaf)) if d is None else detached(leaf)) if isinstance(leaf, torch.Tensor) else leaf
        for leaf, d in zip(leaves, split_dims)
    ]
    if not by_size:
        if num_microbatches == 1:  # passed whole, but detached like any piece (inference tensors copied)
            return [unflatten(spec, leaves)], [1]
        raise ValueError(
            f"fpipe.step: no tensor leaf of the batch is split, so it cannot be cut into "
            f"{plural(num_microbatches, 'microbatch')} (batch_dims: {batch_dims!r}). "
            "Give a batch dim for at least one tensor leaf."
        )
    if len(by_size) > 1:
        paths = _paths(batch)
        listing = "; ".join(f"size {n}: {', '.join(paths[k] for k in ks)}" for n, ks in sorted(by_size.items()))
        raise ValueError(
            f"fpipe.step: batch leaves disagree on the batch size along their batch_dims ({listing}). "
            "Make them agree, or set batch_dims to None for leaves that are not batched."
        )
    ((size, sized),) = by_size.items()
    if size < num_microbatches:
        paths = _paths(batch)
        raise ValueError(
            f"fpipe.step: a batch of {size} cannot be split into {plural(num_microbatches, 'microbatch')} "
            f"(leaves: {', '.join(paths[k] for k in sized)}). Use a batch of at least {num_microbatches} or "
            "fewer microbatches."
        )
    # Each leaf's column: its pieces, or the leaf itself in every microbatch; a row of them is a microbatch.
    columns = [
        [leaf] * num_microbatches if d is None else _pieces(leaf, num_microbatches, d)
        for leaf, d in zip(leaves, split_dims)
    ]
    q, r = divmod(size, num_microbatches)  # the sizes of tensor_split's pieces
    return [unflatten(spec, row) for row in zip(*columns)], [q + 1] * r + [q] * (num_microbatches - r)


def _pieces(leaf: torch.Tensor, num_microbatches: int, dim: int) -> list[torch.Tensor]:
    """``leaf`` cut along ``dim`` into ``num_microbatches`` pieces, each laid out for the boundary."""
    pieces = list(torch.tensor_split(leaf, num_microbatches, dim=dim))
    if dim == 0 and boundary_layout(leaf) is leaf:  # the usual batch: its rows are laid out already
        return pieces
    return [boundary_layout(piece) for piece in pieces]


def _paths(batch: PyTree) -> list[str]:
    """The key paths of ``batch``'s leaves, in ``flatten`` order (for errors)."""
    return leaves_with_paths(batch).paths


def counts(microbatches: Sequence[PyTree], weight_fn: Callable[[Any], Any]) -> list[int]:
    """``weight_fn`` of each microbatch: how many of its tokens (or examples) count.

    Raises:
        ValueError: if ``weight_fn`` raises or returns anything but a non-negative integer
            (an int, or an integer tensor of one element, not on the meta device), naming the
            microbatch.
    """
    out = []
    for i, microbatch in enumerate(microbatches):
        try:
            count = weight_fn(microbatch)
        except Exception as error:
            raise ValueError(f"fpipe.step: weight_fn raised on microbatch {i}: {error!r}.") from error
        if isinstance(count, torch.Tensor) and count.is_meta:
            raise ValueError(
                f"fpipe.step: weight_fn returned a tensor on the meta device for microbatch {i}, which holds no "
                f"count ({count!r}). Count on the batch's own device (e.g. (mb['labels'] != -100).sum())."
            )
        if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point():
            count = int(count.item())
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"fpipe.step: weight_fn must return a count, a non-negative integer, but returned {count!r} "
                f"for microbatch {i}. Return e.g. mask.sum() (an integer tensor) or len(...)."
            )
        out.append(count)
    return out


def stack(trees: list[PyTree]) -> PyTree:
    """Gather per-microbatch pytrees into one: tensor leaves stacked on a new leading dim, others in tuples.

    Raises:
        ValueError: if the pytrees differ in structure or a tensor leaf changes shape.
    """
    columns, spec = _columns(trees, "fpipe.step: the aux returned by loss_fn")
    out: list[Any] = []
    for column in columns:
        if all(isinstance(x, torch.Tensor) for x in column):
            if len({tuple(x.shape) for x in column}) > 1:
                raise ValueError(
                    "fpipe.step: an aux tensor changes shape across microbatches "
                    f"({[tuple(x.shape) for x in column]}); aux tensors are stacked, so return shapes "
                    "that do not depend on the microbatch size (e.g. a sum or a mean)."
                )
            out.append(torch.stack([x.detach() for x in column]))
        else:  # tensors among other leaves are detached too: results carry no graph
            out.append(tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in column))
    return unflatten(spec, out)


def concat(trees: list[PyTree]) -> PyTree:
    """The last stage's per-microbatch outputs stitched back in example order: the inverse of
    ``split`` for outputs whose batch dimension is 0 (tensor leaves concatenated along it, others
    gathered in tuples with one entry per microbatch).

    Raises:
        ValueError: if the pytrees differ in structure or a tensor leaf has no batch dimension.
    """
    columns, spec = _columns(trees, "fpipe.step.evaluate: the last stage's output")
    out: list[Any] = []
    for column in columns:
        if all(isinstance(x, torch.Tensor) for x in column):
            if any(x.dim() == 0 for x in column):
                raise ValueError(
                    "fpipe.step.evaluate: a tensor of the last stage's output is a scalar, so it has no batch "
                    "dimension to stitch the microbatches along. Return outputs with the batch along dim 0, "
                    "or call evaluate without outputs=True."
                )
            out.append(torch.cat([x.detach() for x in column]))
        else:
            out.append(tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in column))
    return unflatten(spec, out)


def _columns(trees: list[PyTree], what: str) -> tuple[list[tuple[Any, ...]], Any]:
    """The leaves of per-microbatch ``trees`` as columns (one tuple per leaf), and their common
    structure; ``what`` (the function and the value) starts the error if the structures differ."""
    flat = [flatten(tree) for tree in trees]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat):
        if other != spec:
            raise ValueError(
                f"{what} for microbatch {i} has structure {other}, but microbatch 0's has {spec}. "
                "Return the same structure for every microbatch."
            )
    return list(zip(*(leaves for leaves, _ in flat))), spec
