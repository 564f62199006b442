"""``fpipe.split_module``: stages cut from an ``nn.Module`` train like the module itself.

The oracle is the unsplit module's ``loss.backward()``: the gradient of every parameter of every
stage, looked up by its name in the model, equals ``model.get_parameter(name).grad``. Modules
parallelized by torch's ``parallelize_module`` (DTensor weights) split the same way, on one spawn
of 4 gloo ranks (pp 2 x tp 2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fpipe
from fpipe.schedules import GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1
from tests._multiprocess import run_ranks
from tests.helpers import (
    TINY_LM_CALL,
    TINY_LM_LENGTH,
    TinyLM,
    assert_bitwise,
    assert_close,
    by_name,
    tiny_lm_batch,
    tiny_lm_grads,
    tiny_lm_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --- Transparency --------------------------------------------------------------------------------


SPECS = {
    "lists": ([["embed", "rotary", "layers[0:2]"], ["rotary", "layers[2:4]", "norm", "head"]], OneFOneB(4)),
    "strings": (
        ["embed + rotary + layers[0]", "rotary + layers.1 + layers[2:-1]", "rotary + layers[-1] + norm + head"],
        GPipe(3),
    ),
    "interleaved": (
        [
            "embed + rotary + layers[:1]",
            "rotary + layers[1:2]",
            "rotary + layers[2:3]",
            "rotary + layers[3:] + norm + head",
        ],
        Interleaved1F1B(5, stages_per_rank=2),
    ),
    "one-stage": (["embed + rotary + layers + norm + head"], GPipe(2)),
}


@pytest.mark.parametrize(("spec", "schedule"), SPECS.values(), ids=SPECS.keys())
def test_split_stages_train_like_the_module(spec: list[Any], schedule: Any) -> None:
    model, batch = TinyLM(), tiny_lm_batch()
    stages, params = fpipe.split_module(model, spec, call=TINY_LM_CALL)
    step = fpipe.pipeline(tiny_lm_loss, stages, schedule)
    loss, grads = step(params, batch)
    expected_loss, expected = tiny_lm_grads(model, batch)
    assert_close(loss, expected_loss)
    for stage_params, stage_grads in zip(params, grads):
        assert_close(stage_grads, by_name(expected, stage_params))
    assert sorted(name for p in params for name in p) == sorted(expected)  # every parameter, once


def test_params_are_the_models_names_and_detached_aliases() -> None:
    model = TinyLM()
    stages, params = fpipe.split_module(model, ["embed + rotary + layers[0:2]", "rotary + layers[2:] + norm + head"])
    names = [name for name, _ in model.named_parameters()]
    assert list(params[0]) == [n for n in names if n.startswith(("embed.", "layers.0.", "layers.1."))]
    assert list(params[1]) == [n for n in names if n.startswith(("layers.2.", "layers.3.", "norm.", "head."))]
    for p in params:
        for name, alias in p.items():
            original = model.get_parameter(name)
            assert alias is not original and not alias.requires_grad
            assert alias.data_ptr() == original.data_ptr()
    assert stages[1].param_names == tuple(params[1])
    assert stages[0].module_names == ("embed", "rotary", "layers.0", "layers.1")
    assert stages[1].segments == ("rotary", "layers[2:]", "norm", "head")
    assert repr(stages[1]) == "<fpipe.ModuleStage 1: rotary + layers[2:] + norm + head>"


def test_stages_use_the_params_they_are_given() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    stages, params = fpipe.split_module(model, ["0 + 1", "2"])
    x = torch.randn(5, 3)
    assert torch.equal(stages[1](params[1], stages[0](params[0], x)), model(x))
    other = {"0.weight": torch.randn(4, 3), "0.bias": torch.randn(4)}
    assert_close(stages[0](other, x), torch.tanh(x @ other["0.weight"].T + other["0.bias"]))
    assert torch.equal(stages[0](params[0], x), torch.tanh(model[0](x)))  # the module is unchanged


def test_extras_travel_between_stages() -> None:
    """Non-tensor, integer and bool extras arrive at later stages as the first stage sent them."""
    seen: list[Any] = []

    def head(module: Any, x: dict[str, Any]) -> torch.Tensor:
        seen.append((x["tag"], x["mask"].dtype, x["mask"].shape, sorted(x)))
        return module(x["hidden"])

    model, batch = TinyLM(2), tiny_lm_batch(6)
    call = {**TINY_LM_CALL, "norm": lambda norm, x: {**x, "hidden": norm(x["hidden"])}, "head": head}
    stages, params = fpipe.split_module(
        model, ["embed + rotary + layers[0]", "rotary + layers[1] + norm + head"], call=call
    )
    loss, _ = fpipe.pipeline(tiny_lm_loss, stages, GPipe(3))(params, batch)
    assert seen == [("batch", torch.bool, (2, TINY_LM_LENGTH), ["hidden", "mask", "rope", "tag"])] * 3
    assert_close(loss, tiny_lm_grads(model, batch)[0])


def test_adapters_by_longest_prefix() -> None:
    """``"layers.1"`` beats ``"layers"``, which beats the default ``""``; unmatched modules get ``module(x)``."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.Linear(2, 2))
    calls: list[str] = []

    def adapter(tag: str) -> Any:
        return lambda module, x: calls.append(tag) or module(x)

    stages, params = fpipe.split_module(
        model, ["0 + 1 + 2"], call={"": adapter("default"), "1": adapter("list"), "1.1": adapter("second")}
    )
    x = torch.randn(3, 2)
    y = stages[0](params[0], x)
    assert calls == ["default", "list", "second", "default"]
    assert torch.equal(y, model[2](model[1][1](model[1][0](model[0](x)))))

    calls.clear()
    stages, params = fpipe.split_module(model, ["0 + 1 + 2"], call=adapter("all"))  # one adapter for every module
    stages[0](params[0], x)
    assert calls == ["all"] * 4


