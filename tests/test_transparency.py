"""Transparency: a pipelined step computes the loss and gradients of the unsplit model.

The oracle is ``torch.func.grad_and_value`` of ``loss_fn(compose(stages)(params, batch), batch)``
on the whole batch, in float64, to a relative error of 1e-10. Every entry of ``CONFORMANCE`` runs
the same battery over stage counts, microbatch counts (uneven splits included), random batch
pytrees (leaves split along dim 0, dim 1 or not at all), recomputed stages and ``has_aux``, and
must equal GPipe bitwise, so a new schedule is tested the moment it is listed there
(tests/conformance.py, which tests/test_api.py and tests/test_distributed.py run too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

import fpipe
from fpipe.schedules import GPipe, OneFOneB
from tests.conformance import CONFORMANCE, Conformance, shares_stages
from tests.helpers import assert_bitwise, assert_close, reference, some_stage_count

# --- A model over random batch pytrees ----------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """A leaf of a batch to generate: ``kind`` float/int/bool tensor, or a non-tensor ``value``.

    A tensor's examples lie along ``dim`` (0, or 1 after a leading dim of 2); ``None``: a leaf of
    4 rows that is not split (``batch_dims`` None), every microbatch gets it whole.
    """

    kind: str
    value: Any = None
    dim: int | None = 0


class Pair(NamedTuple):
    first: Any
    second: Any


DIMS = st.sampled_from([0, 0, 1, None])
LEAVES = st.one_of(
    st.builds(Leaf, st.just("float"), st.sampled_from([(), (2,), (2, 3)]), DIMS),
    st.builds(Leaf, st.just("int"), st.sampled_from([(), (2,)]), DIMS),
    st.builds(Leaf, st.just("bool"), st.just(()), DIMS),
    st.just(Leaf("none")),
    st.text(max_size=3).map(lambda s: Leaf("str", s)),
    st.integers(-3, 3).map(lambda v: Leaf("pyint", v)),
    st.sampled_from(["tuple", "dict"]).map(lambda node: Leaf("empty", node)),  # a node without leaves
)
STRUCTURES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.lists(children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=3),
        st.tuples(children, children).map(lambda pair: Pair(*pair)),
    ),
    max_leaves=8,
)


def materialize(structure: Any, n: int, generator: torch.Generator) -> Any:
    """A pytree shaped like ``structure`` whose tensor leaves have ``n`` examples along dim 0."""

    def leaf(spec: Leaf) -> Any:
        shape = {0: (n,), 1: (2, n), None: (4,)}[spec.dim] + (spec.value if isinstance(spec.value, tuple) else ())
        if spec.kind == "float":
            return torch.randn(shape, generator=generator)
        if spec.kind == "int":
            return torch.randint(-5, 5, shape, generator=generator)
        if spec.kind == "bool":
            return torch.rand(shape, generator=generator) > 0.5
        if spec.kind == "empty":
            return () if spec.value == "tuple" else {}
        return spec.value

    return optree.tree_map(leaf, structure, is_leaf=lambda x: isinstance(x, Leaf), none_is_leaf=True)


def batch_dims_of(structure: Any) -> Any:
    """The ``batch_dims`` pytree of ``materialize(structure)``: each tensor leaf's dim, else None."""
    tensors = ("float", "int", "bool")
    return optree.tree_map(
        lambda spec: spec.dim if spec.kind in tensors else None,
        structure,
        is_leaf=lambda x: isinstance(x, Leaf),
        none_is_leaf=True,
    )


