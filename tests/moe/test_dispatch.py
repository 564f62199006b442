"""fpipe.moe's dispatch and combine in one process (``group=None``): the rows' order (NOTE
[dispatch order]), the weighted sum and its gradients against plain loops, and the errors. Over
several ranks (variable splits, the split agreement): tests/moe/test_layer.py's spawns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fpipe.moe import Routing, combine, dispatch, route
from tests.helpers import assert_bitwise, assert_close


@given(
    num_tokens=st.integers(0, 9),
    num_experts=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_dispatch_orders_rows_by_expert_token_slot_and_combine_sums_them(
    num_tokens: int, num_experts: int, data: st.DataObject, seed: int
) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 3, generator=g)
    routing = route(torch.randn(num_tokens, num_experts, generator=g).round(), top_k)
    tokens, handle = dispatch(x, routing, num_experts)

    pairs = sorted((int(routing.experts[t, j]), t, j) for t in range(num_tokens) for j in range(top_k))
    expected = torch.stack([x[t] for _, t, _ in pairs]) if pairs else torch.zeros(0, 3)
    assert_bitwise(tokens, expected)
    assert handle.tokens_per_expert.tolist() == [sum(e == i for e, _, _ in pairs) for i in range(num_experts)]

    y = tokens * 2 + 1  # any per-row function
    out = combine(y, handle)
    loop = torch.zeros(num_tokens, 3)
    for t in range(num_tokens):
        for j in range(top_k):
            loop[t] += routing.weights[t, j] * (x[t] * 2 + 1)
    assert_close(out, loop, 1e-12)


def test_gradients_through_dispatch_and_combine_match_a_dense_loop() -> None:
    x, logits, scale = torch.randn(7, 4), torch.randn(7, 5), torch.randn(5, 4)

    def layer(x: torch.Tensor, logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        routing = route(logits, 2)
        tokens, handle = dispatch(x, routing, 5)
        rows = torch.split(tokens, handle.tokens_per_expert.tolist())
        y = torch.cat([torch.tanh(r * scale[e]) for e, r in enumerate(rows)])
        return (combine(y, handle) ** 2).sum()

    def dense(x: torch.Tensor, logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        routing = route(logits, 2)
        out = torch.zeros_like(x)
        for e in range(5):
            gate = (routing.weights * (routing.experts == e)).sum(1)
            out = out + gate[:, None] * torch.tanh(x * scale[e])
        return (out**2).sum()

    got = torch.func.grad_and_value(layer, argnums=(0, 1, 2))(x, logits, scale)
    expected = torch.func.grad_and_value(dense, argnums=(0, 1, 2))(x, logits, scale)
    assert_close(got, expected, 1e-12)
    assert_bitwise(torch.func.grad_and_value(layer, argnums=(0, 1, 2))(x, logits, scale), got)


def test_dispatch_keeps_the_rows_dtype_and_combine_follows_y() -> None:
    x = torch.randn(4, 2, dtype=torch.float32)
    routing = route(torch.randn(4, 3), 2)
    tokens, handle = dispatch(x, routing, 3)
    assert tokens.dtype == torch.float32
    assert combine(tokens, handle).dtype == torch.float32


def test_bad_shapes_fail() -> None:
    routing = route(torch.randn(4, 3), 1)
    with pytest.raises(ValueError, match=r"one row per row of routing.experts \(x: shape \(5, 2\)"):
        dispatch(torch.randn(5, 2), routing, 3)
    with pytest.raises(ValueError, match=r"outside 0..1 \(num_experts: 2\)"):
        dispatch(torch.randn(4, 2), Routing(torch.tensor([[0], [1], [2], [0]]), routing.weights, routing.scores), 2)
    tokens, handle = dispatch(torch.randn(4, 2), routing, 3)
    with pytest.raises(ValueError, match=r"one row per dispatched row, 4 \(y: shape \(3, 2\)\)"):
        combine(tokens[:3], handle)


# --- With a capacity: fixed rows per expert, the pairs beyond dropped -------------------------


def kept_pairs(routing: Routing, num_experts: int, capacity: int) -> set[tuple[int, int]]:
    """The (token, slot) pairs a capacity keeps: each expert's first ``capacity`` by (token, slot)."""
    pairs = [(t, j) for t in range(routing.experts.shape[0]) for j in range(routing.experts.shape[1])]
    kept: set[tuple[int, int]] = set()
    for e in range(num_experts):
        kept |= set(sorted(pair for pair in pairs if int(routing.experts[pair]) == e)[:capacity])
    return kept


@given(
    num_tokens=st.integers(0, 9),
    num_experts=st.integers(1, 5),
    capacity=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_a_capacity_keeps_each_experts_first_pairs(
    num_tokens: int, num_experts: int, capacity: int, data: st.DataObject, seed: int
) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 3, generator=g)
    routing = route(torch.randn(num_tokens, num_experts, generator=g).round(), top_k)
    tokens, handle = dispatch(x, routing, num_experts, capacity=capacity)

    kept = kept_pairs(routing, num_experts, capacity)
    expected = torch.zeros(num_experts, capacity, 3)
    for e in range(num_experts):
        mine = sorted((t, j) for t, j in kept if int(routing.experts[t, j]) == e)
        for c, (t, _) in enumerate(mine):
            expected[e, c] = x[t]
    assert_bitwise(tokens, expected.reshape(-1, 3))
    assert handle.tokens_per_expert.tolist() == [capacity] * num_experts

    out = combine(tokens * 2 + 1, handle)
    loop = torch.zeros(num_tokens, 3)
    for t, j in kept:
        loop[t] += routing.weights[t, j] * (x[t] * 2 + 1)
    assert_close(out, loop, 1e-12)
    if all(int(n) <= capacity for n in torch.bincount(routing.experts.reshape(-1), minlength=num_experts)):
        dropless, dropless_handle = dispatch(x, routing, num_experts)
        assert_bitwise(out, combine(dropless * 2 + 1, dropless_handle))  # nothing dropped: the same bits


def test_gradients_with_a_capacity_match_a_dense_loop_that_drops() -> None:
    x, logits, scale = torch.randn(9, 4), torch.randn(9, 3), torch.randn(3, 4)
    kept = kept_pairs(route(logits, 2), 3, 4)

    def layer(x: torch.Tensor, logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        tokens, handle = dispatch(x, route(logits, 2), 3, capacity=4)
        y = torch.tanh(tokens.reshape(3, 4, 4) * scale[:, None]).reshape(-1, 4)
        return (combine(y, handle) ** 2).sum()

    def dense(x: torch.Tensor, logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        routing = route(logits, 2)
        mask = torch.zeros(9, 2)
        for t, j in kept:
            mask[t, j] = 1.0
        out = torch.zeros_like(x)
        for e in range(3):
            gate = (routing.weights * mask * (routing.experts == e)).sum(1)
            out = out + gate[:, None] * torch.tanh(x * scale[e])
        return (out**2).sum()

    assert len(kept) < 18  # some pairs are dropped
    got = torch.func.grad_and_value(layer, argnums=(0, 1, 2))(x, logits, scale)
    assert_close(got, torch.func.grad_and_value(dense, argnums=(0, 1, 2))(x, logits, scale), 1e-12)


@pytest.mark.parametrize("capacity", [0, -1, 2.0, True])
def test_a_bad_capacity_fails(capacity: object) -> None:
    routing = route(torch.randn(4, 3), 1)
    with pytest.raises(ValueError, match=rf"capacity must be a positive int or None \(capacity: {capacity!r}\)"):
        dispatch(torch.randn(4, 2), routing, 3, capacity=capacity)  # type: ignore[arg-type]
