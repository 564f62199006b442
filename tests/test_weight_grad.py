"""The split backward (fpipe/_weight_grad.py, NOTE [split backward]): ``input_grad`` then
``DeferredWeightGrad.run`` give bitwise the gradients of one ``autograd.grad`` over inputs and
parameters, whatever paths join them, and ``W`` never recomputes what ``I`` ran."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from fpipe._weight_grad import input_grad
from tests.helpers import assert_bitwise

Graph = Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]]

GRAPHS: dict[str, Graph] = {
    "linear": lambda x, p: [torch.tanh(x @ p[0]) @ p[1]],
    "shared weight": lambda x, p: [torch.tanh(x @ p[0]) @ p[0]],
    "a path that misses the input": lambda x, p: [x @ p[0], p[0].sum().reshape(1, 1).expand(2, 3) * p[1][:2]],
    "a parameter off every input path": lambda x, p: [(x @ p[0]).sum() * p[1].sum().reshape(1, 1)],
    "two outputs": lambda x, p: [x @ p[0], torch.sin(x @ p[0]) @ p[1]],
}


def _leaves() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, dtype=torch.float64, generator=gen).requires_grad_()
    params = [torch.randn(3, 3, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2)]
    return x, params


def _roots(outputs: list[torch.Tensor]) -> list[GradientEdge]:
    """The outputs as a pullback keeps them (NOTE [outputs let go])."""
    return [get_gradient_edge(o) for o in outputs]


@pytest.mark.parametrize("graph", GRAPHS.values(), ids=GRAPHS.keys())
def test_input_then_weight_equals_one_backward(graph: Graph) -> None:
    x, params = _leaves()
    outputs = graph(x, params)
    cotangents = [torch.full_like(o, 0.5) for o in outputs]
    expected = torch.autograd.grad(outputs, [x, *params], cotangents, retain_graph=True, allow_unused=True)
    dx, deferred = input_grad(_roots(outputs), cotangents, [x], params)
    weights = deferred.run()
    assert_bitwise([dx[0], *weights], list(expected))


def test_without_differentiable_inputs_everything_waits_for_w() -> None:
    x, params = _leaves()
    outputs = [x.detach() @ params[0]]
    dx, deferred = input_grad(_roots(outputs), [torch.ones_like(outputs[0])], [], params)
    assert list(dx) == [] and deferred.rest == [0, 1] and deferred.groups == []
    (g0, g1) = deferred.run()
    assert g0 is not None and g1 is None and torch.equal(g0, x.detach().sum(0).reshape(3, 1).expand(3, 3))


def test_w_runs_only_the_parameter_side() -> None:
    calls = []

    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, t: torch.Tensor) -> torch.Tensor:
            return t * 2

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
            calls.append("tail")
            return g * 2

    x, params = _leaves()
    outputs = [Counted.apply(x @ params[0])]
    _, deferred = input_grad(_roots(outputs), [torch.ones(2, 3, dtype=torch.float64)], [x], params[:1])
    assert calls == ["tail"]  # I ran the node between the outputs and the intermediates
    deferred.run()
    assert calls == ["tail"]  # W did not run it again
