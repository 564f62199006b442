"""``fpipe.optim.sgd`` (fpipe/optim/_sgd.py): its state against ``torch.optim.SGD``'s, and its refusals.

The battery of ``test_optimizer.py`` compares the updated parameters with ``torch.optim.SGD``;
here the state ``sgd`` keeps between updates: the momentum buffer, bitwise torch's after every
update (it starts as the first gradient, undamped), only a step count without momentum, and a
learning-rate schedule read at the number of updates done.
"""

from __future__ import annotations

import pytest
import torch

import fpipe.optim
from tests.helpers import assert_bitwise

STEPS = 4


def _tree(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w, b, c = torch.randn(3, 2, generator=g), torch.randn(4, generator=g), torch.randn((), generator=g)
    return [{"w": w}, {"b": b, "c": c}]


def _params() -> list[dict[str, torch.Tensor]]:
    return _tree(1)


def _grads(step: int) -> list[dict[str, torch.Tensor]]:
    return _tree(100 + step)


def _rate(step: int) -> float:
    return 0.2 / (1 + step)


@pytest.mark.parametrize(
    "options",
    [
        {"momentum": 0.9, "dampening": 0.5, "weight_decay": 0.1},
        {"momentum": 0.8, "nesterov": True},
        {"momentum": 0.9, "maximize": True, "foreach": False},
    ],
    ids=str,
)
def test_the_momentum_buffer_is_torch_s_after_every_update(options: dict) -> None:
    opt = fpipe.optim.sgd(_rate, **options)
    params = _params()
    state = opt.init(params)
    flat = [t.clone() for stage in params for t in stage.values()]
    torch_opt = torch.optim.SGD(flat, lr=_rate(0), **options)
    for step in range(STEPS):
        grads = _grads(step)
        params, state = opt.update(params, grads, state)
        for t, grad in zip(flat, [g for stage in grads for g in stage.values()]):
            t.grad = grad.clone()
        torch_opt.param_groups[0]["lr"] = _rate(step)
        torch_opt.step()
        buffers = [b for stage in state for b in stage["momentum_buffer"].values()]
        assert_bitwise(buffers, [torch_opt.state[t]["momentum_buffer"] for t in flat], f"update {step}")
        assert_bitwise([p for stage in params for p in stage.values()], flat, f"update {step}")
        assert [float(stage["step"]) for stage in state] == [step + 1.0] * 2


def test_the_first_update_starts_the_buffer_at_the_gradient_undamped() -> None:
    opt = fpipe.optim.sgd(0.1, momentum=0.9, dampening=0.5)
    params = _params()
    _, state = opt.update(params, _grads(0), opt.init(params))
    buffers = [state[s]["momentum_buffer"][k] for s, stage in enumerate(_grads(0)) for k in stage]
    assert_bitwise(buffers, [g for stage in _grads(0) for g in stage.values()])


def test_without_momentum_the_state_is_a_step_count() -> None:
    opt = fpipe.optim.sgd(0.1)
    params = _params()
    state = opt.init(params)
    assert [set(stage) for stage in state] == [{"step"}, {"step"}]
    params, state = opt.update(params, _grads(0), state)
    assert [set(stage) for stage in state] == [{"step"}, {"step"}] and float(state[1]["step"]) == 1.0
    assert torch.equal(params[0]["w"], _params()[0]["w"] - 0.1 * _grads(0)[0]["w"])


@pytest.mark.parametrize(("momentum", "dampening"), [(0.0, 0.0), (0.9, 0.1)])
def test_nesterov_needs_momentum_and_no_dampening(momentum: float, dampening: float) -> None:
    message = rf"nesterov needs a positive momentum and no dampening \(momentum: {momentum}, dampening: {dampening}\)"
    with pytest.raises(ValueError, match=message):
        fpipe.optim.sgd(0.1, momentum=momentum, dampening=dampening, nesterov=True)