def per_example(leaf: torch.Tensor, dim: int | None, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``leaf`` as ``(n, k)`` rows, one per example; a leaf not split adds its sum to every example."""
    if dim is None:
        return leaf.to(dtype).sum().expand(n, 1)
    return leaf.movedim(dim, 0).reshape(n, -1).to(dtype)


def signature(tree: Any) -> tuple[Any, list[Any]]:
    """What must survive the trip between stages: structure, tensor dtypes, non-tensor values."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    return spec, [leaf.dtype if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


def mix(extra: Any, dims: list[Any], like: torch.Tensor) -> torch.Tensor:
    """A per-example ``(n, 1)`` summary of the tensor leaves of ``extra`` (ints and bools included)."""
    out = torch.zeros(like.shape[0], 1, dtype=like.dtype)
    for leaf, dim in zip(optree.tree_leaves(extra, none_is_leaf=True), dims):
        if isinstance(leaf, torch.Tensor):
            scale = 0.1 if leaf.is_floating_point() else 0.01
            out = out + scale * per_example(leaf, dim, like.shape[0], like.dtype).sum(-1, keepdim=True)
    return out


def make_model(
    num_stages: int, batch: Any, key: Any, dims: Any = 0, width: int = 3
) -> tuple[list[Any], Any, list[Any]]:
    """Stages, loss_fn and params of a tanh MLP whose stages also carry ``batch[key]['extra']`` along.

    Each stage checks that the extra pytree arrives with its structure, dtypes and non-tensor
    leaves intact, adds a summary of its tensor leaves (ints and bools too) to the hidden state,
    and scales its float leaves by a parameter, so gradients also flow through them.
    ``dims`` is the ``batch_dims`` of the extra pytree. ``loss_fn`` returns ``(loss, aux)``.
    """
    x_key, target_key, extra_key = key
    expected = signature(batch[extra_key])
    leaf_dims = optree.tree_leaves(
        optree.tree_broadcast_prefix(dims, batch[extra_key], none_is_leaf=True), none_is_leaf=True
    )

    def scale_floats(extra: Any, g: torch.Tensor) -> Any:
        return optree.tree_map(
            lambda t: t * g if isinstance(t, torch.Tensor) and t.is_floating_point() else t, extra, none_is_leaf=True
        )

    def stage(s: int) -> Callable[[Any, Any], Any]:
        def fn(p: dict[str, torch.Tensor], x: Any) -> Any:
            h, extra = (x[x_key], x[extra_key]) if s == 0 else x
            assert signature(extra) == expected, f"stage {s} received {signature(extra)}"
            h = torch.tanh(h @ p["w"] + p["b"] + mix(extra, leaf_dims, h))
            return h, scale_floats(extra, p["g"])

        return fn

    def loss_fn(y: Any, microbatch: Any) -> tuple[torch.Tensor, Any]:
        h, extra = y
        n = h.shape[0]
        losses = ((h - microbatch[target_key]) ** 2).sum(-1)
        for leaf, dim in zip(optree.tree_leaves(extra, none_is_leaf=True), leaf_dims):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                losses = losses + per_example(leaf**2, dim, n, h.dtype).sum(-1)
        return losses.mean(), {"size": n, "loss": losses.mean()}

    params = [
        {"w": torch.randn(width, width) / width**0.5, "b": torch.randn(width) * 0.1, "g": torch.tensor(0.9 + 0.05 * s)}
        for s in range(num_stages)
    ]
    return [stage(s) for s in range(num_stages)], loss_fn, params


# A batch with every kind of leaf, nested: pinned as an example so every entry always sees it.
RICH = {
    "a": (Leaf("float", (2, 3)), Leaf("int", (2,), 1), [Leaf("none"), Leaf("str", "tok")]),
    "b": {"c": Leaf("bool"), "a": Leaf("pyint", 3)},
    "c": [Leaf("float", ()), Pair(Leaf("float", (2,), None), Leaf("float", (3,), 1))],
}


class Batch(NamedTuple):
    x: torch.Tensor
    target: torch.Tensor
    extra: Any


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
@given(
    stage_index=st.sampled_from(range(6)),
    num_microbatches=st.sampled_from(range(1, 11)),
    extra_examples=st.sampled_from(range(26)),
    structure=STRUCTURES,
    container=st.sampled_from(["dict", "tuple", "namedtuple"]),
    recompute=st.integers(0, 2**6 - 1),
    has_aux=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(
    stage_index=5,
    num_microbatches=10,
    extra_examples=3,
    structure=RICH,
    container="dict",
    recompute=0,
    has_aux=True,
    seed=0,
)
@example(
    stage_index=5,
    num_microbatches=8,
    extra_examples=0,
    structure=RICH,
    container="tuple",
    recompute=0b101010,
    has_aux=False,
    seed=1,
)
@example(
    stage_index=0,
    num_microbatches=3,
    extra_examples=1,
    structure=RICH,
    container="namedtuple",
    recompute=0b1,
    has_aux=True,
    seed=2,
)
def test_step_equals_the_unsplit_model(
    entry: Conformance,
    stage_index: int,
    num_microbatches: int,
    extra_examples: int,
    structure: Any,
    container: str,
    recompute: int,
    has_aux: bool,
    seed: int,
) -> None:
    """``recompute`` is a bit mask of the stages to recompute."""
    num_stages = entry.stage_counts[stage_index % len(entry.stage_counts)]
    batch_size = num_microbatches + extra_examples
    recomputed = {s for s in range(num_stages) if recompute >> s & 1}
    check_transparency(entry, num_stages, num_microbatches, batch_size, structure, container, seed, recomputed, has_aux)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_every_stage_and_microbatch_count(entry: Conformance) -> None:
    """The whole grid, deterministically (hypothesis above favours small cases): uneven splits of ``2m + 1``."""
    for num_stages in entry.stage_counts:
        for num_microbatches in (1, 2, 3, 4, 5, 7, 8, 10):
            batch_size = 2 * num_microbatches + 1
            container = ["dict", "tuple", "namedtuple"][num_microbatches % 3]
            check_transparency(entry, num_stages, num_microbatches, batch_size, RICH, container, 0)


def check_transparency(
    entry: Conformance,
    num_stages: int,
    num_microbatches: int,
    batch_size: int,
    structure: Any,
    container: str,
    seed: int,
    recompute: set[int] | None = None,
    has_aux: bool = False,
) -> None:
    """One run of the battery: ``entry``'s step on a random batch equals the unsplit model, and
    GPipe's step (nothing recomputed) bitwise: its loss bitwise and its grads within rounding where
    a stage lives on several ranks (DualPipe: NOTE [a stage on several ranks])."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, generator=generator)
    target = torch.randn(batch_size, 3, generator=generator)
    extra, dims = materialize(structure, batch_size, generator), batch_dims_of(structure)
    batch = Batch(x, target, extra)
    batch_dims: Any = Batch(0, 0, dims)
    if container != "namedtuple":
        batch, batch_dims = tuple(batch), tuple(batch_dims)
    if container == "dict":
        batch, batch_dims = dict(zip(Batch._fields, batch)), dict(zip(Batch._fields, batch_dims))
    key = ("x", "target", "extra") if container == "dict" else (0, 1, 2)
    stages, loss_fn, params = make_model(num_stages, batch, key, dims)
    if not has_aux:
        loss_fn = lambda y, microbatch, with_aux=loss_fn: with_aux(y, microbatch)[0]  # noqa: E731

    def run(schedule: Any, recompute: Any) -> Any:
        step = fpipe.pipeline(loss_fn, stages, schedule, batch_dims=batch_dims, recompute=recompute, has_aux=has_aux)
        return step(params, batch)

    schedule = entry.make(num_stages, num_microbatches)
    result = run(schedule, recompute or ())
    (loss, aux), grads = result if has_aux else ((result[0], None), result[1])

    expected_loss, expected_grads = reference(
        lambda y, b: loss_fn(y, b)[0] if has_aux else loss_fn(y, b), stages, params, batch
    )
    context = f"{entry} with {num_stages} stages, {num_microbatches} microbatches, batch of {batch_size}"
    assert_close(loss, expected_loss, context=context)
    assert_close(grads, expected_grads, context=context)
    if has_aux:
        sizes = [len(piece) for piece in torch.tensor_split(torch.arange(batch_size), num_microbatches)]
        assert aux["size"] == tuple(sizes), context
        assert aux["loss"].shape == (num_microbatches,), context
        assert_close(aux["loss"] @ torch.tensor(sizes, dtype=aux["loss"].dtype) / batch_size, loss, context=context)
    gpipe_loss, gpipe_grads = run(GPipe(num_microbatches), ())
    gpipe_loss = gpipe_loss[0] if has_aux else gpipe_loss
    if shares_stages(schedule, num_stages):  # its holders' sums add last: the loss bitwise, grads within rounding
        assert_bitwise(loss, gpipe_loss, context)
        assert_close(grads, gpipe_grads, context=context)
    else:
        assert_bitwise((loss, grads), (gpipe_loss, gpipe_grads), context)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_step_equals_module_backward(entry: Conformance) -> None:
    """An ``nn.Sequential`` split into stages with ``functionalize`` matches ``loss.backward()``."""
    num_stages = some_stage_count(entry, 3)
    blocks = [nn.Sequential(nn.Linear(4 if s == 0 else 5, 5), nn.Tanh()) for s in range(num_stages)]
    model = nn.Sequential(*blocks, nn.Linear(5, 2))
    stage_blocks = [*blocks[:-1], nn.Sequential(blocks[-1], model[-1])]
    x, target = torch.randn(13, 4), torch.randn(13, 2)

    def loss_fn(y: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((y - microbatch["target"]) ** 2).sum(-1).mean()

    functional = [fpipe.functionalize(block) for block in stage_blocks]
    stages = [lambda p, x, fn=fn: fn(p, x["x"] if isinstance(x, dict) else x) for fn, _ in functional]
    step = fpipe.pipeline(loss_fn, stages, entry.make(num_stages, 5))
    loss, grads = step([params for _, params in functional], {"x": x, "target": target})

    expected_loss = loss_fn(model(x), {"target": target})
    expected_loss.backward()
    assert_close(loss, expected_loss.detach())
    for block, block_grads in zip(stage_blocks, grads):
        assert_close(block_grads, {name: p.grad for name, p in block.named_parameters()})


# --- Complex tensors across stage boundaries ----------------------------------------------------


def as_complex(h: torch.Tensor) -> torch.Tensor:
    """``(..., 2k)`` real as ``(..., k)`` complex (pairs of features)."""
    return torch.view_as_complex(h.unflatten(-1, (-1, 2)).contiguous())


def as_real(h: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(h).flatten(-2)


def make_rope_model(num_stages: int, width: int = 4) -> tuple[list[Any], Any, list[Any]]:
    """RoPE-style model: a complex ``freqs_cis`` table and complex activations cross every boundary.

    Stage 0 makes the table differentiable (rotates it by learned angles ``omega``) and passes
    ``(h, freqs)`` on; middle stages rotate complex ``h`` by the table and mix it with complex
    params; the last stage returns to real features.
    """

    def first(p: dict[str, torch.Tensor], microbatch: dict[str, torch.Tensor]) -> Any:
        table = microbatch["freqs_cis"]
        positions = torch.arange(table.shape[0], dtype=p["omega"].dtype)[:, None]
        freqs = table * torch.polar(torch.ones_like(table.real), positions * p["omega"])
        return as_complex(microbatch["x"] @ p["w"]) * freqs, freqs

    def middle(p: dict[str, torch.Tensor], x: Any) -> Any:
        h, freqs = x
        return torch.tanh(h @ p["w"]) * freqs, freqs

    def last(p: dict[str, torch.Tensor], x: Any) -> torch.Tensor:
        h, freqs = x
        return torch.tanh(as_real(h * freqs) @ p["w"])

    def loss_fn(y: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((y - microbatch["target"]) ** 2).sum((-1, -2)).mean()

    k = width // 2
    params: list[Any] = [{"w": torch.randn(width, width) / 2, "omega": torch.randn(k)}]
    params += [{"w": torch.randn(k, k, dtype=torch.complex128) / 2} for _ in range(num_stages - 2)]
    params += [{"w": torch.randn(width, width) / 2}]
    return [first, *[middle] * (num_stages - 2), last], loss_fn, params


def rope_batch(batch_size: int, seq_len: int, width: int = 4) -> dict[str, torch.Tensor]:
    angles = torch.arange(seq_len)[:, None] / 10.0 ** torch.arange(width // 2)
    return {
        "x": torch.randn(batch_size, seq_len, width),
        "freqs_cis": torch.polar(torch.ones_like(angles), angles),
        "target": torch.randn(batch_size, seq_len, width),
    }


ROPE_BATCH_DIMS = {"x": 0, "freqs_cis": None, "target": 0}


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_complex_activations_and_params(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 3)
    stages, loss_fn, params = make_rope_model(num_stages)
    batch = rope_batch(7, 5)
    step = fpipe.pipeline(loss_fn, stages, entry.make(num_stages, 3), batch_dims=ROPE_BATCH_DIMS)
    loss, grads = step(params, batch)

    expected_loss, expected_grads = reference(loss_fn, stages, params, batch)
    assert_close(loss, expected_loss)
    assert_close(grads, expected_grads)
    assert grads[1]["w"].is_complex() and grads[1]["w"].abs().sum() > 0
    assert grads[0]["omega"].abs().sum() > 0  # reached through the complex table


def test_shapes_may_change_between_calls() -> None:
    """One step, no setup: batch size and sequence length (and the table with it) change per call."""
    stages, loss_fn, params = make_rope_model(3)
    step = fpipe.pipeline(loss_fn, stages, OneFOneB(num_microbatches=3), batch_dims=ROPE_BATCH_DIMS)
    for batch_size, seq_len in [(6, 5), (11, 3), (3, 9), (6, 5)]:
        batch = rope_batch(batch_size, seq_len)
        loss, grads = step(params, batch)
        expected_loss, expected_grads = reference(loss_fn, stages, params, batch)
        assert_close(loss, expected_loss)
        assert_close(grads, expected_grads)


# --- Cotangents that autograd passes through ----------------------------------------------------


def test_gradients_that_autograd_passes_through_are_not_shared() -> None:
    """``x + shift`` hands the incoming cotangent itself to both ``x`` and ``shift``, and
    ``offset.sum()`` an expanded (stride-0) view of it; summing over microbatches must not write
    through either alias. The oracle is the loop in the ``pipeline`` docstring (the loss here is
    not a per-example mean, so it is not the unsplit model).
    """

    def stage(p: dict[str, torch.Tensor], x: Any) -> torch.Tensor:
        h = x["x"].mean(0) if isinstance(x, dict) else x
        return h + p["shift"] + 0.1 * p["offset"].sum()

    def loss_fn(y: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((y - microbatch["target"].mean(0)) ** 2).sum()

    num_stages, num_microbatches = 4, 4
    stages = [stage] * num_stages
    params = [{"shift": torch.randn(3), "offset": torch.randn(2)} for _ in range(num_stages)]
    batch = {"x": torch.randn(10, 3), "target": torch.randn(10, 3)}

    expected_loss: Any = 0.0
    expected_grads: Any = None
    pieces = [torch.tensor_split(leaf, num_microbatches) for leaf in (batch["x"], batch["target"])]
    for x, target in zip(*pieces):
        loss_i, grads_i = reference(loss_fn, stages, params, {"x": x, "target": target})
        weight = x.shape[0] / 10
        expected_loss = expected_loss + weight * loss_i
        scaled = optree.tree_map(lambda g, w=weight: w * g, grads_i)
        expected_grads = scaled if expected_grads is None else optree.tree_map(torch.add, expected_grads, scaled)

    for entry in CONFORMANCE:
        if num_stages not in entry.stage_counts:
            continue
        loss, grads = fpipe.pipeline(loss_fn, stages, entry.make(num_stages, num_microbatches))(params, batch)
        assert_close(loss, expected_loss)
        assert_close(grads, expected_grads)
        leaves = optree.tree_leaves(grads)
        assert len({g.data_ptr() for g in leaves}) == len(leaves), f"{entry}: gradients share memory"
