"""A tied parameter is one tensor to ``fpipe.optim``: stepped once, with one state, as torch.optim steps it.

``fpipe.split_module`` gives the first and last stages of a tied-embedding model aliases of one
memory (``"embed.weight"``), and ``fpipe.sum_tied`` gives each the whole gradient. The oracle is
``torch.optim.SGD`` / ``torch.optim.AdamW`` stepping the unsplit module after ``loss.backward()``
and ``clip_grad_norm_``: trained 3 steps in one process and on 2 gloo ranks, under schedules that
put the two copies on one rank (ZB-V, DualPipeV) and on two (1F1B, interleaved 1F1B), in place
and pure, every parameter equals the module's to float64 rounding. Then the checks of NOTE [one
tensor, one step] (fpipe/optim/_aliases.py) on hand-made aliases, against the battery's optimizers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fpipe
import fpipe.optim
from fpipe.schedules import DualPipeV, Interleaved1F1B, OneFOneB, ZeroBubbleV, placement
from tests._multiprocess import run_ranks
from tests.helpers import OPTIMIZER_UPDATES, OPTIMIZERS, assert_bitwise, torch_optim_reference

pytestmark = pytest.mark.usefixtures("one_thread")

V, D, STEPS, MAX_NORM = 11, 6, 3, 0.5


class TiedLM(nn.Module):
    """An embedding, tanh layers, and a head whose weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)  # type: ignore[no-any-return]


CALL = {"embed": lambda embed, batch: embed(batch["tokens"]), "layers": lambda layer, h: torch.tanh(layer(h))}
SPECS = {
    2: ["embed + layers[0:2]", "layers[2:] + head"],
    4: ["embed + layers[0]", "layers[1]", "layers[2]", "layers[3] + head"],
}
# name: (schedule, stages); on 2 ranks the tied copies (first and last stage) share a rank under the V's.
SCHEDULES = {
    "1F1B": (OneFOneB(4), 2),
    "interleaved": (Interleaved1F1B(4, stages_per_rank=2), 4),
    "ZB-V": (ZeroBubbleV(4), 4),
    "DualPipeV": (DualPipeV(4), 4),
}


def _model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM().double()


