"""The one door to optree (fpipe/_pytree.py): options fixed once, a plain tensor's fast answers
equal optree's, key paths and names, boundary layouts, and structures as plain data."""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict, deque
from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fpipe import _pytree, _stage
from fpipe._pytree import (
    boundary_layout,
    broadcast_prefix,
    detached,
    flatten,
    is_differentiable,
    leaves_with_names,
    leaves_with_paths,
    map_tensors,
    scatter,
    stage_list,
    structure_data,
    structure_from_data,
    tensor_map,
    unflatten,
)
from fpipe._stage import StageRun
from tests.helpers import assert_bitwise


class Pair(NamedTuple):
    first: Any
    second: Any


def _plain(value: Any, path: str) -> Any:
    return value


def test_a_tensor_flattens_as_optree_flattens_it() -> None:
    t = torch.ones(2)
    leaves, spec = flatten(t)
    reference_leaves, reference = optree.tree_flatten(t, none_is_leaf=True)
    assert leaves == [t] and leaves[0] is t and spec == reference and reference_leaves[0] is t
    assert unflatten(spec, [t]) is t


def test_none_is_a_leaf_and_order_is_optrees() -> None:
    tree = {"b": None, "a": [1.5, 3]}
    leaves, spec = flatten(tree)
    assert leaves == [1.5, 3, None]  # keys sorted, None kept
    assert unflatten(spec, leaves) == tree


def test_paths_and_names() -> None:
    tree = {"h": [Pair(torch.ones(1), 2)], "w": torch.zeros(1)}
    paths, _, _ = leaves_with_paths(tree)
    assert paths == ["['h'][0][0]", "['h'][0][1]", "['w']"]
    assert leaves_with_paths(torch.ones(1)).paths == ["<root>"]
    names, code, _, _ = leaves_with_names(tree)
    assert names == [("h", "0", "first"), ("h", "0", "second"), ("w",)]
    assert code == ["['h'][0].first", "['h'][0].second", "['w']"]


def test_broadcast_prefix_names_a_mismatch() -> None:
    assert broadcast_prefix({"x": 0, "y": None}, {"x": [1, 2], "y": 3}) == [0, 0, None]
    with pytest.raises(ValueError):
        broadcast_prefix([0, 1], (1, 2))


def test_differentiable_leaves_and_map_tensors() -> None:
    assert [is_differentiable(x) for x in (torch.ones(1), torch.ones(1, dtype=torch.complex64))] == [True, True]
    assert [is_differentiable(x) for x in (torch.ones(1, dtype=torch.int64), torch.ones(1).bool(), 1.0)] == [
        False,
        False,
        False,
    ]
    out = map_tensors(lambda t: t + 1, {"a": torch.zeros(1), "b": "text", "c": None})
    assert out["b"] == "text" and out["c"] is None and out["a"].item() == 1


def test_detached_copies_only_inference_tensors() -> None:
    t = torch.ones(2, requires_grad=True)
    alias = detached(t)
    assert not alias.requires_grad and alias.data_ptr() == t.data_ptr()
    with torch.inference_mode():
        frozen = torch.ones(2)
    copy = detached(frozen)
    assert not copy.is_inference() and copy.data_ptr() != frozen.data_ptr()


def test_boundary_layout_is_contiguous_and_resolved() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    assert boundary_layout(t) is t
    moved = boundary_layout(t.t())
    assert moved.is_contiguous() and torch.equal(moved, t.t())
    z = torch.tensor([1 + 2j]).conj()
    resolved = boundary_layout(z)
    assert not resolved.is_conj() and torch.equal(resolved, z)


@pytest.mark.parametrize(
    "tree",
    [
        {"b": 1, "a": [2, (3, None)]},
        OrderedDict([("z", 1), ("y", 2)]),
        defaultdict(list, {"k": 1}),
        deque([1, 2], maxlen=3),
        Pair(1, {"x": 2}),
        torch.ones(1),
    ],
    ids=["dict", "OrderedDict", "defaultdict", "deque", "namedtuple", "leaf"],
)
def test_structure_as_data_round_trips_through_json(tree: Any) -> None:
    spec = flatten(tree)[1]
    data = json.loads(json.dumps(structure_data(tree, spec, _plain)))
    assert structure_from_data(data, lambda v: v) == spec


def test_structures_that_cannot_travel_are_named() -> None:
    class Local(NamedTuple):
        x: int

    tree = {"a": Local(1)}
    with pytest.raises(TypeError, match=r"defined inside a function cannot be named to another rank \(at \['a'\]"):
        structure_data(tree, flatten(tree)[1], _plain)
    odd = defaultdict(lambda: 0, {"k": 1})
    with pytest.raises(TypeError, match="default factory cannot be named"):
        structure_data(odd, flatten(odd)[1], _plain)


@pytest.mark.parametrize(
    ("data", "error", "fragment"),
    [
        (["list", None, [1, 0]], ValueError, "not numbered 0, 1, ..."),
        (["dict", ["a"], [0, 1]], ValueError, "a dict of 2 children with 1 key"),
        (["namedtuple", ["nowhere", "Pair", ["x"]], [0]], TypeError, "is not defined here"),
        (["custom", ["nowhere", "Thing", None], [0]], TypeError, "is not registered here"),
        ("leaf", ValueError, "neither a leaf index nor"),
    ],
)
def test_structure_from_bad_data_fails(data: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment.replace(".", r"\.")):
        structure_from_data(data, lambda v: v)


