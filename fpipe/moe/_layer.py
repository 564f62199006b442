"""The reference MoE layer, DeepSeek-style: routed SwiGLU experts, optionally split over an
expert-parallel mesh, and a dense shared expert."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ._dispatch import combine, dispatch
from ._routing import Score, balance_loss, route, token_counts

EXPERT_WEIGHTS = ("w1", "w3", "w2")
"""The params' keys of the routed experts' weights, ``[E, ...]`` each (``distribute_experts`` splits them)."""


class MoEStats(NamedTuple):
    """What an ``moe`` call tells besides its output.

    Attributes:
        balance_loss: the scalar ``balance_loss`` of this call's tokens (unscaled: multiply by
            your coefficient and add it to the loss).
        counts: int64 ``[E]``, how many of *this call's* tokens (this rank's) chose each of all
            ``E`` experts, wherever they live: a sum over data-parallel ranks and microbatches
            gives the global batch's counts, e.g. for DeepSeek-V3's bias update.
    """

    balance_loss: torch.Tensor
    counts: torch.Tensor


def init_moe(
    dim: int,
    hidden: int,
    num_experts: int,
    *,
    shared_hidden: int | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Parameters of an ``moe`` layer: a router, ``num_experts`` SwiGLU experts and a shared one.

    Every matrix is drawn from a normal distribution with standard deviation
    ``1 / sqrt(fan_in)``. The pytree::

        {"router": [dim, E],
         "w1": [E, dim, hidden], "w3": [E, dim, hidden], "w2": [E, hidden, dim],
         "shared": {"w1": [dim, shared_hidden], "w3": [dim, shared_hidden], "w2": [shared_hidden, dim]}}

    Args:
        dim: the model's feature size.
        hidden: each routed expert's hidden size.
        num_experts: ``E``.
        shared_hidden: the shared expert's hidden size (default ``hidden``); 0 for none (no
            ``"shared"`` key).
        generator: the random generator (None: torch's default one). Every rank of an
            expert-parallel group must draw the same parameters before ``distribute_experts``.
        dtype: the parameters' dtype (None: torch's default).

    Returns:
        The parameter pytree, plain tensors holding every expert.

    Examples:
        >>> params = fpipe.moe.init_moe(8, 16, 4, generator=torch.Generator().manual_seed(0))
        >>> {name: tuple(w.shape) for name, w in params.items() if name != "shared"}
        {'router': (8, 4), 'w1': (4, 8, 16), 'w3': (4, 8, 16), 'w2': (4, 16, 8)}
    """
    shared = hidden if shared_hidden is None else shared_hidden

    def normal(*shape: int) -> torch.Tensor:
        fan_in = shape[-2]
        w: torch.Tensor = torch.randn(*shape, generator=generator, dtype=dtype) / fan_in**0.5
        return w

    params: dict[str, Any] = {
        "router": normal(dim, num_experts),
        "w1": normal(num_experts, dim, hidden),
        "w3": normal(num_experts, dim, hidden),
        "w2": normal(num_experts, hidden, dim),
    }
    if shared:
        params["shared"] = {"w1": normal(dim, shared), "w3": normal(dim, shared), "w2": normal(shared, dim)}
    return params


