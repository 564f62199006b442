"""What the tests share: the two comparisons, the oracles, and the toy models.

Every test module imports what it shares from here (or from the other helper modules, named
without ``test_``: tests/_multiprocess.py, tests/conformance.py, tests/saving/_tools.py...), never
from another test module (tests/test_layers.py checks it).

- ``assert_bitwise``: the same bits. "Bitwise" in a test's name or comment means this one
  (STYLE.md, point 20): 0.0 and -0.0 differ, two NaNs with the same payload are equal.
- ``assert_close``: float64 results to a relative error (the oracle's comparison).
- ``reference``: ``torch.func.grad_and_value`` of the unsplit model, the transparency oracle;
  ``torch_optim_reference`` and ``torch_stages`` put torch's optimizers and schedules beside fpipe's.
- The toy models, each with its batch and loss: tanh layers, a model of mixed leaves (complex,
  int, string), weights by global name, the Hugging Face example's Llama, a Llama-like module,
  a toy mixture of experts (each token to a fixed expert, over ``mesh["ep"]``).
"""

from __future__ import annotations

import importlib.util
import math
import struct
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.optim
from torch import nn

import fpipe.optim
from fpipe.planning import Device, Transformer
from fpipe.planning._ranking import Candidate
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV

if TYPE_CHECKING:
    from tests.conformance import Conformance

TOLERANCE = 1e-10


# --- Comparisons --------------------------------------------------------------------------------


def assert_bitwise(actual: Any, expected: Any, context: str = "") -> None:
    """Same pytree structure (``None`` a leaf), and per leaf the same type and the same bits.

    A tensor leaf matches in dtype, shape and device and in its raw bytes (a lazily conjugated or
    negated view counts as what it reads as; strides do not count); a DTensor in its placements
    and mesh and then its local tensor; a meta tensor in dtype and shape only (it has no bits);
    a float or complex leaf in its bits too; any other leaf by ``==``. ``context`` starts the
    failure message, which names the key path of the first leaf that differs.
    """
    a_leaves, a_spec = optree.tree_flatten(actual, none_is_leaf=True)
    e_paths, e_leaves, e_spec = optree.tree_flatten_with_path(expected, none_is_leaf=True)
    where = f"{context}: " if context else ""
    assert a_spec == e_spec, f"{where}the structures differ: {a_spec} and {e_spec}"
    for path, a, e in zip(e_paths, a_leaves, e_leaves):
        _assert_same_bits(a, e, f"{where}at {''.join(f'[{k!r}]' for k in path) or 'the root'}")


def bitwise_equal(actual: Any, expected: Any) -> bool:
    """Whether ``assert_bitwise(actual, expected)`` passes: for checks a rank returns as booleans."""
    try:
        assert_bitwise(actual, expected)
    except AssertionError:
        return False
    return True


