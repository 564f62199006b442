"""Mixture of experts with expert parallelism, for use inside a stage function.

``routing = route(logits, top_k)`` chooses each token's experts; ``tokens, handle =
dispatch(x, routing, num_experts, group)`` sends the tokens to the ranks holding them and
``combine(y, handle)`` brings the experts' outputs back, weighted; ``moe(params, x, top_k=...)``
is a reference DeepSeek-style layer on them, its experts plain tensors or split over an
expert-parallel mesh (``distribute_experts``). The exchange is dropless (variable splits, read
on the host) or, with ``capacity=``, of fixed size with no host synchronization.

Why this lives in the library: the model is the user's, but an expert-parallel layer needs a
token exchange that is correct (dropless, variable splits that every rank agrees on, or an
error on every rank rather than a hang), deterministic (the same bits on every run: no atomics,
ties broken by expert index) and differentiable (the expert gradients come back through the
exchange), and that is easy to get subtly wrong. It depends on torch only, not on the pipeline
runtime: a stage calls it as any other function.
"""

from ._dispatch import Dispatched as Dispatched
from ._dispatch import combine as combine
from ._dispatch import dispatch as dispatch
from ._layer import MoEStats as MoEStats
from ._layer import distribute_experts as distribute_experts
from ._layer import init_moe as init_moe
from ._layer import moe as moe
from ._routing import Routing as Routing
from ._routing import balance_loss as balance_loss
from ._routing import route as route
from ._routing import token_counts as token_counts

__all__ = [
    "Dispatched",
    "MoEStats",
    "Routing",
    "balance_loss",
    "combine",
    "dispatch",
    "distribute_experts",
    "init_moe",
    "moe",
    "route",
    "token_counts",
]