def test_stage_list_is_the_one_check_of_one_pytree_per_stage() -> None:
    """Not a list: ``TypeError``; a list of the wrong length: ``ValueError``; everywhere alike."""
    assert stage_list("fpipe.step", "params", ({"w": 1}, None), 2) == [{"w": 1}, None]
    for value in ({"w": 1}, "ab", b"ab", 3):
        with pytest.raises(TypeError, match=r"fpipe\.step: params must be a list with one pytree per stage \(got: "):
            stage_list("fpipe.step", "params", value, 2)
    with pytest.raises(ValueError, match=r"fpipe\.save: params has 1 entry but the step has 2 stages\. Pass one"):
        stage_list("fpipe.save", "params", [None], 2, against="the step")
    with pytest.raises(TypeError, match=r"one dict per stage \(grads: dict\)\. Pass a list, one entry per stage\. Fix"):
        stage_list("f", "grads", {}, each="dict", got="grads", fix="Fix.")


# NOTE [one-tensor fast path]: ``tensor_map`` and ``flatten`` answer a plain tensor without optree;
# the general path (optree's flatten, then the loop) must give the same bits.
_DTYPES = [torch.float64, torch.float32, torch.complex128, torch.int64, torch.bool]


def _general_flatten(tree: Any) -> Any:
    return optree.tree_flatten(tree, none_is_leaf=True)


def _plain_tensor(dtype: torch.dtype, shape: list[int], transpose: bool, grad: bool) -> torch.Tensor:
    t = torch.randn(shape, dtype=torch.float64).to(dtype) if dtype != torch.bool else torch.ones(shape) > 0
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # not contiguous: the stage lays it out anew
    differentiable = dtype.is_floating_point or dtype.is_complex
    return (t.detach().requires_grad_() * 1) if grad and differentiable else t


_TENSORS = st.builds(
    _plain_tensor,
    st.sampled_from(_DTYPES),
    st.lists(st.integers(0, 3), max_size=3),
    st.booleans(),
    st.booleans(),
)


@given(_TENSORS, st.booleans())
def test_tensor_maps_fast_path_is_its_general_path(x: torch.Tensor, keep: bool) -> None:
    def fn(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return t.detach() * 2 if t.dtype != torch.bool else ~t, keep and t.dim() > 0

    fast = tensor_map(fn, x)
    general = _pytree._tensor_map(fn, *_general_flatten(x))
    assert list(fast.positions) == list(general.positions) and len(fast.kept) == len(general.kept)
    assert all(a is c for a, c in zip(fast.kept, fast.leaves, strict=False))  # the kept leaves are the new ones
    a, b = unflatten(fast.spec, fast.leaves), unflatten(general.spec, general.leaves)
    assert_bitwise(a, b)
    assert a.stride() == b.stride()
    assert flatten(x)[0][0] is _general_flatten(x)[0][0] is x


@given(st.one_of(st.none(), _TENSORS), st.booleans())
def test_scatters_fast_path_is_its_general_path(value: torch.Tensor | None, relayout: bool) -> None:
    """One value in one position: the shortcut's list is the loop's, the same tensors bitwise."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        return boundary_layout(t) if relayout else t.detach().clone()

    fast, general = scatter(fn, (0,), [value], 1), _pytree._scatter(fn, (0,), [value], 1)
    assert len(fast) == len(general) == 1
    a, b = fast[0], general[0]
    if value is None:
        assert a is None and b is None
        return
    assert a is not None and b is not None
    assert_bitwise(a, b)
    assert a.stride() == b.stride()
    assert (a is value) == (b is value)  # a laid-out value is passed on, not copied, on both paths


def test_scatter_places_each_value_at_its_position() -> None:
    values = [torch.ones(1), None, torch.zeros(2)]
    out = scatter(lambda t: t * 2, (0, 2, 3), values, 5)
    assert [None if t is None else t.tolist() for t in out] == [[2.0], None, None, [0.0, 0.0], None]
    assert scatter(lambda t: t, (), [], 1) == [None]  # an input without a gradient


def test_a_stage_runs_a_plain_tensor_bitwise_as_its_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward, backward and gradients of a stage, with the one-tensor shortcut and with it
    off (every flatten through optree): the same bits, tensor by tensor."""

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"]) + p["b"]

    def run(x: torch.Tensor) -> list[torch.Tensor | None]:
        params = {"w": torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3), "b": torch.ones(3)}
        stage = StageRun(0, fn, params)
        y, pullback = stage.forward(x, differentiate_input=True)
        (cotangent,) = stage.backward(pullback, [torch.full_like(y, 0.5)], 0)
        return [y, cotangent, *stage.grads().values()]

    wide = torch.ones(4, 2, dtype=torch.float64, requires_grad=True)
    for x in (torch.arange(8.0, dtype=torch.float64).reshape(2, 4).requires_grad_() * 1, wide.t(), torch.ones(2, 4)):
        fast = run(x)
        with monkeypatch.context() as patched:
            patched.setattr(_stage, "tensor_map", lambda fn, tree: _pytree._tensor_map(fn, *_general_flatten(tree)))
            general = run(x)
        assert (fast[1] is None) == (general[1] is None) == (not x.requires_grad)
        assert_bitwise(fast, general)
        for a, b in zip(fast, general, strict=True):
            assert a is None or a.stride() == b.stride()
