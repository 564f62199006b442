"""``fpipe.optim.adamw``: AdamW over per-stage pytrees, computed by ``torch.optim.adamw.adamw``."""

from __future__ import annotations

from collections.abc import Sequence

from torch.optim.adamw import adamw as torch_adamw

from .._pytree import PyTree
from ._optimizer import Group, LearningRate, Optimizer, check_learning_rate, check_options, make_optimizer


def adamw(
    learning_rate: LearningRate = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    weight_decay_mask: Sequence[PyTree] | None = None,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> Optimizer:
    """AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019) as pure functions.

    The update is ``torch.optim.AdamW``'s, computed by its own functional kernel
    (``torch.optim.adamw.adamw``, NOTE [torch kernels] in ``fpipe/optim/_optimizer.py``): with the
    same options and gradients, the parameters and state equal those of ``torch.optim.AdamW``
    bitwise. The state holds, per stage, ``{"step", "exp_avg", "exp_avg_sq"}`` (and
    ``"max_exp_avg_sq"`` with ``amsgrad``), which ``fpipe.save`` and ``fpipe.load`` take as
    ``optimizer_state`` (NOTE [optimizer state]). Every operation is elementwise, so it runs
    unchanged on the shards of ``fpipe.Parallelism(mesh=mesh, shard_params=True)``.

    Conceptually, for each parameter ``p`` with gradient ``g`` (``t`` counts updates from 1)::

        p = p - lr * weight_decay * p                      # only where weight_decay_mask is True
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)

    Args:
        learning_rate: a float, or a schedule: a function of the number of updates done so far
            (0 for the first) returning the rate, such as ``fpipe.optim.warmup_cosine(...)``.
        betas: as in ``torch.optim.AdamW``.
        eps: as in ``torch.optim.AdamW``.
        weight_decay: as in ``torch.optim.AdamW``.
        amsgrad: as in ``torch.optim.AdamW``.
        maximize: as in ``torch.optim.AdamW``.
        weight_decay_mask: one bool pytree per stage, a prefix of the stage's parameters: which
            leaves get weight decay (all without a mask). Decide it on the full parameters: shards
            are 1-D (``[{k: v.dim() >= 2 for k, v in p.items()} for p in full_params]``).
        foreach: which of torch's implementations runs, as in ``torch.optim.AdamW`` (``None``:
            torch's default, foreach where it can).
        fused: as in ``torch.optim.AdamW``.

    Returns:
        An ``Optimizer``: ``state = opt.init(params)``, ``params, state = opt.update(params,
        grads, state)`` (new tensors) or ``opt.update_(params, grads, state)`` (in place).
        ``params``, ``grads`` and ``state`` are per-stage lists; stages whose ``params`` entry
        is ``None`` (held by another rank) are skipped.

    Examples:
        >>> import torch, fpipe
        >>> opt = fpipe.optim.adamw(fpipe.optim.warmup_cosine(1e-3, warmup_steps=10, total_steps=100))
        >>> params = [{"w": torch.ones(2, 2)}, {"w": torch.ones(2)}]
        >>> state = opt.init(params)
        >>> grads = [{"w": torch.ones(2, 2)}, {"w": torch.ones(2)}]
        >>> params, state = opt.update(params, grads, state)
        >>> params[1]["w"], state[1]["step"]
        (tensor([0.9999, 0.9999]), tensor(1.))
    """
    check_learning_rate("adamw", learning_rate)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(
            f"fpipe.optim.adamw: betas must be a pair of floats (betas: {betas!r}). Pass e.g. (0.9, 0.999)."
        )
    beta1, beta2 = betas
    options = {"betas[0]": beta1, "betas[1]": beta2, "eps": eps, "weight_decay": weight_decay}
    check_options("fpipe.optim.adamw", options, below_one=("betas[0]", "betas[1]"))

    def kernel(group: Group, *, lr: float) -> None:
        steps = group.steps
        if fused:  # the fused kernel takes its step counters on the parameters' device
            steps = [t.to(p.device) for t, p in zip(steps, group.params)]
        torch_adamw(
            group.params,
            group.grads,
            group.buffers["exp_avg"],
            group.buffers["exp_avg_sq"],
            group.buffers.get("max_exp_avg_sq", []),
            steps,
            foreach=foreach,
            fused=fused,
            has_complex=any(p.is_complex() for p in group.params),
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group.weight_decay,
            eps=eps,
            maximize=maximize,
        )

    buffers = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    return make_optimizer("adamw", buffers, kernel, learning_rate, weight_decay, weight_decay_mask)
