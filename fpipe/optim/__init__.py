"""Functional optimizers over fpipe's per-stage parameter pytrees, computed by torch.optim's kernels.

``opt = fpipe.optim.adamw(lr)``, ``state = opt.init(params)``, then after each step
``params, state = opt.update(params, grads, state)`` (or ``opt.update_`` in place). See
``notes/optim.md``.
"""

from ._adamw import adamw as adamw
from ._clip import clip_by_global_norm as clip_by_global_norm
from ._optimizer import Optimizer as Optimizer
from ._schedules import warmup_cosine as warmup_cosine
from ._sgd import sgd as sgd

__all__ = [
    "Optimizer",
    "adamw",
    "clip_by_global_norm",
    "sgd",
    "warmup_cosine",
]
