"""The one door to optree: every flatten in fpipe goes through here, with the same options.

``None`` is a leaf (``none_is_leaf=True``): a ``None`` in a batch travels as a non-tensor leaf,
and a ``None`` in a ``batch_dims`` prefix means "do not split". Registrations made in optree's
default namespace (and optree's built-in types) are honoured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

PyTree = Any
TreeSpec = optree.PyTreeSpec

_OPTIONS: dict[str, Any] = {"none_is_leaf": True}


def flatten(tree: PyTree) -> tuple[list[Any], TreeSpec]:
    """Leaves (in optree's order) and the structure of ``tree``."""
    return optree.tree_flatten(tree, **_OPTIONS)


def unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of ``flatten``."""
    return optree.tree_unflatten(spec, leaves)


def leaves_with_paths(tree: PyTree) -> tuple[list[str], list[Any], TreeSpec]:
    """Like ``flatten``, plus each leaf's key path as a string such as ``['tokens'][0]``."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, **_OPTIONS)
    return [keystr(p) for p in paths], leaves, spec


def leaves_with_names(tree: PyTree) -> tuple[list[tuple[str, ...]], list[str], list[Any], TreeSpec]:
    """Like ``flatten``, plus each leaf's key path as name parts and as code such as ``['h'].a[0]``.

    The name parts are how ``fpipe.save`` names tensors: a mapping key as ``str(key)``, a
    sequence index in decimal, a named field (namedtuple, dataclass, attribute) by its name.
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, **_OPTIONS)
    names = [tuple(_entry_name(e) for e in accessor) for accessor in accessors]
    return names, [accessor.codify("") for accessor in accessors], leaves, spec


def _entry_name(entry: Any) -> str:
    if isinstance(getattr(entry, "field", None), str):  # namedtuple and structseq fields
        return str(entry.field)
    if isinstance(entry, optree.GetAttrEntry):  # dataclass fields, attributes
        return str(entry.name)
    return str(entry.entry)


def keystr(path: Sequence[Any]) -> str:
    """A key path tuple as ``['h'][0]``; the root is ``<root>``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def broadcast_prefix(prefix: PyTree, tree: PyTree) -> list[Any]:
    """The leaves of ``prefix`` repeated over the leaves of ``tree`` that each one covers.

    Raises ``ValueError`` naming the mismatch if ``prefix`` is not a prefix of ``tree``.
    """
    return optree.broadcast_prefix(prefix, tree, **_OPTIONS)


def is_differentiable(leaf: Any) -> bool:
    """Floating and complex tensors get gradients; everything else passes through untouched."""
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its graph: a detached alias, or a copy if ``t`` is an inference tensor
    (made under ``torch.inference_mode()``), which autograd could not record or save."""
    return t.clone() if t.is_inference() else t.detach()


def boundary_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor crossing a stage boundary is laid out: contiguous, with conjugate and
    negative bits resolved (NOTE [boundary layout] in fpipe/_stage.py). ``t`` itself if it is so."""
    return t.resolve_conj().resolve_neg().contiguous()


def map_tensors(fn: Any, tree: PyTree) -> PyTree:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves are kept as they are."""
    leaves, spec = flatten(tree)
    return unflatten(spec, [fn(x) if isinstance(x, torch.Tensor) else x for x in leaves])
