"""The wire format: pytrees as torch.distributed point-to-point messages (notes/wire.md).

A message is a few tensors sent in this order on one (sender, receiver) pair:

1. ``first``: ``uint8[META_BYTES + expected]``, where ``expected`` is the packed size of the
   previous message on the same channel (0 for the first). It opens with the meta, ``int64[6]``
   = ``[DATA, header_nbytes, packed_nbytes, expected, 0, 0]``, or ``[ERROR, failing_rank,
   stage, kind, microbatch, 0]`` when the sender gives up (no more follows). When the packed
   bytes have the expected size they travel right behind the meta (inline); otherwise that
   space is zero padding and they follow on their own.
2. ``header``: ``uint8[header_nbytes]``, only when the pytree's layout differs from the previous
   message on the same channel: the pickled ``Layout`` (treespec, each tensor leaf's dtype,
   shape, where it travels and whether it carries the sender's graph, the non-tensor leaves).
3. ``packed``: ``uint8[packed_nbytes]``, only when not inline and not empty.
4. Every large tensor leaf (``INLINE_LIMIT`` bytes or more), in leaf order: its own bytes, sent
   from the leaf's storage and received straight into the arriving tensor, no copy on either
   side (a stage's output is kept for its backward anyway, so sending it costs no memory).

NOTE [receives ahead]
When the channel's last layout has large leaves, the receiver posts the next message's receives
ahead of need (``first`` and one per large leaf of that layout), so that activations flow while
it computes; otherwise it posts them when it needs the message. Both sides know which case
applies (``ahead``: the same history of the channel), so the sender knows what is posted. If
such a message's layout changed after all, the sender fills the receives posted ahead with
zeros (``padding``) right after ``first``, then sends the message as usual: a layout change on
a channel of large leaves costs their bytes once more.

Small leaves are packed, each at a 16-byte aligned offset (``META_BYTES`` is a multiple of 16,
so inline leaves stay aligned). Complex, integer and bool tensors travel as raw bytes like any
other. Sender and receiver each keep the last layout and packed size per channel (e.g.
"activations of stage 2") and see the channel's messages in the same order, so the receiver
knows the size of the next ``first`` without being told: a value of small leaves is one message,
and a header travels only when a pytree first appears or its structure, a shape, a dtype or a
non-tensor leaf changes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ._pytree import PyTree, TreeSpec, flatten, unflatten

META_WORDS = 6
META_BYTES = 8 * META_WORDS  # a multiple of 16: an inline payload keeps its leaves aligned
DATA = 0
ERROR = 1
INLINE_LIMIT = 1 << 16  # tensor leaves of this many bytes or more travel as messages of their own
_ALIGN = 16


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree travels: packed at an offset, or as a message of its own."""

    spec: TreeSpec
    # (leaf, dtype, shape, offset in the packed bytes or -1 for its own message, size, requires_grad)
    tensors: tuple[tuple[int, torch.dtype, tuple[int, ...], int, int, bool], ...]
    values: tuple[tuple[int, Any], ...]  # (leaf, non-tensor value)
    nbytes: int  # of the packed leaves


