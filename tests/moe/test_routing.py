"""fpipe.moe's routing against plain loops: top-k with ties to the lower index, the weights, the
bias that moves only the selection, the counts and the balance loss (and its gradient), and the
errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fpipe.moe import Routing, balance_loss, route, token_counts
from tests.helpers import assert_bitwise, assert_close


def reference_route(logits: torch.Tensor, top_k: int, score: str, bias: torch.Tensor | None) -> Routing:
    """``route`` as a loop over tokens: sort by (-score - bias, index)."""
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    experts, weights = [], []
    for t in range(logits.shape[0]):
        key = [float(scores[t, e]) + (0.0 if bias is None else float(bias[e])) for e in range(logits.shape[1])]
        chosen = sorted(range(logits.shape[1]), key=lambda e: (-key[e], e))[:top_k]
        w = scores[t, chosen]
        experts.append(chosen)
        weights.append(w / w.sum() if score == "sigmoid" else w)
    stacked = torch.stack(weights) if weights else torch.zeros(0, top_k)
    return Routing(torch.tensor(experts, dtype=torch.int64).reshape(-1, top_k), stacked, scores)


def reference_balance_loss(routing: Routing, num_experts: int, length: int) -> torch.Tensor:
    """The sequence-wise loss as written in DeepSeek-V3 (arXiv:2412.19437, eq. 17-20), a loop per sequence."""
    num_tokens, top_k = routing.experts.shape
    losses = []
    for start in range(0, num_tokens, length):
        experts = routing.experts[start : start + length]
        scores = routing.scores[start : start + length]
        total = torch.zeros((), dtype=scores.dtype)
        for i in range(num_experts):
            f = num_experts / (top_k * length) * float((experts == i).sum())
            p = (scores[:, i] / scores.sum(-1)).mean()
            total = total + f * p
        losses.append(total)
    return torch.stack(losses).mean()


@given(
    num_tokens=st.integers(0, 9),
    num_experts=st.integers(1, 8),
    data=st.data(),
    score=st.sampled_from(["softmax", "sigmoid"]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_route_matches_a_loop_over_tokens(
    num_tokens: int, num_experts: int, data: st.DataObject, score: str, with_bias: bool, seed: int
) -> None:
    top_k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g).round()  # rounded: ties are common
    bias = torch.randn(num_experts, generator=g).round() / 4 if with_bias else None
    got = route(logits, top_k, score=score, bias=bias)  # type: ignore[arg-type]
    expected = reference_route(logits, top_k, score, bias)
    assert torch.equal(got.experts, expected.experts)
    assert_close(got.weights, expected.weights, 1e-12)
    assert_close(got.scores, expected.scores, 1e-12)


def test_exact_ties_go_to_the_lower_expert_index() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 2.0], [5.0, 1.0, 5.0, 1.0]])
    assert route(logits, 2).experts.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert route(logits, 3, score="sigmoid").experts.tolist() == [[0, 1, 2], [1, 2, 3], [0, 2, 1]]


def test_the_bias_moves_the_selection_not_the_weights() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    plain = route(logits, 1, score="sigmoid")
    biased = route(logits, 1, score="sigmoid", bias=torch.tensor([0.0, 0.0, 10.0]))
    assert (plain.experts.item(), biased.experts.item()) == (0, 2)
    assert torch.equal(biased.scores, plain.scores)
    two = route(logits, 2, score="sigmoid", bias=torch.tensor([0.0, 0.0, 10.0]))
    s = torch.sigmoid(logits[0])
    assert_close(two.weights[0], torch.stack([s[2], s[0]]) / (s[2] + s[0]), 1e-12)


def test_softmax_weights_are_the_chosen_probabilities() -> None:
    logits = torch.randn(6, 5)
    r = route(logits, 2)
    assert_close(r.weights, torch.softmax(logits, -1).gather(1, r.experts), 1e-15)


@pytest.mark.parametrize(
    ("logits", "top_k", "kwargs", "fragment"),
    [
        (torch.zeros(3, 4), 5, {}, "top_k must be an int from 1 to the number of experts, 4 (top_k: 5)"),
        (torch.zeros(3, 4), 0, {}, "(top_k: 0)"),
        (torch.zeros(3, 4), 1.0, {}, "(top_k: 1.0)"),
        (torch.zeros(2, 3, 4), 1, {}, "logits must be 2-D"),
        (torch.zeros(3, 4), 1, {"score": "relu"}, 'score must be "softmax" or "sigmoid" (score: \'relu\')'),
        (torch.zeros(3, 4), 1, {"bias": torch.zeros(3)}, "bias must have one entry per expert, shape (4,)"),
    ],
)
def test_bad_arguments_fail(logits: torch.Tensor, top_k: int, kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        route(logits, top_k, **kwargs)  # type: ignore[arg-type]


def test_non_finite_logits_fail_naming_the_tokens() -> None:
    logits = torch.zeros(5, 3)
    logits[1, 2], logits[3, 0] = float("nan"), float("-inf")
    with pytest.raises(ValueError, match=r"NaN or infinite for 2 tokens of 5 \(tokens 1, 3\)"):
        route(logits, 1)


def test_token_counts_count_every_choice() -> None:
    r = route(torch.randn(7, 5), 3)
    counts = token_counts(r, 5)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [int((r.experts == e).sum()) for e in range(5)]
    assert token_counts(r, 6).tolist() == [*counts.tolist(), 0]
    wrong = Routing(torch.tensor([[0, 5]]), r.weights[:1], r.scores[:1])
    with pytest.raises(ValueError, match=r"experts from 0 to 5, outside 0..4 \(num_experts: 5\)"):
        token_counts(wrong, 5)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize(("num_tokens", "sequence_length"), [(12, None), (12, 4), (12, 1), (5, 5)])
def test_balance_loss_and_its_gradient_match_the_papers_formula(
    score: str, num_tokens: int, sequence_length: int | None
) -> None:
    logits = torch.randn(num_tokens, 6)
    length = num_tokens if sequence_length is None else sequence_length

    def loss(logits: torch.Tensor, reference: bool) -> torch.Tensor:
        r = route(logits, 2, score=score)  # type: ignore[arg-type]
        if reference:
            return reference_balance_loss(r, 6, length)
        return balance_loss(r, 6, sequence_length=sequence_length)

    got_grad, got = torch.func.grad_and_value(loss)(logits, False)
    expected_grad, expected = torch.func.grad_and_value(loss)(logits, True)
    assert_close(got, expected, 1e-12)
    assert_close(got_grad, expected_grad, 1e-12)


def test_a_balanced_routing_costs_one_and_no_tokens_cost_nothing() -> None:
    r = route(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 1.0, 5.0]]), 2)
    assert balance_loss(r, 4).item() == pytest.approx(1.0, abs=1e-12)
    empty = route(torch.zeros(0, 4), 2)
    assert balance_loss(empty, 4).item() == 0.0
    assert token_counts(empty, 4).tolist() == [0, 0, 0, 0]


def test_balance_loss_bad_sequence_length_fails() -> None:
    r = route(torch.randn(6, 4), 1)
    with pytest.raises(ValueError, match=r"dividing the number of tokens, 6 \(sequence_length: 4\)"):
        balance_loss(r, 4, sequence_length=4)
    with pytest.raises(ValueError, match=r"\[tokens, num_experts\] = \[6, 5\]"):
        balance_loss(r, 5)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_normalize_divides_the_chosen_weights_by_their_sum(score: str) -> None:
    """``normalize=True`` is Mixtral's routing with softmax (softmax, top-k, renormalized) and
    ``False`` leaves sigmoid affinities as they are; None keeps each score's default."""
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    top = torch.topk(s, 2, dim=-1)  # no ties in random logits
    normalized = route(logits, 2, score=score, normalize=True)  # type: ignore[arg-type]
    plain = route(logits, 2, score=score, normalize=False)  # type: ignore[arg-type]
    default = route(logits, 2, score=score)  # type: ignore[arg-type]
    assert torch.equal(normalized.experts, top.indices) and torch.equal(plain.experts, top.indices)
    assert_close(normalized.weights, top.values / top.values.sum(-1, keepdim=True), 1e-15)
    assert_close(plain.weights, top.values, 1e-15)
    assert_bitwise(default.weights, normalized.weights if score == "sigmoid" else plain.weights)
    with pytest.raises(ValueError, match=r"normalize must be True, False or None \(normalize: 1\)"):
        route(logits, 2, normalize=1)  # type: ignore[arg-type]
