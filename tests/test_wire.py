"""The wire format: pytrees to messages and back, headers only when layouts change, small leaves
packed inline in the first tensor when they have the size the receiver expects, large leaves
sent from and received into their own storage."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from fpipe._wire import DATA, ERROR, INLINE_LIMIT, META_BYTES, Decoder, Encoder, as_bytes, error_message, meta_of

CPU = torch.device("cpu")


def transfer(encoder: Encoder, decoder: Decoder, tree: object) -> tuple[object, list[torch.Tensor]]:
    """Send ``tree`` over a simulated channel on which every tensor must fit the receive posted
    for it, in the order the transport posts them (NOTE [receives ahead]); returns what arrived
    and what travelled."""
    assert encoder.ahead == decoder.ahead  # both sides know what is posted before the send
    posted = [decoder.first_buffer(CPU)]
    large = decoder.large_leaves(None, CPU) if decoder.ahead else None
    posted += [as_bytes(t) for t in large or []]
    sent = iter(encoder.encode(tree, CPU))
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
    return decoder.decode(first, packed, large), travelled


def roundtrip(encoder: Encoder, decoder: Decoder, tree: object) -> tuple[object, bool]:
    """What arrived, and whether a header travelled."""
    out, sent = transfer(encoder, decoder, tree)
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
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
        else:
            assert out[key] == value


def test_headers_travel_only_when_the_layout_changes() -> None:
    encoder, decoder = Encoder(), Decoder()
    sent = [roundtrip(encoder, decoder, {"h": torch.ones(2, n)})[1] for n in (3, 3, 4, 4, 3)]
    assert sent == [True, False, True, False, True]


def test_a_non_tensor_leaf_that_changes_type_travels() -> None:
    """``1 == True == 1.0``, yet each must arrive as itself."""
    encoder, decoder = Encoder(), Decoder()
    for value in (1, True, 1.0):
        out, _ = roundtrip(encoder, decoder, {"h": torch.ones(2), "flag": value})
        received = out["flag"]  # type: ignore[index]
        assert (type(received), received) == (type(value), value)


class _Settings:
    def __init__(self, rate: float) -> None:
        self.rate = rate

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Settings) and self.rate == other.rate


def test_a_non_tensor_leaf_arrives_as_it_was_sent_even_when_equal_to_the_last() -> None:
    """``-0.0 == 0.0``, and an object changed in place equals itself: neither may arrive as the
    value the receiver kept from an earlier header."""
    encoder, decoder = Encoder(), Decoder()
    settings = _Settings(0.1)
    for scale, rate in ((0.0, 0.1), (-0.0, 0.1), (-0.0, 0.2)):
        settings.rate = rate
        out, _ = roundtrip(encoder, decoder, {"h": torch.ones(2), "scale": scale, "settings": settings})
        assert math.copysign(1.0, out["scale"]) == math.copysign(1.0, scale)  # type: ignore[index]
        assert out["settings"].rate == rate  # type: ignore[index]


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
    assert len(sent) == 1 and torch.equal(out["z"], tree["z"])  # type: ignore[index]


def test_an_error_message_fits_the_posted_receive() -> None:
    encoder, decoder = Encoder(), Decoder()
    transfer(encoder, decoder, {"h": torch.ones(5, dtype=torch.float32)})
    message = error_message([3, 1, 2, 4], encoder.expected, CPU)
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
    assert out["h"].requires_grad and torch.equal(out["h"], big.detach())  # type: ignore[index]
    assert torch.equal(out["pos"], torch.arange(3)) and out["tag"] == "x"  # type: ignore[index]


def test_a_large_non_contiguous_leaf_travels() -> None:
    encoder, decoder = Encoder(), Decoder()
    tree = {"h": torch.randn(64, INLINE_LIMIT // 256).t(), "z": torch.randn(INLINE_LIMIT // 16, dtype=torch.complex128)}
    for _ in range(2):
        out, sent = transfer(encoder, decoder, tree)
    assert len(sent) == 3 and torch.equal(out["h"], tree["h"]) and torch.equal(out["z"], tree["z"])  # type: ignore[index]


def test_large_conjugate_and_negative_views_travel_as_their_values() -> None:
    """``z.conj()`` (and autograd's cotangent through one) is a lazy view whose bytes are ``z``'s:
    it is materialized before it is sent, whatever its size."""
    z = torch.randn(INLINE_LIMIT // 16 + 1, dtype=torch.complex128)
    x = torch.randn(INLINE_LIMIT // 8 + 1, dtype=torch.float64)
    tree = {"z": z.conj(), "small": z[:3].conj(), "x": torch._neg_view(x)}
    encoder, decoder = Encoder(), Decoder()
    for _ in range(2):
        out, _ = transfer(encoder, decoder, tree)
        assert isinstance(out, dict)
        assert torch.equal(out["z"], z.conj().resolve_conj()) and torch.equal(out["small"], z[:3].conj())
        assert torch.equal(out["x"], -x)


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
        for key, value in tree.items():
            if isinstance(value, torch.Tensor):
                assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
            else:
                assert type(out[key]) is type(value) and out[key] == value
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
