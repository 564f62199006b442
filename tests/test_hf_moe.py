"""A Hugging Face ``MixtralForCausalLM`` cut into stages, its MoE blocks through ``fpipe.moe``, trains
like the Hugging Face model itself, in one process and on pp 2 x ep 2; loaded with each rank reading
only its experts, exported back bitwise.

The model and its adapters are examples/hf_moe.py's: a tiny random ``MixtralConfig`` (2 layers,
hidden 16, 4 experts, top 2) in float64, written by ``save_pretrained(..., save_original_format=False)``
(the experts as 3-D tensors), and a padded batch. The oracle is ``loss.backward()`` through the
model's own ``forward`` (its router's loop over experts and ``index_add_``), to fpipe's relative
error of 1e-10. (The router's softmax is float32 on both paths, as Hugging Face computes it.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import fpipe
from fpipe.schedules import GPipe, OneFOneB
from tests._multiprocess import run_ranks
from tests.helpers import assert_bitwise, assert_close, hf_padded_batch

pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_moe.py"
SIZE = {"layers": 2, "hidden": 16, "experts": 4, "top_k": 2}


def example() -> ModuleType:
    """examples/hf_moe.py as a module of its own."""
    spec = importlib.util.spec_from_file_location("fpipe_example_hf_moe", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def moe() -> ModuleType:
    return example()


def checkpoint(moe: ModuleType, directory: Path) -> Any:
    """The tiny Mixtral, written into ``directory``; returned."""
    return moe.write_checkpoint(directory, moe.build_config(**SIZE, dtype=torch.float64), seed=0)


def unsplit(model: Any, moe: ModuleType, batches: list[dict[str, Any]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean of the model's losses on ``batches`` and its gradients, by Hugging Face's own backward."""
    model.zero_grad()
    total = sum(
        moe.loss_fn(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b) for b in batches
    )
    loss = total / len(batches)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_the_moe_block_is_hugging_faces(moe: ModuleType) -> None:
    """``sparse_moe_block`` on plain tensors equals ``MixtralSparseMoeBlock.forward``, and its gradients."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    block = MixtralForCausalLM(moe.build_config(**SIZE)).to(torch.float64).model.layers[0].mlp
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    params = dict(block.named_parameters())
    outputs = []
    for forward in (block.forward, lambda h: moe.sparse_moe_block(block, h)):
        y = forward(x)
        outputs.append((y, torch.autograd.grad(y.square().sum(), [x, *params.values()])))
    assert_close(outputs[1], outputs[0])


@pytest.mark.parametrize("schedule", [OneFOneB(3), GPipe(2)], ids=["1f1b", "gpipe"])
def test_one_process_equals_hugging_face_and_exports_back(moe: ModuleType, tmp_path: Path, schedule: Any) -> None:
    from transformers import MixtralForCausalLM

    model = checkpoint(moe, tmp_path / "hf")
    named = dict(model.named_parameters())
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= set(named)
    stages, template = moe.split(moe.meta_model(model.config, torch.float64), 1)
    step = fpipe.pipeline(moe.loss_fn, stages, schedule)
    params = moe.load(tmp_path / "hf", template, step, None)
    assert_bitwise(params, [{name: named[name].detach() for name in p} for p in template])
    batch = hf_padded_batch(moe)
    loss, grads = step(params, batch)
    expected_loss, expected = unsplit(model, moe, [batch])
    assert_close(loss, expected_loss)
    for s, stage_grads in enumerate(grads):
        assert_close(stage_grads, {name: expected[name] for name in stage_grads}, context=f"stage {s}")
    assert {name for p in grads for name in p} == set(expected)

    fpipe.save_hf(tmp_path / "out", params, config=tmp_path / "hf")
    back = dict(MixtralForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    assert_bitwise({n: t.detach() for n, t in back.items()}, {n: t for p in params for n, t in p.items()})


def test_pp_times_ep_equals_hugging_face_each_rank_reading_its_experts(moe: ModuleType, tmp_path: Path) -> None:
    """pp 2 x ep 2 on 4 gloo ranks, each expert rank with half the batch: the loss and every gradient
    equal the Hugging Face model's on the mean of the halves' losses; each rank read its stage's
    names, of each expert tensor its own experts' rows only; the export of the parameters after one
    SGD step (each expert tensor gathered whole) loads into ``from_pretrained`` bitwise."""
    from transformers import MixtralForCausalLM

    model = checkpoint(moe, tmp_path / "hf")
    results = run_ranks(4, _pp_times_ep, str(tmp_path / "hf"), str(tmp_path / "out"), timeout=180)
    batch = hf_padded_batch(moe)
    halves = [{k: v[e * 3 : (e + 1) * 3] for k, v in batch.items()} for e in range(2)]
    expected_loss, expected = unsplit(model, moe, halves)
    named = {name: p.detach() for name, p in model.named_parameters()}
    updated = {}
    for rank, ep, held, loaded, loss, grads, params, read in results:

        def mine(name: str, t: torch.Tensor, ep: int = ep) -> torch.Tensor:  # experts 0-1 or 2-3
            return t[ep * 2 : (ep + 1) * 2] if name.endswith(moe.EXPERT_TENSORS) else t

        assert_close(loss, expected_loss, context=f"rank {rank}")
        names = {name for s in held for name in grads[s]}
        assert names == {n for n in named if n.startswith(f"model.layers.{held[0]}.")} | (
            {"model.embed_tokens.weight"} if held == [0] else {"model.norm.weight", "lm_head.weight"}
        )
        for s in held:
            assert_close(grads[s], {n: mine(n, expected[n]) for n in grads[s]}, context=f"rank {rank}, stage {s}")
        assert read == {n: mine(n, named[n]).numel() for n in names}, f"rank {rank}"
        for s in held:
            assert_bitwise(loaded[s], {n: mine(n, named[n]) for n in loaded[s]}, f"rank {rank}, stage {s}")
        for s in held:
            for name, t in params[s].items():
                updated.setdefault(name, {})[ep] = t
    back = dict(MixtralForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    whole = {n: torch.cat([p[0], p[1]]) if n.endswith(moe.EXPERT_TENSORS) else p[0] for n, p in updated.items()}
    assert_bitwise({n: t.detach() for n, t in back.items()}, whole)
    assert all(torch.equal(p[0], p[1]) for n, p in updated.items() if not n.endswith(moe.EXPERT_TENSORS))


def _pp_times_ep(rank: int, world: int, directory: str, out: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.saving._tools import Spy

    torch.set_default_dtype(torch.float64)
    moe = example()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    ep = mesh["ep"].get_local_rank()
    stages, template = moe.split(moe.meta_model(moe.read_config(directory), torch.float64), 1)
    step = fpipe.pipeline(moe.loss_fn, stages, OneFOneB(3), parallel=fpipe.Parallelism(mesh=mesh, timeout=60))
    spy = Spy()
    params = moe.load(directory, template, step, mesh)
    experts = {n: isinstance(t, DTensor) for p in params if p is not None for n, t in p.items()}
    assert experts == {n: n.endswith(moe.EXPERT_TENSORS) for n in experts}
    batch = {k: v[ep * 3 : (ep + 1) * 3] for k, v in hf_padded_batch(moe).items()}
    loss, grads = step(params, batch if 0 in step.local_stages else None)
    with torch.no_grad():
        sgd = [None if p is None else {n: t - 0.5 * g[n] for n, t in p.items()} for p, g in zip(params, grads)]
    fpipe.save_hf(out, sgd, config=directory, parallel=step)

    def local(tree: Any) -> Any:
        return None if tree is None else {n: t.to_local() if hasattr(t, "to_local") else t for n, t in tree.items()}

    held = list(step.local_stages)
    return (
        rank,
        ep,
        held,
        [local(p) for p in params],
        loss,
        [local(g) for g in grads],
        [local(p) for p in sgd],
        dict(spy.read),
    )


def test_example_trains_and_exports(moe: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import MixtralForCausalLM

    args = ["--steps", "3", "--batch-size", "8", "--hidden", "16", "--quiet", "--export", str(tmp_path / "out")]
    losses = moe.main(args)
    assert len(losses) == 3 and losses[0] > 2.0  # about ln(17): chance
    assert capsys.readouterr().out.startswith("3 steps in")
    back = MixtralForCausalLM.from_pretrained(tmp_path / "out")
    assert back.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 32, 16)
