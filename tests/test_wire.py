"""The wire format: pytrees to (header, payload) and back, headers only when layouts change."""

from __future__ import annotations

import torch

from fpipe._wire import Decoder, Encoder


def roundtrip(encoder: Encoder, decoder: Decoder, tree: object) -> tuple[object, bool]:
    header, payload = encoder.encode(tree, torch.device("cpu"))
    decoder.payload_size(header)
    return decoder.decode(payload), header is not None


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
