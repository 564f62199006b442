"""A stage within one step (``fpipe._stage``): forwards that save pullbacks, explicit VJPs."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import optree
import pytest
import torch

import fpipe
from fpipe._stage import Pullback, StageRun
from fpipe.schedules import GPipe, OneFOneB
from tests.conformance import CONFORMANCE
from tests.helpers import assert_bitwise, assert_close, reference


def layer(p: dict[str, Any], x: dict[str, Any]) -> dict[str, Any]:
    """A stage with real and complex params and inputs, and int/str leaves passing through."""
    h = torch.tanh(x["h"] @ p["w"] + p["b"])
    z = x["z"] * p["c"] + h[:, :2].to(p["c"].dtype)
    return {"h": h, "z": z, "ids": x["ids"] + 1, "tag": x["tag"], "norm": (z.abs() ** 2).sum()}


def layer_params() -> dict[str, Any]:
    return {"w": torch.randn(3, 3), "b": torch.randn(3), "c": torch.randn(2, dtype=torch.complex128), "n": 3}


def layer_input() -> dict[str, Any]:
    """An activation as a previous stage hands it over: its float and complex leaves carry a graph."""
    h, z = torch.randn(4, 3, requires_grad=True), torch.randn(4, 2, dtype=torch.complex128, requires_grad=True)
    return {"h": h * 1, "z": z * 1, "ids": torch.arange(4), "tag": "t"}


def cotangents_for(y: Any) -> list[torch.Tensor | None]:
    """A random cotangent per differentiable output leaf, ``None`` for the others."""
    return [
        torch.randn_like(leaf)
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
        else None
        for leaf in optree.tree_leaves(y, none_is_leaf=True)
    ]


def test_backward_is_the_vjp() -> None:
    params, x = layer_params(), layer_input()
    run = StageRun(0, layer, params)
    y, pullback = run.forward(x, differentiate_input=True)
    cotangents = cotangents_for(y)
    input_cotangents = run.backward(pullback, cotangents, 0)

    # The reference differentiates only the float/complex leaves; optree orders dict keys sorted.
    def differentiable_part(p: dict[str, Any], x_float: dict[str, Any]) -> dict[str, Any]:
        y = layer({**p, "n": params["n"]}, {**x_float, "ids": x["ids"], "tag": x["tag"]})
        return {k: y[k] for k in ("h", "norm", "z")}

    expected_y, vjp = torch.func.vjp(differentiable_part, {k: params[k] for k in "wbc"}, {k: x[k] for k in ("h", "z")})
    by_name = dict(zip(sorted(y), cotangents))
    assert by_name["ids"] is None and by_name["tag"] is None
    expected_param_grads, expected_input_grads = vjp({k: by_name[k] for k in ("h", "norm", "z")})

    assert_close({k: y[k] for k in ("h", "norm", "z")}, expected_y)
    assert torch.equal(y["ids"], x["ids"] + 1) and y["tag"] == "t"
    grads = run.grads()
    assert grads["n"] is None
    assert_close({k: grads[k] for k in "wbc"}, expected_param_grads)
    assert input_cotangents is not None
    by_input = dict(zip(sorted(x), input_cotangents))
    assert by_input["ids"] is None and by_input["tag"] is None
    assert_close({k: by_input[k] for k in ("h", "z")}, expected_input_grads)


def fused_and_input_split(
    index: int, fn: Any, params: Any, x: Any
) -> tuple[StageRun, StageRun, Pullback, Any, Any, Any, Any]:
    """The same forward on two runs of the stage: a fused backward on one, only ``I`` on the
    other. ``(fused, split, split's pullback, y, cotangents, fused input grads, I's)``."""
    fused, split = StageRun(index, fn, params), StageRun(index, fn, params)
    y, pullback = fused.forward(x, differentiate_input=True)
    cotangents = cotangents_for(y)
    expected = fused.backward(pullback, cotangents, 0)
    _, pullback = split.forward(x, differentiate_input=True)
    return fused, split, pullback, y, cotangents, expected, split.backward_input(pullback, cotangents)


def test_split_backward_equals_fused_backward_bitwise() -> None:
    fused, split, pullback, _, _, expected, got = fused_and_input_split(0, layer, layer_params(), layer_input())
    assert split.grads()["w"].abs().sum() == 0  # no weight gradient yet
    split.backward_weight(pullback, 0)

    assert expected is not None and got is not None
    assert_bitwise((got, split.grads()), (expected, fused.grads()))


def sum_beside(p: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"h": x @ p, "u": p.sum()}


def param_beside(p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ p, p


def sum_used_and_beside(p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = (p * p).sum()
    return torch.tanh(x @ p) * u, u


@pytest.mark.parametrize("fn", [sum_beside, param_beside, sum_used_and_beside])
def test_split_backward_of_outputs_the_inputs_do_not_reach(fn: Any) -> None:
    """A parameter reaching the outputs both through the inputs' paths and beside them (an
    output that only parameters reach): ``W`` adds the part that does not meet the inputs."""
    params, x = torch.randn(3, 3), torch.randn(4, 3, requires_grad=True) * 1
    fused, split, pullback, y, cotangents, expected, got = fused_and_input_split(1, fn, params, x)
    split.backward_weight(pullback, 0)

    _, vjp = torch.func.vjp(fn, params, x.detach())
    expected_grad, expected_input_grad = vjp(optree.tree_unflatten(optree.tree_structure(y), cotangents))
    assert_close((fused.grads(), expected[0]), (expected_grad, expected_input_grad))
    assert_bitwise((split.grads(), got[0]), (fused.grads(), expected[0]))


def two_groups_met_twice(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    q, r = p["c"] + p["a"], p["c"] * p["b"]  # c meets the input's paths in a's two nodes and in b's two
    return x * q + x.sin() * q + x.cos() * r + x.exp() * r


def test_split_backward_merges_each_group_a_parameter_meets_once() -> None:
    """``c``'s gradient arrives through the intermediates of ``a``'s group and of ``b``'s, two
    nodes each: its group takes both in once (merging one twice failed in ``I``)."""
    params, x = {k: torch.randn(4) for k in "abc"}, torch.randn(2, 4, requires_grad=True)
    fused, split, pullback, _, _, expected, got = fused_and_input_split(1, two_groups_met_twice, params, x)
    split.backward_weight(pullback, 0)
    assert expected is not None and got is not None
    assert_bitwise(got[0], expected[0])
    assert_close(split.grads(), fused.grads())


def test_inputs_and_params_are_detached_copies() -> None:
    """The user's tensors keep ``requires_grad``, version and graph; nothing writes ``.grad``."""
    w = torch.nn.Parameter(torch.randn(3, 3))
    upstream = torch.randn(4, 3, requires_grad=True)
    h = upstream * 2  # a user graph that must not be extended or run
    run = StageRun(1, lambda p, x: (x @ p).sum(0), w)
    _, pullback = run.forward(h, differentiate_input=True)
    (g,) = run.backward(pullback, [torch.ones(3)], 0) or [None]

    assert g is not None and torch.equal(g, torch.ones(4, 3) @ w.detach().T)
    assert w.grad is None and upstream.grad is None and w._version == 0 and h._version == 0
    assert h.grad_fn is not None and h.grad_fn.name() == "MulBackward0"
    assert run.params is not w and run.params.requires_grad and w.requires_grad


