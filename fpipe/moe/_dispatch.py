"""Dispatch and combine: the token exchange of expert parallelism, dropless with variable splits,
or with a fixed capacity and no host synchronization.

NOTE [dispatch order]
The experts are split over the ``R`` ranks of the expert-parallel group in contiguous blocks:
rank ``r`` holds experts ``[r E/R, (r+1) E/R)``. A token chosen ``k`` times is sent ``k`` times,
once per (token, slot) pair. The pairs travel in three orders, each a permutation of the last::

    1. local pairs, sorted by (global expert, token, slot)   a stable sort of routing.experts:
                                                               contiguous per destination rank
    2. received rows, by (source rank, local expert, token, slot)   what all_to_all delivers
    3. expert inputs, by (local expert, source rank, token, slot)   a stable sort of 2. by expert

``dispatch`` goes 1 -> 2 -> 3, ``combine`` goes back 3 -> 2 -> 1 and sums each token's ``k``
rows weighted by its gate weights, slot 0 first. Every step is an all_to_all or an indexing by a
permutation, whose backward writes each row to exactly one place (a sum of one term, whatever
order an accumulating kernel runs in), and a token's ``k`` copies are made by an expand, whose
backward is a sum over ``k``: no row gets several contributions in an unordered index_add or by
atomics, so outputs and gradients are the same bits on every run. The only reductions, over
the ``k`` slots, run in slot order.

With a ``capacity`` (``dispatch(..., capacity=C)``), each (source rank, expert) pair of the
exchange has exactly ``C`` rows: an expert's first ``C`` pairs in order 1, by (token, slot), take
them, later ones are dropped (they add nothing in ``combine``), and empty rows are zeros. The
exchange is then an all_to_all of equal splits, and every index is computed on the device: no
host synchronization. A dropped pair and every empty row read one shared zero row; in the
backward, those gathers add into that row only, which is discarded, so every kept row's
gradient is still one value, the same bits on every run.

NOTE [split agreement]
A variable-split all_to_all hangs or delivers garbage if a sender and a receiver disagree on
how many rows pass between them. So before any row moves, the ranks all-gather a small header
(number of experts, feature size, pairs to send, pairs counted) and every rank checks every
other's: a disagreement raises the same ValueError on every rank, naming the rank, and no rank
is left waiting in a collective. The per-expert counts then travel by an all_to_all of ints,
and each rank's receive splits are computed from exactly the counts its senders computed their
send splits from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

from .._pairs import communication_point
from ._routing import Routing, token_counts


class Dispatched(NamedTuple):
    """What ``combine`` needs to bring expert outputs back to their tokens (NOTE [dispatch order]).

    A plain value, so another microbatch's work may run between ``dispatch`` and ``combine``.

    Attributes:
        tokens_per_expert: int64 ``[E / R]``, how many rows each local expert received: the
            expert inputs are these many rows for local expert 0, then local expert 1, ...
            (``R C`` each with a capacity, empty rows included).
        rows: ``N``, the number of expert-input rows (a Python int: no synchronization).
        weights: ``[T, k]``, the gate weights (the routing's), summed over in ``combine``.
        pair_order: ``[T k]``, order 1 as indices of the (token, slot) pairs ``t k + j``.
        expert_order: ``[N]``, order 3 as indices of the received rows (order 2); empty in
            one process or with a capacity.
        pair_slot: with a capacity, each pair's row (in order 1) in the ``[E C]`` rows sent,
            ``E C`` if dropped; else empty.
        send_splits: rows sent to each rank (order 1's blocks).
        receive_splits: rows received from each rank (order 2's blocks).
        capacity: rows per (source rank, expert), or None (dropless).
        group: the expert-parallel process group, or None for one process.
    """

    tokens_per_expert: torch.Tensor
    rows: int
    weights: torch.Tensor
    pair_order: torch.Tensor
    expert_order: torch.Tensor
    pair_slot: torch.Tensor
    send_splits: list[int]
    receive_splits: list[int]
    capacity: int | None
    group: dist.ProcessGroup | None


def dispatch(
    x: torch.Tensor,
    routing: Routing,
    /,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    capacity: int | None = None,
) -> tuple[torch.Tensor, Dispatched]:
    """Send each token to the ranks holding its experts; rows grouped by local expert.

    Conceptually, in one process (``group=None``, all experts local)::

        pairs = [(routing.experts[t, j], t, j) for t in range(T) for j in range(k)]
        tokens = stack([x[t] for (e, t, j) in sorted(pairs)])
        tokens_per_expert = token_counts(routing, num_experts)

    Over a group of ``R`` ranks, rank ``r`` holds experts ``[r E/R, (r+1) E/R)`` and gets the
    rows of every rank's tokens that chose them, ordered by (local expert, source rank, token,
    slot) (NOTE [dispatch order]). Dropless: every choice is served, so the number of rows
    ``N`` varies; the counts are exchanged first (one small all-gather and an all_to_all of
    ints, read on the host), then the rows by a differentiable all_to_all. Every rank of the
    group must call ``dispatch`` (and ``combine``) together, the same number of times.

    With a ``capacity`` ``C``, each local expert gets exactly ``R C`` rows, ``C`` from each
    source rank: the first ``C`` pairs by (token, slot) that chose it there, then zero rows;
    the pairs beyond are dropped (``combine`` adds nothing for them: the token keeps its other
    choices, and the shared expert and residual if the model has them). No host
    synchronization: nothing is checked that needs the data (experts in range, the ranks'
    agreement), so every rank must pass the same ``num_experts``, ``C`` and feature size. A
    common choice is ``C = ceil(capacity_factor * T * k / E)``; a rank's dropped pairs per
    expert are ``max(token_counts - C, 0)``.

    Args:
        x: ``[T, d]`` tokens.
        routing: their ``Routing`` (``route``).
        num_experts: ``E``, the number of experts over the whole group, a multiple of its size.
        group: the expert-parallel process group, or None (one process, no communication).
        capacity: rows per (source rank, expert), a positive int; None: dropless.

    Returns:
        ``(tokens, handle)``: the ``[N, d]`` expert inputs, grouped by local expert
        (``handle.tokens_per_expert`` rows each), and the ``Dispatched`` handle for ``combine``.

    Raises:
        ValueError: ``x`` not ``[T, d]`` for the routing's ``T``, experts out of range,
            ``num_experts`` not a multiple of the group's size, a bad ``capacity``, or ranks
            that disagree (NOTE [split agreement]: the message names the rank; raised on
            every rank).

    Examples:
        >>> x = torch.tensor([[0.0], [1.0], [2.0]])
        >>> r = fpipe.moe.route(torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), 1)
        >>> tokens, handle = fpipe.moe.dispatch(x, r, 2)
        >>> tokens.flatten(), handle.tokens_per_expert  # token 1 (expert 0), then 0 and 2 (expert 1)
        (tensor([1., 0., 2.]), tensor([1, 2]))
    """
    experts = routing.experts
    if x.dim() != 2 or experts.dim() != 2 or x.shape[0] != experts.shape[0]:
        raise ValueError(
            f"fpipe.moe.dispatch: x must be [tokens, features] with one row per row of routing.experts "
            f"(x: shape {tuple(x.shape)}, routing.experts: shape {tuple(experts.shape)})."
        )
    size = 1 if group is None else dist.get_world_size(group)
    if num_experts % size:
        raise ValueError(
            f"fpipe.moe.dispatch: num_experts must be a multiple of the expert-parallel group's size, "
            f"{size} (num_experts: {num_experts}). Use a number of experts that the ranks divide evenly."
        )
    local_experts = num_experts // size
    if capacity is not None:
        return _dispatch_capacity(x, routing, num_experts, group, size, capacity)
    num_tokens, top_k = experts.shape
    counts = token_counts(routing, num_experts)  # [E]
    if group is not None:
        _agree(group, num_experts, x.shape[1], num_tokens * top_k, int(counts.sum()), counts.device)
    pair_order = torch.sort(experts.reshape(-1), stable=True).indices  # order 1
    send = _pairs(x, top_k)[pair_order]
    rows = send.shape[0]
    empty = torch.zeros(0, dtype=torch.int64, device=x.device)
    if group is None:
        return send, Dispatched(counts, rows, routing.weights, pair_order, empty, empty, [rows], [rows], None, None)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [R, E/R]: source rank, local expert
    received_counts = received_counts.reshape(size, local_experts)
    send_splits = counts.reshape(size, local_experts).sum(dim=1).tolist()
    receive_splits = received_counts.sum(dim=1).tolist()
    received = _all_to_all(send, receive_splits, send_splits, group)  # order 2
    local_expert = torch.arange(local_experts, device=x.device).repeat(size)
    row_expert = torch.repeat_interleave(local_expert, received_counts.reshape(-1))
    expert_order = torch.sort(row_expert, stable=True).indices  # order 3
    tokens_per_expert = received_counts.sum(dim=0)
    rows = received.shape[0]
    weights = routing.weights
    handle = Dispatched(
        tokens_per_expert, rows, weights, pair_order, expert_order, empty, send_splits, receive_splits, None, group
    )
    return received[expert_order], handle


def _pairs(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T k, d]``: row ``t k + j`` is ``x[t]``. Not ``x[arange(T k) // k]``, whose backward is an
    index_add: an expand's backward is a sum over ``k`` (NOTE [dispatch order])."""
    num_tokens, dim = x.shape
    return x.unsqueeze(1).expand(num_tokens, top_k, dim).reshape(num_tokens * top_k, dim)


def _dispatch_capacity(
    x: torch.Tensor, routing: Routing, num_experts: int, group: dist.ProcessGroup | None, size: int, capacity: int
) -> tuple[torch.Tensor, Dispatched]:
    """``dispatch`` with ``capacity`` rows per (source rank, expert), without host synchronization."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"fpipe.moe.dispatch: capacity must be a positive int or None (capacity: {capacity!r}).")
    num_tokens, top_k = routing.experts.shape
    dim, num_pairs, device = x.shape[1], num_tokens * top_k, x.device
    flat = routing.experts.reshape(-1)
    pair_order = torch.sort(flat, stable=True).indices  # order 1
    sorted_experts = flat[pair_order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts  # each expert's first pair in order 1
    position = torch.arange(num_pairs, device=device) - starts[sorted_experts]
    slots = num_experts * capacity
    pair_slot = torch.where(position < capacity, sorted_experts * capacity + position, slots)
    slot = torch.arange(slots, device=device)
    expert, offset = slot // capacity, slot % capacity
    source = torch.where(offset < counts[expert], starts[expert] + offset, num_pairs)  # the zero row if empty
    sent = torch.cat([_pairs(x, top_k)[pair_order], x.new_zeros(1, dim)])[source]  # [E C, d]: (expert, offset)
    local_experts = num_experts // size
    splits = [local_experts * capacity] * size
    # received: by (source rank, local expert, offset); the experts want (local expert, source rank, offset)
    received = sent if group is None else _all_to_all(sent, splits, splits, group)
    tokens = received.reshape(size, local_experts, capacity, dim).transpose(0, 1).reshape(-1, dim)
    per_expert = torch.full((local_experts,), size * capacity, dtype=torch.int64, device=device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    handle = Dispatched(
        per_expert, tokens.shape[0], routing.weights, pair_order, empty, pair_slot, splits, splits, capacity, group
    )
    return tokens, handle


def combine(y: torch.Tensor, handle: Dispatched, /) -> torch.Tensor:
    """Bring the experts' outputs back to their tokens and sum them weighted by the gate weights.

    Conceptually, the inverse of ``dispatch`` followed by::

        out[t] = sum over j = 0, 1, ..., k-1 of weights[t, j] * y_of(t, j)

    in that order of ``j`` (a fixed order, no atomics: NOTE [dispatch order]).

    Args:
        y: ``[N, d_out]`` expert outputs, one row per row ``dispatch`` returned, in its order.
        handle: ``dispatch``'s ``Dispatched``.

    Returns:
        ``[T, d_out]``, in ``y``'s dtype.

    Raises:
        ValueError: ``y`` has not one row per dispatched row.

    Examples:
        >>> x = torch.tensor([[0.0], [1.0], [2.0]])
        >>> r = fpipe.moe.route(torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), 2)
        >>> tokens, handle = fpipe.moe.dispatch(x, r, 2)
        >>> torch.allclose(fpipe.moe.combine(tokens, handle), x)  # the weights sum to 1
        True
    """
    rows = handle.rows
    if y.dim() != 2 or y.shape[0] != rows:
        raise ValueError(
            f"fpipe.moe.combine: y must have one row per dispatched row, {rows} "
            f"(y: shape {tuple(y.shape)}). Keep the rows in the order dispatch gave them."
        )
    if handle.capacity is not None:
        size, dim = len(handle.send_splits), y.shape[1]
        by_rank = y.reshape(-1, size, handle.capacity, dim).transpose(0, 1).reshape(-1, dim)
        sent = (
            by_rank
            if handle.group is None
            else _all_to_all(by_rank, handle.send_splits, handle.receive_splits, handle.group)
        )
        back = torch.cat([sent, y.new_zeros(1, dim)])[handle.pair_slot]  # order 1, zeros for dropped pairs
    elif handle.group is None:
        back = y
    else:
        inverse = torch.empty_like(handle.expert_order)
        inverse[handle.expert_order] = torch.arange(rows, device=y.device)
        back = _all_to_all(y[inverse], handle.send_splits, handle.receive_splits, handle.group)  # order 1
    num_tokens, top_k = handle.weights.shape
    unsort = torch.empty_like(handle.pair_order)
    unsort[handle.pair_order] = torch.arange(num_tokens * top_k, device=y.device)
    pairs = back[unsort].reshape(num_tokens, top_k, y.shape[1])
    weights = handle.weights.to(y.dtype)
    out = pairs[:, 0] * weights[:, 0, None]
    for j in range(1, top_k):
        out = out + pairs[:, j] * weights[:, j, None]
    return out


def _all_to_all(
    rows: torch.Tensor, receive_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """The differentiable all_to_all of ``rows`` (its backward is the reverse exchange), waited
    on; posted, then a communication point, then waited for, in the forward and in the backward
    (NOTE [overlapped pairs] in fpipe/_pairs.py)."""
    out: torch.Tensor = _Exchange.apply(rows, receive_splits, send_splits, group)  # type: ignore[no-untyped-call]
    return out


class _Exchange(torch.autograd.Function):
    """torch's functional all_to_all, posted and waited for around a communication point; its
    backward is the reverse exchange, the same way (``all_to_all_single_autograd``'s, with the
    point between posting and waiting)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, receive_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (receive_splits, send_splits), group
        return _exchange(rows, receive_splits, send_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        receive_splits, send_splits = ctx.splits
        return _exchange(grad, send_splits, receive_splits, ctx.group), None, None, None


def _exchange(
    rows: torch.Tensor, receive_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = functional.all_to_all_single(rows.contiguous(), receive_splits, send_splits, group)
    communication_point()  # another microbatch's half of an overlapped pair runs while it flies
    waited: torch.Tensor = functional.wait_tensor(out)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return waited


def _agree(
    group: dist.ProcessGroup, num_experts: int, dim: int, pairs: int, counted: int, device: torch.device
) -> None:
    """Raise on every rank if the ranks disagree on what they exchange (NOTE [split agreement])."""
    size = dist.get_world_size(group)
    mine = torch.tensor([num_experts, dim, pairs, counted], dtype=torch.int64, device=device)
    headers = torch.empty(size * 4, dtype=torch.int64, device=device)
    dist.all_gather_single(headers, mine, group=group)
    rows = headers.reshape(size, 4).tolist()
    for rank, (experts, features, sent, summed) in enumerate(rows):
        if summed != sent:
            raise ValueError(
                f"fpipe.moe.dispatch: rank {rank} of the expert-parallel group counted {summed} routed "
                f"pairs but has {sent} to send (tokens x top_k). Its token counts disagree with its "
                "routing; every rank must count with the routing it dispatches."
            )
        if (experts, features) != tuple(rows[0][:2]):
            raise ValueError(
                f"fpipe.moe.dispatch: the ranks of the expert-parallel group disagree on "
                f"(num_experts, features): rank 0 has {tuple(rows[0][:2])}, rank {rank} has "
                f"{(experts, features)}. Every rank must run the same layer with the same sizes."
            )