def test_the_adapter_sees_the_module() -> None:
    seen = []
    model = nn.Sequential(nn.Linear(2, 3))

    def adapter(module: Any, x: torch.Tensor) -> torch.Tensor:
        seen.append((module.module is model[0], repr(module)))
        return module(x)

    stages, params = fpipe.split_module(model, ["0"], call=adapter)
    stages[0](params[0], torch.randn(1, 2))
    assert seen == [(True, "<fpipe module '0' with stage parameters>")]


def test_module_names_with_any_characters() -> None:
    """ModuleDict keys may hold characters other than letters, digits and ``_`` (``"conv-1"``, ``"lin 2"``)."""
    blocks = nn.ModuleDict({"conv-1": nn.Linear(3, 3), "lin 2": nn.Sequential(nn.Tanh(), nn.Linear(3, 2))})
    model = nn.Sequential(blocks)
    stages, params = fpipe.split_module(model, ["0.conv-1", ["0.lin 2[0:]"]])
    assert [list(p) for p in params] == [["0.conv-1.weight", "0.conv-1.bias"], ["0.lin 2.1.weight", "0.lin 2.1.bias"]]
    x = torch.randn(4, 3)
    assert torch.equal(stages[1](params[1], stages[0](params[0], x)), blocks["lin 2"](blocks["conv-1"](x)))
    with pytest.raises(ValueError, match=r"cannot read segment '0.conv-2' of stage 0. Did you mean '0.conv-1'\?"):
        fpipe.split_module(model, ["0.conv-2", "0.lin 2"])