def layout_of(tree: PyTree) -> tuple[Layout, list[Any]]:
    """The layout of ``tree`` and its leaves."""
    leaves, spec = flatten(tree)
    tensors, values, offset = [], [], 0
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            size = leaf.numel() * leaf.element_size()
            packed = size < INLINE_LIMIT
            tensors.append((k, leaf.dtype, tuple(leaf.shape), offset if packed else -1, size, leaf.requires_grad))
            offset += -(-size // _ALIGN) * _ALIGN if packed else 0
        else:
            values.append((k, leaf))
    return Layout(spec, tuple(tensors), tuple(values), offset), leaves


def _same(a: Layout | None, b: Layout) -> bool:
    """Whether ``b``'s tree and tensors are ``a``'s (its non-tensor leaves are compared pickled)."""
    return a is not None and (a.spec, a.tensors, a.nbytes) == (b.spec, b.tensors, b.nbytes)


def meta_of(first: torch.Tensor) -> list[int]:
    """The meta words that open a received ``first`` buffer."""
    words: list[int] = first[:META_BYTES].view(torch.int64).tolist()
    return words


def _first(words: list[int], expected: int, device: torch.device, *, inline: bool) -> torch.Tensor:
    """A ``first`` buffer opening with ``words``; its tail is left for an inline payload, else zeroed."""
    first = (torch.empty if inline else torch.zeros)(META_BYTES + expected, dtype=torch.uint8, device=device)
    first[:META_BYTES].view(torch.int64).copy_(torch.tensor(words + [0] * (META_WORDS - len(words))))
    return first


def error_message(code: list[int], expected: int, device: torch.device) -> torch.Tensor:
    """The ``first`` buffer of an ERROR message, sized as the receiver's posted receive."""
    return _first([ERROR, *code], expected, device, inline=False)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat ``uint8`` view to send or receive."""
    return t.reshape(-1).view(torch.uint8)


def _bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor on ``device``: a view when ``t`` is contiguous there.

    A conjugate or negative view (``z.conj()``, and autograd's cotangents through one) has no
    bytes of its own values to view: they are materialized first."""
    return as_bytes(t.detach().to(device).resolve_conj().resolve_neg().contiguous())


def _large(layout: Layout | None) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """``(dtype, shape, nbytes)`` of the leaves of ``layout`` that travel on their own."""
    if layout is None:
        return []
    return [(dtype, shape, size) for _, dtype, shape, offset, size, _ in layout.tensors if offset < 0]


class Encoder:
    """Turns pytrees of one channel into messages (lists of tensors to send, in order)."""

    def __init__(self) -> None:
        self._last: Layout | None = None
        # The non-tensor leaves of ``_last`` as they were sent: pickled, because ``==`` does not
        # tell the receiver's copy from the new value (``1 == True == 1.0``, ``-0.0 == 0.0``, an
        # object changed in place equals itself, an array's ``==`` is no bool).
        self._values = b""
        self.expected = 0  # the packed size the receiver's next ``first`` buffer has room for

    @property
    def ahead(self) -> bool:
        """Whether the receiver posts the next message's receives ahead (NOTE [receives ahead])."""
        return bool(_large(self._last))

    def encode(self, tree: PyTree, device: torch.device) -> list[torch.Tensor]:
        layout, leaves = layout_of(tree)
        header, values = None, pickle.dumps(layout.values)
        if not _same(self._last, layout) or values != self._values:
            header = torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8).to(device)
        inline = layout.nbytes == self.expected
        words = [DATA, 0 if header is None else header.numel(), layout.nbytes, self.expected]
        first = _first(words, self.expected, device, inline=inline)
        packed = first[META_BYTES:] if inline else torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        large = []
        for k, dtype, shape, offset, size, _ in layout.tensors:
            if offset < 0:
                large.append(_bytes(leaves[k], device))
            else:
                packed[offset : offset + size].view(dtype).view(shape).copy_(leaves[k].detach())
        padding = []
        if header is not None and self.ahead:
            padding = [torch.zeros(size, dtype=torch.uint8, device=device) for _, _, size in _large(self._last)]
        self._last, self._values, self.expected = layout, values, layout.nbytes
        tensors = [first, *padding, header, None if inline else packed, *large]
        return [t for t in tensors if t is not None and t.numel()]


class Decoder:
    """Turns the messages of one channel back into pytrees.

    For each message: ``first_buffer`` to receive into, and if ``ahead``, ``large_leaves(None)``
    too, both posted before the message is sent (NOTE [receives ahead]); with its meta,
    ``opened`` gives the header and packed buffers that follow; with the header received,
    ``large_leaves`` gives the buffers of the large leaves, unless those posted ahead are the
    right ones (no header: the layout did not change; with a header, what was posted ahead
    receives padding); once all have arrived, ``decode``.
    """

    def __init__(self) -> None:
        self._layout: Layout | None = None
        self.expected = 0  # the sender's ``Encoder.expected``, kept in step

    @property
    def ahead(self) -> bool:
        """``Encoder.ahead`` of the sender: whether the next message's receives go ahead."""
        return bool(_large(self._layout))

    def first_buffer(self, device: torch.device) -> torch.Tensor:
        """The buffer the next message's ``first`` tensor arrives in."""
        return torch.empty(META_BYTES + self.expected, dtype=torch.uint8, device=device)

    def opened(self, meta: list[int], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Buffers for the header and the packed bytes that follow a DATA ``first`` (``None``: none)."""
        _, header_nbytes, packed_nbytes, expected = meta[:4]
        assert expected == self.expected, f"fpipe wire: the sender expects {expected} inline bytes, we {self.expected}"
        header = torch.empty(header_nbytes, dtype=torch.uint8, device=device) if header_nbytes else None
        packed = None
        if packed_nbytes != expected:
            packed = torch.empty(packed_nbytes, dtype=torch.uint8, device=device)
        self.expected = packed_nbytes
        return header, packed

    def large_leaves(self, header: torch.Tensor | None, device: torch.device) -> list[torch.Tensor]:
        """Read a new header if there is one; new tensors for the large leaves, in leaf order, to
        receive into (``as_bytes``) and hand to ``decode``."""
        if header is not None:
            self._layout = pickle.loads(bytes(header.cpu().tolist()))
        assert self._layout is not None, "fpipe wire: a message without header on a new channel"
        return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape, _ in _large(self._layout)]

    def decode(self, first: torch.Tensor, packed: torch.Tensor | None, large: list[torch.Tensor]) -> PyTree:
        """The pytree of a message whose buffers have all arrived."""
        layout = self._layout
        assert layout is not None
        if packed is None:
            packed = first[META_BYTES:]
        size = packed.numel()
        assert size == layout.nbytes, f"fpipe wire: {size} packed bytes, the layout says {layout.nbytes}"
        leaves: list[Any] = [None] * (len(layout.tensors) + len(layout.values))
        own = iter(large)
        for k, dtype, shape, offset, size, requires_grad in layout.tensors:
            leaf = next(own) if offset < 0 else packed[offset : offset + size].view(dtype).view(shape)
            leaves[k] = leaf.requires_grad_(requires_grad)
        for k, value in layout.values:
            leaves[k] = value
        return unflatten(layout.spec, leaves)
