"""The interpreter (fpipe/_executor.py): one loop over ``(rank, action)`` pairs, one dispatch on
the kind, a transport that moves values; seeds carry the loss weights; failures name the action."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fpipe import PipelineError
from fpipe._executor import Executor, LocalTransport
from fpipe._stage import Grads, StageRun
from fpipe.schedules import Action
from tests.helpers import assert_bitwise


def _scale(params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x * params


def _sum(y: torch.Tensor, microbatch: Any) -> torch.Tensor:
    return y.sum()


class Spy(LocalTransport):
    """A local transport that logs each message: ``("send activation", stage, microbatch)``..."""

    def __init__(self, microbatches: list[Any]) -> None:
        super().__init__(microbatches)
        self.log: list[tuple[str, int, int]] = []

    def send_activation(self, stage: int, microbatch: int, value: Any) -> None:
        self.log.append(("send activation", stage, microbatch))
        super().send_activation(stage, microbatch, value)

    def recv_activation(self, stage: int, microbatch: int) -> Any:
        self.log.append(("recv activation", stage, microbatch))
        return super().recv_activation(stage, microbatch)

    def send_cotangent(self, stage: int, microbatch: int, value: Grads) -> None:
        self.log.append(("send cotangent", stage, microbatch))
        super().send_cotangent(stage, microbatch, value)

    def recv_cotangent(self, stage: int, microbatch: int) -> Grads:
        self.log.append(("recv cotangent", stage, microbatch))
        return super().recv_cotangent(stage, microbatch)


def _order(*actions: str) -> list[tuple[int, Action]]:
    return [(Action.parse(a).stage, Action.parse(a)) for a in actions]


def _executor(
    microbatches: list[torch.Tensor], weights: list[float], *, fns: Any = (_scale, _scale), **options: Any
) -> tuple[Executor, dict[int, StageRun], Spy]:
    stages = {s: StageRun(s, fn, torch.tensor(2.0 + s, dtype=torch.float64)) for s, fn in enumerate(fns)}
    transport = Spy(microbatches)
    loss_fn = options.pop("loss_fn", _sum)
    executor = Executor(stages, len(fns), loss_fn, has_aux=False, weights=weights, transport=transport, **options)
    return executor, stages, transport


def test_the_local_transport_is_a_mailbox() -> None:
    transport = LocalTransport(["mb0", "mb1"])
    transport.send_activation(0, 1, "y")  # stage 0's output is stage 1's input
    transport.send_cotangent(1, 1, ["dx"])  # stage 1's input cotangent is stage 0's output one
    assert transport.microbatch(1) == "mb1"
    assert transport.recv_activation(1, 1) == "y" and transport.recv_cotangent(0, 1) == ["dx"]
    with pytest.raises(KeyError):  # a receive pops: a value lives until the program needs it
        transport.recv_activation(1, 1)


def test_actions_move_values_through_the_transport_and_weights_seed_the_backward() -> None:
    x = [torch.ones(2, dtype=torch.float64), 3 * torch.ones(2, dtype=torch.float64)]
    executor, stages, transport = _executor(x, [0.25, 0.75])
    executor.run(_order("0F0", "1F0", "0F1", "1F1", "1B0", "0B0", "1B1", "0B1"))
    assert transport.log == [
        ("send activation", 0, 0),
        ("recv activation", 1, 0),
        ("send activation", 0, 1),
        ("recv activation", 1, 1),
        ("send cotangent", 1, 0),
        ("recv cotangent", 0, 0),
        ("send cotangent", 1, 1),
        ("recv cotangent", 0, 1),
    ]
    # loss_i = sum(x_i * 2 * 3): d/d p0 = 3 sum(x_i), d/d p1 = 2 sum(x_i), weighted 0.25, 0.75
    assert [executor.losses[i].item() for i in (0, 1)] == [12.0, 36.0]
    assert stages[0].grads().item() == 0.25 * 3 * 2 + 0.75 * 3 * 6
    assert stages[1].grads().item() == 0.25 * 2 * 2 + 0.75 * 2 * 6
    assert executor.current is None


def test_a_split_backward_gives_the_fused_backwards_gradients() -> None:
    x = [torch.arange(3.0, dtype=torch.float64)]
    fused, fused_stages, _ = _executor(x, [1.0])
    fused.run(_order("0F0", "1F0", "1B0", "0B0"))
    split, split_stages, _ = _executor(x, [1.0])
    split.run(_order("0F0", "1F0", "1I0", "0I0", "1W0", "0W0"))
    for s in (0, 1):
        assert_bitwise(split_stages[s].grads(), fused_stages[s].grads(), f"stage {s}")


def test_forward_only_keeps_outputs_and_makes_no_gradient() -> None:
    x = [torch.ones(2, dtype=torch.float64)]
    executor, stages, _ = _executor(x, [1.0], forward_only=True, keep_outputs=True)
    executor.run(_order("0F0", "1F0"))
    assert executor.losses[0].item() == 12.0 and not executor.losses[0].requires_grad
    assert torch.equal(executor.outputs[0], 6 * x[0])
    assert stages[0].grads().item() == 0.0  # no microbatch reached it: zeros


def test_a_seed_too_large_for_the_loss_dtype_is_inf() -> None:
    x = [torch.ones(2, dtype=torch.float16)] * 2
    executor, stages, _ = _executor(x, [1.0, 1.0], loss_scale=2.0**17)
    executor.run(_order("0F0", "1F0", "0F1", "1F1", "1B0", "0B0", "1B1", "0B1"))
    assert torch.isinf(stages[1].grads())


def test_failures_name_the_action() -> None:
    def broken(params: Any, x: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("no")

    executor, _, _ = _executor([torch.ones(1)], [1.0], fns=(_scale, broken))
    with pytest.raises(PipelineError, match="1F0") as raised:
        executor.run(_order("0F0", "1F0"))
    assert raised.value.action == Action(1, "F", 0) and not raised.value.in_loss_fn
    assert executor.current == Action(1, "F", 0)


def test_a_failing_loss_fn_is_told_from_its_stage() -> None:
    def loss_fn(y: torch.Tensor, microbatch: Any) -> torch.Tensor:
        raise KeyError("labels")

    executor, _, _ = _executor([torch.ones(1)], [1.0], loss_fn=loss_fn)
    with pytest.raises(PipelineError, match="loss_fn in") as raised:
        executor.run(_order("0F0", "1F0"))
    assert raised.value.in_loss_fn and isinstance(raised.value.__cause__, KeyError)
