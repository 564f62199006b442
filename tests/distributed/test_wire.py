"""The wire format: pytrees to messages and back, headers only when layouts change, small leaves
packed inline in the first tensor when they have the size the receiver expects, large leaves
sent from and received into their own storage."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import struct
import sys
from collections import OrderedDict, defaultdict, deque
from enum import IntEnum
from typing import Any, NamedTuple

import optree
import optree.dataclasses
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fpipe._distributed import _wire as wire
from fpipe._distributed._wire import (
    DATA,
    ERROR,
    INLINE_LIMIT,
    META_BYTES,
    Decoder,
    Encoder,
    FailureCode,
    as_bytes,
    error_message,
    layout_of,
    meta_of,
)
from tests._multiprocess import run_ranks
from tests.helpers import assert_bitwise

CPU = torch.device("cpu")


def transfer(encoder: Encoder, decoder: Decoder, tree: object, mesh: Any = None) -> tuple[object, list[torch.Tensor]]:
    """Send ``tree`` over a simulated channel on which every tensor must fit the receive posted
    for it, in the order the transport posts them (NOTE [receives ahead]); returns what arrived
    and what travelled. DTensor leaves live on ``mesh``, the tensor-parallel sub-mesh of both sides."""
    assert encoder.ahead == decoder.ahead  # both sides know what is posted before the send
    posted = [decoder.first_buffer(CPU)]
    large = decoder.large_leaves(None, CPU) if decoder.ahead else None
    posted += [as_bytes(t) for t in large or []]
    sent = iter(encoder.encode(tree, CPU, None if mesh is None else mesh.mesh.reshape(-1).tolist()))
    travelled: list[torch.Tensor] = []

    def deliver(buffer: torch.Tensor) -> None:
        tensor = next(sent)
        assert tensor.numel() == buffer.numel()
        buffer.copy_(tensor)
        travelled.append(tensor)

    for buffer in posted:
        deliver(buffer)
    first = posted[0]
    header, packed = decoder.opened(meta_of(first), CPU)
    if header is not None:
        large = None  # what was posted ahead was padding
        deliver(header)
    buffers = [t for t in (packed,) if t is not None and t.numel()]
    if large is None:
        large = decoder.large_leaves(header, CPU)
        buffers += [as_bytes(t) for t in large]
    for buffer in buffers:
        deliver(buffer)
    assert next(sent, None) is None
    return decoder.decode(first, packed, large, mesh), travelled


def roundtrip(encoder: Encoder, decoder: Decoder, tree: object, mesh: Any = None) -> tuple[object, bool]:
    """What arrived, and whether a header travelled."""
    out, sent = transfer(encoder, decoder, tree, mesh)
    return out, meta_of(sent[0])[1] > 0


def test_every_kind_of_leaf_travels() -> None:
    tree = {
        "h": torch.randn(3, 4).t(),  # non-contiguous
        "z": torch.randn(2, dtype=torch.complex128),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(3, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 2),
        "scalar": torch.tensor(1.5),
        "tag": "x",
        "none": None,
    }
    out, _ = roundtrip(Encoder(), Decoder(), tree)
    assert isinstance(out, dict) and out.keys() == tree.keys()
    assert_bitwise(out, tree)


def test_headers_travel_only_when_the_layout_changes() -> None:
    encoder, decoder = Encoder(), Decoder()
    sent = [roundtrip(encoder, decoder, {"h": torch.ones(2, n)})[1] for n in (3, 3, 4, 4, 3)]
    assert sent == [True, False, True, False, True]


def test_a_repeated_one_tensor_message_skips_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [one-tensor messages]: a plain tensor of the channel's last layout travels without a
    layout being made; a change of layout, a strided or conjugate tensor goes the general path."""
    layouts: list[object] = []
    monkeypatch.setattr(wire, "layout_of", lambda *args: layouts.append(args) or layout_of(*args))
    encoder, decoder = Encoder(), Decoder()
    z = torch.randn(3, dtype=torch.complex64)
    values = [  # (value, whether it goes the general path)
        (torch.randn(2, 3), True),
        (torch.randn(2, 3), False),
        (torch.randn(2, 3).requires_grad_(), True),  # requires_grad is part of the layout
        (torch.randn(2, 3), True),
        (torch.randn(3, 2).t(), True),  # not contiguous
        (torch.randn(2, 3), False),
        (torch.randn(2, 3, dtype=torch.float16), True),
        (z.conj(), True),
        (z.conj(), True),  # a conjugate view is resolved by the general path
        (z, False),
    ]
    for k, (value, general) in enumerate(values):
        before = len(layouts)
        out, _ = transfer(encoder, decoder, value)
        assert_bitwise(out, value.detach(), f"value {k}")
        assert out.requires_grad == value.requires_grad and len(layouts) - before == general, k


