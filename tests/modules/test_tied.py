"""``fpipe.sum_tied``: a parameter used by several stages gets the sum of their gradients.

In one process on hand-made gradients, and over 3 gloo ranks, where a tied-embedding model
trained with ``pipeline(parallel=fpipe.Parallelism(group=...))`` and ``sum_tied(group=...)``
equals its ``loss.backward()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import TINY_LM_CALL, TinyLM, assert_close, by_name, tiny_lm_batch, tiny_lm_grads, tiny_lm_loss


def test_sums_in_stage_order_and_gives_every_stage_its_own_tensor() -> None:
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    w, u = torch.randn(2), torch.randn(2)
    grads: list[Any] = [{"emb": a, "w": w}, {"u": u}, {"emb": b, "x": None}, {"emb": c}]
    summed = fpipe.sum_tied(grads)
    total = a.clone().add_(b).add_(c)
    assert all(torch.equal(summed[s]["emb"], total) for s in (0, 2, 3))
    assert len({id(summed[s]["emb"]) for s in (0, 2, 3)}) == 3  # not aliases of each other
    assert summed[0]["w"] is w and summed[1] == {"u": u} and summed[2]["x"] is None
    assert grads[0]["emb"] is a and torch.equal(a, a.clone())  # the input list is not touched
    assert summed is not grads and all(summed[s] is not grads[s] for s in range(4))


def test_nothing_tied_is_a_copy() -> None:
    grads: list[Any] = [{"a": torch.ones(1)}, None, {"b": torch.ones(1)}]
    assert fpipe.sum_tied(grads) == grads


def test_params_give_the_layout() -> None:
    """With ``params``, names tied in the model are summed even where grads has None."""
    params = [{"emb": torch.zeros(2)}, {"emb": torch.zeros(2), "w": torch.zeros(1)}]
    summed = fpipe.sum_tied([{"emb": torch.ones(2)}, None], params=params)
    assert torch.equal(summed[0]["emb"], torch.ones(2)) and summed[1] is None


def test_copies_in_different_dtypes_add_in_the_promoted_dtype_and_keep_their_own() -> None:
    """A stage cast to another dtype: the sum is exact in float64 and each copy keeps its dtype."""
    a, b = torch.full((2,), 1 / 3, dtype=torch.float32), torch.full((2,), 1 / 3, dtype=torch.float64)
    for grads in ([{"w": a}, {"w": b}], [{"w": b}, {"w": a}]):
        summed = fpipe.sum_tied(grads)
        expected = a.double() + b
        for s in (0, 1):
            assert summed[s]["w"].dtype == grads[s]["w"].dtype
            assert torch.equal(summed[s]["w"], expected.to(grads[s]["w"].dtype))


def test_copies_that_disagree_in_shape_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"copies of 'w' disagree in shape \(stage 0: \(2,\), stage 2: \(1,\)\)"):
        fpipe.sum_tied([{"w": torch.ones(2)}, {}, {"w": torch.ones(1)}])  # would broadcast
    with pytest.raises(ValueError, match=r"copies of 'w' disagree in shape"):
        fpipe.sum_tied([{"w": torch.ones(2)}, None], params=[{"w": torch.ones(2)}, {"w": torch.ones(3)}])


def test_a_tied_name_without_gradients_is_left_alone() -> None:
    assert fpipe.sum_tied([{"w": None}, {"w": None}]) == [{"w": None}, {"w": None}]


def test_errors() -> None:
    with pytest.raises(TypeError, match=r"grads must be a list with one dict per stage \(got: dict\)"):
        fpipe.sum_tied({"a": torch.ones(1)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"the gradients of stage 1 are a Tensor, not a dict"):
        fpipe.sum_tied([{"a": torch.ones(1)}, torch.ones(1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"with group=, pass params="):
        fpipe.sum_tied([{"a": torch.ones(1)}], group=object())
    with pytest.raises(ValueError, match=r"params has 1 entry but grads has 2 stages"):
        fpipe.sum_tied([{}, {}], params=[{}])


# --- Over torch.distributed ---------------------------------------------------------------------

SPEC = ["embed + rotary + layers[0]", "rotary + layers[1]", "rotary + layers[2:] + norm + head"]


def _tied_model() -> tuple[TinyLM, dict[str, Any]]:
    torch.manual_seed(0)
    return TinyLM(3, tied=True), tiny_lm_batch(6)


def _train_on_ranks(rank: int, world_size: int) -> list[Any]:
    """Rank r holds stage r: the tied copies are on ranks 0 and 2, and rank 1 contributes zeros."""
    torch.set_default_dtype(torch.float64)
    model, batch = _tied_model()
    stages, params = fpipe.split_module(model, SPEC, call=TINY_LM_CALL)
    step = fpipe.pipeline(tiny_lm_loss, stages, OneFOneB(3), parallel=fpipe.Parallelism(group=dist.group.WORLD))
    local = [p if s in step.local_stages else None for s, p in enumerate(params)]
    _, grads = step(local, batch)
    return fpipe.sum_tied(grads, params=params, group=dist.group.WORLD)


def _mixed_dtypes_on_ranks(rank: int, world_size: int) -> Any:
    """Stage 0 (rank 0) holds its copy in float32, stage 1 (rank 1) in float64."""
    params = [{"w": torch.zeros(3, dtype=torch.float32)}, {"w": torch.zeros(3, dtype=torch.float64)}]
    grads: list[Any] = [None, None]
    grads[rank] = {"w": torch.full((3,), 1 / 3, dtype=params[rank]["w"].dtype)}
    return fpipe.sum_tied(grads, params=params, group=dist.group.WORLD)[rank]["w"]


@pytest.mark.timeout(120)
def test_distributed_copies_in_different_dtypes() -> None:
    """Every rank all-reduces in the promoted dtype read from params, not its own copy's."""
    w0, w1 = run_ranks(2, _mixed_dtypes_on_ranks)
    expected = torch.tensor(1 / 3, dtype=torch.float32).double() + 1 / 3
    assert w0.dtype == torch.float32 and torch.equal(w0, expected.float().expand(3))
    assert w1.dtype == torch.float64 and torch.equal(w1, expected.expand(3))


@pytest.mark.timeout(120)
def test_distributed_sum_equals_module_backward() -> None:
    model, batch = _tied_model()
    _, expected = tiny_lm_grads(model, batch)
    _, params = fpipe.split_module(model, SPEC, call=TINY_LM_CALL)
    results = run_ranks(3, _train_on_ranks)
    for rank, grads in enumerate(results):
        for s in range(3):
            if s == rank:
                assert_close(grads[s], by_name(expected, params[s]), context=f"rank {rank}, stage {s}")
            else:
                assert grads[s] is None
    assert "embed.weight" in params[0] and "embed.weight" in params[2] and "embed.weight" not in params[1]
