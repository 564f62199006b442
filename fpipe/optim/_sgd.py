"""``fpipe.optim.sgd``: SGD with momentum over per-stage pytrees, computed by ``torch.optim.sgd.sgd``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.sgd import sgd as torch_sgd

from .._pytree import PyTree
from ._optimizer import Group, LearningRate, Optimizer, check_learning_rate, check_options, make_optimizer


def sgd(
    learning_rate: LearningRate = 1e-3,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    weight_decay_mask: Sequence[PyTree] | None = None,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Optimizer:
    """Stochastic gradient descent with momentum (Sutskever et al., ICML 2013; Nesterov) as pure functions.

    The update is ``torch.optim.SGD``'s, computed by its functional kernel
    (``torch.optim.sgd.sgd``, NOTE [torch kernels] in ``fpipe/optim/_optimizer.py``): equal to
    ``torch.optim.SGD`` bitwise. The state holds, per stage, ``{"step", "momentum_buffer"}``
    (only ``{"step"}`` when ``momentum`` is 0). As in torch, the first update starts the
    momentum buffer at the gradient itself (no dampening), which the state's step tells.

    Conceptually, for each parameter ``p`` with gradient ``g``::

        g = g + weight_decay * p                           # L2, only where weight_decay_mask is True
        b = g if first update else momentum * b + (1 - dampening) * g
        p = p - lr * (g + momentum * b if nesterov else b)

    Args:
        learning_rate: a float, or a schedule: a function of the number of updates done so far
            (0 for the first) returning the rate.
        momentum: as in ``torch.optim.SGD``.
        dampening: as in ``torch.optim.SGD``.
        nesterov: as in ``torch.optim.SGD``.
        weight_decay: as in ``torch.optim.SGD``.
        maximize: as in ``torch.optim.SGD``.
        foreach: as in ``torch.optim.SGD``.
        weight_decay_mask: as in ``fpipe.optim.adamw``.

    Returns:
        An ``Optimizer`` (see ``fpipe.optim.adamw``).

    Examples:
        >>> import torch, fpipe
        >>> opt = fpipe.optim.sgd(0.1, momentum=0.9)
        >>> params, grads = [{"w": torch.ones(2)}], [{"w": torch.ones(2)}]
        >>> params, state = opt.update(params, grads, opt.init(params))
        >>> params[0]["w"], state[0]["momentum_buffer"]["w"]
        (tensor([0.9000, 0.9000]), tensor([1., 1.]))
    """
    check_learning_rate("sgd", learning_rate)
    check_options("fpipe.optim.sgd", {"momentum": momentum, "weight_decay": weight_decay})
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"fpipe.optim.sgd: nesterov needs a positive momentum and no dampening "
            f"(momentum: {momentum}, dampening: {dampening}). Set momentum > 0 and dampening=0, or nesterov=False."
        )

    def kernel(group: Group, *, lr: float) -> None:
        # torch starts a buffer as a copy of the first gradient where its list holds None, and
        # puts the new buffer in the list; the state's buffer takes its value.
        held: list[torch.Tensor | None] = [*group.buffers.get("momentum_buffer", [None] * len(group.params))]
        started: list[torch.Tensor | None] = [b if int(t) > 0 else None for b, t in zip(held, group.steps)]
        torch_sgd(
            group.params,
            group.grads,
            started,
            foreach=foreach,
            weight_decay=group.weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=maximize,
        )
        for buffer, new in zip(held, started):
            if buffer is not None and new is not None and new is not buffer:
                buffer.copy_(new)

    buffers = ("momentum_buffer",) if momentum != 0 else ()
    return make_optimizer("sgd", buffers, kernel, learning_rate, weight_decay, weight_decay_mask)