def _batch(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return {"tokens": torch.randint(V, (8, 5), generator=g), "targets": torch.randint(V, (8, 5), generator=g)}


def _loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def _decay(params: list[Any]) -> list[Any]:
    """Weight decay for matrices only (the embedding included), decided on the full layout."""
    return [{name: t.dim() >= 2 for name, t in p.items()} for p in params]


# name: (fpipe optimizer from the layout, torch.optim optimizer of the unsplit model)
TRAINING: dict[str, tuple[Callable[[list[Any]], fpipe.optim.Optimizer], Callable[[nn.Module], Any]]] = {
    "sgd": (
        lambda layout: fpipe.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
        lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adamw": (
        lambda layout: fpipe.optim.adamw(0.05, weight_decay=0.1, weight_decay_mask=_decay(layout)),
        lambda model: torch.optim.AdamW(
            [
                {"params": [p for p in model.parameters() if p.dim() >= 2]},
                {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=0.05,
            weight_decay=0.1,
        ),
    ),
}


def _train(
    step: Any, optimizer: str, layout: list[Any], params: list[Any], *, in_place: bool, group: Any = None
) -> tuple[list[float], list[Any]]:
    """STEPS updates of ``params`` (this rank's; ``layout``: every stage's): sum_tied, a clip
    counting the tied gradient once, then the update. The losses and the parameters."""
    opt = TRAINING[optimizer][0](layout)
    state = opt.init(params)
    losses = []
    for k in range(STEPS):
        loss, grads = step(params, _batch(k))
        grads = fpipe.sum_tied(grads, params=layout, group=group)
        grads = fpipe.optim.clip_by_global_norm(grads, step.global_norm, max_norm=MAX_NORM, params=layout)
        if in_place:
            opt.update_(params, grads, state)
        else:
            params, state = opt.update(params, grads, state)
        losses.append(float(loss))
    return losses, params


def _reference(optimizer: str) -> tuple[list[float], TiedLM]:
    """The unsplit module trained by torch.optim: ``loss.backward()``, ``clip_grad_norm_``, ``step()``."""
    model = _model()
    opt = TRAINING[optimizer][1](model)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        batch = _batch(k)
        loss = _loss(model(batch["tokens"]), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item())
    return losses, model


def _assert_trains_like_the_module(
    optimizer: str, losses: list[float], params: list[Any], *, context: str = ""
) -> None:
    expected_losses, model = _reference(optimizer)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-13, atol=0, msg=context)
    for s, p in enumerate(params):
        if p is None:
            continue
        for name, t in p.items():
            expected = model.get_parameter(name).detach()
            torch.testing.assert_close(t, expected, rtol=1e-12, atol=1e-14, msg=f"{context} params[{s}][{name!r}]")


@pytest.mark.parametrize("in_place", [True, False], ids=["update_", "update"])
@pytest.mark.parametrize("optimizer", TRAINING)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_process_trains_a_tied_model_as_torch_optim(schedule: str, optimizer: str, in_place: bool) -> None:
    pipeline_schedule, num_stages = SCHEDULES[schedule]
    model = _model()
    stages, params = fpipe.split_module(model, SPECS[num_stages], call=CALL)
    first, last = params[0]["embed.weight"], params[-1]["embed.weight"]
    assert first is not last and first.data_ptr() == last.data_ptr()  # aliases, as split_module gives them
    step = fpipe.pipeline(_loss, stages, pipeline_schedule)
    losses, params = _train(step, optimizer, params, params, in_place=in_place)
    _assert_trains_like_the_module(optimizer, losses, params)
    if in_place:  # still one memory, the module's own
        assert params[0]["embed.weight"].data_ptr() == params[-1]["embed.weight"].data_ptr() == first.data_ptr()
    else:  # one new tensor
        assert params[0]["embed.weight"] is params[-1]["embed.weight"]


def _train_on_ranks(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    """Every optimizer, in place and pure, on this rank's stages; the tied copies' placement."""
    torch.set_default_dtype(torch.float64)
    pipeline_schedule, num_stages = SCHEDULES[schedule]
    out: dict[str, Any] = {}
    for optimizer, in_place in itertools.product(TRAINING, (True, False)):
        stages, params = fpipe.split_module(_model(), SPECS[num_stages], call=CALL)
        step = fpipe.pipeline(
            _loss, stages, pipeline_schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=60)
        )
        local = [p if s in step.local_stages else None for s, p in enumerate(params)]
        group = dist.group.WORLD
        out[f"{optimizer} in_place={in_place}"] = _train(step, optimizer, params, local, in_place=in_place, group=group)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_train_a_tied_model_as_torch_optim(schedule: str) -> None:
    pipeline_schedule, num_stages = SCHEDULES[schedule]
    where = placement(pipeline_schedule, num_stages, 2)
    assert (where[0] == where[-1]) == (schedule in ("ZB-V", "DualPipeV"))  # both copies on rank 0, or apart
    results = run_ranks(2, _train_on_ranks, schedule, timeout=180)
    for rank, result in enumerate(results):
        for name, (losses, params) in result.items():
            held = [s for s, p in enumerate(params) if p is not None]
            assert held == [s for s in range(num_stages) if where[s] == rank]
            _assert_trains_like_the_module(name.split()[0], losses, params, context=f"rank {rank}, {name}")
    if where[0] != where[-1]:  # copies in two processes: the same update from the same state, bitwise
        for name in results[0]:
            assert_bitwise(results[0][name][1][0]["embed.weight"], results[1][name][1][-1]["embed.weight"])


# --- Hand-made aliases against the battery's optimizers ------------------------------------------


def _tied_params() -> list[Any]:
    """Stages 0 and 2 hold aliases of one ``w`` (distinct tensor objects, as split_module gives)."""
    w = torch.randn(3, 2)
    return [{"w": w.detach(), "a": torch.randn(2)}, {"b": torch.randn(4)}, {"c": torch.randn(()), "w": w.detach()}]


def _tied_grads(params: list[Any], seed: int) -> list[Any]:
    """Gradients whose tied copies are equal, as after sum_tied."""
    g = torch.Generator().manual_seed(seed)
    grads = [optree.tree_map(lambda t: torch.randn(t.shape, generator=g), p) for p in params]
    grads[2]["w"] = grads[0]["w"].clone()
    return grads


def _untied(trees: list[Any]) -> list[Any]:
    """The tied copy of stage 2 left out: the parameters as torch.optim sees the unsplit model."""
    return [trees[0], trees[1], {"c": trees[2]["c"]}]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_tied_parameter_is_stepped_once_with_one_state(name: str) -> None:
    make, make_torch = OPTIMIZERS[name]
    opt = make()
    params = _tied_params()
    grads = [_tied_grads(params, k) for k in range(OPTIMIZER_UPDATES)]
    expected, torch_state = torch_optim_reference(make_torch, _untied(params), [_untied(g) for g in grads])

    state = opt.init(params)
    for key in set(state[0]) - {"step"}:
        assert state[0][key]["w"] is state[2][key]["w"]  # one buffer per memory
    pure, pure_state = params, state
    in_place, in_place_state = [optree.tree_map(torch.clone, p) for p in params], opt.init(params)
    in_place[2]["w"] = in_place[0]["w"].detach()  # tied again
    for k in range(OPTIMIZER_UPDATES):
        pure, pure_state = opt.update(pure, grads[k], pure_state)
        opt.update_(in_place, grads[k], in_place_state)
    leaves = [t for p in _untied(pure) for t in optree.tree_leaves(p)]
    assert_bitwise(leaves, expected)
    assert_bitwise(in_place, pure)
    assert_bitwise(in_place_state, pure_state)
    assert pure[0]["w"] is pure[2]["w"] and in_place[0]["w"].data_ptr() == in_place[2]["w"].data_ptr()
    for key in set(pure_state[0]) - {"step"}:
        assert pure_state[0][key]["w"] is pure_state[2][key]["w"]
        assert_bitwise(pure_state[0][key]["w"], torch_state[1][key])  # the flat list: a, w, b, c


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if "foreach=True" in n])
def test_a_saved_state_loads_a_buffer_per_copy_and_trains_on_as_one(name: str, tmp_path: Path) -> None:
    """``fpipe.load`` gives each copy its own buffer; the update keeps them equal, as save needs."""
    opt = OPTIMIZERS[name][0]()
    params = _tied_params()
    state = opt.init(params)
    opt.update_(params, _tied_grads(params, 0), state)
    fpipe.save(tmp_path, params, optimizer_state=state)
    loaded = fpipe.load(tmp_path, params, optimizer_state=opt.init(params))
    for key in set(state[0]) - {"step"}:
        assert loaded.optimizer_state[0][key]["w"] is not loaded.optimizer_state[2][key]["w"]
    loaded_params = [optree.tree_map(torch.clone, p) for p in loaded.params]
    loaded_params[2]["w"] = loaded_params[0]["w"].detach()  # tied again, as split_module would give them
    for k in range(1, OPTIMIZER_UPDATES):
        opt.update_(params, _tied_grads(params, k), state)
        opt.update_(loaded_params, _tied_grads(params, k), loaded.optimizer_state)
    assert_bitwise(loaded_params, params)
    assert_bitwise(loaded.optimizer_state, state)  # the separate buffers stayed equal
    fpipe.save(tmp_path, loaded_params, optimizer_state=loaded.optimizer_state)  # and save takes them