def test_module_lists_stand_for_their_modules_nested_too() -> None:
    """A ModuleList has no forward: named whole or in a range it is its modules, and an empty one is none."""
    model = nn.Module()
    model.first = nn.Linear(2, 2)
    model.nest = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Tanh()]), nn.Linear(2, 2)])
    model.empty = nn.ModuleList()
    stages, params = fpipe.split_module(model, ["first + nest[0]", "nest[1:]"])
    assert [stage.module_names for stage in stages] == [("first", "nest.0.0", "nest.0.1"), ("nest.1",)]
    stages, params = fpipe.split_module(model, ["first", "nest"])
    assert stages[1].module_names == ("nest.0.0", "nest.0.1", "nest.1")
    x = torch.randn(3, 2)
    expected = model.nest[1](model.nest[0][1](model.nest[0][0](model.first(x))))
    assert torch.equal(stages[1](params[1], stages[0](params[0], x)), expected)
    with pytest.raises(ValueError, match=r"'empty' of stage 0 selects no module \('empty' is an empty ModuleList\)"):
        fpipe.split_module(model, ["first + empty", "nest"])
    model.nest.append(nn.ModuleList())
    with pytest.raises(ValueError, match=r"'nest\[2:\]' of stage 1 selects no module \(its ModuleLists are empty\)"):
        fpipe.split_module(model, ["first + nest[:2]", "nest[2:]"])


# --- Buffers, frozen and tied parameters --------------------------------------------------------