def test_first_stage_does_not_differentiate_its_input() -> None:
    x = torch.randn(4, 3)
    run = StageRun(0, lambda p, x: x @ p, torch.randn(3, 3))
    _, pullback = run.forward(x, differentiate_input=False)
    assert pullback.inputs == [] and not x.requires_grad
    assert run.backward(pullback, [torch.ones(4, 3)], 0) == [None]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_forward_records_a_graph_whatever_the_grad_mode(mode: Any) -> None:
    # made outside: inference tensors cannot enter a graph; x carries a graph like an activation
    x, p = torch.ones(3, requires_grad=True) * 1, torch.tensor(2.0)
    with mode():
        run = StageRun(0, lambda p, x: x * p, p)
        y, pullback = run.forward(x, differentiate_input=True)
        assert y.requires_grad and [(e.node, e.output_nr) for e in pullback.outputs] == [(y.grad_fn, 0)]
        (g,) = run.backward(pullback, [torch.ones(3)], 0) or [None]
        grads = run.grads()
    assert g is not None and torch.equal(g, torch.full((3,), 2.0))
    assert grads.item() == 3.0 and not grads.is_inference()


def test_unreached_and_non_differentiable_params() -> None:
    params = {"used": torch.randn(3), "unused": torch.randn(2), "steps": torch.tensor(4), "name": "s"}
    run = StageRun(0, lambda p, x: x * p["used"], params)
    _, pullback = run.forward(torch.randn(3), differentiate_input=False)
    run.backward(pullback, [torch.ones(3)], 0)
    grads = run.grads()
    assert torch.equal(grads["unused"], torch.zeros(2)) and grads["steps"] is None and grads["name"] is None