def moe(
    params: dict[str, Any],
    x: torch.Tensor,
    /,
    *,
    top_k: int,
    score: Score = "softmax",
    bias: torch.Tensor | None = None,
    sequence_length: int | None = None,
    capacity: int | None = None,
) -> tuple[torch.Tensor, MoEStats]:
    """A mixture-of-experts layer: each token through its ``top_k`` routed experts, plus the shared one.

    Conceptually, with every expert in one process::

        routing = route(x @ params["router"], top_k, score=score, bias=bias)
        y = swiglu(params["shared"], x)
        for t in range(T):
            for j in range(top_k):
                e = routing.experts[t, j]
                y[t] += routing.weights[t, j] * swiglu(params["w1"][e], params["w3"][e], params["w2"][e], x[t])

    where ``swiglu(w1, w3, w2, x) = (silu(x @ w1) * (x @ w3)) @ w2`` (DeepSeekMoE,
    arXiv:2401.06066; DeepSeek-V3, arXiv:2412.19437). Tokens are sent to their experts by
    ``dispatch`` and brought back by ``combine``: dropless, deterministic, differentiable.

    Expert parallelism: when ``w1``, ``w3`` and ``w2`` are DTensors with ``Shard(0)`` on a 1-D
    device mesh (``distribute_experts(params, mesh["ep"])``), this rank runs only its block of
    experts, on the rows every rank of the mesh's group sends it; every rank of the group must
    call the layer together. Each rank's gradient of its own loss then holds, in its local
    piece of an expert weight, the contributions of *every* rank's tokens to those experts (the
    all_to_all's backward brings them), while the router's and the shared expert's gradients
    hold its own tokens' only. So for a loss that is the mean over ``R`` ranks of each rank's
    loss, the expert gradients are the local pieces divided by ``R`` (not averaged over the
    group: each block lives once), and the others are averaged over the ranks as data-parallel
    gradients are.

    Args:
        params: ``init_moe``'s pytree; the expert weights plain (all experts) or DTensors.
        x: ``[..., dim]`` tokens; the leading dimensions are flattened, in order, into ``T``.
        top_k: experts per token.
        score: ``"softmax"`` or ``"sigmoid"`` (``route``).
        bias: ``[E]`` selection bias (``route``), or None.
        sequence_length: for the balance loss, the length of the sequences the ``T`` tokens
            form (``balance_loss``); None: one group.
        capacity: rows per (source rank, expert), dropping the pairs beyond (``dispatch``);
            None: dropless. The exchange and the experts (one batched matmul) then need no
            host synchronization (``route``'s check of the logits and the stats' check of the
            expert indices still read the device).

    Returns:
        ``(y, stats)``: ``y`` of ``x``'s shape, and ``MoEStats`` for this call's tokens.

    Raises:
        ValueError: shapes that disagree, expert weights partly DTensors, or DTensors not
            ``Shard(0)`` on a 1-D mesh (naming the leaf); and what ``route`` and ``dispatch``
            raise.

    Examples:
        >>> params = fpipe.moe.init_moe(8, 16, 4, generator=torch.Generator().manual_seed(0))
        >>> y, stats = fpipe.moe.moe(params, torch.randn(2, 5, 8), top_k=2)
        >>> y.shape, stats.counts.sum()
        (torch.Size([2, 5, 8]), tensor(20))
    """
    router = params["router"]
    num_experts = router.shape[-1]
    group, (w1, w3, w2) = _local_experts(params, num_experts)
    if x.shape[-1] != router.shape[0]:
        raise ValueError(
            f"fpipe.moe.moe: x's last dimension must be the router's input size, {router.shape[0]} "
            f"(x: shape {tuple(x.shape)}, params['router']: shape {tuple(router.shape)})."
        )
    tokens = x.reshape(-1, x.shape[-1])
    routing = route(tokens @ router, top_k, score=score, bias=bias)
    expert_inputs, handle = dispatch(tokens, routing, num_experts, group, capacity=capacity)
    if capacity is None:
        rows = torch.split(expert_inputs, handle.tokens_per_expert.tolist())
        outputs = torch.cat([_swiglu(w1[e], w3[e], w2[e], rows[e]) for e in range(len(rows))])
    else:  # the same number of rows for every local expert: one batched matmul
        batched = expert_inputs.reshape(w1.shape[0], -1, expert_inputs.shape[1])
        outputs = _swiglu(w1, w3, w2, batched).reshape(expert_inputs.shape[0], -1)
    y = combine(outputs, handle)
    if "shared" in params:
        shared = params["shared"]
        y = y + _swiglu(shared["w1"], shared["w3"], shared["w2"], tokens)
    stats = MoEStats(
        balance_loss(routing, num_experts, sequence_length=sequence_length), token_counts(routing, num_experts)
    )
    return y.reshape(x.shape), stats