def test_a_non_tensor_leaf_that_changes_type_travels() -> None:
    """``1 == True == 1.0``, yet each must arrive as itself."""
    encoder, decoder = Encoder(), Decoder()
    for value in (1, True, 1.0):
        out, _ = roundtrip(encoder, decoder, {"h": torch.ones(2), "flag": value})
        received = out["flag"]  # type: ignore[index]
        assert (type(received), received) == (type(value), value)


def test_a_float_leaf_arrives_bit_for_bit_and_a_header_travels_when_its_bits_change() -> None:
    """``-0.0 == 0.0`` and ``nan != nan``: neither may arrive as the value the receiver kept from
    an earlier header, and a repeated nan needs no header."""
    encoder, decoder = Encoder(), Decoder()
    nan, inf = float("nan"), float("inf")
    steps = [
        (0.0, True),
        (-0.0, True),
        (-0.0, False),
        (nan, True),
        (nan, False),
        (-nan, True),
        (inf, True),
    ]
    assert struct.pack(">d", nan) != struct.pack(">d", -nan)
    for scale, header in steps:
        out, sent = roundtrip(encoder, decoder, {"h": torch.ones(2), "scale": scale})
        assert_bitwise(out["scale"], scale, repr(scale))  # type: ignore[index]
        assert sent == header, scale


def test_a_steady_channel_sends_one_tensor_with_the_payload_inline() -> None:
    encoder, decoder = Encoder(), Decoder()
    trees = [{"h": torch.ones(2, n, dtype=torch.float32)} for n in (2, 2, 4, 4, 0, 0, 2)]
    messages = [transfer(encoder, decoder, tree)[1] for tree in trees]
    # first tensor's size, whether a header follows, the size of a payload that follows
    shapes = [(m[0].numel(), meta_of(m[0])[1] > 0, m[2].numel() if len(m) > 2 else None) for m in messages]
    assert shapes == [
        (META_BYTES, True, 16),  # new channel: nothing expected yet, so the payload follows the header
        (META_BYTES + 16, False, None),  # the steady state: one tensor, payload inline
        (META_BYTES + 16, True, 32),  # a new layout of another size: the 16 expected bytes are padding
        (META_BYTES + 32, False, None),
        (META_BYTES + 32, True, None),  # an empty payload follows nowhere
        (META_BYTES, False, None),
        (META_BYTES, True, 16),
    ]


def test_a_new_layout_of_the_same_size_keeps_the_payload_inline() -> None:
    encoder, decoder = Encoder(), Decoder()
    transfer(encoder, decoder, {"h": torch.ones(4, dtype=torch.float32)})
    out, sent = transfer(encoder, decoder, {"h": torch.arange(4, dtype=torch.int32)})
    assert [t.numel() for t in sent] == [META_BYTES + 16, sent[1].numel()]
    assert meta_of(sent[0])[:4] == [DATA, sent[1].numel(), 16, 16]
    assert torch.equal(out["h"], torch.arange(4, dtype=torch.int32))  # type: ignore[index]


def test_inline_leaves_stay_aligned() -> None:
    """``META_BYTES`` is a multiple of 16: complex128 leaves can be viewed in place."""
    encoder, decoder = Encoder(), Decoder()
    tree = {"z": torch.randn(3, dtype=torch.complex128), "x": torch.randn(1)}
    for _ in range(2):
        out, sent = transfer(encoder, decoder, tree)
    assert len(sent) == 1
    assert_bitwise(out, tree)


