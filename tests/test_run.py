"""The one run of a step (``fpipe._run``): both paths, in one process and on a pipeline rank, go
through ``run``; the step's loss is each microbatch's loss times its weight, the products added
by one ``torch.sum`` (NOTE [loss weights], NOTE [the step's loss])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe import _run
from fpipe.schedules import GPipe
from tests.helpers import assert_bitwise


def test_one_process_and_a_pipeline_rank_run_through_the_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` is the only place an ``Executor`` is built: one per step, in one process and on a
    pipeline rank (a one-rank gloo group of this process alone), and both give the same loss."""
    built: list[Any] = []

    class Counted(_run.Executor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self.transport)

    monkeypatch.setattr(_run, "Executor", Counted)
    stages = [lambda p, x: torch.tanh(x @ p)]
    loss_fn = lambda y, mb: (y**2).mean()  # noqa: E731
    params, batch = [torch.randn(3, 3, dtype=torch.float64)], torch.randn(4, 3, dtype=torch.float64)
    here, _ = fpipe.pipeline(loss_fn, stages, GPipe(2))(params, batch, key=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranked, _ = fpipe.pipeline(loss_fn, stages, GPipe(2), parallel=fpipe.Parallelism(group=dist.new_group([0])))(
            params, batch, key=1
        )
    finally:
        dist.destroy_process_group()
    assert [type(t).__name__ for t in built] == ["LocalTransport", "DistributedTransport"]
    assert_bitwise(here, ranked)


def test_split_batch_cuts_and_counts_once() -> None:
    """``split_batch``: the microbatches, their sizes and ``weight_fn``'s total (``None`` without
    it, or on a rank that does not count)."""
    stages = [lambda p, x: x * p]
    weighted = fpipe.pipeline(lambda y, mb: y.sum(), stages, GPipe(2), weight_fn=lambda mb: int(mb.sum()))
    batch = torch.tensor([1.0, 2.0, 3.0])
    microbatches, sizes, count = _run.split_batch(weighted, batch)
    assert [mb.tolist() for mb in microbatches] == [[1.0, 2.0], [3.0]] and sizes == [2, 1] and count == 6
    assert _run.split_batch(weighted, batch, counted=False)[2] is None
    plain = fpipe.pipeline(lambda y, mb: y.sum(), stages, GPipe(2))
    assert _run.split_batch(plain, batch)[1:] == ([2, 1], None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[3], [2, 2], [3] * 8, [3, 2, 2], [1] * 64], ids=str)
def test_loss_is_the_sum_of_the_weighted_losses(dtype: torch.dtype, sizes: list[int]) -> None:
    # One weight for all (equal sizes) and one per microbatch ([3, 2, 2]) take different paths.
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(sum(sizes), 3, generator=generator, dtype=torch.float64) * 100).to(dtype)
    p = torch.randn(3, generator=generator, dtype=torch.float64).to(dtype)
    step = fpipe.pipeline(lambda y, mb: y.mean(), [lambda p, x: x * p], GPipe(len(sizes)))
    loss, _ = step([p], batch)
    terms = [(x * p).mean() * (x.shape[0] / sum(sizes)) for x in torch.split(batch, sizes)]
    assert loss.dtype == dtype
    assert_bitwise(loss, torch.stack(terms).sum())


def test_losses_of_different_dtypes_are_added_as_stack_promotes() -> None:
    # A wider loss after two narrower ones: a sum in the first one's dtype would round it.
    generator = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(2, 3, generator=generator, dtype=dtype) for dtype in (torch.float32, torch.float32, torch.float64)
    ]
    p = torch.randn(3, generator=generator, dtype=torch.float32)
    step = fpipe.pipeline(lambda y, mb: y.mean(), [lambda p, x: x * p], GPipe(3))
    loss, _ = step([p], fpipe.Microbatches(xs))
    terms = [(x * p).mean() * (1 / 3) for x in xs]
    assert loss.dtype == torch.float64
    assert_bitwise(loss, torch.stack(terms).sum())