def test_output_without_cotangent_is_skipped() -> None:
    run = StageRun(0, lambda p, x: (x * p, x * p * 3), torch.tensor(2.0))
    _, pullback = run.forward(torch.ones(2, requires_grad=True) * 1, differentiate_input=True)
    (g,) = run.backward(pullback, [None, torch.ones(2)], 0) or [None]
    assert g is not None and torch.equal(g, torch.full((2,), 6.0)) and run.grads().item() == 6.0


# --- NOTE [fixed accumulation order] ----------------------------------------------------------


def _viewing(p: Any, x: torch.Tensor) -> torch.Tensor:
    """Hands views of one cotangent to its input and to both parameters (``ViewBackward``)."""
    return (x.view(()) + p["p"].view(()) + p["q"].view(())) * p["r"]


@pytest.mark.parametrize("conformance", [c for c in CONFORMANCE if 2 in c.stage_counts], ids=str)
def test_gradients_the_engine_keeps_share_no_storage(conformance: Any) -> None:
    """NOTE [gradients the engine keeps]: the engine keeps views of one cotangent as the ``.grad``
    of several leaves; the next microbatch's in-place additions must not add into the others
    (plain ``.backward()`` in a loop gives 5 here instead of 3), nor into the cotangent that
    went back to stage 0."""
    stages = [lambda p, x: (x * p).reshape(1), _viewing]
    params = [
        torch.tensor([1.5], dtype=torch.float64),
        {k: torch.tensor([v], dtype=torch.float64) for k, v in (("p", 2.0), ("q", -1.0), ("r", 0.5))},
    ]
    batch = torch.arange(1.0, 4.0, dtype=torch.float64).reshape(3, 1)
    step = fpipe.pipeline(lambda y, mb: y * mb.sum(), stages, conformance.make(2, 3))
    loss, grads = step(params, batch)
    whole = [_per_row(f) for f in stages]
    expected_loss, expected = reference(lambda y, mb: (y * mb.sum(-1)).mean(), whole, params, batch)
    assert_close(loss, expected_loss, 1e-15)
    assert_close(grads, expected, 1e-15)


def _per_row(stage: Any) -> Any:
    """``stage`` on a whole batch, one row at a time (its views are of one row)."""
    return lambda p, x: torch.stack([stage(p, row.reshape(1, -1)).reshape(()) for row in x])


# --- Stages end to end ------------------------------------------------------------------------