def test_an_error_message_fits_the_posted_receive() -> None:
    encoder, decoder = Encoder(), Decoder()
    transfer(encoder, decoder, {"h": torch.ones(5, dtype=torch.float32)})
    message = error_message(FailureCode(3, 1, 2, 4), encoder.expected, CPU)
    first = decoder.first_buffer(CPU)
    assert message.numel() == first.numel() == META_BYTES + 32
    first.copy_(message)
    assert meta_of(first) == [ERROR, 3, 1, 2, 4, 0]


def test_large_leaves_travel_from_their_own_storage() -> None:
    """A leaf of ``INLINE_LIMIT`` bytes or more is its own message, sent without a copy (a stage's
    output is kept for its backward anyway); small leaves still share the first tensor."""
    encoder, decoder = Encoder(), Decoder()
    big = torch.randn(INLINE_LIMIT // 8, dtype=torch.float64, requires_grad=True) * 1
    tree = {"h": big, "pos": torch.arange(3), "cos": torch.randn(4, dtype=torch.float32), "tag": "x"}
    transfer(encoder, decoder, tree)
    out, sent = transfer(encoder, decoder, tree)
    assert [t.numel() for t in sent] == [META_BYTES + 32 + 16, INLINE_LIMIT]  # int64[3] padded to 32, float32[4]
    assert sent[1].data_ptr() == big.data_ptr()  # no copy
    assert out["h"].requires_grad  # type: ignore[index]
    assert_bitwise(out, {**tree, "h": big.detach()})


def test_a_large_non_contiguous_leaf_travels() -> None:
    encoder, decoder = Encoder(), Decoder()
    tree = {"h": torch.randn(64, INLINE_LIMIT // 256).t(), "z": torch.randn(INLINE_LIMIT // 16, dtype=torch.complex128)}
    for _ in range(2):
        out, sent = transfer(encoder, decoder, tree)
    assert len(sent) == 3
    assert_bitwise(out, tree)


def test_large_conjugate_and_negative_views_travel_as_their_values() -> None:
    """``z.conj()`` (and autograd's cotangent through one) is a lazy view whose bytes are ``z``'s:
    it is materialized before it is sent, whatever its size."""
    z = torch.randn(INLINE_LIMIT // 16 + 1, dtype=torch.complex128)
    x = torch.randn(INLINE_LIMIT // 8 + 1, dtype=torch.float64)
    tree = {"z": z.conj(), "small": z[:3].conj(), "x": torch._neg_view(x)}
    encoder, decoder = Encoder(), Decoder()
    for _ in range(2):
        out, _ = transfer(encoder, decoder, tree)
        assert_bitwise(out, {"z": z.conj().resolve_conj(), "small": z[:3].conj(), "x": -x})


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.int64, torch.bool]
# element counts around the inline limit for every dtype size (1 to 8 bytes), and small ones
_NUMELS = [0, 1, 3, 17, INLINE_LIMIT // 8, INLINE_LIMIT // 4, INLINE_LIMIT // 2 - 1, INLINE_LIMIT // 2 + 5]


def _tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(2, (numel,), generator=generator).bool()
    if dtype == torch.int64:
        return torch.randint(-100, 100, (numel,), generator=generator)
    return torch.randn(numel, generator=generator, dtype=dtype)


_layouts = st.dictionaries(
    st.sampled_from("abcd"),
    st.one_of(st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_NUMELS)), st.sampled_from([None, 3, "s"])),
    min_size=1,
    max_size=4,
)


@given(st.lists(st.tuples(_layouts, st.booleans()), min_size=1, max_size=6), st.integers(0, 2**16))
def test_any_sequence_of_pytrees_travels_on_one_channel(steps: list[tuple[dict, bool]], seed: int) -> None:
    """Whatever the sequence of layouts (repeated or not, small and large leaves, empty ones),
    every message fits the receives posted for it and arrives equal; a repeated layout sends no
    header, and its small leaves ride in the first tensor."""
    encoder, decoder = Encoder(), Decoder()
    previous = None
    for k, (layout, repeat) in enumerate(steps):
        layout = previous if repeat and previous is not None else layout
        tree = {
            key: _tensor(*spec, seed + k * 10 + i) if isinstance(spec, tuple) else spec
            for i, (key, spec) in enumerate(sorted(layout.items()))
        }
        out, sent = transfer(encoder, decoder, tree)
        assert isinstance(out, dict) and out.keys() == tree.keys()
        assert_bitwise(out, tree)
        large = [
            v for v in tree.values() if isinstance(v, torch.Tensor) and v.numel() * v.element_size() >= INLINE_LIMIT
        ]
        if layout is previous:
            assert meta_of(sent[0])[1] == 0 and len(sent) == 1 + len(large)
        previous = layout


def test_a_new_layout_on_a_channel_of_large_leaves_pads_what_was_posted_ahead() -> None:
    """NOTE [receives ahead]: after a message with large leaves, the next one's receives are posted
    before it is sent; when its layout changed after all, zeros fill them first."""
    encoder, decoder = Encoder(), Decoder()
    n = INLINE_LIMIT // 4
    assert not encoder.ahead
    transfer(encoder, decoder, {"h": torch.ones(n, dtype=torch.float32)})
    assert encoder.ahead and decoder.ahead
    out, sent = transfer(encoder, decoder, {"h": torch.ones(2 * n, dtype=torch.float32)})
    assert [t.numel() for t in sent[:2]] == [META_BYTES, INLINE_LIMIT] and not sent[1].any()  # padding
    assert [t.numel() for t in sent[3:]] == [2 * INLINE_LIMIT] and meta_of(sent[0])[1] == sent[2].numel()
    assert torch.equal(out["h"], torch.ones(2 * n, dtype=torch.float32))  # type: ignore[index]
    out, sent = transfer(encoder, decoder, {"h": torch.zeros(3)})  # small again: posted when needed after
    assert [t.numel() for t in sent[:2]] == [META_BYTES, 2 * INLINE_LIMIT] and not decoder.ahead


# -- the header is data (NOTE [header] in fpipe/_distributed/_wire.py) --------------------------------------

GLOBAL = optree.registry.__GLOBAL_NAMESPACE  # the namespace fpipe flattens with


class Pair(NamedTuple):
    first: Any
    second: Any


class Box:
    """A class registered with optree: its items are children, its label is node data."""

    def __init__(self, items: list[Any], label: Any) -> None:
        self.items, self.label = items, label


optree.register_pytree_node(
    Box, lambda b: (b.items, b.label), lambda label, items: Box(list(items), label), namespace=GLOBAL
)


@optree.dataclasses.dataclass(namespace=GLOBAL)
class Record:
    x: Any
    name: str = dataclasses.field(default="r", metadata={"pytree_node": False})


_plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # nan, inf, -0.0 included
    st.complex_numbers(),
    st.text(),
    st.binary(),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.complex128, torch.bool, torch.float8_e4m3fn]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
)
_tensors = st.tuples(st.sampled_from([torch.float64, torch.int32, torch.bool]), st.integers(0, 4)).map(
    lambda spec: torch.zeros(spec[1], dtype=spec[0])
)
_keys = st.one_of(st.text(max_size=3), st.integers(), st.booleans(), st.none(), st.tuples(st.integers(), st.text()))


def _nodes(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(_keys, children, max_size=3),
        st.dictionaries(st.text(max_size=2), children, max_size=3).map(OrderedDict),
        st.dictionaries(st.integers(), children, max_size=3).map(lambda d: defaultdict(list, d)),
        st.tuples(st.lists(children, max_size=3), st.one_of(st.none(), st.just(3))).map(lambda a: deque(*a)),
        st.tuples(children, children).map(lambda a: Pair(*a)),
        st.tuples(children, children).map(torch.return_types.max),
        st.tuples(st.lists(children, max_size=2), _plain).map(lambda a: Box(*a)),
        st.tuples(children, st.text(max_size=3)).map(lambda a: Record(*a)),
    )


@given(st.lists(st.recursive(st.one_of(_plain, _tensors), _nodes, max_leaves=8), min_size=1, max_size=3))
def test_every_kind_of_leaf_and_node_travels_as_it_was_sent(trees: list[Any]) -> None:
    """Plain values of every supported type (floats bit for bit), builtin containers, namedtuples,
    structseqs and classes registered with optree arrive with their type and node data."""
    encoder, decoder = Encoder(), Decoder()
    for tree in trees:
        out, _ = roundtrip(encoder, decoder, tree)
        assert_bitwise(out, tree)


def test_containers_arrive_with_their_key_order_factory_and_maxlen() -> None:
    tree = {
        "b": OrderedDict(y=torch.ones(1), x=2),
        "a": defaultdict(list, {3: "s"}),
        "q": deque([1.5], maxlen=4),
        "box": Box([torch.ones(1)], ("label", -0.0)),
        "record": Record(torch.ones(1), name="n"),
    }
    out, _ = roundtrip(Encoder(), Decoder(), tree)
    assert isinstance(out, dict) and list(out) == ["b", "a", "q", "box", "record"]
    assert list(out["b"]) == ["y", "x"] and out["a"].default_factory is list and out["q"].maxlen == 4
    assert_bitwise(out, tree)  # node data (the box's label) compares by ==, so the label's -0.0 apart:
    assert_bitwise(out["box"].label, ("label", -0.0))
    assert out["record"].name == "n"


def test_a_header_is_json() -> None:
    _, sent = transfer(Encoder(), Decoder(), {"h": torch.ones(2, dtype=torch.float32), "p": Pair(1, None)})
    header = json.loads(bytes(sent[1].tolist()))
    assert header["leaves"] == [["tensor", "float32", [2], False], ["int", 1], ["None"]]
    assert header["tree"] == [
        "dict",
        [["str", "h"], ["str", "p"]],
        [0, ["namedtuple", [__name__, "Pair", ["first", "second"]], [1, 2]]],
    ]


class Level(IntEnum):
    LOW = 1


class _Settings:
    pass


def _local_namedtuple() -> Any:
    class Local(NamedTuple):
        x: int

    return Local(1)


@pytest.mark.parametrize(
    ("tree", "fragment"),
    [
        ({"h": torch.ones(1), "s": _Settings()}, "non-tensor leaf cannot travel between ranks (leaf ['s']: <"),
        ({"level": Level.LOW}, "(leaf ['level']: <Level.LOW: 1> of type Level)"),  # would arrive as an int
        ({"a": [1, {"b": 2.0, "c": object()}]}, "leaf ['a'][1]['c']"),
        ({_Settings(): torch.ones(1)}, "a dict key or pytree node's data cannot travel"),
        (Box([], object()), "(at <root>: <object object"),
        (defaultdict(lambda: 0, {}), "a defaultdict's default factory cannot be named"),
        (_local_namedtuple(), "a namedtuple defined inside a function cannot be named to another rank (at <root>:"),
    ],
)
def test_a_value_that_cannot_travel_is_an_error_naming_its_key_path(tree: Any, fragment: str) -> None:
    encoder = Encoder()
    with pytest.raises(TypeError, match=re.escape(fragment)):
        encoder.encode(tree, CPU)
    assert encoder.expected == 0 and not encoder.ahead  # nothing was sent: the channel is as it was


def _receive(header: bytes, packed_nbytes: int = 0) -> Any:
    """A decoder's reading of a message whose header is ``header``."""
    decoder = Decoder()
    decoder.opened([DATA, len(header), packed_nbytes, 0, 0, 0], CPU)
    return decoder.large_leaves(torch.frombuffer(bytearray(header), dtype=torch.uint8), CPU)


def _header(tree: Any, leaves: list[Any]) -> bytes:
    return json.dumps({"tree": tree, "leaves": leaves}).encode()


_TENSOR = ["tensor", "float32", [4], False]
_DTENSOR = ["dtensor", "float32", [4], False, [["Shard", 0]], [8], [1]]


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b"\x80\x03cposix\nsystem\n", "not valid (header: 'ascii' codec can't decode"),  # a pickle
        (b"garbage", "not valid (header: Expecting value"),
        (b"[1, 2]", "not an object of a tree and a list of leaves"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"tree": 0, "leaves": [NaN]}', "not a value: 'NaN'"),
        (_header(0, [["int", 1], ["int", 2]]), "2 leaves for a tree of 1"),
        (_header(["tuple", None, [1, 0]], [["int", 1], ["int", 2]]), "numbered 0, 1, ..."),
        (_header(["set", None, []], []), "not a node"),
        (_header(0, [["tensor", "float99", [1], False]]), "not a tensor leaf"),
        (_header(0, [["tensor", "float32", [-1], False]]), "not a shape"),
        (_header(0, [["tensor", "float32", [1 << 40, 1 << 40], False]]), "a tensor too large to exist"),
        (_header(0, [["tensor", "int64", [1], True]]), "requires_grad True for a int64 tensor"),
        (_header(0, [_TENSOR]), "its small tensor leaves take 16 bytes, the message announces 0"),
        (_header(["list", None, [0]], [["bytes", "zz"]]), "non-hexadecimal"),
        (_header(0, [["float", "00"]]), "not the 16 hex digits of a float"),
        (_header(0, [["device", "warp:9"]]), "not a device"),
        (_header(["dict", [["list", []]], [0]], [["None"]]), "an unhashable key"),
        (_header(["dict", [["str", "a"]], [0, 1]], [["None"], ["None"]]), "a dict of 2 children with 1 key"),
        (_header(["deque", ["int", 1], [0, 1]], [["None"], ["None"]]), "a deque of 2 children with maxlen 1"),
        (_header(["defaultdict", ["eval", []], []], []), "not a defaultdict's [factory, keys]"),
        (_header(0, [[*_DTENSOR[:4], [["Shard", -1]], [2], [1]]]), "not a placement: ['Shard', -1]"),
        (_header(0, [[*_DTENSOR[:4], [["Partial", "xor"]], [2], [1]]]), "not a placement: ['Partial', 'xor']"),
        (_header(0, [[*_DTENSOR[:4], "R", [2], [1]]]), "not placements: 'R'"),
        (_header(0, [[*_DTENSOR[:4], [["Replicate"]], [-2], [1]]]), "not a DTensor shape or stride: [-2]"),
    ],
)
def test_a_corrupt_header_is_a_clear_error(header: bytes, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"fpipe\.step: a message from the peer is not valid") as info:
        _receive(header)
    assert fragment in str(info.value)


