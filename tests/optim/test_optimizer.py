"""Every optimizer of ``fpipe.optim`` equals its ``torch.optim`` class, bitwise, over random pytrees.

One battery runs over ``OPTIMIZERS`` (tests/helpers.py; optax's way: a new variant is tested the
moment it is listed): ``OPTIMIZER_UPDATES`` updates of random per-stage pytrees, pure and in place,
against the ``torch.optim`` optimizer on the same tensors as a flat list with ``.grad`` set. Both run torch's own kernel
with the same ``foreach``, so every bit agrees. Then the state's checks and error messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fpipe.optim
from tests.helpers import OPTIMIZER_UPDATES, OPTIMIZERS, assert_bitwise, stage_leaves, torch_optim_reference

SHAPES = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
DTYPES = st.sampled_from([torch.float64, torch.float32, torch.complex128])
# A stage: a dict of leaves, some nested in a list; None: a stage held by another rank.
STAGE = st.one_of(
    st.none(),
    st.dictionaries(st.sampled_from("abcd"), st.tuples(SHAPES, DTYPES), min_size=1, max_size=3),
    st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=2).map(lambda leaves: {"layers": leaves}),
)


def _materialize(stages: list[Any], seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        None
        if stage is None
        else optree.tree_map(lambda leaf: torch.randn(leaf[0], dtype=leaf[1], generator=g), stage, is_leaf=_is_spec)
        for stage in stages
    ]


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)


@pytest.mark.parametrize("name", OPTIMIZERS)
@given(
    stages=st.lists(STAGE, min_size=1, max_size=3).filter(lambda s: s != [None] * len(s)), seed=st.integers(0, 2**16)
)
def test_updates_equal_torch_optim_bitwise(name: str, stages: list[Any], seed: int) -> None:
    make, make_torch = OPTIMIZERS[name]
    opt = make()
    params = _materialize(stages, seed)
    grads = [_materialize(stages, seed + 1 + k) for k in range(OPTIMIZER_UPDATES)]
    expected, torch_state = torch_optim_reference(make_torch, params, grads)

    state = opt.init(params)
    in_place = [None if p is None else optree.tree_map(torch.clone, p) for p in params]
    in_place_state = opt.init(in_place)
    pure = params
    for k in range(OPTIMIZER_UPDATES):
        inputs = (pure, grads[k], state)
        snapshot = [optree.tree_map(torch.clone, t) for t in inputs]
        pure, state = opt.update(*inputs)
        assert_bitwise(list(inputs), snapshot)  # nothing passed to update is modified
        assert opt.update_(in_place, grads[k], in_place_state) is None
    assert_bitwise(stage_leaves(pure), expected)
    assert_bitwise(in_place, pure)
    assert_bitwise(in_place_state, state)
    held = [s for s, p in enumerate(params) if p is not None]
    assert [s for s, t in enumerate(state) if t is not None] == held
    for s in held:
        assert torch.equal(state[s]["step"], torch.tensor(float(OPTIMIZER_UPDATES), dtype=torch.float32))
    # torch's state, buffer by buffer, in the same order as the leaves.
    for key in [
        k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer") if held and k in state[held[0]]
    ]:
        assert_bitwise(stage_leaves([state[s][key] for s in held]), [torch_state[i][key] for i in range(len(expected))])


def _model_params() -> list[Any]:
    return [
        {"w": torch.randn(3, 4), "b": torch.randn(4)},
        None,
        {"head": {"w": torch.randn(4, 2), "gain": torch.randn(())}},
    ]


def test_weight_decay_mask_equals_two_torch_param_groups() -> None:
    params = _model_params()
    grads = [
        [None if p is None else optree.tree_map(torch.randn_like, p) for p in params] for _ in range(OPTIMIZER_UPDATES)
    ]
    mask = [{"w": True, "b": False}, None, {"head": {"w": True, "gain": False}}]
    opt = fpipe.optim.adamw(0.1, weight_decay=0.5, weight_decay_mask=mask)
    state = opt.init(params)
    new = params
    for g in grads:
        new, state = opt.update(new, g, state)
    flat = [t.clone().requires_grad_() for t in stage_leaves(params)]  # b, w, gain, w (sorted keys)
    reference = torch.optim.AdamW(
        [{"params": [flat[1], flat[3]]}, {"params": [flat[0], flat[2]], "weight_decay": 0.0}], lr=0.1, weight_decay=0.5
    )
    for g in grads:
        for p, dp in zip(flat, stage_leaves(g)):
            p.grad = dp.clone()
        reference.step()
    assert_bitwise(stage_leaves(new), [p.detach() for p in flat])


def test_learning_rate_schedule_and_override() -> None:
    params = _model_params()
    grads = [
        [None if p is None else optree.tree_map(torch.randn_like, p) for p in params] for _ in range(OPTIMIZER_UPDATES)
    ]
    schedule = fpipe.optim.warmup_cosine(0.1, warmup_steps=OPTIMIZER_UPDATES, total_steps=10)
    rates = [schedule(k) for k in range(OPTIMIZER_UPDATES)]
    assert len(set(rates)) == OPTIMIZER_UPDATES
    for opt, lrs in [(fpipe.optim.adamw(schedule), rates), (fpipe.optim.adamw(1.0), [0.3] * OPTIMIZER_UPDATES)]:
        state, new = opt.init(params), params
        for g in grads:
            new, state = opt.update(new, g, state, lr=None if lrs is rates else 0.3)
        expected, _ = torch_optim_reference(lambda p: torch.optim.AdamW(p), params, grads, lrs)
        assert_bitwise(stage_leaves(new), expected)


def _message(error: type[Exception], fn: Callable[[], Any]) -> str:
    with pytest.raises(error) as info:
        fn()
    return str(info.value)


def test_errors_name_the_stage_and_key_path() -> None:
    params = _model_params()
    grads = [None if p is None else optree.tree_map(torch.ones_like, p) for p in params]
    opt = fpipe.optim.adamw(0.1)
    state = opt.init(params)
    wrong = [state[0], None, {**state[2], "exp_avg": {"head": {"w": torch.zeros(4, 2)}}}]
    assert "state[2]['exp_avg'] does not have the structure" in _message(
        ValueError, lambda: opt.update(params, grads, wrong)
    )
    assert "missing: [\"['head']['gain']\"]" in _message(ValueError, lambda: opt.update(params, grads, wrong))
    keys = [state[0], None, {"step": state[2]["step"], "m": state[2]["exp_avg"]}]
    assert "the state of stage 2 does not have the keys" in _message(
        ValueError, lambda: opt.update(params, grads, keys)
    )
    sgd_state = fpipe.optim.sgd(0.1, momentum=0.9).init(params)
    assert "['exp_avg', 'exp_avg_sq', 'step'] (state[0]: ['momentum_buffer', 'step'])" in _message(
        ValueError, lambda: opt.update(params, grads, sgd_state)
    )
    step = [{**state[0], "step": 3}, None, state[2]]
    assert "step counter of stage 0 is not a scalar tensor" in _message(
        ValueError, lambda: opt.update(params, grads, step)
    )
    shapes = [{"w": torch.ones(12), "b": grads[0]["b"]}, None, grads[2]]
    assert "grads[0]['w'] is not a tensor of its parameter's dtype and shape (grads[0]['w']: torch.float64 [12]" in (
        _message(ValueError, lambda: opt.update(params, shapes, state))
    )
    floats = [state[0], None, {**state[2], "exp_avg_sq": optree.tree_map(lambda t: t.float(), state[2]["exp_avg_sq"])}]
    assert "state[2]['exp_avg_sq']['head']['gain'] is not a tensor" in _message(
        ValueError, lambda: opt.update(params, grads, floats)
    )
    assert "grads has 2 entries but params has 3" in _message(ValueError, lambda: opt.update(params, grads[:2], state))
    assert "stage 2 has parameters but no grads" in _message(
        ValueError, lambda: opt.update(params, [*grads[:2], None], state)
    )
    assert "stage 0 has parameters but no state" in _message(ValueError, lambda: opt.update(params, grads, [None] * 3))
    assert "params must be a list with one pytree per stage (params: dict)" in _message(
        TypeError, lambda: opt.init(params[0])
    )
    ints = [{**params[0], "n": torch.tensor([1, 2])}]
    for call in (lambda: opt.init(ints), lambda: opt.update(ints, [{**grads[0], "n": None}], opt.init(params[:1]))):
        assert "not floating point (params[0]['n']: torch.int64)" in _message(TypeError, call)
    after = opt.update(params, grads, state)[1]
    uneven = [after[0], None, state[2]]
    assert "step counters differ (steps: [0, 1])" in _message(
        ValueError, lambda: fpipe.optim.adamw(lambda step: 0.1).update(params, grads, uneven)
    )
    opt.update(params, grads, uneven)  # a float rate needs no common step


def test_option_errors() -> None:
    params = _model_params()
    grads = [None if p is None else optree.tree_map(torch.ones_like, p) for p in params]
    assert "learning_rate must be a float or a function of the step (learning_rate: '1e-3')" in _message(
        TypeError,
        lambda: fpipe.optim.adamw("1e-3"),  # type: ignore[arg-type]
    )
    assert "nesterov needs a positive momentum and no dampening (momentum: 0.0" in _message(
        ValueError, lambda: fpipe.optim.sgd(0.1, nesterov=True)
    )
    for mask, error, fragment in [
        ([{"w": True, "b": False}], ValueError, "weight_decay_mask has no entry for stage 2"),
        ([True, None, {"tail": True}], ValueError, "weight_decay_mask[2] is not a prefix"),
        ([{"w": 1, "b": True}, None, True], TypeError, "weight_decay_mask[0] has leaves that are not bools"),
    ]:
        opt = fpipe.optim.adamw(0.1, weight_decay_mask=mask)
        assert fragment in _message(error, lambda opt=opt: opt.update(params, grads, opt.init(params)))


@pytest.mark.parametrize("rate", [-0.01, float("nan"), float("inf")])
def test_a_negative_or_non_finite_rate_is_refused_as_torch_optim_does(rate: float) -> None:
    if rate != float("inf"):  # torch.optim refuses these; an infinite rate fpipe refuses too (all params inf/nan)
        with pytest.raises(ValueError, match="Invalid learning rate"):
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=rate)
    for make in (fpipe.optim.adamw, fpipe.optim.sgd):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            make(rate)
    params = [{"w": torch.ones(2)}]
    opt = fpipe.optim.adamw(lambda step: rate)
    with pytest.raises(ValueError, match=r"learning_rate\(0\) must be a finite number >= 0"):
        opt.update(params, [{"w": torch.ones(2)}], opt.init(params))
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        fpipe.optim.adamw(1e-3).update(params, [{"w": torch.ones(2)}], opt.init(params), lr=rate)


@pytest.mark.parametrize("step", [-3.0, 1.5, 1 + 1j])
def test_a_step_counter_that_is_not_a_whole_number_is_refused(step: complex) -> None:
    params = [{"w": torch.ones(2)}]
    opt = fpipe.optim.adamw(1e-3)
    state = opt.init(params)
    state[0]["step"] = torch.tensor(step)
    with pytest.raises(ValueError, match=r"step counter of stage 0 must be a whole number >= 0"):
        opt.update(params, [{"w": torch.ones(2)}], state)


@pytest.mark.parametrize(
    ("make", "torch_make", "options", "fragment"),
    [
        (fpipe.optim.adamw, torch.optim.AdamW, {"betas": (1.5, 0.9)}, r"betas\[0\] must be in \[0, 1\)"),
        (fpipe.optim.adamw, torch.optim.AdamW, {"betas": (0.9, -0.1)}, r"betas\[1\] must be in \[0, 1\)"),
        (fpipe.optim.adamw, torch.optim.AdamW, {"eps": -1e-8}, "eps must be a finite number >= 0"),
        (fpipe.optim.adamw, torch.optim.AdamW, {"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
        (fpipe.optim.sgd, torch.optim.SGD, {"momentum": -1.0}, "momentum must be a finite number >= 0"),
        (fpipe.optim.sgd, torch.optim.SGD, {"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
    ],
)
def test_options_out_of_range_are_refused_as_torch_optim_does(
    make: Callable[..., object], torch_make: Callable[..., object], options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match="Invalid"):
        torch_make([torch.zeros(1, requires_grad=True)], lr=1e-3, **options)
    with pytest.raises(ValueError, match=fragment):
        make(1e-3, **options)


def test_options_in_range_are_accepted() -> None:
    fpipe.optim.adamw(1e-3, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    fpipe.optim.sgd(1e-3, momentum=0.0, weight_decay=0.0)
    with pytest.raises(TypeError, match="betas must be a pair of floats"):
        fpipe.optim.adamw(1e-3, betas=0.9)  # type: ignore[arg-type]