def _assert_same_bits(a: Any, e: Any, where: str) -> None:
    assert type(a) is type(e), f"{where}: types {type(a).__name__} and {type(e).__name__}"
    if not isinstance(e, torch.Tensor):
        assert _bits_of_scalar(a) == _bits_of_scalar(e), f"{where}: {a!r} and {e!r}"
        return
    assert (a.dtype, a.shape, a.device) == (e.dtype, e.shape, e.device), (
        f"{where}: {a.dtype} {tuple(a.shape)} on {a.device} and {e.dtype} {tuple(e.shape)} on {e.device}"
    )
    from torch.distributed.tensor import DTensor

    if isinstance(e, DTensor):
        assert (a.placements, a.device_mesh) == (e.placements, e.device_mesh), (
            f"{where}: placements {a.placements} on {a.device_mesh} and {e.placements} on {e.device_mesh}"
        )
        _assert_same_bits(a.to_local(), e.to_local(), f"{where} (local tensor)")
        return
    if e.device.type == "meta":
        return
    a_bits, e_bits = _bits(a), _bits(e)
    differ = (a_bits != e_bits).any(dim=1)
    if differ.any():
        first = int(differ.nonzero()[0])
        a_first, e_first = a.detach().reshape(-1)[first].item(), e.detach().reshape(-1)[first].item()
        raise AssertionError(
            f"{where}: {int(differ.sum())} of {e.numel()} elements differ in their bits, "
            f"the first at flat index {first}: {a_first!r} and {e_first!r}"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements on the CPU, one row per element (``numel x itemsize``)."""
    values = torch.empty(t.numel(), dtype=t.dtype, device=t.device)  # stride 1, whatever t's strides
    values.copy_(t.detach().resolve_conj().resolve_neg().reshape(-1))
    return values.view(torch.uint8).reshape(values.numel(), t.element_size()).cpu()


def _bits_of_scalar(x: Any) -> Any:
    """A float's or complex's bytes (``-0.0 != 0.0``, equal NaNs equal); any other value itself."""
    if isinstance(x, float):
        return struct.pack("<d", x)
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    return x


def assert_close(actual: Any, expected: Any, tolerance: float = TOLERANCE, *, context: str = "") -> None:
    """Same pytree structure, dtypes and shapes; every tensor leaf within ``tolerance`` relative error."""
    a_leaves, a_spec = optree.tree_flatten(actual, none_is_leaf=True)
    e_leaves, e_spec = optree.tree_flatten(expected, none_is_leaf=True)
    assert a_spec == e_spec, context
    for a, e in zip(a_leaves, e_leaves):
        if not isinstance(e, torch.Tensor):
            assert a == e, context
            continue
        assert isinstance(a, torch.Tensor), context
        assert (a.dtype, a.shape) == (e.dtype, e.shape), context
        error = torch.linalg.vector_norm(a - e)
        assert error <= tolerance * torch.linalg.vector_norm(e), f"{context}: relative error {error / e.norm()}"


# --- The oracle ---------------------------------------------------------------------------------


def compose(stages: Sequence[Callable[[Any, Any], Any]]) -> Callable[[Sequence[Any], Any], Any]:
    """The unsplit model: ``stages[-1](params[-1], ... stages[0](params[0], batch))``."""

    def model(params: Sequence[Any], batch: Any) -> Any:
        x = batch
        for stage, p in zip(stages, params):
            x = stage(p, x)
        return x

    return model


def reference(loss_fn: Callable[[Any, Any], Any], stages: Sequence[Any], params: list[Any], batch: Any) -> Any:
    """``(loss, grads)`` of the unsplit model on the whole batch."""
    grads, loss = torch.func.grad_and_value(lambda p, b: loss_fn(compose(stages)(p, b), b))(params, batch)
    return loss, grads


def some_stage_count(entry: Conformance, at_least: int) -> int:
    """The smallest stage count of a conformance entry that is at least ``at_least``."""
    return min(s for s in entry.stage_counts if s >= at_least)


# --- Tanh layers on a plain tensor ---------------------------------------------------------------
# (the small model of tests whose subject is not the model: devices, syncs, overlap)


def tanh_layer(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"])


def mse_loss(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """The mean squared distance of the output from the batch (the batch is its own target)."""
    return (y - batch).square().mean()


def tanh_params(num_stages: int, width: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Each stage's ``w`` and ``b``, float64 whatever the default dtype (a rank's process keeps torch's)."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    return [
        {"w": torch.randn(width, width, generator=g, dtype=f64), "b": torch.randn(width, generator=g, dtype=f64)}
        for _ in range(num_stages)
    ]


def tanh_batch(size: int = 10, width: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(size, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- The optimizers and their torch.optim oracle (tests/optim/) --------------------------------

OPTIMIZER_UPDATES = 3  # updates per comparison with torch.optim

# name -> (fpipe optimizer, the torch.optim optimizer of the same options on a list of tensors): the
# battery of tests/optim/test_optimizer.py runs every entry (optax's way: listed is tested)
OPTIMIZERS: dict[str, tuple[Callable[..., fpipe.optim.Optimizer], Callable[..., torch.optim.Optimizer]]] = {}
for foreach in (True, False):
    OPTIMIZERS |= {
        f"adamw foreach={foreach}": (
            lambda f=foreach, **kw: fpipe.optim.adamw(0.1, betas=(0.8, 0.9), weight_decay=0.1, foreach=f, **kw),
            lambda p, f=foreach: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.9), weight_decay=0.1, foreach=f),
        ),
        f"adamw amsgrad maximize foreach={foreach}": (
            lambda f=foreach, **kw: fpipe.optim.adamw(0.01, amsgrad=True, maximize=True, foreach=f, **kw),
            lambda p, f=foreach: torch.optim.AdamW(p, lr=0.01, amsgrad=True, maximize=True, foreach=f),
        ),
        f"sgd foreach={foreach}": (
            lambda f=foreach, **kw: fpipe.optim.sgd(0.1, foreach=f, **kw),
            lambda p, f=foreach: torch.optim.SGD(p, lr=0.1, foreach=f),
        ),
        f"sgd momentum dampening weight_decay foreach={foreach}": (
            lambda f=foreach, **kw: fpipe.optim.sgd(
                0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, foreach=f, **kw
            ),
            lambda p, f=foreach: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, foreach=f),
        ),
        f"sgd nesterov maximize foreach={foreach}": (
            lambda f=foreach, **kw: fpipe.optim.sgd(0.1, momentum=0.8, nesterov=True, maximize=True, foreach=f, **kw),
            lambda p, f=foreach: torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True, maximize=True, foreach=f),
        ),
    }


def stage_leaves(trees: list[Any]) -> list[torch.Tensor]:
    """The tensors of per-stage trees in order, one flat list (``None``: a stage held elsewhere)."""
    return [t for tree in trees if tree is not None for t in optree.tree_leaves(tree)]


def torch_optim_reference(
    make: Callable[..., torch.optim.Optimizer],
    params: list[Any],
    grads: list[list[Any]],
    lrs: list[float] | None = None,
) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
    """``make`` run on ``params``' leaves as one flat list: the leaves after ``len(grads)`` steps, and the state."""
    flat = [t.clone().requires_grad_() for t in stage_leaves(params)]
    optimizer = make(flat)
    for k, step_grads in enumerate(grads):
        for p, g in zip(flat, stage_leaves(step_grads)):
            p.grad = g.clone()
        if lrs is not None:
            optimizer.param_groups[0]["lr"] = lrs[k]
        optimizer.step()
    return [p.detach() for p in flat], {i: optimizer.state[p] for i, p in enumerate(flat)}


# --- torch.distributed.pipelining's schedules, the oracle of fpipe's (tests/schedules/) ----------


def torch_stages(num_ranks: int, stages: list[int], num_stages: int) -> list[Any]:
    """Stand-ins for rank 0's ``PipelineStage`` objects: what the schedule constructors read."""
    return [
        types.SimpleNamespace(
            num_stages=num_stages,
            group_size=num_ranks,
            group_rank=0,
            stage_index=s,
            is_first=s == 0,
            is_last=s == num_stages - 1,
            submod=None,
        )
        for s in stages
    ]


def torch_csv(tmp_path: Path, schedule: Any, *, format: str = "compute_only") -> Path:
    """``schedule``'s program as torch writes it (its private ``_dump_csv``), in a file under ``tmp_path``."""
    path = tmp_path / f"{type(schedule).__name__}.csv"
    schedule._dump_csv(str(path), format=format)
    return path


# --- A model with a leaf of every kind: complex, int and string activations ---------------------
# (tests/test_distributed.py, tests/test_evaluate.py: what crosses a wire between ranks)

MIXED_WIDTH, MIXED_VOCAB = 4, 11
MIXED_BATCH_DIMS = {"tokens": 0, "pos": 0, "freqs": None, "tag": None, "target": 0}


def mixed_first(p: dict[str, torch.Tensor], mb: dict[str, Any]) -> dict[str, Any]:
    """An embedding turned complex and rotated by the batch's ``freqs``, then ``mixed_block``."""
    h = p["emb"][mb["tokens"]]
    z = torch.view_as_complex(h.reshape(*h.shape[:-1], MIXED_WIDTH // 2, 2)) * mb["freqs"]
    return mixed_block(p, {"z": z, "pos": mb["pos"], "tag": mb["tag"]})


def mixed_block(p: dict[str, torch.Tensor], x: dict[str, Any]) -> dict[str, Any]:
    """A tanh layer on the complex ``z`` read as real, nudged by the int positions; ``tag`` passes on."""
    h = torch.view_as_real(x["z"]).flatten(-2)
    h = torch.tanh(h @ p["w"]) + 0.01 * x["pos"].unsqueeze(-1).to(h.dtype)
    assert x["tag"] == "batch" and x["pos"].dtype == torch.int64
    return {"z": torch.view_as_complex(h.reshape(*h.shape[:-1], MIXED_WIDTH // 2, 2)), "pos": x["pos"], "tag": x["tag"]}


def mixed_loss(y: dict[str, Any], mb: dict[str, Any]) -> torch.Tensor:
    h = torch.view_as_real(y["z"]).flatten(-2)
    return ((h - mb["target"]) ** 2).mean()


def mixed_model(num_stages: int) -> tuple[list[Any], list[dict[str, torch.Tensor]]]:
    """``(stages, params)``: ``mixed_first`` then ``mixed_block``s, float64 weights of seed 0."""
    g = torch.Generator().manual_seed(0)
    params = [
        {"w": torch.randn(MIXED_WIDTH, MIXED_WIDTH, generator=g, dtype=torch.float64) / 2} for _ in range(num_stages)
    ]
    params[0]["emb"] = torch.randn(MIXED_VOCAB, MIXED_WIDTH, generator=g, dtype=torch.float64)
    return [mixed_first] + [mixed_block] * (num_stages - 1), params


def mixed_batch(length: int, seed: int = 1, size: int = 10) -> dict[str, Any]:
    """``size`` sequences of ``length`` tokens, their positions, a rotary table, a tag and targets."""
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, MIXED_VOCAB, (size, length), generator=g),
        "pos": torch.arange(length).expand(size, length).clone(),
        "freqs": torch.polar(
            torch.ones(length, MIXED_WIDTH // 2, dtype=torch.float64),
            torch.rand(length, MIXED_WIDTH // 2, generator=g, dtype=torch.float64),
        ),
        "tag": "batch",
        "target": torch.randn(size, length, MIXED_WIDTH, generator=g, dtype=torch.float64),
    }


# --- A model as weights by global name: layers grouped into stages, the embedding tied -------
# (tests/saving/: resharding between layouts)

NAMED_LAYERS, NAMED_WIDTH, NAMED_VOCAB = 8, 4, 11


def named_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter by global name, in several dtypes."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed": torch.randn(NAMED_VOCAB, NAMED_WIDTH, generator=g, dtype=torch.float64)}
    for i in range(NAMED_LAYERS):
        out[f"layers.{i}.w"] = torch.randn(NAMED_WIDTH, NAMED_WIDTH, generator=g, dtype=torch.float64)
        out[f"layers.{i}.b"] = torch.randn(NAMED_WIDTH, generator=g).to(torch.float32)
    out["norm"] = torch.randn(NAMED_WIDTH, generator=g).to(torch.bfloat16)
    return out


def stage_weights(weights: dict[str, torch.Tensor], groups: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """One dict per stage: its layers' tensors; the embedding on the first and (tied) the last stage."""
    stages = [
        {n: t for n, t in weights.items() if n.startswith("layers.") and int(n.split(".")[1]) in g} for g in groups
    ]
    stages[0] = {"embed": weights["embed"], **stages[0]}
    stages[-1] = {**stages[-1], "norm": weights["norm"], "embed": weights["embed"]}
    return stages


# the layers of each stage
FOUR_STAGES = [[0, 1], [2, 3], [4, 5], [6, 7]]
TWO_STAGES = [[0, 1, 2, 3], [4, 5, 6, 7]]
ONE_STAGE = [list(range(NAMED_LAYERS))]
EIGHT_STAGES = [[i] for i in range(NAMED_LAYERS)]


# --- A Hugging Face Llama: the model and adapters of examples/hf_llama.py -----------------------
# (tests/test_hf_llama.py, tests/saving/: the conftest fixture ``hf`` loads it once per module)

HF_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"
HF_SIZE = {"layers": 3, "hidden": 16, "heads": 4, "dtype": torch.float64}
HF_TWO_STAGES = [
    "model.embed_tokens + model.rotary_emb + model.layers[0:2]",
    "model.layers[2:] + model.norm + lm_head",
]


def hf_example() -> ModuleType:
    """examples/hf_llama.py as a module of its own (it imports transformers: skip without it first)."""
    spec = importlib.util.spec_from_file_location("fpipe_example_hf_llama", HF_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_padded_batch(hf: ModuleType, size: int = 6) -> dict[str, Any]:
    """The example's batch (seed 1) with some sequences right-padded (the first token always real)."""
    batch = hf.get_batch(size, 3, torch.Generator().manual_seed(1))
    lengths = torch.tensor([7, 5, 7, 3, 6, 7])[:size]
    batch["attention_mask"] = (torch.arange(7) < lengths[:, None]).long()
    return batch


def hf_meta_model(hf: ModuleType, tied: bool = True, dtype: torch.dtype = torch.float64) -> Any:
    """The model of ``HF_SIZE`` on the meta device, but for its rotary table (a buffer, not in a checkpoint)."""
    with torch.device("meta"):
        model = hf.build_model(**{**HF_SIZE, "dtype": dtype}, tied=tied)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


def hf_checkpoint(hf: ModuleType, directory: Path, tied: bool = True, dtype: torch.dtype = torch.float64) -> Any:
    """The model of ``HF_SIZE``, saved by ``save_pretrained`` into several files; returned."""
    model = hf.build_model(**{**HF_SIZE, "dtype": dtype}, tied=tied)
    model.save_pretrained(directory, max_shard_size="20KB")
    return model


# --- A Llama-like nn.Module: embedding, rotary table (buffers only), blocks with extras, norm, head
# (tests/modules/: split_module and sum_tied against the module's own backward)

TINY_LM_VOCAB, TINY_LM_WIDTH, TINY_LM_LENGTH = 11, 8, 5


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * self.weight


class _Rotary(nn.Module):
    """cos and sin of the RoPE angles for positions ``0..length-1``; holds a buffer, no parameter."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, dim, 2) / dim), persistent=False)

    def forward(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(length, dtype=self.inv_freq.dtype)[:, None] * self.inv_freq
        return torch.cos(angles), torch.sin(angles)


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _Block(nn.Module):
    """Causal self-attention with RoPE and a padding mask, then an MLP; residual both."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        q, k = _rotate(q, rope), _rotate(k, rope)
        length = h.shape[1]
        allowed = torch.ones(length, length, dtype=torch.bool).tril() & mask[:, None, :]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(h.shape[-1])).masked_fill(~allowed, torch.finfo(h.dtype).min)
        h = h + self.out(scores.softmax(-1) @ v)
        return h + self.mlp(h)


class TinyLM(nn.Module):
    """``forward(tokens, mask)`` gives logits; ``tied=True`` ties the head to the embedding."""

    def __init__(self, num_layers: int = 4, *, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(TINY_LM_VOCAB, TINY_LM_WIDTH)
        self.rotary = _Rotary(TINY_LM_WIDTH)
        self.layers = nn.ModuleList([_Block(TINY_LM_WIDTH) for _ in range(num_layers)])
        self.norm = _RMSNorm(TINY_LM_WIDTH)
        self.head = nn.Linear(TINY_LM_WIDTH, TINY_LM_VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, rope = self.embed(tokens), self.rotary(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, mask=mask, rope=rope)
        return self.head(self.norm(h))


# The activation between modules is {"hidden": h, **extras}; the head gets a plain tensor.
TINY_LM_CALL = {
    "embed": lambda embed, batch: {"hidden": embed(batch["tokens"]), "mask": batch["mask"], "tag": batch["tag"]},
    "rotary": lambda rotary, x: {**x, "rope": rotary(x["hidden"].shape[1])},
    "layers": lambda layer, x: {**x, "hidden": layer(x["hidden"], mask=x["mask"], rope=x["rope"])},
    "norm": lambda norm, x: norm(x["hidden"]),
}


def tiny_lm_batch(size: int = 10) -> dict[str, Any]:
    lengths = torch.randint(1, TINY_LM_LENGTH + 1, (size,))
    return {
        "tokens": torch.randint(0, TINY_LM_VOCAB, (size, TINY_LM_LENGTH)),
        "mask": torch.arange(TINY_LM_LENGTH) < lengths[:, None],  # right padding: the first token is always real
        "targets": torch.randint(0, TINY_LM_VOCAB, (size, TINY_LM_LENGTH)),
        "tag": "batch",
    }


def tiny_lm_loss(logits: torch.Tensor, microbatch: dict[str, Any]) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), microbatch["targets"].flatten())


def tiny_lm_grads(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit oracle of a ``TinyLM``: ``loss.backward()`` on the whole batch; grads by parameter name."""
    model.zero_grad()
    loss = tiny_lm_loss(model(batch["tokens"], batch["mask"]), batch)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def by_name(grads: dict[str, torch.Tensor], keys: Any) -> dict[str, torch.Tensor]:
    """The entries of ``grads`` that ``keys`` names (a stage's parameter names)."""
    return {name: grads[name] for name in keys}


# The planner's toy: a tiny transformer on a made-up device, and the schedules it ranks
# (tests/planning/test_plan.py, test_ranking.py).
MODEL = Transformer(layers=2, hidden=4, sequence=8, vocabulary=16, microbatch_size=2)
DEVICE = Device(flops=2.0, bandwidth=4.0, latency=0.5, bytes_per_param=16.0)


def candidates(m: int, p: int) -> list[Candidate]:
    return [
        Candidate("gpipe", 1, lambda costs: GPipe(m).program(p)),
        Candidate("1f1b", 1, lambda costs: OneFOneB(m).program(p)),
        Candidate("zbh1", 1, lambda costs: ZeroBubbleH1(m).program(p)),
        Candidate("zbv", 2, lambda costs: ZeroBubbleV(m).program(2 * p)),
    ]


# A toy mixture of experts (tests/distributed/test_expert_parallel.py's model, for tests/saving/test_experts.py):
# token ``t`` goes to expert ``t % EXPERTS`` through the differentiable all-to-all of equal splits.
EXPERTS, EXPERT_WIDTH, EXPERT_TOKENS = 4, 3, 8  # experts per layer, width, tokens per microbatch


def expert_layer(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``h + tanh(h[t] @ w[t % E])`` per token ``t``; ``p["w"]``: every expert ``[E, D, D]``, or a
    DTensor sharded over ``mesh["ep"]`` whose block this rank holds (tokens travel there and back)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
    from torch.distributed.tensor import DTensor

    e, w, (tokens, width) = EXPERTS, p["w"], h.shape
    order = torch.arange(tokens).reshape(tokens // e, e).T.reshape(-1)  # expert-major: t % E, then t
    x = (h @ p["dense"])[order].reshape(e, tokens // e, width)
    if isinstance(w, DTensor):
        group = w.device_mesh.get_group()
        ep, w = w.device_mesh.size(), w.to_local()
        x = wait_tensor(all_to_all_single_autograd(x.reshape(-1, width), None, None, group))
        x = x.reshape(ep, e // ep, tokens // e, width)  # by source rank, then local expert
        y = torch.tanh(torch.einsum("setd,edk->setk", x, w)).reshape(-1, width)
        y = wait_tensor(all_to_all_single_autograd(y, None, None, group)).reshape(e, tokens // e, width)
    else:
        y = torch.tanh(torch.einsum("etd,edk->etk", x, w))
    return h + y.reshape(tokens, width)[torch.argsort(order)]


def expert_params(num_layers: int) -> list[dict[str, torch.Tensor]]:
    """Each layer's dense weight ``[D, D]`` and experts ``[E, D, D]``, in the default dtype."""
    g, d = torch.Generator().manual_seed(0), EXPERT_WIDTH
    return [
        {"dense": torch.randn(d, d, generator=g) / 2, "w": torch.randn(EXPERTS, d, d, generator=g) / 2}
        for _ in range(num_layers)
    ]


def expert_batch(replica: int, m: int = 4) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s batch of ``m`` microbatches."""
    g = torch.Generator().manual_seed(10 + replica)
    size = (m * EXPERT_TOKENS, EXPERT_WIDTH)
    return {"x": torch.randn(*size, generator=g), "y": torch.randn(*size, generator=g)}


def expert_loss(h: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((h - mb["y"]) ** 2).mean()


# A small DeepSeek-style MoE of ``fpipe.moe`` layers for pipeline tests (tests/moe/test_in_a_pipeline.py,
# tests/test_pairs.py): each stage carries ``{"h", "aux", "counts"}``, the activation, the sum of the
# layers' balance losses and their token counts; ``moe_loss`` adds ``MOE_ALPHA`` times the balance
# losses to a mean squared error and returns the counts as aux.
MOE_LAYERS, MOE_DIM, MOE_HIDDEN, MOE_EXPERTS, MOE_TOP_K, MOE_ALPHA = 4, 4, 6, 4, 2, 0.01
MOE_SEQUENCES, MOE_LENGTH, MOE_MICROBATCHES = 8, 3, 4  # sequences per batch, tokens per sequence


def moe_params(bias: bool = False) -> list[dict[str, Any]]:
    """``MOE_LAYERS`` layers of ``fpipe.moe.init_moe``; with ``bias``, DeepSeek-V3's selection bias
    in each (no gradient, moved between steps)."""
    g = torch.Generator().manual_seed(0)
    layers = [
        fpipe.moe.init_moe(MOE_DIM, MOE_HIDDEN, MOE_EXPERTS, shared_hidden=4, generator=g) for _ in range(MOE_LAYERS)
    ]
    if bias:
        for layer in layers:
            layer["bias"] = torch.zeros(MOE_EXPERTS)
    return layers


def moe_batch(replica: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + replica)
    shape = (MOE_SEQUENCES, MOE_LENGTH, MOE_DIM)
    return {"x": torch.randn(*shape, generator=g), "y": torch.randn(*shape, generator=g)}


def moe_layer(p: dict[str, Any], act: dict[str, Any], per_sequence: bool, dropout: float = 0.0) -> dict[str, Any]:
    """One MoE layer on the carried activation (and ``dropout`` on its output, drawn from the
    stage's seeded generator)."""
    h = act["h"]
    weights = {k: v for k, v in p.items() if k != "bias"}
    length = MOE_LENGTH if per_sequence else None
    y, stats = fpipe.moe.moe(weights, h, top_k=MOE_TOP_K, bias=p.get("bias"), sequence_length=length)
    if dropout:
        y = torch.nn.functional.dropout(y, dropout)
    return {"h": h + y, "aux": act["aux"] + stats.balance_loss, "counts": act["counts"] + stats.counts}


def moe_start(mb: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"h": mb["x"], "aux": torch.zeros(()), "counts": torch.zeros(MOE_EXPERTS, dtype=torch.int64)}


def moe_stages(num_stages: int, per_sequence: bool, dropout: float = 0.0) -> tuple[list[Any], int]:
    """``num_stages`` stage functions of ``MOE_LAYERS / num_stages`` layers each, and that count."""
    per = MOE_LAYERS // num_stages

    def stage(s: int) -> Any:
        def run(p: list[dict[str, Any]], x: Any) -> dict[str, Any]:
            act = moe_start(x) if s == 0 else x
            for q in p:
                act = moe_layer(q, act, per_sequence, dropout)
            return act

        return run

    return [stage(s) for s in range(num_stages)], per


def moe_loss(act: dict[str, Any], mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return ((act["h"] - mb["y"]) ** 2).mean() + MOE_ALPHA * act["aux"], act["counts"]


def moe_reference(full: list[dict[str, Any]], replicas: int, per_sequence: bool) -> Any:
    """Loss, gradients and token counts of the unsplit model: every expert in one process, the
    mean over ``replicas`` batches of each one's mean over its microbatches."""
    size = MOE_SEQUENCES // MOE_MICROBATCHES

    def total(ps: list[dict[str, Any]]) -> Any:
        out, counts = torch.zeros(()), torch.zeros(MOE_EXPERTS, dtype=torch.int64)
        for r in range(replicas):
            b = moe_batch(r)
            for i in range(MOE_MICROBATCHES):
                mb = {k: v[i * size : (i + 1) * size] for k, v in b.items()}
                act = moe_start(mb)
                for p in ps:
                    act = moe_layer(p, act, per_sequence)
                loss, c = moe_loss(act, mb)
                out, counts = out + loss / (MOE_MICROBATCHES * replicas), counts + c
        return out, counts

    grads, (loss, counts) = torch.func.grad_and_value(total, has_aux=True)(full)
    return loss, grads, counts
