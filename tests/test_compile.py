"""fpipe composes with torch.compile: compiled stages give the eager results, shapes may change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fpipe
from fpipe.schedules import OneFOneB, ZeroBubbleH1
from tests.helpers import assert_bitwise

pytestmark = pytest.mark.timeout(300)


def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(h @ p["w1"]) @ p["w2"]


def loss_fn(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def params(num_stages: int) -> list[dict[str, torch.Tensor]]:
    return [{"w1": torch.randn(16, 16) / 4, "w2": torch.randn(16, 16) / 4} for _ in range(num_stages)]


@pytest.mark.parametrize("schedule", [OneFOneB(4), ZeroBubbleH1(4)], ids=str)
def test_compiled_stages_equal_eager_stages(schedule: Any) -> None:
    """AOTAutograd (the ``aot_eager`` backend: no C++ build) compiles forward and backward."""
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager")
    eager_step = fpipe.pipeline(loss_fn, [block] * 2, schedule)
    compiled_step = fpipe.pipeline(loss_fn, [compiled] * 2, schedule)
    p = params(2)
    graphs = []
    for length in (5, 7, 9, 11):  # the sequence length changes between steps
        x = torch.randn(8, length, 16)
        loss, grads = eager_step(p, x)
        c_loss, c_grads = compiled_step(p, x)
        torch.testing.assert_close(c_loss, loss)
        torch.testing.assert_close(c_grads, grads)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # dynamo recompiles once with a dynamic length, then never again
    assert graphs[1] == graphs[2] == graphs[3], graphs


def test_compiling_the_step_runs_it_eagerly() -> None:
    step = fpipe.pipeline(loss_fn, [block] * 2, OneFOneB(2))
    p, x = params(2), torch.randn(4, 3, 16)
    loss, grads = torch.compile(step, backend="aot_eager")(p, x)
    expected_loss, expected_grads = step(p, x)
    assert_bitwise((loss, grads), (expected_loss, expected_grads))


def test_recomputed_compiled_stages_compile_one_more_graph() -> None:
    """A recomputed forward runs without a graph: one more variant of a compiled stage function,
    not one per kind of stage input (stage 0 gets views of the batch, later stages tensors that
    require grad; dynamo guards on both). Past ``recompile_limit`` (8) variants dynamo would run
    the stage eagerly, silently."""
    graphs = []
    for recompute in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(block, backend="aot_eager", dynamic=True)
        step = fpipe.pipeline(loss_fn, [compiled] * 3, OneFOneB(4), recompute=recompute)
        eager = fpipe.pipeline(loss_fn, [block] * 3, OneFOneB(4), recompute=recompute)
        p = params(3)
        for length in (5, 7):  # 10 examples: microbatches of 3, 3, 2, 2
            x = torch.randn(10, length, 16)
            loss, grads = step(p, x)
            expected_loss, expected_grads = eager(p, x)
            torch.testing.assert_close(loss, expected_loss)
            torch.testing.assert_close(grads, expected_grads)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs == [2, 3], graphs
