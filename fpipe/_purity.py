"""Stages are pure: which parameter or input a stage updated in place, when autograd refuses it.

NOTE [in-place updates of leaves]
A stage differentiates graph leaves of its own: its parameters and the input leaves that carry
the previous stage's graph (NOTE [differentiable leaves] in fpipe/_stage.py). Updating one in
place (``p["w"].add_(1)``, ``x.mul_(2)``, ``x[0] = 0``, ``x += 1``) makes autograd raise "a leaf
Variable that requires grad is being used in an in-place operation", which names neither the
stage nor the tensor. Nothing is checked while stages run well: only when a forward raises that
error is the stage function called once more, on the same parameters and inputs, under a
``TorchFunctionMode`` that stops at the first in-place call (a method or function whose name
ends in ``_``, an augmented assignment, ``__setitem__``, ``inplace=True``) made with grad mode on
whose first argument is one of those leaves, or a view of one. Its key path becomes the error.
The mode sees only the stage's own torch calls (not those made inside a torch function that
handles ``__torch_function__`` itself), so a leaf it does not find leaves autograd's error as it
was. The second call repeats what the stage did before the update (random draws, a module's
buffer updates); the step has failed by then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._pytree import PyTree, leaves_with_paths

# What autograd says of an in-place update of a leaf that requires grad, or of a view of one.
_AUTOGRAD_MESSAGE = "leaf Variable that requires grad is being used in an in-place operation"

# Methods that end in ``_`` but leave the data alone.
_NOT_UPDATES = frozenset({"requires_grad_", "share_memory_", "rename_"})

# ``x[k] = v`` and the augmented assignments (``x += v``, ...).
_OPERATORS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__imatmul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)


def raise_if_in_place(error: RuntimeError, stage: int, again: Callable[[], Any], params: PyTree, x: PyTree) -> None:
    """If ``error`` is autograd's refusal of an in-place update of a graph leaf, find the leaf by
    calling ``again()`` (the stage function on ``params`` and ``x``, the prepared leaves that
    raised) once more, and raise the error that names it (NOTE [in-place updates of leaves]).

    Returns when ``error`` is another error, or when the second call finds no such update.

    Raises:
        RuntimeError: naming the stage, the leaf's key path and the fix, from ``error``.
    """
    if _AUTOGRAD_MESSAGE not in str(error):
        return
    leaves: dict[int, tuple[str, str, torch.Tensor]] = {}  # by id: key path, "parameter" or "input", leaf
    for name, kind, tree in (("params", "parameter", params), ("x", "input", x)):
        paths, values, _ = leaves_with_paths(tree)
        for path, leaf in zip(paths, values):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_leaf:
                leaves[id(leaf)] = (name if path == "<root>" else f"{name}{path}", kind, leaf)
    try:
        with torch.inference_mode(False), torch.enable_grad(), _InPlaceWatch(leaves):
            again()
    except _Found as found:
        view = "a view of " if found.view else ""
        raise RuntimeError(
            f"stage {stage} updates {view}its {found.kind} {found.path} in place ({found.path}: {found.op}), "
            "a leaf its backward differentiates. Stages must be pure functions stage(params, x) -> y: "
            "write the update out of place, e.g. w = w + 1 instead of w.add_(1) or w += 1."
        ) from error
    except Exception:  # the second call failed otherwise: autograd's error stands
        return


class _Found(Exception):
    """The in-place call on a watched leaf: its key path and kind, the op, and whether through a view."""

    def __init__(self, path: str, kind: str, op: str, view: bool) -> None:
        super().__init__(path)
        self.path, self.kind, self.op, self.view = path, kind, op, view


class _InPlaceWatch(TorchFunctionMode):
    """Raises ``_Found`` at the first in-place call, under grad mode, on one of ``leaves`` (by
    identity, or through a view of it); lets every other call through."""

    def __init__(self, leaves: Mapping[int, tuple[str, str, torch.Tensor]]) -> None:
        super().__init__()
        self._leaves = leaves

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and torch.is_grad_enabled():
            op = _in_place_op(func, kwargs)
            if op is not None:
                target = args[0]
                for tensor, view in ((target, False), (target._base, True)):
                    entry = None if tensor is None else self._leaves.get(id(tensor))
                    if entry is not None and entry[2] is tensor:
                        raise _Found(entry[0], entry[1], op, view)
        return func(*args, **kwargs)


def _in_place_op(func: Any, kwargs: Mapping[str, Any]) -> str | None:
    """How ``func`` (called with ``kwargs``) is written if it updates its first argument in place, else ``None``."""
    name = getattr(func, "__name__", "")
    if not isinstance(name, str):
        return None
    if kwargs.get("inplace") is True:
        return f"{name}(inplace=True)"
    if name in _OPERATORS:
        return name
    if name.endswith("_") and not name.endswith("__") and name not in _NOT_UPDATES:
        return name
    return None