def test_buffers_are_read_from_the_module() -> None:
    """BatchNorm statistics are buffers: not in params, read at each call, updated like the module's."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    stages, params = fpipe.split_module(model, ["0 + 1", "2"])
    assert list(params[0]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    model.eval()
    state = model.state_dict()
    state["1.running_mean"], state["1.running_var"] = torch.randn(3), torch.rand(3) + 0.5
    model.load_state_dict(state)  # after the split: the stages see it
    x = torch.randn(4, 3)
    assert torch.equal(stages[1](params[1], stages[0](params[0], x)), model(x))

    model.train()
    twin = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    twin.load_state_dict(model.state_dict())
    assert torch.equal(stages[0](params[0], x), twin[1](twin[0](x)))
    assert torch.equal(model[1].running_mean, twin[1].running_mean)


@pytest.mark.parametrize("schedule", [GPipe(2), ZeroBubbleH1(2)], ids=["gpipe", "zbh1"])
def test_recomputation_updates_buffers_once(schedule: Any) -> None:
    """A train-mode BatchNorm updates its running statistics in the forward only, not again when
    a recomputed forward is replayed in the backward (NOTE [recomputation])."""

    def run(recompute: bool) -> tuple[torch.Tensor, list[Any], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2), nn.BatchNorm1d(2))
        stages, params = fpipe.split_module(model, ["0 + 1", "2 + 3"])
        step = fpipe.pipeline(lambda y, mb: y.square().mean(), stages, schedule, recompute=recompute)
        loss, grads = step(params, torch.randn(8, 3))
        return loss, grads, {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num" in k}

    loss, grads, buffers = run(False)
    assert buffers["1.num_batches_tracked"].item() == buffers["3.num_batches_tracked"].item() == 2
    recomputed_loss, recomputed_grads, recomputed_buffers = run(True)
    assert_bitwise((recomputed_loss, recomputed_grads, recomputed_buffers), (loss, grads, buffers))


def test_frozen_params_are_excluded_but_used() -> None:
    model = TinyLM(2)
    model.layers[0].requires_grad_(False)
    stages, params = fpipe.split_module(
        model, ["embed + rotary + layers[0]", "rotary + layers[1] + norm + head"], call=TINY_LM_CALL
    )
    assert params[0] == {"embed.weight": params[0]["embed.weight"]}
    batch = tiny_lm_batch(4)
    loss, grads = fpipe.pipeline(tiny_lm_loss, stages, GPipe(2))(params, batch)
    expected_loss, expected = tiny_lm_grads(model, batch)
    assert_close(loss, expected_loss)
    assert_close(grads, [by_name(expected, p) for p in params])


def test_tied_embeddings_appear_in_both_stages_and_sum_tied_adds_their_grads() -> None:
    model, batch = TinyLM(tied=True), tiny_lm_batch()
    assert model.head.weight is model.embed.weight
    stages, params = fpipe.split_module(
        model, ["embed + rotary + layers[0:2]", "rotary + layers[2:] + norm + head"], call=TINY_LM_CALL
    )
    assert "embed.weight" in params[0] and "embed.weight" in params[1] and "head.weight" not in params[1]
    assert params[0]["embed.weight"].data_ptr() == params[1]["embed.weight"].data_ptr()
    loss, grads = fpipe.pipeline(tiny_lm_loss, stages, OneFOneB(3))(params, batch)
    expected_loss, expected = tiny_lm_grads(model, batch)
    assert_close(loss, expected_loss)
    partial = grads[0]["embed.weight"] + grads[1]["embed.weight"]
    assert_close(partial, expected["embed.weight"])  # each stage holds its own uses only
    summed = fpipe.sum_tied(grads)
    assert_close(summed, [by_name(expected, p) for p in params])


def test_tied_within_one_stage_appears_once() -> None:
    model, batch = TinyLM(2, tied=True), tiny_lm_batch(4)
    stages, params = fpipe.split_module(model, [["embed", "rotary", "layers", "norm", "head"]], call=TINY_LM_CALL)
    assert list(params[0]).count("embed.weight") == 1
    _, grads = fpipe.pipeline(tiny_lm_loss, stages, GPipe(2))(params, batch)
    assert_close(grads[0], by_name(tiny_lm_grads(model, batch)[1], params[0]))


# --- Errors -------------------------------------------------------------------------------------


BAD_SPECS = {
    "unknown": ([["embed", "layer[0:4]"]], r"no module 'layer' \(stage 0: 'layer\[0:4\]'\). Did you mean 'layers'\?"),
    "overlapping-ranges": (
        ["embed + layers[0:3]", "layers[2:] + norm + head"],
        r"'layers.2' is named twice: .*stage 1 \('layers\[2:\]'\).*stage 0 \('layers\[0:3\]'\)",
    ),
    "inside": (["embed + layers + norm", "layers.1.mlp + head"], r"'layers.1.mlp' overlaps 'layers.1'"),
    "missing": (["embed + layers[0:2] + layers[3]", "norm"], r"no stage \(modules or parameters: layers.2, head\)"),
    "a-parameter": (["embed + layers + norm + head + layers.0.norm.weight"], r"no module 'layers.0.norm.weight'"),
    "out-of-range": (["embed + layers[0:9]"], r"'layers\[0:9\]' of stage 0 is out of range: its list has 4"),
    "index-out-of-range": (["embed + layers[4]"], r"'layers\[4\]' of stage 0 is out of range: its list has 4"),
    "negative-out-of-range": (["embed + layers[-5:]"], r"'layers\[-5:\]' of stage 0 is out of range"),
    "empty-range": (["embed + layers[2:2]"], r"'layers\[2:2\]' of stage 0 selects no module"),
    "not-a-list": (["embed[0:1]"], r"'embed' is a Embedding, not a ModuleList or Sequential"),
    "syntax": (["embed + layers(0)"], r"cannot read segment 'layers\(0\)' of stage 0"),
    "empty-brackets": (["embed + layers[]"], r"cannot read segment 'layers\[\]' of stage 0"),
    "empty-segment": (["embed + layers + norm + "], r"stage 0 has an empty segment"),
    "empty-stage": (["embed + layers + norm + head", ""], r"stage 1 names no module"),
}


@pytest.mark.parametrize(("spec", "match"), BAD_SPECS.values(), ids=BAD_SPECS.keys())
def test_bad_split_points(spec: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fpipe.split_module(TinyLM(), spec, call=TINY_LM_CALL)


def test_a_module_without_parameters_may_repeat_but_not_one_with() -> None:
    fpipe.split_module(TinyLM(), ["embed + rotary + layers[0:2]", "rotary + layers[2:] + norm + head"])
    with pytest.raises(ValueError, match=r"'norm' is named twice"):
        fpipe.split_module(TinyLM(), ["embed + norm + layers[0:2]", "layers[2:] + norm + head"])


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"expected an nn.Module \(model: function\)"):
        fpipe.split_module(lambda x: x, [["0"]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"one entry per stage"):
        fpipe.split_module(TinyLM(), "embed + layers")
    with pytest.raises(TypeError, match=r"stage 1 must be a list of module names"):
        fpipe.split_module(TinyLM(), ["embed", [0, 1]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"stage 0 is a range of indices, not module names.*\"layers\[0:2\]\""):
        fpipe.split_module(TinyLM(), [range(0, 2), "layers[2:] + norm + head"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"adapter for 'layer', which names no module.*Did you mean 'layers'"):
        fpipe.split_module(TinyLM(), ["embed + layers + norm + head"], call={"layer": lambda m, x: m(x)})
    with pytest.raises(TypeError, match=r"the adapter for 'norm' is not callable"):
        fpipe.split_module(TinyLM(), ["embed + layers + norm + head"], call={"norm": 3})  # type: ignore[dict-item]
    with pytest.raises(
        TypeError, match=r"fpipe.split_module: call must be an adapter call\(module, x\) -> x or a dict"
    ):
        fpipe.split_module(TinyLM(), ["embed + layers + norm + head"], call=3)  # type: ignore[arg-type]


def test_stage_params_must_match() -> None:
    stages, params = fpipe.split_module(TinyLM(2), ["embed + layers[0]", "layers[1] + norm + head"], call=TINY_LM_CALL)
    with pytest.raises(ValueError, match=r"stage 1: stage_params does not match.*missing: layers.1.norm.weight, "):
        stages[1](params[0], None)
    with pytest.raises(ValueError, match=r"\(missing: none; unexpected: extra\). Pass params\[1\]"):
        stages[1]({**params[1], "extra": torch.zeros(())}, None)
    with pytest.raises(TypeError, match=r"stage 0: stage_params must be the dict"):
        stages[0]([1], None)


# --- Modules parallelized by torch (DTensor weights on a tp sub-mesh), then split: pp 2 x tp 2 ---


def _mlp():
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64}  # the same draws here and in the ranks, whatever the default dtype
    layers = [nn.Linear(4, 8, **f64), nn.Tanh(), nn.Linear(8, 4, **f64), nn.Linear(4, 8, **f64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 3, **f64))


def _mse(y, mb):
    return ((y - mb["y"]) ** 2).mean()


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    return {"x": x, "y": torch.randn(6, 3, generator=g, dtype=torch.float64)}


def _parallelized(rank, world):
    """torch's ColwiseParallel / RowwiseParallel on a model's Linears, then split_module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = _mlp()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(), "5": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    call = {"": lambda module, x: module(x), "0": lambda module, mb: module(mb["x"])}
    stages, params = fpipe.split_module(model, ["0+1+2", "3+4+5"], call=call)
    step = fpipe.pipeline(_mse, stages, OneFOneB(3), parallel=fpipe.Parallelism(mesh=mesh, timeout=60))
    loss, grads = step([p if s in step.local_stages else None for s, p in enumerate(params)], _mlp_batch())
    full = {k: g.full_tensor() if isinstance(g, DTensor) else g for s in step.local_stages for k, g in grads[s].items()}
    return loss, full


def test_modules_parallelized_by_torch_then_split():
    results = run_ranks(4, _parallelized, timeout=120)
    model = _mlp()
    batch = _mlp_batch()
    loss = _mse(model(batch["x"]), batch)
    loss.backward()
    for d_loss, d_grads in results:
        torch.testing.assert_close(d_loss, loss.detach(), rtol=1e-13, atol=0)
        assert len(d_grads) == 4
        for name, g in d_grads.items():
            torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-12, atol=1e-15)