def _swiglu(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2


def _local_experts(
    params: dict[str, Any], num_experts: int
) -> tuple[dist.ProcessGroup | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The expert-parallel group (None: one process) and this rank's expert weights, checked."""
    weights = [params[name] for name in EXPERT_WEIGHTS]
    for name, w in zip(EXPERT_WEIGHTS, weights):
        if w.dim() != 3 or w.shape[0] != num_experts:
            raise ValueError(
                f"fpipe.moe.moe: params[{name!r}] must be [num_experts, ., .] with the router's "
                f"{num_experts} experts (params[{name!r}]: shape {tuple(w.shape)})."
            )
    distributed = [isinstance(w, DTensor) for w in weights]
    if not any(distributed):
        return None, (weights[0], weights[1], weights[2])
    if not all(distributed):
        plain = [name for name, d in zip(EXPERT_WEIGHTS, distributed) if not d]
        raise ValueError(
            f"fpipe.moe.moe: the expert weights must be all DTensors or all plain tensors "
            f"(plain: {', '.join(f'params[{n!r}]' for n in plain)}). Use distribute_experts(params, mesh['ep'])."
        )
    mesh = weights[0].device_mesh
    for name, w in zip(EXPERT_WEIGHTS, weights):
        if w.device_mesh.ndim != 1 or tuple(w.placements) != (Shard(0),) or w.device_mesh != mesh:
            raise ValueError(
                f"fpipe.moe.moe: an expert weight must be a DTensor with placements (Shard(0),) on "
                f"the 1-D expert-parallel mesh of params['w1'] (params[{name!r}]: placements "
                f"{tuple(w.placements)} on a {w.device_mesh.ndim}-D mesh). Use distribute_experts(params, mesh['ep'])."
            )
    if num_experts % mesh.size():
        raise ValueError(
            f"fpipe.moe.moe: num_experts must be a multiple of the expert-parallel mesh's size, "
            f"{mesh.size()} (num_experts: {num_experts})."
        )
    local = [w.to_local() for w in weights]
    return mesh.get_group(), (local[0], local[1], local[2])


def distribute_experts(params: dict[str, Any], ep_mesh: DeviceMesh, /) -> dict[str, Any]:
    """``params`` with the expert weights as DTensors ``Shard(0)`` on ``ep_mesh``: each rank its block.

    Rank ``r`` of the mesh keeps experts ``[r E/R, (r+1) E/R)`` of ``w1``, ``w3`` and ``w2``
    (copies, no communication: every rank must hold the same ``params``, e.g. ``init_moe`` with
    the same seed); the router and the shared expert stay plain tensors, replicated. ``moe``
    then runs this rank's experts and exchanges tokens over the mesh's group.

    Args:
        params: ``init_moe``'s pytree, plain tensors.
        ep_mesh: the 1-D expert-parallel mesh (``mesh["ep"]``).

    Returns:
        A new pytree; ``params`` is not modified.

    Raises:
        ValueError: ``ep_mesh`` not 1-D, or ``E`` not a multiple of its size.

    Example (two processes, ``torchrun --nproc-per-node 2``)::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        params = fpipe.moe.distribute_experts(fpipe.moe.init_moe(8, 16, 4, generator=seeded), mesh["ep"])
        y, stats = fpipe.moe.moe(params, x, top_k=2)  # this rank's tokens; experts 0-1 or 2-3 here
    """
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"fpipe.moe.distribute_experts: ep_mesh must be 1-D (ep_mesh: {ep_mesh.ndim}-D, dimensions "
            f"{ep_mesh.mesh_dim_names}). Pass the expert-parallel sub-mesh: mesh['ep']."
        )
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    num_experts = params["w1"].shape[0]
    if num_experts % size:
        raise ValueError(
            f"fpipe.moe.distribute_experts: the number of experts must be a multiple of the mesh's "
            f"size, {size} (params['w1']: {num_experts} experts)."
        )
    block = num_experts // size
    out = dict(params)
    for name in EXPERT_WEIGHTS:
        w = params[name]
        piece = w[rank * block : (rank + 1) * block].detach().clone()
        out[name] = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride())
    return out