def test_stage_ignoring_an_input_leaf_and_a_parameter_free_stage() -> None:
    """Stage 1 drops a differentiable leaf (its cotangent is ``None``) and stage 0 has no params."""

    def embed(p: Any, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": microbatch["x"] * 2, "side": microbatch["x"] ** 2}

    def project(p: dict[str, torch.Tensor], x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(x["h"] @ p["w"]), "side": x["side"] * p["s"]}

    def drop_side(p: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return x["h"] @ p

    def loss_fn(y: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (y**2).sum(-1).mean()

    stages = [embed, project, drop_side]
    params: list[Any] = [None, {"w": torch.randn(3, 3), "s": torch.randn(3)}, torch.randn(3, 2)]
    batch = {"x": torch.randn(5, 3)}
    loss, grads = fpipe.pipeline(loss_fn, stages, OneFOneB(num_microbatches=2))(params, batch)
    expected_loss, expected_grads = reference(loss_fn, stages, [{}, *params[1:]], batch)  # torch.func wants tensors
    assert grads[0] is None and torch.equal(grads[1]["s"], torch.zeros(3))
    assert_close(loss, expected_loss)
    assert_close(grads[1:], expected_grads[1:])


def test_leaves_passed_through_unchanged() -> None:
    """A stage may return an input leaf or a parameter as is; its cotangent flows straight back."""

    def first(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ p["w"], p["table"]

    def second(p: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return x[0] * p, x[1]

    def third(p: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0] @ x[1] + p

    def loss_fn(y: torch.Tensor, microbatch: torch.Tensor) -> torch.Tensor:
        return (y**2).sum(-1).mean()

    stages = [first, second, third]
    params: list[Any] = [{"w": torch.randn(3, 3), "table": torch.randn(3, 2)}, torch.randn(3), torch.randn(2)]
    batch = torch.randn(6, 3)
    loss, grads = fpipe.pipeline(loss_fn, stages, GPipe(num_microbatches=3))(params, batch)
    expected_loss, expected_grads = reference(loss_fn, stages, params, batch)
    assert_close(loss, expected_loss)
    assert_close(grads, expected_grads)


# --- NOTE [in-place updates of leaves] --------------------------------------------------------


def test_an_in_place_update_of_a_plain_input_is_named_on_the_fast_path() -> None:
    calls: list[int] = []

    def stage(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        calls.append(0)
        return x.mul_(2) @ p

    run = StageRun(3, stage, torch.randn(3, 3))
    with pytest.raises(RuntimeError, match=r"^stage 3 updates its input x in place \(x: mul_\)") as info:
        run.forward(torch.randn(4, 3, requires_grad=True) * 1, differentiate_input=True)
    assert "leaf Variable that requires grad is being used in an in-place operation" in str(info.value.__cause__)
    assert len(calls) == 2  # the forward, and the one call that finds the leaf


def test_an_in_place_update_by_the_last_stage_is_named() -> None:
    def stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        p["w"][0].copy_(x[0])
        return x @ p["w"]

    run = StageRun(2, stage, {"w": torch.randn(3, 3), "steps": torch.tensor(1)})
    match = r"^stage 2 updates a view of its parameter params\['w'\] in place \(params\['w'\]: copy_\)"
    with pytest.raises(RuntimeError, match=match):
        run.forward_loss(torch.randn(4, 3), None, lambda y, mb: y.sum(), has_aux=False, differentiate_input=False)


def test_other_errors_and_updates_outside_the_stage_are_left_as_they_were() -> None:
    """Another RuntimeError is raised as is, the stage called once; an in-place update by
    ``loss_fn`` (of the input leaf the stage handed on) is not the stage's: autograd's error stands."""
    error = RuntimeError("boom")
    calls: list[int] = []

    def failing(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        calls.append(0)
        raise error

    with pytest.raises(RuntimeError) as info:
        StageRun(0, failing, torch.randn(3)).forward(torch.randn(3), differentiate_input=False)
    assert info.value is error and calls == [0]

    run = StageRun(1, lambda p, x: x, torch.randn(3))
    x = torch.randn(3, requires_grad=True) * 1
    with pytest.raises(RuntimeError, match=r"^a leaf Variable that requires grad is being used in an in-place"):
        run.forward_loss(x, None, lambda y, mb: y.mul_(2).sum(), has_aux=False, differentiate_input=True)


# A plain tensor takes fast paths through a stage (``to_device``, ``forward``, ``_inputs``,
# ``_graph_outputs``, the input cotangents of ``backward`` and ``backward_input``): each must give bitwise
# what the general path gives. The general path runs on the same numbers packed so that no fast
# path applies: the input a tuple with an int leaf beside it, and the output a tuple whose second
# leaf carries a graph but gets no cotangent.


def _fast(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p) * p[0]


def _general(p: torch.Tensor, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _fast(p, xs[0]), xs[0].sum() * xs[1]


@pytest.mark.parametrize("backward", ["fused", "split"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_the_one_tensor_fast_paths_equal_the_general_path(backward: str, recompute: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(3, 3, dtype=torch.float64, generator=gen)
    xs = [torch.randn(4, 3, dtype=torch.float64, generator=gen).requires_grad_() * 1 for _ in range(2)]
    cots = [torch.randn(4, 3, dtype=torch.float64, generator=gen) for _ in range(2)]
    fast, general = StageRun(1, _fast, p, recompute=recompute), StageRun(1, _general, p, recompute=recompute)
    got: dict[str, list[Any]] = {"fast": [], "general": []}
    for i, (x, cot) in enumerate(zip(xs, cots)):
        for name, run, arg, cotangents in (
            ("fast", fast, fast.to_device(x), [cot]),
            ("general", general, general.to_device((x, torch.tensor(2))), [cot, None]),
        ):
            y, pullback = run.forward(arg, differentiate_input=True)
            got[name].append(y if name == "fast" else y[0])
            if backward == "fused":
                dx = run.backward(pullback, cotangents, i)
            else:
                dx = run.backward_input(pullback, cotangents)
                run.backward_weight(pullback, i)
            got[name].append(dx[0])
            assert len(dx) == (1 if name == "fast" else 2) and (name == "fast" or dx[1] is None)
    got["fast"].append(fast.grads())
    got["general"].append(general.grads())
    assert_bitwise(got["fast"], got["general"])


def test_a_pullback_lets_its_outputs_go() -> None:
    """NOTE [outputs let go]: ``x @ w`` does not need its result for its backward, so once the
    caller drops the output (sent, say) nothing holds it; the backward still gives the VJP."""
    x, w = torch.randn(4, 3, requires_grad=True) * 1, torch.randn(3, 5)
    run = StageRun(1, lambda p, x: {"y": x @ p}, w)
    y, pullback = run.forward(x, differentiate_input=True)
    expected = torch.ones(4, 5) @ w.T
    output = weakref.ref(y["y"])
    del y
    gc.collect()
    assert output() is None
    (dx,) = run.backward(pullback, [torch.ones(4, 5)], 0) or [None]
    assert dx is not None and torch.equal(dx, expected)
