"""A Hugging Face ``LlamaForCausalLM`` cut by ``fpipe.split_module`` trains like the unsplit model.

The model and its adapters are those of ``examples/hf_llama.py``: random weights from a small
``LlamaConfig``, in float64, with tied and untied embeddings and a padded batch. The oracle is
``loss.backward()`` through the model's own ``forward`` (which builds its causal mask and rotary
table itself), to fpipe's usual relative error of 1e-10. (Hugging Face's RMSNorm rounds to
float32 whatever the model's dtype; it does so row by row, identically on both paths.)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

import fpipe
from fpipe.schedules import GPipe, Interleaved1F1B, OneFOneB
from tests.helpers import assert_close, hf_padded_batch

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


def unsplit(model: Any, hf: ModuleType, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = hf.loss_fn(logits, batch)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("tied", "schedule"),
    [(True, OneFOneB(3)), (False, GPipe(2)), (True, Interleaved1F1B(3, stages_per_rank=3))],
    ids=["tied-1f1b", "untied-gpipe", "tied-interleaved"],
)
def test_pipeline_equals_unsplit_backward(hf: ModuleType, tied: bool, schedule: Any) -> None:
    model = hf.build_model(layers=3, hidden=16, heads=4, dtype=torch.float64, tied=tied)
    batch = hf_padded_batch(hf)
    stages, params = hf.split(model, 2)
    assert [s.module_names for s in stages] == [
        ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"),
        ("model.layers.2",),
        ("model.norm", "lm_head"),
    ]
    assert ("model.embed_tokens.weight" in params[2]) == tied
    assert ("lm_head.weight" in params[2]) == (not tied)
    loss, grads = fpipe.pipeline(hf.loss_fn, stages, schedule)(params, batch)
    expected_loss, expected = unsplit(model, hf, batch)
    assert_close(loss, expected_loss)
    grads = fpipe.sum_tied(grads)
    for s, (stage_params, stage_grads) in enumerate(zip(params, grads)):
        assert_close(stage_grads, {name: expected[name] for name in stage_params}, context=f"stage {s}")
    assert {name for p in params for name in p} == set(expected)


def test_loss_fn_is_hugging_faces_loss(hf: ModuleType) -> None:
    """The example's loss equals ``LlamaForCausalLM``'s own ``labels=`` loss (which upcasts to float32)."""
    model, batch = hf.build_model(layers=2, hidden=16), hf_padded_batch(hf)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    torch.testing.assert_close(hf.loss_fn(out.logits, batch), out.loss)


def test_example_trains(hf: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    losses = hf.main(["--steps", "3", "--batch-size", "8", "--hidden", "16", "--layers", "2", "--quiet"])
    assert len(losses) == 3 and losses[0] > 2.0  # about ln(17): chance
    assert capsys.readouterr().out.startswith("3 steps in")
