"""The parallel strategy as a value (``fpipe._strategy``): built once by ``pipeline()``, handed
to every run; in one process it builds replicated stages and agrees with no one (the
collectives themselves: tests/distributed/test_collectives.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fpipe
from fpipe._run import ReplicatedStages, order_for
from fpipe._strategy import Strategy
from fpipe.schedules import GPipe


def _strategy(**changes: object) -> Strategy:
    fields = {"topology": None, "parallel": fpipe.Parallelism(timeout=1.0), "divide": True}
    return Strategy(**{**fields, "precision": None, **changes})  # type: ignore[arg-type]


def test_a_strategy_is_a_frozen_value() -> None:
    strategy = _strategy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.shard_params = True  # type: ignore[misc]
    assert strategy.with_layouts({}) == strategy and strategy.with_layouts({}) is not strategy
    assert dict(strategy.layouts) == {}


def test_in_one_process_it_builds_replicated_stages_and_agrees_with_itself() -> None:
    step = fpipe.pipeline(lambda y, mb: y.sum(), [lambda p, x: x * p] * 2, GPipe(2))
    strategy = _strategy()
    held = strategy.held_stages(step, order_for(step.program, None), [torch.ones(()), torch.ones(())])
    assert isinstance(held, ReplicatedStages) and sorted(held) == [0, 1]
    grads = [torch.tensor([3.0]), None, torch.tensor([4.0])]
    assert torch.equal(strategy.global_norm([0, 2], grads), torch.tensor(5.0, dtype=torch.float64))


def test_unscale_agrees_with_itself_in_one_process_and_returns_the_next_state() -> None:
    """Without a policy the grads pass as they are; under loss scaling the inf/nan finding is this
    process's own (``any_inf_nan`` with no topology) and the next state is returned, a new value."""
    params, grads = [torch.ones(2, dtype=torch.float16)], [torch.tensor([2.0, 4.0])]
    assert _strategy().unscale(params, grads, [0], None) == (grads, None, False)
    strategy = _strategy(precision=fpipe.Precision(loss_scale=fpipe.LossScale(init=2.0, interval=1)))
    state = fpipe.LossScaleState(2.0, 0)
    unscaled, after, skipped = strategy.unscale(params, grads, [0], state)
    assert torch.equal(unscaled[0], torch.tensor([1.0, 2.0], dtype=torch.float16)) and not skipped
    assert after == fpipe.LossScaleState(4.0, 0) and state == fpipe.LossScaleState(2.0, 0)
    _, after, skipped = strategy.unscale(params, [torch.tensor([float("inf"), 0.0])], [0], state)
    assert skipped and after == fpipe.LossScaleState(1.0, 0)


def test_check_refuses_what_the_precision_policy_refuses() -> None:
    step = fpipe.pipeline(lambda y, mb: y.sum(), [lambda p, x: x * p], GPipe(1))
    policy = fpipe.Precision(compute=torch.float16, loss_scale=fpipe.LossScale())
    with pytest.raises(ValueError, match="loss scaling is for float16 parameters"):
        _strategy(precision=fpipe.Precision(loss_scale=fpipe.LossScale())).check(step, [torch.ones(2)])
    _strategy(precision=policy).check(step, [torch.ones(2)])  # float32 master weights: fine


def test_a_step_without_shards_refuses_shard() -> None:
    step = fpipe.pipeline(lambda y, mb: y.sum(), [lambda p, x: x * p], GPipe(1))
    with pytest.raises(ValueError, match="this step does not shard"):
        _strategy().shard(step, [torch.ones(2)])
    with pytest.raises(ValueError, match="the step has no layouts"):
        _strategy().gather(step, [torch.ones(2)])
