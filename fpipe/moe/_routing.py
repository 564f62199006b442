"""Routing: which experts each token goes to, with which gate weights, and the balance loss.

NOTE [deterministic top-k]
Ties between experts (equal router logits, or equal biased scores) are broken by the expert
index: the lower index wins. ``torch.topk`` promises no order among equal values (and CUDA's
differs from the CPU's), so the choice is a stable descending sort of the selection scores
over the experts, whose first ``top_k`` columns are taken: equal scores keep their index order.
The sort costs ``E log E`` per token instead of ``E``, negligible beside the experts' matmuls,
and makes the routing a function of the logits alone: every rank, every run and every device
routes a token the same way, so dispatch splits and losses are reproducible bit for bit.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from .._plural import listing, plural

Score = Literal["softmax", "sigmoid"]
"""How router logits become scores: ``"softmax"`` over the experts (Switch, Mixtral, DeepSeek-V2)
or an independent ``"sigmoid"`` per expert (DeepSeek-V3)."""


class Routing(NamedTuple):
    """Where each of ``T`` tokens goes: its ``k`` experts and their gate weights.

    Attributes:
        experts: ``[T, k]`` int64, each token's chosen experts, in descending order of the
            selection score (ties: lower index first, NOTE [deterministic top-k]).
        weights: ``[T, k]``, the gate weight of each choice (differentiable: the gradient reaches
            the router through them).
        scores: ``[T, E]``, every expert's score for every token (softmax probabilities or
            sigmoid affinities), what ``balance_loss`` averages.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor


def route(
    logits: torch.Tensor,
    /,
    top_k: int,
    *,
    score: Score = "softmax",
    bias: torch.Tensor | None = None,
    normalize: bool | None = None,
) -> Routing:
    """The top-``top_k`` experts of each token and their gate weights, from router logits.

    Conceptually, for each token ``t``::

        s = softmax(logits[t]) if score == "softmax" else sigmoid(logits[t])
        experts[t] = the top_k indices of s + bias, by descending value, lower index first on ties
        weights[t] = s[experts[t]]
        if normalize:  # by default: score == "sigmoid"
            weights[t] = weights[t] / weights[t].sum()

    By default, with ``"softmax"`` the weights are the chosen probabilities, not renormalized
    (Switch Transformer, arXiv:2101.03961; DeepSeek-V2, arXiv:2405.04434); with ``"sigmoid"``
    they are the chosen affinities normalized over the ``top_k`` choices (DeepSeek-V3,
    arXiv:2412.19437). ``normalize=True`` with ``"softmax"`` renormalizes the chosen
    probabilities to sum to 1, as Mixtral does (and Qwen3-MoE with ``norm_topk_prob``).
    ``bias`` is DeepSeek-V3's auxiliary-loss-free balancing: a per-expert offset added to the
    scores for the *selection* only; the weights and ``scores`` never see it (nor does the
    gradient: the selection is not differentiable). The caller updates it between steps from
    the token counts (``token_counts``), e.g. ``bias += rate * sign(mean(counts) - counts)``.

    Ties are broken by the expert index, lower first (NOTE [deterministic top-k]).

    Args:
        logits: ``[T, E]`` router logits, one row per token.
        top_k: experts per token, ``1 <= top_k <= E``.
        score: ``"softmax"`` or ``"sigmoid"``.
        bias: ``[E]`` selection bias, or None.
        normalize: divide each token's weights by their sum; None: for ``"sigmoid"`` only.

    Returns:
        A ``Routing`` (``experts`` and ``weights`` ``[T, top_k]``, ``scores`` ``[T, E]``).

    Raises:
        ValueError: ``logits`` not 2-D, ``top_k`` out of range, an unknown ``score``, a ``bias``
            of the wrong shape, a ``normalize`` not a bool or None, or logits that are NaN or
            infinite (naming the tokens).

    Examples:
        >>> logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 1.0, 5.0]])
        >>> r = fpipe.moe.route(logits, 2)
        >>> r.experts  # token 0: experts 1 and 2 tie, both chosen, 1 first
        tensor([[1, 2],
                [3, 0]])
        >>> fpipe.moe.route(logits, 1, bias=torch.tensor([0.0, 0.0, 0.1, 0.0])).experts  # token 0 now 2
        tensor([[2],
                [3]])
        >>> fpipe.moe.route(logits, 2, normalize=True).weights  # Mixtral's: each row sums to 1
        tensor([[0.5000, 0.5000],
                [0.9526, 0.0474]])
    """
    if logits.dim() != 2:
        raise ValueError(
            f"fpipe.moe.route: logits must be 2-D, [tokens, experts] (logits: shape {tuple(logits.shape)}). "
            "Flatten the batch dimensions first: logits.reshape(-1, num_experts)."
        )
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"fpipe.moe.route: top_k must be an int from 1 to the number of experts, {num_experts} "
            f"(top_k: {top_k!r}). Choose fewer experts per token or more experts."
        )
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f'fpipe.moe.route: score must be "softmax" or "sigmoid" (score: {score!r}).')
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(
            f"fpipe.moe.route: bias must have one entry per expert, shape ({num_experts},) "
            f"(bias: shape {tuple(bias.shape)})."
        )
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"fpipe.moe.route: normalize must be True, False or None (normalize: {normalize!r}).")
    check_finite(logits, "fpipe.moe.route")
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    selection = scores.detach() if bias is None else scores.detach() + bias.detach().to(scores.dtype)
    order = torch.sort(selection, dim=-1, descending=True, stable=True).indices  # NOTE [deterministic top-k]
    experts = order[:, :top_k].contiguous()
    weights = scores.gather(1, experts)
    if (score == "sigmoid") if normalize is None else normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights, scores)