def test_a_counter_shared_by_stages_counts_once() -> None:
    opt = fpipe.optim.adamw(0.1)
    params = _tied_params()
    state = opt.init(params)
    for t in state[1:]:
        t["step"] = state[0]["step"]
    opt.update_(params, _tied_grads(params, 0), state)
    assert state[2]["step"] is state[0]["step"] and int(state[0]["step"]) == 1


def _message(fn: Callable[[], Any]) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("in_place", [True, False], ids=["update_", "update"])
def test_tied_copies_that_are_not_one_parameter_are_refused(in_place: bool) -> None:
    def update(opt: fpipe.optim.Optimizer, params: list[Any], grads: list[Any], state: list[Any]) -> None:
        if in_place:
            opt.update_(params, grads, state)
        else:
            opt.update(params, grads, state)

    opt = fpipe.optim.adamw(0.1)
    params = _tied_params()
    unsummed = _tied_grads(params, 0)
    unsummed[2]["w"] = unsummed[2]["w"] + 1
    message = _message(lambda: update(opt, params, unsummed, opt.init(params)))
    assert "params[0]['w'] and params[2]['w'] are one tensor (the same memory" in message
    assert "gradients differ (grads[0]['w'] and grads[2]['w']: largest difference 1)" in message
    assert "fpipe.sum_tied(grads)" in message
    before = optree.tree_map(torch.clone, params)
    grads = _tied_grads(params, 0)
    mask = [{"w": True, "a": False}, True, {"c": False, "w": False}]
    masked = fpipe.optim.adamw(0.1, weight_decay_mask=mask)
    assert "weight_decay_mask gives them different weight decay (weight_decay_mask[0]['w']: True, " in _message(
        lambda: update(masked, params, grads, masked.init(params))
    )
    state = opt.init(params)
    state[2]["exp_avg"] = {**state[2]["exp_avg"], "w": torch.ones(3, 2)}
    assert "optimizer state differs (state[0]['exp_avg']['w'] and state[2]['exp_avg']['w'])" in _message(
        lambda: update(opt, params, grads, state)
    )
    state = opt.init(params)
    state[2]["step"] = torch.tensor(1.0)
    assert "step counters differ (state[0]['step']: 0, state[2]['step']: 1)" in _message(
        lambda: update(opt, params, grads, state)
    )
    assert_bitwise(params, before)  # nothing was written


