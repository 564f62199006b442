"""The wire format: pytrees as torch.distributed point-to-point messages (notes/wire.md).

A message is up to three tensors sent in this order on one (sender, receiver) pair:

1. ``meta``: ``int64[5]`` = ``[DATA, header_nbytes, payload_nbytes, 0, 0]``, or
   ``[ERROR, failing_rank, stage, kind, microbatch]`` when the sender gives up (no more follows).
2. ``header``: ``uint8[header_nbytes]``, only when the pytree's layout differs from the previous
   message on the same channel: the pickled ``Layout`` (treespec, each tensor leaf's dtype,
   shape, byte offset and whether it carries the sender's graph, the non-tensor leaves).
3. ``payload``: ``uint8[payload_nbytes]``, every tensor leaf's bytes, each at a 16-byte
   aligned offset. Complex, integer and bool tensors travel as raw bytes like any other.

Sender and receiver each keep the last layout per channel (e.g. "activations of stage 2") and
see the channel's messages in the same order, so a header travels when a pytree first appears
and again only when its structure, a shape, a dtype or a non-tensor leaf changes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ._pytree import PyTree, TreeSpec, flatten, unflatten

META_WORDS = 5
DATA = 0
ERROR = 1
_ALIGN = 16


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lives in a payload."""

    spec: TreeSpec
    # (leaf, dtype, shape, offset, size, requires_grad)
    tensors: tuple[tuple[int, torch.dtype, tuple[int, ...], int, int, bool], ...]
    values: tuple[tuple[int, Any], ...]  # (leaf, non-tensor value)
    nbytes: int


def layout_of(tree: PyTree) -> tuple[Layout, list[Any]]:
    """The layout of ``tree`` and its leaves."""
    leaves, spec = flatten(tree)
    tensors, values, offset = [], [], 0
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            size = leaf.numel() * leaf.element_size()
            tensors.append((k, leaf.dtype, tuple(leaf.shape), offset, size, leaf.requires_grad))
            offset += -(-size // _ALIGN) * _ALIGN
        else:
            values.append((k, leaf))
    return Layout(spec, tuple(tensors), tuple(values), offset), leaves


def _same(a: Layout | None, b: Layout) -> bool:
    """Whether ``b`` may travel without a header after ``a``: equal, non-tensor leaves of equal type
    too (``1 == True == 1.0``, yet each must arrive as itself)."""
    try:
        return a == b and all(type(x) is type(y) for (_, x), (_, y) in zip(a.values, b.values))
    except Exception:  # a non-tensor leaf whose == is not a bool (e.g. an array): resend
        return False


class Encoder:
    """Turns pytrees of one channel into (header or None, payload) for sending."""

    def __init__(self) -> None:
        self._last: Layout | None = None

    def encode(self, tree: PyTree, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        layout, leaves = layout_of(tree)
        header = None
        if not _same(self._last, layout):
            self._last = layout
            header = torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8).to(device)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        for k, dtype, shape, offset, size, _ in layout.tensors:
            payload[offset : offset + size].view(dtype).view(shape).copy_(leaves[k].detach())
        return header, payload


class Decoder:
    """Turns (header or None, payload) of one channel back into pytrees."""

    def __init__(self) -> None:
        self._layout: Layout | None = None

    def payload_size(self, header: torch.Tensor | None) -> int:
        """Read a new header if there is one; the payload size of the message it describes."""
        if header is not None:
            self._layout = pickle.loads(bytes(header.cpu().tolist()))
        assert self._layout is not None, "fpipe wire: a message without header on a new channel"
        return self._layout.nbytes

    def decode(self, payload: torch.Tensor) -> PyTree:
        layout = self._layout
        assert layout is not None
        leaves: list[Any] = [None] * (len(layout.tensors) + len(layout.values))
        for k, dtype, shape, offset, size, requires_grad in layout.tensors:
            leaves[k] = payload[offset : offset + size].view(dtype).view(shape).requires_grad_(requires_grad)
        for k, value in layout.values:
            leaves[k] = value
        return unflatten(layout.spec, leaves)
