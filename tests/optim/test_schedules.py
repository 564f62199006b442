"""``fpipe.optim.warmup_cosine``: the warm-up and the cosine written out, and its errors."""

from __future__ import annotations

import math

import pytest

import fpipe.optim


def test_warmup_then_cosine_then_min_lr() -> None:
    schedule = fpipe.optim.warmup_cosine(2.0, warmup_steps=4, total_steps=8, min_lr=0.2)
    assert [schedule(k) for k in range(4)] == [0.5, 1.0, 1.5, 2.0]
    for k in range(4, 12):
        progress = min(1.0, (k - 4) / 4)
        assert schedule(k) == 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * progress))
    assert schedule(6) == pytest.approx(1.1) and schedule(8) == schedule(100) == pytest.approx(0.2)
    assert fpipe.optim.warmup_cosine(1.0, warmup_steps=0, total_steps=0)(0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"warmup_steps": -1, "total_steps": 3}, "warmup_steps must be a non-negative int (warmup_steps: -1)"),
        ({"warmup_steps": 1, "total_steps": 2.5}, "total_steps must be a non-negative int (total_steps: 2.5)"),
        ({"warmup_steps": 5, "total_steps": 3}, "total_steps is shorter than the warm-up (total_steps: 3"),
        ({"warmup_steps": 1, "total_steps": 3, "min_lr": 2.0}, "0 <= min_lr <= peak_lr (min_lr: 2.0, peak_lr: 1.0)"),
    ],
)
def test_errors(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        fpipe.optim.warmup_cosine(1.0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [-3, 1.5, True])
def test_warmup_cosine_takes_a_non_negative_int_step(step: object) -> None:
    schedule = fpipe.optim.warmup_cosine(1e-3, warmup_steps=2, total_steps=10)
    with pytest.raises(ValueError, match="a non-negative int"):
        schedule(step)  # type: ignore[arg-type]
