"""Splitting a batch into microbatches and stacking per-microbatch results (``fpipe._microbatch``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fpipe
from fpipe._microbatch import split, stack
from fpipe._pytree import boundary_layout
from fpipe.schedules import OneFOneB
from tests.helpers import assert_bitwise, assert_close, reference


def test_ten_into_four_is_three_three_two_two() -> None:
    batch = torch.arange(10)
    microbatches, sizes = split(batch, 4, 0)
    assert sizes == [3, 3, 2, 2]
    assert [mb.tolist() for mb in microbatches] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


@given(num_microbatches=st.integers(1, 12), extra=st.integers(0, 40), dim=st.sampled_from([0, 1, -1]))
def test_sizes_differ_by_at_most_one_and_pieces_cover_the_batch(num_microbatches: int, extra: int, dim: int) -> None:
    size = num_microbatches + extra
    shape = [2, 3]
    shape.insert(dim % 3 if dim >= 0 else 2, size)
    x = torch.randn(shape, requires_grad=True)
    version = x._version
    microbatches, sizes = split({"x": x}, num_microbatches, dim)

    assert sum(sizes) == size and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert [mb["x"].shape[dim] for mb in microbatches] == sizes
    assert torch.equal(torch.cat([mb["x"] for mb in microbatches], dim=dim), x.detach())
    for mb in microbatches:  # contiguous (NOTE [boundary layout]), views where they can be, no graph
        assert mb["x"].is_contiguous()
        shares = mb["x"].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert shares == (dim == 0 or num_microbatches == 1)
        assert not mb["x"].requires_grad and mb["x"].grad_fn is None
    assert x.requires_grad and x._version == version


def test_batch_dims_prefix_with_none_passes_a_leaf_whole() -> None:
    table = torch.randn(5, 2)
    batch = {"tokens": torch.arange(12).reshape(6, 2), "rope": {"freqs": table, "scale": torch.ones(6)}}
    microbatches, sizes = split(batch, 3, {"tokens": 0, "rope": None})
    assert sizes == [2, 2, 2]
    for i, mb in enumerate(microbatches):
        # passed whole: the same values in the same memory (a detached alias, never a copy)
        assert torch.equal(mb["rope"]["freqs"], table) and mb["rope"]["freqs"].data_ptr() == table.data_ptr()
        assert mb["rope"]["scale"].data_ptr() == batch["rope"]["scale"].data_ptr()
        assert torch.equal(mb["tokens"], batch["tokens"][2 * i : 2 * i + 2])


def test_a_different_dim_per_leaf() -> None:
    batch = {"time_major": torch.randn(7, 10, 3), "batch_major": torch.randn(10, 4), "last": torch.randn(2, 10)}
    microbatches, sizes = split(batch, 4, {"time_major": 1, "batch_major": 0, "last": -1})
    assert sizes == [3, 3, 2, 2]
    start = 0
    for mb, n in zip(microbatches, sizes):
        assert torch.equal(mb["time_major"], batch["time_major"][:, start : start + n])
        assert torch.equal(mb["batch_major"], batch["batch_major"][start : start + n])
        assert torch.equal(mb["last"], batch["last"][:, start : start + n])
        start += n


def test_non_tensor_leaves_pass_whole() -> None:
    config = {"temperature": 0.7}
    batch = (torch.randn(4, 2), "train", 3, None, config, [torch.arange(4)])
    microbatches, sizes = split(batch, 2, 0)
    assert sizes == [2, 2]
    for i, (x, mode, epoch, nothing, cfg, (ids,)) in enumerate(microbatches):
        assert (mode, epoch, nothing) == ("train", 3, None)
        assert cfg["temperature"] == 0.7
        assert torch.equal(x, batch[0][2 * i : 2 * i + 2]) and ids.tolist() == [2 * i, 2 * i + 1]


def test_unsplit_batch_is_one_microbatch() -> None:
    batch = {"table": torch.randn(3, 3, requires_grad=True), "name": "x"}
    (microbatch,), sizes = split(batch, 1, None)
    assert sizes == [1] and microbatch["name"] == "x" and torch.equal(microbatch["table"], batch["table"])
    assert not microbatch["table"].requires_grad  # detached, like any piece
    with pytest.raises(ValueError, match="no tensor leaf of the batch is split"):
        split(batch, 2, None)


def test_unsplit_inference_batch() -> None:
    # A batch made under inference mode and passed whole: autograd cannot save inference
    # tensors, so the whole batch, like a split one, reaches the stages as a plain copy.
    def first(p: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(batch["x"] @ p)

    def loss_fn(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((y @ batch["x"].T) ** 2).mean()

    params = [torch.randn(3, 3), torch.randn(3, 3)]
    with torch.inference_mode():
        batch = {"x": torch.randn(4, 3)}
    step = fpipe.pipeline(loss_fn, [first, lambda p, x: x @ p], OneFOneB(num_microbatches=1), batch_dims=None)
    loss, grads = step(params, batch)
    ref_loss, ref_grads = reference(loss_fn, [first, lambda p, x: x @ p], params, {"x": batch["x"].clone()})
    assert_close((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize(
    ("batch", "num_microbatches", "batch_dims", "match"),
    [
        (torch.tensor(3.0), 1, 0, r"cannot split batch leaf <root> of shape \(\) along dim 0"),
        ({"x": torch.randn(4, 2)}, 2, {"x": True}, r"along dim True"),
        ({"x": torch.randn(4, 2)}, 2, {"x": -3}, r"along dim -3"),
        ({"x": torch.randn(4, 2)}, 2, [0], "batch_dims does not match the batch structure"),
        ({"a": [torch.randn(4)], "b": torch.randn(5, 4)}, 2, 0, r"size 4: \['a'\]\[0\]; size 5: \['b'\]"),
        ({"a": torch.randn(4)}, 5, 0, r"a batch of 4 cannot be split into 5 microbatches \(leaves: \['a'\]\)"),
    ],
)
def test_split_errors(batch: Any, num_microbatches: int, batch_dims: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split(batch, num_microbatches, batch_dims)


def test_stack_gathers_tensors_on_a_new_leading_dim_and_others_in_tuples() -> None:
    w = torch.randn(2, requires_grad=True)
    trees = [{"loss": (w * i).sum(), "vec": w * i, "n": i, "tag": None} for i in range(3)]
    out = stack(trees)
    assert out["n"] == (0, 1, 2) and out["tag"] == (None, None, None)
    assert torch.equal(out["vec"], torch.stack([w.detach() * i for i in range(3)]))
    assert out["loss"].shape == (3,) and not out["loss"].requires_grad and out["loss"].grad_fn is None


def test_stack_errors() -> None:
    with pytest.raises(ValueError, match="for microbatch 1 has structure"):
        stack([{"a": torch.ones(())}, {"b": torch.ones(())}])
    with pytest.raises(ValueError, match=r"aux tensor changes shape across microbatches \(\[\(3,\), \(2,\)\]\)"):
        stack([torch.ones(3), torch.ones(2)])


def test_pipeline_splits_along_batch_dims() -> None:
    """Time-major inputs split along dim 1 give the unsplit model's loss and gradients."""

    def stage(p: torch.Tensor, x: Any) -> torch.Tensor:
        h = x["x"] if isinstance(x, dict) else x
        return torch.tanh(h @ p)

    def loss_fn(y: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((y - microbatch["target"]) ** 2).sum((0, 2)).mean()  # mean over dim 1, the examples

    batch = {"x": torch.randn(5, 11, 3), "target": torch.randn(5, 11, 3)}
    stages, params = [stage] * 3, [torch.randn(3, 3) for _ in range(3)]
    step = fpipe.pipeline(loss_fn, stages, OneFOneB(num_microbatches=4), batch_dims=1)
    loss, grads = step(params, batch)
    expected_loss, expected_grads = reference(loss_fn, stages, params, batch)
    assert_close(loss, expected_loss)
    assert_close(grads, expected_grads)


def test_stack_detaches_tensors_in_mixed_columns() -> None:
    """An aux leaf that is a tensor on some microbatches and None on others carries no graph."""
    w = torch.ones(2, requires_grad=True)
    stacked = stack([{"a": (w * 2).sum()}, {"a": None}])
    assert stacked["a"][1] is None and stacked["a"][0].grad_fn is None


@pytest.mark.parametrize(
    ("make", "dim"),
    [
        (lambda: torch.arange(30.0).reshape(10, 3), 0),
        (lambda: torch.arange(30.0).reshape(3, 10).t(), 0),  # not contiguous: pieces are laid out
        (lambda: torch.arange(30.0).reshape(3, 10), 1),
        (lambda: torch.arange(30.0).reshape(3, 10), -1),
    ],
)
def test_a_plain_tensor_splits_bitwise_as_the_general_path(make: Any, dim: int) -> None:
    batch = make()
    fast, fast_sizes = split(batch, 4, dim)
    general, sizes = split({"x": batch}, 4, dim)  # a dict: no fast path
    assert fast_sizes == sizes == [3, 3, 2, 2]
    for a, b in zip(fast, general, strict=True):
        assert_bitwise(a, b["x"])
        assert a.stride() == b["x"].stride() and a.is_contiguous()


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=3),
    st.integers(-3, 2),
    st.integers(1, 6),
    st.sampled_from(["contiguous", "transposed", "conj", "neg", "sliced"]),
    st.sampled_from([torch.float64, torch.complex128, torch.int64]),
)
def test_a_plain_tensors_split_is_the_general_path_bitwise(
    shape: list[int], dim: int, num_microbatches: int, layout: str, dtype: torch.dtype
) -> None:
    """A plain tensor takes no shortcut of its own (NOTE [one-tensor fast path] in fpipe/_pytree.py):
    its pieces are bitwise, stride for stride, the general path's on a dict and tensor_split's
    pieces laid out; a laid-out batch's rows (dim 0) are passed on as tensor_split's views."""
    batch = torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape).to(dtype)
    if layout == "transposed" and batch.dim() >= 2:
        batch = batch.transpose(0, -1)
    elif layout == "conj" and dtype.is_complex:
        batch = batch.conj()
    elif layout == "neg" and dtype.is_complex:
        batch = torch._neg_view(batch)
    elif layout == "sliced":
        batch = batch[..., ::2]
    dim = dim % batch.dim() - (batch.dim() if dim < 0 else 0)
    if batch.shape[dim] < num_microbatches:
        with pytest.raises(ValueError, match="cannot be split"):
            split(batch, num_microbatches, dim)
        return
    pieces, sizes = split(batch, num_microbatches, dim)
    general, general_sizes = split({"x": batch}, num_microbatches, dim)  # a dict: flattened by optree
    expected = [boundary_layout(p) for p in torch.tensor_split(batch, num_microbatches, dim=dim)]
    assert sizes == general_sizes == [p.shape[dim] for p in expected]
    for a, b, e in zip(pieces, [g["x"] for g in general], expected, strict=True):
        for x in (a, b):
            assert_bitwise(x, e)
            assert x.stride() == e.stride()
            assert x.is_contiguous() and not x.is_conj() and not x.is_neg()
        if dim % batch.dim() == 0 and boundary_layout(batch) is batch:
            assert a.data_ptr() == e.data_ptr()  # a view of the batch, not a copy