def check_finite(logits: torch.Tensor, where: str) -> None:
    """Raise a ValueError naming the tokens (rows) of ``logits`` with a NaN or an infinity."""
    bad = (~torch.isfinite(logits.detach())).any(dim=-1)
    if bool(bad.any()):
        tokens = [str(t) for t in bad.nonzero().flatten().tolist()]
        raise ValueError(
            f"{where}: the router logits are NaN or infinite for {plural(len(tokens), 'token')} of "
            f"{logits.shape[0]} (tokens {listing(tokens)}). The activations or the router weights "
            "have diverged: check the learning rate, the loss scale, and the inputs of these tokens."
        )


def token_counts(routing: Routing, /, num_experts: int) -> torch.Tensor:
    """How many tokens chose each expert: int64 ``[num_experts]``, summing to ``T * k``.

    Conceptually ``[(routing.experts == e).sum() for e in range(num_experts)]``. These are the
    counts DeepSeek-V3's bias update reads, and what ``balance_loss`` weights the scores by.

    Examples:
        >>> r = fpipe.moe.route(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 1.0, 5.0]]), 2)
        >>> fpipe.moe.token_counts(r, 4)
        tensor([1, 1, 1, 1])
    """
    _check_experts(routing.experts, num_experts, "fpipe.moe.token_counts")
    return torch.bincount(routing.experts.reshape(-1), minlength=num_experts)


def _check_experts(experts: torch.Tensor, num_experts: int, where: str) -> None:
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < num_experts:
        raise ValueError(
            f"{where}: the routing names experts from {int(experts.min())} to {int(experts.max())}, "
            f"outside 0..{num_experts - 1} (num_experts: {num_experts}). Pass the router's number of experts."
        )


def balance_loss(routing: Routing, /, num_experts: int, *, sequence_length: int | None = None) -> torch.Tensor:
    """The auxiliary load-balancing loss of Switch Transformer and DeepSeek, unscaled.

    Over one group of ``T`` tokens, with ``k`` experts per token::

        f[i] = num_experts / (k * T) * (number of choices of expert i)   # detached: counts
        P[i] = mean over the T tokens of p[t, i]
        loss = sum over i of f[i] * P[i]

    where ``p[t] = scores[t] / scores[t].sum()`` (the softmax probabilities themselves, or
    DeepSeek-V3's normalized sigmoid affinities). A perfectly balanced routing gives 1 with
    softmax scores. Multiply by your coefficient (DeepSeek-V3's alpha) before adding it to the
    loss. The gradient reaches the router through ``P`` only.

    Without ``sequence_length`` the group is every token given: called on a microbatch, this is
    a per-microbatch loss. With it, the ``T`` tokens are ``T / sequence_length`` sequences of
    consecutive tokens, the loss is computed per sequence and averaged over the sequences:
    DeepSeek-V3's sequence-wise balance loss.

    What a "global-batch" balance loss can and cannot mean under microbatching: a stage's
    forward sees one microbatch, never the others, so a loss whose ``f`` counts the whole
    batch's tokens cannot be computed in a forward. It can be had as the sum (or mean) of the
    per-microbatch terms this function returns, which is what the pipeline's loss over
    microbatches gives, or from the counts of the previous step (passed in as data), which is
    how DeepSeek-V3's bias update balances over the global batch without a loss at all.

    Args:
        routing: the ``Routing`` of the group's tokens.
        num_experts: ``E``, the number of experts.
        sequence_length: the length of each sequence, dividing ``T``; None: one group.

    Returns:
        A scalar tensor (0 for no tokens).

    Examples:
        >>> r = fpipe.moe.route(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 1.0, 5.0]]), 2)
        >>> fpipe.moe.balance_loss(r, 4)
        tensor(1.)
    """
    experts, scores = routing.experts, routing.scores
    num_tokens, top_k = experts.shape
    if tuple(scores.shape) != (num_tokens, num_experts):
        raise ValueError(
            f"fpipe.moe.balance_loss: the routing's scores must be [tokens, num_experts] = "
            f"[{num_tokens}, {num_experts}] (scores: shape {tuple(scores.shape)})."
        )
    _check_experts(experts, num_experts, "fpipe.moe.balance_loss")
    length = max(num_tokens, 1) if sequence_length is None else sequence_length
    if isinstance(length, bool) or not isinstance(length, int) or length < 1 or num_tokens % length:
        raise ValueError(
            f"fpipe.moe.balance_loss: sequence_length must be a positive int dividing the number of "
            f"tokens, {num_tokens} (sequence_length: {sequence_length!r}). Pass the tokens of whole sequences."
        )
    if num_tokens == 0:
        return scores.sum()
    num_sequences = num_tokens // length
    probabilities = scores / scores.sum(dim=-1, keepdim=True)
    mean_probability = probabilities.reshape(num_sequences, length, num_experts).mean(dim=1)  # P, per sequence
    sequence = torch.arange(num_sequences, device=experts.device).repeat_interleave(length * top_k)
    counts = torch.bincount(sequence * num_experts + experts.reshape(-1), minlength=num_sequences * num_experts)
    fraction = counts.reshape(num_sequences, num_experts).to(scores.dtype) * (num_experts / (top_k * length))
    return (fraction * mean_probability).sum(dim=-1).mean()
