"""The traced core (``fpipe._traced``) run without a compiler: the eager step's arithmetic, op for
op, so that any backend that keeps the ops keeps the bits; what its trace notes."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fpipe
from fpipe._random import Keys
from fpipe._run import order_for
from fpipe._traced import Core, LocalMail, begin, end, first_draw, grads_like, own_code, traced, tracing
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1
from tests.helpers import assert_bitwise


def _stage(p, x):
    x = x["x"] if isinstance(x, dict) else x
    return torch.tanh(x @ p["w"]) + x


def _loss(y, mb):
    return ((y - mb["t"]) ** 2).mean()


def _model():
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 4, generator=g, dtype=torch.float64)} for _ in range(3)]
    batch = {
        "x": torch.randn(5, 4, generator=g, dtype=torch.float64),
        "t": torch.randn(5, 4, generator=g, dtype=torch.float64),
    }
    return params, batch


@pytest.mark.parametrize("schedule", [GPipe(3), OneFOneB(3), ZeroBubbleH1(3)], ids=str)
def test_the_core_run_eagerly_is_bitwise_the_eager_step(schedule):
    """Uneven microbatches (2, 2, 1) weighed by their sizes; split backwards (ZB-H1) fused into I."""
    params, batch = _model()
    step = fpipe.pipeline(_loss, [_stage] * 3, schedule)
    core = Core(step, order_for(step.program, None))
    sizes = [2, 2, 1]
    microbatches = [{k: v[a : a + n] for k, v in batch.items()} for a, n in zip([0, 2, 4], sizes)]
    weights = torch.tensor([n / 5 for n in sizes], dtype=torch.float64)
    loss, aux, sums = core(params, microbatches, weights, weights, Keys(0).seeds(3, 3), False, [])
    assert aux is None
    assert_bitwise((loss, grads_like(params, sums)), step(params, batch))


def test_each_core_has_its_own_code_and_local_mail_hands_values_on():
    step = fpipe.pipeline(_loss, [_stage] * 3, OneFOneB(3))
    a, b = own_code(Core(step, order_for(step.program, None))), own_code(Core(step, order_for(step.program, None)))
    assert a.__func__.__code__ is not b.__func__.__code__  # dynamo's caches and limits are per code object
    mail = LocalMail()
    mail.put(("act", 0, 1), "y")
    mail.put(("mb", 0, 1), "ignored")  # (the last stage has the batch in one process)
    assert mail.take(("act", 0, 1)) == "y" and mail.held == {}
    result = (torch.zeros(()), None, None)
    assert mail.result(result) is result


@pytest.mark.parametrize(
    ("draw", "op"),
    [
        (lambda h: torch.nn.functional.dropout(h, 0.5, training=True), None),  # counted (NOTE [counted draws])
        (lambda h: h * torch.rand_like(h), "rand_like"),
        (lambda h: torch.nn.functional.scaled_dot_product_attention(h[None], h[None], h[None], dropout_p=0.1)[0],
         "scaled_dot_product_attention"),
    ],
    ids=["dropout", "rand_like", "attention"],
)  # fmt: skip
def test_the_trace_notes_the_action_and_the_draws_it_does_not_count(draw, op):
    def drawing(p, x):
        return draw(_stage(p, x))

    params, batch = _model()
    step = fpipe.pipeline(_loss, [_stage, drawing, _stage], GPipe(3))
    counter = CompileCounter()
    compiled = torch.compile(own_code(Core(step, order_for(step.program, None))), backend=counter, fullgraph=True)
    microbatches = [{k: v[a : a + 2] for k, v in batch.items()} for a in (0, 2, 3)]
    weights = torch.tensor([0.4, 0.2, 0.4], dtype=torch.float64)
    begin()
    assert (tracing(), traced(), first_draw()) == (None, False, None)
    with torch._dynamo.config.patch(trace_autograd_ops=True), torch.enable_grad():
        compiled(params, microbatches, weights, weights, Keys(0).seeds(3, 3), False, [])
    assert traced() and tracing() is None and counter.frame_count == 1
    actions = [a for _, a in order_for(step.program, None).actions]
    first = next(k for k, a in enumerate(actions) if a.stage == 1)  # 1F0
    assert first_draw() == (None if op is None else (first, op))
    end()
