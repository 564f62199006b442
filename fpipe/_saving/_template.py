"""A load's template: the names its leaves want, checked, and the trees filled with what was read.

``fpipe.load`` (``fpipe/_saving/_load.py``) and ``fpipe.load_hf`` (``fpipe/_saving/_hf_load.py``)
read different directories into the same kind of template: one pytree per stage whose tensor
leaves are named by their key paths (NOTE [names] in ``fpipe/_saving/_save.py``). Both walk it
with ``template_uses`` before reading and put the tensors read into it with ``fill``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Shard

from .._plural import plural
from .._pytree import PyTree, leaves_with_names, unflatten
from .._tensor_parallel import from_header, header_of, is_dtensor, local, on_ranks
from ._boxes import Box, box_of, is_piece
from ._ranks import Sharding, full_shapes
from ._store import Part


class Use(NamedTuple):
    """A template leaf to fill: its key path, stage, position among the stage's leaves, itself,
    for a shard (NOTE [sharded saves] in ``fpipe/_saving/_store.py``) its ``(q, d)`` and full shape,
    and for a DTensor (or a shard of one's local piece) the box of its local piece (NOTE [tensor-parallel saves] in
    ``fpipe/_saving/_boxes.py``; ``None`` when it holds the whole tensor)."""

    where: str
    stage: int
    position: int
    leaf: torch.Tensor
    shard: tuple[int, int] | None = None
    shape: list[int] | None = None
    box: Box | None = None

    @property
    def full_shape(self) -> list[int]:
        return list(self.leaf.shape) if self.shape is None else self.shape

    @property
    def part(self) -> Part:
        """What to read for this leaf."""
        return Part(self.box, self.shard)


def template_uses(
    function: str,
    kind: str,
    trees: Sequence[PyTree],
    sharding: Sharding | None,
    expert_ranks: Sequence[int] | None = None,
) -> dict[str, list[Use]]:
    """Each name the template of ``kind`` holds, with the leaves it fills; ``function``
    (``fpipe.load``, ``fpipe.load_hf``) names the caller in errors; ``expert_ranks``: the ranks of
    this rank's ``mesh["ep"]``, where expert weights live (``Topology.expert_ranks``).

    Raises ``TypeError`` for a leaf that is neither a tensor nor ``None`` or a tensor without a
    name, and ``ValueError`` for a name twice in a stage, a shard of the wrong size, or an expert
    weight whose experts the expert-parallel ranks do not divide.
    """
    uses: dict[str, list[Use]] = {}
    for s, tree in enumerate(trees):
        names, codes, leaves, _ = leaves_with_names(tree)
        layout = None if sharding is None else sharding.layouts.get(s)
        full = {} if layout is None or tree is None else full_shapes(function, kind, tree, layout)
        for position, (parts, code, leaf) in enumerate(zip(names, codes, leaves)):
            where = f"{label(kind)}[{s}]{code}"
            if leaf is None:
                continue
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{function}: {where} is a {type(leaf).__name__}; template leaves are tensors (they give the "
                    "shape, dtype and device; meta tensors work) or None."
                )
            if not parts:
                raise TypeError(f"{function}: {where} is a tensor at the root of stage {s}, so it has no name.")
            name = ".".join(parts)
            mine = uses.setdefault(name, [])
            if any(use.stage == s for use in mine):
                raise ValueError(
                    f"{function}: {mine[0].where} and {where} both get the name {name!r} (names are key paths "
                    "joined by '.'). Rename a key so that every name in a stage is unique."
                )
            if name in full:
                assert sharding is not None
                cut_from, size = full[name], full[name].size(sharding.shard)
                if list(leaf.shape) != [size]:
                    piece = "" if cut_from.box is None else f"the local piece (shape {list(cut_from.box.shape)}) of "
                    raise ValueError(
                        f"{function}: {where} should be this rank's shard of {piece}a tensor of shape "
                        f"{cut_from.shape}, a 1-D tensor of {plural(size, 'element')} (got: shape {list(leaf.shape)}). "
                        "With a sharded step, pass the template step.shard returns (meta tensors of the full shapes "
                        "will do)."
                    )
                mine.append(Use(where, s, position, leaf, sharding.shard, cut_from.shape, cut_from.box))
            else:
                box = box_of(function, where, leaf) if is_piece(leaf) else None
                if expert_ranks is not None and is_dtensor(leaf) and on_ranks(leaf, expert_ranks):
                    _check_experts(function, where, leaf, len(expert_ranks))
                mine.append(Use(where, s, position, leaf, box=box))
    return uses


def _check_experts(function: str, where: str, leaf: Any, size: int) -> None:
    """An expert weight (a DTensor sharded along its first dimension over ``mesh["ep"]``) needs a
    number of experts its ``size`` expert-parallel ranks divide: each runs as many (``fpipe.moe``)."""
    experts = leaf.shape[0] if leaf.dim() else 0
    if any(type(p) is Shard and p.dim % max(leaf.dim(), 1) == 0 for p in leaf.placements) and experts % size:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"{function}: {where} is an expert weight of {experts} experts (its first dimension, sharded over "
            f"mesh['ep']), which the {size} expert-parallel ranks do not divide: each must hold as many experts. "
            f"Load it on an expert-parallel size that divides {experts} ({listing([str(d) for d in divisors])}), "
            "or into plain tensors."
        )


def fill(
    trees: Sequence[PyTree],
    uses: Mapping[str, Sequence[Use]],
    tensors: Mapping[tuple[str, Part], torch.Tensor],
) -> list[PyTree]:
    """The template trees with their tensor leaves replaced by the loaded tensors (a copy for
    each further use of one tensor, on the leaf's device unless that is ``meta``); a DTensor
    leaf gets a DTensor like it around the piece read (no communication)."""
    flat = [leaves_with_names(tree) for tree in trees]
    leaves_of = [list(f.leaves) for f in flat]
    for name, name_uses in uses.items():
        for k, use in enumerate(name_uses):
            tensor = tensors[name, use.part]
            if any(other.part == use.part for other in name_uses[:k]):
                tensor = tensor.clone()
            device = local(use.leaf).device
            if device.type != "meta":
                tensor = tensor.to(device)
            if is_dtensor(use.leaf):
                tensor = from_header(tensor, use.leaf.device_mesh, header_of(use.leaf, use.where))  # type: ignore[attr-defined]
            leaves_of[use.stage][use.position] = tensor
    return [unflatten(f.spec, leaves) for f, leaves in zip(flat, leaves_of)]


def label(kind: str) -> str:
    """How messages call the template of ``kind`` (``params`` or ``optimizer_state``)."""
    return "template" if kind == "params" else kind


def dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def listing(items: Sequence[str], limit: int = 10) -> str:
    """``[a, b, ... 3 more]``: at most ``limit`` items of a list for a message."""
    shown = ", ".join(items[:limit])
    return f"[{shown}, ... {len(items) - limit} more]" if len(items) > limit else f"[{shown}]"