def test_a_dtensor_leaf_on_a_rank_without_a_tensor_parallel_mesh_is_a_clear_error() -> None:
    header = _header(0, [_DTENSOR])
    decoder = Decoder()
    _, packed = decoder.opened([DATA, len(header), 16, 0, 0, 0], CPU)
    decoder.large_leaves(torch.frombuffer(bytearray(header), dtype=torch.uint8), CPU)
    with pytest.raises(ValueError, match="a DTensor leaf, but this rank's mesh has no tensor-parallel dimension"):
        decoder.decode(decoder.first_buffer(CPU), packed, [])


def _dtensors_travel(rank: int, world: int) -> None:
    """On a 1-rank mesh: DTensor leaves as local pieces, placements in the header only when they change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    encoder, decoder = Encoder(), Decoder()
    big = torch.randn(INLINE_LIMIT // 8, 2, dtype=torch.float64)
    tree = {
        "h": DTensor.from_local(big, mesh, [Shard(1)]).requires_grad_(),
        "p": DTensor.from_local(torch.randn(3), mesh, [Partial()]),
        "x": torch.arange(2),
    }
    out, sent = transfer(encoder, decoder, tree, mesh)
    assert sent[-1].data_ptr() == big.data_ptr()  # the local piece travels from its own storage
    for k in ("h", "p"):
        assert isinstance(out[k], DTensor) and out[k].placements == tree[k].placements  # type: ignore[index]
        assert out[k].shape == tree[k].shape and out[k].device_mesh == mesh  # type: ignore[index]
        assert_bitwise(out[k], tree[k])  # type: ignore[index]
    assert out["h"].requires_grad and not out["p"].requires_grad  # type: ignore[index]
    assert roundtrip(encoder, decoder, tree, mesh)[1] is False  # the same placements: no header
    tree["p"] = DTensor.from_local(torch.randn(3), mesh, [Replicate()])
    out, header = roundtrip(encoder, decoder, tree, mesh)
    assert header and out["p"].placements == (Replicate(),)  # type: ignore[index]
    with pytest.raises(ValueError, match=r"the leaf \['h'\] is a DTensor but the pipeline's mesh has no tensor-par"):
        Encoder().encode(tree, CPU, None)
    with pytest.raises(ValueError, match=r"the leaf \['h'\] is a DTensor on the wrong mesh"):
        Encoder().encode(tree, CPU, [5])


def test_dtensor_leaves_travel_as_local_pieces_with_their_placements() -> None:
    run_ranks(1, _dtensors_travel)


def test_a_header_naming_an_unknown_class_is_a_clear_error_and_imports_nothing() -> None:
    assert "this" not in sys.modules  # importing it would print the Zen of Python
    with pytest.raises(TypeError, match=r"a namedtuple from the peer is not defined here \(at <root>: this.s\)"):
        _receive(_header(["namedtuple", ["this", "s", []], []], []))
    with pytest.raises(TypeError, match=r"a namedtuple from the peer is not defined here \(at <root>: os.system\)"):
        _receive(_header(["namedtuple", ["os", "system", []], []], []))
    with pytest.raises(TypeError, match=r"pytree node from the peer is not registered here \(at \[0\]: builtins.eval"):
        _receive(_header(["tuple", None, [["custom", ["builtins", "eval", ["None"]], []]]], []))
    with pytest.raises(TypeError, match=r"does not match the class here .* with fields \['x'\]"):
        _receive(_header(["namedtuple", [__name__, "Pair", ["x"]], [0]], [["None"]]))
    assert "this" not in sys.modules


def test_a_meta_announcing_negative_sizes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="a meta announcing -5 header and 0 packed bytes"):
        Decoder().opened([DATA, -5, 0, 0, 0, 0], CPU)


@given(
    st.binary(min_size=1, max_size=64)
    | st.text(alphabet='[]{}",:0123456789abcdefghijklmnopqrstuvwxyz-.', min_size=1, max_size=64).map(str.encode)
)
def test_no_bytes_make_a_header_fail_otherwise_than_clearly(header: bytes) -> None:
    try:
        _receive(header)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("fpipe.step: "), e


@given(st.data())
def test_no_edit_of_a_real_header_makes_it_fail_otherwise_than_clearly(data: st.DataObject) -> None:
    tree = {"h": torch.ones(2, dtype=torch.float32), "p": Pair(deque([1.5], maxlen=2), [None, "s"]), "n": (True, b"x")}
    _, sent = transfer(Encoder(), Decoder(), tree)
    header = bytearray(sent[1].tolist())
    for _ in range(data.draw(st.integers(1, 3))):
        header[data.draw(st.integers(0, len(header) - 1))] = data.draw(st.sampled_from(b'[]{}",:0123456789-aeflnrstu'))
    try:
        _receive(bytes(header), 16)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("fpipe.step: "), e


def test_pickle_is_not_used_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the wire")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    encoder, decoder = Encoder(), Decoder()
    tree = {"h": torch.ones(3), "p": Pair(Box([1], "b"), torch.return_types.max((2.5, None))), "d": torch.float16}
    for n in (1, 2, 2):
        out, _ = roundtrip(encoder, decoder, {**tree, "n": n})
        assert_bitwise(out, {**tree, "n": n})
