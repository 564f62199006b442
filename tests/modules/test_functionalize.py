"""``fpipe.functionalize``: an ``nn.Module`` as a pure function of its trainable parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpipe
from fpipe.schedules import GPipe, OneFOneB
from tests.helpers import assert_close


def test_fn_equals_module_forward() -> None:
    module = nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 2))
    fn, params = fpipe.functionalize(module)
    assert list(params) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    x = torch.randn(3, 4)
    assert torch.equal(fn(params, x), module(x))


def test_params_are_detached_aliases() -> None:
    module = nn.Linear(3, 2)
    _, params = fpipe.functionalize(module)
    for name, p in module.named_parameters():
        alias = params[name]
        assert alias is not p and not alias.requires_grad and alias.grad_fn is None
        assert alias.data_ptr() == p.data_ptr()
    assert all(p.requires_grad for p in module.parameters())


def test_fn_uses_the_params_it_is_given() -> None:
    module = nn.Linear(3, 2)
    fn, params = fpipe.functionalize(module)
    other = {"weight": torch.randn(2, 3), "bias": torch.randn(2)}
    x = torch.randn(4, 3)
    assert torch.equal(fn(other, x), x @ other["weight"].T + other["bias"])
    assert torch.equal(fn(params, x), module(x))  # the module itself is unchanged


def test_gradient_equals_module_backward() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    fn, params = fpipe.functionalize(module)
    x = torch.randn(5, 3)
    grads = torch.func.grad(lambda p: fn(p, x).square().mean())(params)
    module(x).square().mean().backward()
    assert_close(grads, {name: p.grad for name, p in module.named_parameters()})


def test_buffers_are_read_from_the_module() -> None:
    """BatchNorm running statistics are not parameters; ``fn`` reads them at each call."""
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    fn, params = fpipe.functionalize(module)
    assert sorted(params) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert not any("running" in name or "num_batches" in name for name in params)

    module.eval()
    state = module.state_dict()
    state["1.running_mean"] = torch.randn(3)
    state["1.running_var"] = torch.rand(3) + 0.5
    module.load_state_dict(state)
    x = torch.randn(4, 3)
    assert torch.equal(fn(params, x), module(x))

    module.train()  # batch statistics now; the running ones are updated like the module's own
    twin = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    twin.load_state_dict(module.state_dict())
    assert torch.equal(fn(params, x), twin(x))
    assert torch.equal(module[1].running_mean, twin[1].running_mean)
    assert module[1].num_batches_tracked.item() == twin[1].num_batches_tracked.item() == 1


def test_recomputation_updates_buffers_once() -> None:
    """The replay of a recomputed forward gets copies of the buffers (fpipe._stage.replaying)."""
    counts = []
    for recompute in (False, True):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        fn, params = fpipe.functionalize(module)
        step = fpipe.pipeline(lambda y, mb: y.square().mean(), [fn], GPipe(2), recompute=recompute)
        step([params], torch.randn(8, 3))
        counts.append((module[1].num_batches_tracked.item(), module[1].running_mean.clone()))
    assert counts[0][0] == counts[1][0] == 2
    assert torch.equal(counts[0][1], counts[1][1])


def test_frozen_params_are_excluded_but_used() -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    module[0].weight.requires_grad_(False)
    fn, params = fpipe.functionalize(module)
    assert sorted(params) == ["0.bias", "1.bias", "1.weight"]
    x = torch.randn(4, 3)
    assert torch.equal(fn(params, x), module(x))
    with torch.no_grad():
        module[0].weight.mul_(2)  # read at call time
    assert torch.equal(fn(params, x), module(x))


class Tied(nn.Module):
    """An embedding and an output projection sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mix = nn.Linear(3, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens)))) * scale


def test_tied_weights_appear_once_and_get_both_gradients() -> None:
    module = Tied()
    fn, params = fpipe.functionalize(module)
    assert sorted(params) == ["embed.weight", "mix.bias", "mix.weight"]
    tokens = torch.tensor([[0, 3, 4], [1, 1, 2]])
    assert torch.equal(fn(params, tokens, scale=2.0), module(tokens, scale=2.0))

    replaced = {**params, "embed.weight": torch.randn(5, 3)}  # both uses see the new weight
    expected = (torch.tanh(module.mix(replaced["embed.weight"][tokens])) @ replaced["embed.weight"].T).detach()
    assert_close(fn(replaced, tokens), expected)

    grads = torch.func.grad(lambda p: fn(p, tokens).square().mean())(params)
    module(tokens).square().mean().backward()
    assert_close(grads, {name: p.grad for name, p in module.named_parameters()})


def test_functionalized_stages_in_a_pipeline() -> None:
    """A model split in two blocks: each functionalized block trains like the module."""
    blocks = [nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))]
    functional = [fpipe.functionalize(block) for block in blocks]
    stages = [functional[0][0], functional[1][0]]
    x, target = torch.randn(9, 3), torch.randn(9, 1)

    def loss_fn(y: torch.Tensor, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((y - microbatch[1]) ** 2).mean()

    step = fpipe.pipeline(loss_fn, [lambda p, b: stages[0](p, b[0]), stages[1]], OneFOneB(num_microbatches=4))
    loss, grads = step([params for _, params in functional], (x, target))
    expected = loss_fn(blocks[1](blocks[0](x)), (x, target))
    expected.backward()
    assert_close(loss, expected.detach())
    for block, block_grads in zip(blocks, grads):
        assert_close(block_grads, {name: p.grad for name, p in block.named_parameters()})


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"expected an nn.Module \(got: function\)"):
        fpipe.functionalize(lambda x: x)  # type: ignore[arg-type]