def test_memory_written_twice_by_an_in_place_update_is_refused() -> None:
    opt = fpipe.optim.sgd(0.1, momentum=0.9)
    storage = torch.randn(6)
    overlapping = [{"a": storage[0:4]}, {"b": storage[2:6]}]
    grads = [{"a": torch.ones(4)}, {"b": torch.ones(4)}]
    assert "params[1]['b'] shares memory with params[0]['a'], and the update writes both" in _message(
        lambda: opt.update_(overlapping, grads, opt.init(overlapping))
    )
    disjoint = [{"a": storage[0:3]}, {"b": storage[3:6]}]  # views of one memory that do not overlap: fine
    opt.update_(disjoint, [{"a": torch.ones(3)}, {"b": torch.ones(3)}], opt.init(disjoint))
    params = [{"a": torch.randn(4)}, {"b": torch.randn(4)}]
    state = opt.init(params)
    state[1]["momentum_buffer"] = {"b": state[0]["momentum_buffer"]["a"]}  # two parameters, one buffer
    assert "state[1]['momentum_buffer']['b'] shares memory with state[0]['momentum_buffer']['a']" in _message(
        lambda: opt.update_(params, grads, state)
    )
    on_params = [{"a": params[0]["a"].detach()}, {"b": torch.ones(4)}]  # a gradient viewing its parameter
    assert "grads[0]['a'] shares memory with params[0]['a'], which the update writes" in _message(
        lambda: opt.update_(params, on_params, opt.init(params))
    )
    new, _ = opt.update(params, on_params, opt.init(params))  # the pure update writes copies: fine
    torch.testing.assert_close(new[0]["a"], params[0]["a"] * 0.9)


def _dtensors_on_ranks(rank: int, world_size: int) -> list[bool]:
    """Tied DTensor copies (a Shard(0) weight on a tp mesh of 2): one tensor by their local pieces."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    w, dw = (distribute_tensor(torch.randn(4, 3, generator=g), mesh, [Shard(0)]) for _ in range(2))
    b, db = (distribute_tensor(torch.randn(3, generator=g), mesh, [Replicate()]) for _ in range(2))
    reference = [w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    reference[0].grad, reference[1].grad = dw, db
    torch.optim.AdamW(reference, lr=0.1).step()
    params = [{"w": w.detach(), "b": b.detach()}, {"w": w.detach()}]
    opt = fpipe.optim.adamw(0.1)
    state = opt.init(params)
    new, _ = opt.update(params, [{"w": dw, "b": db}, {"w": dw.clone()}], state)
    opt.update_(params, [{"w": dw, "b": db}, {"w": dw.clone()}], state)
    assert_bitwise([params[0]["w"], params[0]["b"]], [r.detach() for r in reference], "in place")
    assert_bitwise([new[0]["w"], new[0]["b"]], [r.detach() for r in reference], "pure")
    return [
        state[0]["exp_avg"]["w"] is state[1]["exp_avg"]["w"],
        new[0]["w"] is new[1]["w"],
        params[1]["w"].to_local().data_ptr() == params[0]["w"].to_local().data_ptr(),
    ]


@pytest.mark.timeout(120)
def test_tied_dtensor_copies_are_one_tensor() -> None:
    """Tensor-parallel weights are DTensors: their copies are one tensor by their local pieces,
    stepped once, bitwise ``torch.optim.AdamW`` on the DTensors."""
    for checks in run_ranks(2, _dtensors_on_ranks, timeout=90):  # each rank compares the bits itself
        assert checks == [True] * 3
