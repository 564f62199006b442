"""``fpipe.functionalize``: an ``nn.Module`` as a pure function of its parameter pytree."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from .._stage import replaying


def call_with(
    module: nn.Module,
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    remove_duplicate: bool = True,
) -> Any:
    """``module(*args, **kwargs)`` through ``functional_call`` with ``params`` for its trainable
    parameters; frozen parameters and buffers are read from the module now, the buffers copied
    while a recomputed forward replays (``replaying()``): the replay must not update running
    statistics a second time."""
    copy = replaying()
    state: dict[str, torch.Tensor] = {
        n: p for n, p in module.named_parameters(remove_duplicate=remove_duplicate) if not p.requires_grad
    }
    state.update((n, b.clone() if copy else b) for n, b in module.named_buffers(remove_duplicate=remove_duplicate))
    state.update(params)
    return functional_call(module, state, args, kwargs)


def functionalize(module: nn.Module, /) -> tuple[Callable[..., Any], dict[str, torch.Tensor]]:
    """Split ``module`` into a pure function and its trainable parameters.

    Returns ``(fn, params)`` where ``params`` maps each trainable parameter's name (as in
    ``module.named_parameters()``, tied parameters once) to a detached alias of it, and
    ``fn(params, *args, **kwargs)`` calls ``module.forward(*args, **kwargs)`` with those
    parameters through ``torch.func.functional_call``.

    Buffers (e.g. BatchNorm running statistics) and parameters with ``requires_grad=False`` are
    not in ``params``: ``fn`` reads them from the module at each call, as the module itself
    would, so they follow ``module.to(...)``, ``module.train()``/``eval()`` and ``load_state_dict``.
    Under ``pipeline(..., recompute=...)`` the forward's replay gets copies of the buffers, so
    they are updated once per call, as without recomputation.

    Examples:
        >>> fn, params = fpipe.functionalize(torch.nn.Linear(4, 2))
        >>> sorted(params)
        ['bias', 'weight']
        >>> fn(params, torch.randn(3, 4)).shape
        torch.Size([3, 2])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fpipe.functionalize: expected an nn.Module (got: {type(module).__name__}).")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}

    def fn(params: dict[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        return call_with(module, params, args, kwargs)

    return fn, params
