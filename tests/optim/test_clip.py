"""``fpipe.optim.clip_by_global_norm`` scales as ``torch.nn.utils.clip_grad_norm_`` does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fpipe
import fpipe.optim
import fpipe.schedules


def test_scales_like_clip_grad_norm() -> None:
    grads = [{"w": torch.randn(3, 4), "n": None}, None, {"b": torch.randn(5)}]
    leaves = [grads[0]["w"], grads[2]["b"]]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in leaves]))
    for max_norm in (0.5, 1e9):
        copies = [g.clone().requires_grad_() for g in leaves]
        for c, g in zip(copies, leaves):
            c.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(copies, max_norm, foreach=False)
        clipped = fpipe.optim.clip_by_global_norm(grads, norm, max_norm=max_norm)
        assert clipped[1] is None and clipped[0]["n"] is None
        assert torch.equal(clipped[0]["w"], copies[0].grad) and torch.equal(clipped[2]["b"], copies[1].grad)
    assert torch.linalg.vector_norm(fpipe.optim.clip_by_global_norm(grads, norm, max_norm=0.5)[2]["b"]) < 0.5
    assert torch.equal(grads[0]["w"], leaves[0])  # not modified


def test_takes_a_norm_function() -> None:
    """A norm function (``step.global_norm``) clips as the norm it returns does."""
    stages = [lambda p, x: x @ p, lambda p, x: torch.tanh(x @ p)]
    step = fpipe.pipeline(lambda y, mb: (y**2).mean(), stages, fpipe.schedules.GPipe(2))
    _, grads = step([torch.randn(3, 3, dtype=torch.float64) for _ in range(2)], torch.randn(4, 3, dtype=torch.float64))
    by_value = fpipe.optim.clip_by_global_norm(grads, step.global_norm(grads), max_norm=0.1)
    by_function = fpipe.optim.clip_by_global_norm(grads, step.global_norm, max_norm=0.1)
    assert all(torch.equal(a, b) for a, b in zip(by_value, by_function))


def test_params_leave_the_tied_copies_out_of_the_norm() -> None:
    """With every stage's params, a name in several stages (a tied parameter) is counted in its
    first stage only, as ``clip_grad_norm_`` counts the unsplit model's one tensor (trained
    against it in tests/optim/test_aliases.py)."""
    params = [{"w": torch.ones(2), "a": torch.ones(3)}, None, {"w": torch.ones(2), "b": torch.ones(1)}]
    grads = [{"w": torch.tensor([3.0, 4.0]), "a": torch.zeros(3)}, None, {"w": torch.tensor([3.0, 4.0]), "b": None}]
    seen: list[list[Any]] = []

    def norm(g: list[Any]) -> torch.Tensor:
        seen.append(g)
        return torch.linalg.vector_norm(torch.cat([t for s in g if s is not None for t in s.values() if t is not None]))

    clipped = fpipe.optim.clip_by_global_norm(grads, norm, max_norm=1.0, params=params)
    assert seen[0][0] is grads[0] and seen[0][1] is None and seen[0][2] == {"w": None, "b": None}
    assert torch.allclose(clipped[2]["w"], torch.tensor([0.6, 0.8]))  # the norm is 5, not 5 * sqrt(2)
    assert torch.allclose(
        fpipe.optim.clip_by_global_norm(grads, norm, max_norm=1.0)[2]["w"], torch.tensor([0.6, 0.8]) / 2**0.5
    )


def test_errors() -> None:
    with pytest.raises(TypeError, match="norm must be a scalar"):
        fpipe.optim.clip_by_global_norm([], torch.ones(2), max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        fpipe.optim.clip_by_global_norm([], torch.tensor(1.0), max_norm=0.0)
    with pytest.raises(
        TypeError, match=r"params= needs a norm function, to leave the tied copies out of the norm \(norm: Tensor\)"
    ):
        fpipe.optim.clip_by_global_norm([], torch.tensor(1.0), max_norm=1.0, params=[])
    with pytest.raises(ValueError, match=r"params has 1 entry but grads has 2 stages"):
        fpipe.optim.clip_by_global_norm([None, None], lambda g: torch.tensor(1.0), max_norm=1.0, params=[None])
