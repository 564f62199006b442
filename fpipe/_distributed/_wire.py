"""The wire format: pytrees as torch.distributed point-to-point messages (notes/wire.md).

A message is a few tensors sent in this order on one (sender, receiver) pair:

1. ``first``: ``uint8[META_BYTES + expected]``, where ``expected`` is the packed size of the
   previous message on the same channel (0 for the first). It opens with the meta, ``int64[6]``
   = ``[DATA, header_nbytes, packed_nbytes, expected, 0, 0]``, or ``[ERROR, failing_rank,
   stage, kind, microbatch, 0]`` when the sender gives up (no more follows). When the packed
   bytes have the expected size they travel right behind the meta (inline); otherwise that
   space is zero padding and they follow on their own.
2. ``header``: ``uint8[header_nbytes]``, only when the pytree's layout differs from the previous
   message on the same channel: the ``Layout`` as JSON, data only (NOTE [header]).
3. ``packed``: ``uint8[packed_nbytes]``, only when not inline and not empty.
4. Every large tensor leaf (``INLINE_LIMIT`` bytes or more), in leaf order: its own bytes, sent
   from the leaf's storage and received straight into the arriving tensor, no copy on either
   side; the send keeps that storage alive until the transport lets it go (NOTE [sends
   released] in fpipe/_distributed/_transport.py).

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

NOTE [one-tensor messages]
The usual activation is one small plain tensor of the same dtype, shape and ``requires_grad``
as the last message on its channel: no header, the packed bytes inline, so its message is one
``first`` of known words. The encoder keeps those words (on the device) and the zero tail that
pads the tensor's bytes to their aligned size, and makes the message with one ``torch.cat``
instead of a layout, a header check and copies into a new buffer. The bytes are those of the
general path (whose padding is left unwritten). A cotangent (a list of one tensor) takes the
general path: the same shortcut for it made 1F1B's actions dearer on gloo (measured by
benchmarks/bench_vs_torch.py --per-action-only; notes/wire.md, "The message format").

NOTE [header]
A header is ASCII JSON, never a pickle: a peer's bytes are read as data and can name only
classes this process already has. It is ``{"tree": structure, "leaves": [leaf, ...]}``:

- ``structure``: the pytree's structure (NOTE [structure as data] in fpipe/_pytree.py): builtin
  containers by kind, a namedtuple or structseq by module and qualname among the modules already
  imported, any other node by module and qualname among the classes registered with optree.
- a tensor leaf: ``["tensor", dtype name, shape, requires_grad]``. Offsets are not sent: both
  sides place the small leaves by one rule (``_placed``), and the receiver checks their total
  against the packed size that the meta announces.
- a DTensor leaf (NOTE [DTensor leaves]): ``["dtensor", dtype name, local shape, requires_grad,
  placements, global shape, global stride]``, placements as ``["Shard", dim]``,
  ``["Replicate"]`` or ``["Partial", op]``.
- any other leaf, dict key or node data: a plain value, ``[type, ...]``: ``["None"]``,
  ``["bool", b]``, ``["int", n]``, ``["str", s]``, ``["float", bits]`` and ``["complex", bits,
  bits]`` (the IEEE-754 bits in hex: -0.0 and every nan exact), ``["bytes", hex]``, ``["dtype",
  "float32"]``, ``["device", "cuda:0"]``, ``["Size", dims]``, and ``["tuple", values]``,
  ``["list", values]`` (as node data). Only these exact types travel (not subclasses, which
  would arrive as their base); the sender raises for others, naming the leaf's key path.

NOTE [DTensor leaves]
A DTensor leaf travels as its local piece, from the sender to the rank with the same
tensor-parallel index on the next pipeline rank (their pipeline group: NOTE [mesh dimensions]
in fpipe/_distributed/_topology.py), like any tensor leaf of that shape: packed or on its own,
never gathered, never copied. Its placements and global shape travel in the header, so only
when they change, and the receiver rebuilds the DTensor on its own tensor-parallel sub-mesh
around the piece it received (``DTensor.from_local``, no communication). The sender checks that
the DTensor lives on its tensor-parallel sub-mesh, else the receiver would rebuild another one.

Whether a header travels is decided without writing one: the new layout is compared to the
last one, and its non-tensor leaves' plain values to the last ones, where the type is part of
the value (``1``, ``True`` and ``1.0`` differ, so do ``0.0`` and ``-0.0``; ``nan`` equals
itself).
"""

from __future__ import annotations

import ctypes
import json
import math
import string
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._plural import plural
from .._pytree import PyTree, TreeSpec, flatten, leaves_with_paths, structure_data, structure_from_data, unflatten
from .._tensor_parallel import DTensorHeader, check_mesh, from_header, header_of, is_dtensor, local, placements_from
from ..schedules import Action
from ..schedules._action import KINDS
from ._status import Status

META_WORDS = 6
META_BYTES = 8 * META_WORDS  # a multiple of 16: an inline payload keeps its leaves aligned
DATA = 0
ERROR = 1
INLINE_LIMIT = 1 << 16  # tensor leaves of this many bytes or more travel as messages of their own
_ALIGN = 16


class Placed(NamedTuple):
    """Where one tensor leaf of a pytree travels (``Layout.tensors``)."""

    leaf: int  # its position among the tree's leaves
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the packed bytes, or -1: a message of its own
    size: int  # in bytes
    requires_grad: bool


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree travels: packed at an offset, or as a message of its own."""

    spec: TreeSpec
    tensors: tuple[Placed, ...]
    values: tuple[tuple[int, Any], ...]  # (leaf, non-tensor value)
    nbytes: int  # of the packed leaves
    # (leaf, its DTensor header) for the DTensor leaves, whose ``tensors`` entry is the local piece's
    dtensors: tuple[tuple[int, DTensorHeader], ...] = ()


def layout_of(tree: PyTree, tensor_ranks: list[int] | None = None) -> tuple[Layout, list[Any]]:
    """The layout of ``tree`` and its leaves, a DTensor's local piece in its place (NOTE [DTensor
    leaves]; ``tensor_ranks``: the ranks of this rank's tensor-parallel sub-mesh, where they must live)."""
    leaves, spec = flatten(tree)
    dtensors = []
    for k, x in enumerate(leaves):
        if is_dtensor(x):
            where = f"the leaf {leaves_with_paths(tree).paths[k]}"
            check_mesh(x, tensor_ranks, where)
            dtensors.append((k, header_of(x, where)))
    pieces = [local(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    tensors, nbytes = _placed(
        (k, p.dtype, tuple(p.shape), x.requires_grad)
        for k, (x, p) in enumerate(zip(leaves, pieces, strict=True))
        if isinstance(x, torch.Tensor)
    )
    values = tuple((k, x) for k, x in enumerate(leaves) if not isinstance(x, torch.Tensor))
    return Layout(spec, tensors, values, nbytes, tuple(dtensors)), pieces


def _placed(
    tensors: Iterable[tuple[int, torch.dtype, tuple[int, ...], bool]],
) -> tuple[tuple[Placed, ...], int]:
    """``Layout.tensors`` and ``Layout.nbytes`` of tensor leaves ``(leaf, dtype, shape, requires_grad)``."""
    placed, offset = [], 0
    for k, dtype, shape, requires_grad in tensors:
        size = math.prod(shape) * dtype.itemsize
        packed = size < INLINE_LIMIT
        placed.append(Placed(k, dtype, shape, offset if packed else -1, size, requires_grad))
        offset += -(-size // _ALIGN) * _ALIGN if packed else 0
    return tuple(placed), offset


def _same(a: Layout | None, b: Layout) -> bool:
    """Whether ``b``'s tree and tensors are ``a``'s (its non-tensor leaves are compared as plain values)."""
    return a is not None and (a.spec, a.tensors, a.nbytes, a.dtensors) == (b.spec, b.tensors, b.nbytes, b.dtensors)


# -- the header (NOTE [header]) -----------------------------------------------------------------

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_SUPPORTED = (
    "Pass it as a tensor, or as None, a bool, int, float, complex, str, bytes, torch.dtype, torch.device or "
    "torch.Size, or register its class with optree as a pytree node whose children are such values"
)


class _NotPlain(Exception):
    """``value`` has no plain value (NOTE [header])."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _plain(value: Any) -> Any:
    """``value`` as a plain value (NOTE [header]); raises ``_NotPlain``."""
    kind = type(value)
    if value is None:
        return ["None"]
    if kind is bool or kind is int or kind is str:
        return [kind.__name__, value]
    if kind is float:
        return ["float", _bits(value)]
    if kind is complex:
        return ["complex", _bits(value.real), _bits(value.imag)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is torch.dtype:
        return ["dtype", str(value).removeprefix("torch.")]
    if kind is torch.device:
        return ["device", str(value)]
    if kind is torch.Size:
        return ["Size", list(value)]
    if kind is tuple or kind is list:
        return [kind.__name__, [_plain(v) for v in value]]
    raise _NotPlain(value)


def _bits(x: float) -> str:
    return struct.pack(">d", x).hex()


def _unbits(bits: Any) -> float:
    if not (type(bits) is str and len(bits) == 16 and set(bits) <= set(string.hexdigits)):
        raise ValueError(f"not the 16 hex digits of a float: {bits!r:.80}")
    x: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return x


def _value(term: Any) -> Any:
    """Inverse of ``_plain``; raises ``ValueError`` for anything else."""
    tag, *args = term if type(term) is list and term else [None]
    arg = args[0] if len(args) == 1 else None
    if tag == "None" and not args:
        return None
    if (tag, type(arg)) in (("bool", bool), ("int", int), ("str", str)):
        return arg
    if tag == "float" and len(args) == 1:
        return _unbits(arg)
    if tag == "complex" and len(args) == 2:
        return complex(_unbits(args[0]), _unbits(args[1]))
    if tag == "bytes" and type(arg) is str:
        return bytes.fromhex(arg)
    if tag == "dtype" and type(arg) is str and arg in _DTYPES:
        return _DTYPES[arg]
    if tag == "device" and type(arg) is str:
        try:
            return torch.device(arg)
        except RuntimeError as e:
            raise ValueError(f"not a device: {arg!r:.80} ({e})") from None
    if tag == "Size" and type(arg) is list and all(type(d) is int and d >= 0 for d in arg):
        return torch.Size(arg)
    if tag in ("tuple", "list") and type(arg) is list:
        values = [_value(v) for v in arg]
        return tuple(values) if tag == "tuple" else values
    raise ValueError(f"not a value: {term!r:.80}")


def _plain_at(value: Any, path: str) -> Any:
    """``_plain`` for a dict key or a node's data at key path ``path`` (``structure_data``)."""
    try:
        return _plain(value)
    except _NotPlain as e:
        raise TypeError(
            f"fpipe.step: a dict key or pytree node's data cannot travel between ranks (at {path}: {e.value!r:.80} "
            f"of type {type(e.value).__qualname__}). {_SUPPORTED}."
        ) from None


def _plain_leaves(tree: PyTree, layout: Layout) -> list[Any]:
    """The plain values of ``layout``'s non-tensor leaves; raises ``TypeError`` naming a leaf that has none."""
    values = []
    for k, value in layout.values:
        try:
            values.append(_plain(value))
        except _NotPlain:
            raise TypeError(
                f"fpipe.step: a non-tensor leaf cannot travel between ranks (leaf {leaves_with_paths(tree).paths[k]}: "
                f"{value!r:.80} of type {type(value).__qualname__}). {_SUPPORTED}."
            ) from None
    return values


def _header(tree: PyTree, layout: Layout, values: list[Any]) -> bytes:
    """The header of ``layout``, the layout of ``tree`` whose non-tensor leaves are ``values``."""
    leaves: list[Any] = [None] * (len(layout.tensors) + len(layout.values))
    for k, dtype, shape, _, _, requires_grad in layout.tensors:
        leaves[k] = ["tensor", str(dtype).removeprefix("torch."), list(shape), requires_grad]
    for k, (placements, shape, stride) in layout.dtensors:
        leaves[k] = ["dtensor", *leaves[k][1:], [list(p) for p in placements], list(shape), list(stride)]
    for (k, _), value in zip(layout.values, values, strict=True):
        leaves[k] = value
    header = {"tree": structure_data(tree, layout.spec, _plain_at), "leaves": leaves}
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode("ascii")


def _invalid(detail: str) -> ValueError:
    return ValueError(
        f"fpipe.step: a message from the peer is not valid ({detail}). Run the same fpipe on every rank, and let "
        f"only the job's ranks reach its ports."
    )


def _layout_from(header: bytes, nbytes: int) -> Layout:
    """The layout a header describes, checked against the packed size ``nbytes`` announced in the meta.

    Raises:
        ValueError: the header is not one, or does not describe ``nbytes`` packed bytes.
        TypeError: it names a class this process does not have (``structure_from_data``).
    """
    try:
        return _parse(header, nbytes)
    except RecursionError:
        raise _invalid("a header nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors too
        raise _invalid(f"header: {e}") from None


def _parse(header: bytes, nbytes: int) -> Layout:
    data = json.loads(header.decode("ascii"), parse_constant=_value)  # NaN, Infinity: "not a value"
    if not (type(data) is dict and data.keys() == {"tree", "leaves"} and type(data["leaves"]) is list):
        raise ValueError("not an object of a tree and a list of leaves")
    spec = structure_from_data(data["tree"], _value)
    if spec.num_leaves != len(data["leaves"]):
        raise ValueError(f"{plural(len(data['leaves']), 'leaf')} for a tree of {spec.num_leaves}")
    tensors, values, dtensors = [], [], []
    for k, leaf in enumerate(data["leaves"]):
        if type(leaf) is list and leaf[:1] == ["tensor"]:
            tensors.append((k, *_tensor(leaf)))
        elif type(leaf) is list and leaf[:1] == ["dtensor"] and len(leaf) == 7:
            tensors.append((k, *_tensor(["tensor", *leaf[1:4]])))
            dtensors.append((k, _dtensor_header(leaf[4:])))
        else:
            values.append((k, _value(leaf)))
    placed, total = _placed(tensors)
    if total != nbytes:
        raise ValueError(f"its small tensor leaves take {plural(total, 'byte')}, the message announces {nbytes}")
    return Layout(spec, placed, tuple(values), total, tuple(dtensors))


def _dtensor_header(fields: list[Any]) -> DTensorHeader:
    """``(placements, global shape, global stride)`` of a DTensor leaf in a header, checked."""
    placements, shape, stride = fields
    placements_from(placements)  # raises for anything but Shard, Replicate and Partial
    for dims in (shape, stride):
        if not (type(dims) is list and all(type(n) is int and n >= 0 for n in dims)):
            raise ValueError(f"not a DTensor shape or stride: {dims!r:.80}")
    return tuple(tuple(p) for p in placements), tuple(shape), tuple(stride)


def _tensor(leaf: list[Any]) -> tuple[torch.dtype, tuple[int, ...], bool]:
    """``(dtype, shape, requires_grad)`` of a tensor leaf in a header, checked."""
    _, dtype, shape, requires_grad = leaf if len(leaf) == 4 else (None, None, None, None)
    if not (type(dtype) is str and dtype in _DTYPES):
        raise ValueError(f"not a tensor leaf: {leaf!r:.80}")
    if not (type(shape) is list and all(type(n) is int and n >= 0 for n in shape)):
        raise ValueError(f"not a shape: {shape!r:.80}")
    if math.prod(shape) * _DTYPES[dtype].itemsize >= 1 << 63:
        raise ValueError(f"a tensor too large to exist: {dtype}{shape}")
    differentiable = _DTYPES[dtype].is_floating_point or _DTYPES[dtype].is_complex
    if not (requires_grad is False or (requires_grad is True and differentiable)):
        raise ValueError(f"requires_grad {requires_grad!r:.80} for a {dtype} tensor")
    return _DTYPES[dtype], tuple(shape), requires_grad


def meta_of(first: torch.Tensor) -> list[int]:
    """The meta words that open a received ``first`` buffer."""
    words: list[int] = first[:META_BYTES].view(torch.int64).tolist()
    return words


def _first(words: list[int], expected: int, device: torch.device, *, inline: bool) -> torch.Tensor:
    """A ``first`` buffer opening with ``words``; its tail is left for an inline payload, else zeroed."""
    first = (torch.empty if inline else torch.zeros)(META_BYTES + expected, dtype=torch.uint8, device=device)
    first[:META_BYTES].view(torch.int64).copy_(upload(words + [0] * (META_WORDS - len(words)), device))
    return first


def upload(data: list[int] | bytes, device: torch.device) -> torch.Tensor:
    """Host data (int64 words, or bytes as uint8) as a tensor on ``device``, the host not waiting
    for the copy: from pinned memory, non-blocking (the caching host allocator keeps the pinned
    block until the copy has run). A plain ``torch.tensor(..., device=...)`` waits for it, on
    every message sent (notes/wire.md, "Host synchronization")."""
    if isinstance(data, list):
        host = torch.tensor(data, dtype=torch.int64)
    else:
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class FailureCode(Status):
    """A failure as it travels between ranks, in an ERROR meta and in the step's closing
    all-gather: four int64 words with names (NOTE [one status codec]).

    Attributes:
        rank: the failing pipeline rank (-1: unknown, or a rank of another replica).
        stage, kind, microbatch: its action (``kind`` an index into ``KINDS``); -1 outside any.
    """

    rank: int
    stage: int = -1
    kind: int = -1
    microbatch: int = -1

    @classmethod
    def of(cls, rank: int, action: Action | None) -> FailureCode:
        """The code of a failure of ``rank`` in ``action`` (``None``: outside any)."""
        if action is None:
            return cls(rank)
        return cls(rank, action.stage, KINDS.index(action.kind), action.microbatch)

    def action(self) -> Action | None:
        """The action the failure happened in (``None``: outside any)."""
        return None if self.kind < 0 else Action(self.stage, KINDS[self.kind], self.microbatch)


def error_message(code: FailureCode, expected: int, device: torch.device) -> torch.Tensor:
    """The ``first`` buffer of an ERROR message, sized as the receiver's posted receive."""
    return _first([ERROR, *code.encode()], expected, device, inline=False)


def error_code(meta: list[int]) -> FailureCode:
    """The failure an ERROR message's meta words (``meta_of``) carry."""
    return FailureCode.decode(meta[1 : 1 + FailureCode.width()])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat ``uint8`` view to send or receive."""
    return t.reshape(-1).view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """``as_bytes`` of a contiguous CPU tensor as a ``memoryview``, without a copy (``t`` must
    outlive it): what files, hashes and ``bytes()`` take, where a collective takes a tensor.
    Through ctypes, as a tensor's ``numpy()`` would need NumPy."""
    data = as_bytes(t)
    if sys.byteorder != "little":
        raise NotImplementedError("fpipe: safetensors files are little-endian; this machine is not.")
    if not data.numel():
        return memoryview(b"")
    return memoryview((ctypes.c_char * data.numel()).from_address(data.data_ptr())).cast("B")


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
        # The non-tensor leaves of ``_last`` as they were sent, as plain values (NOTE [header]):
        # ``==`` on the leaves themselves would not tell the receiver's copy from the new value
        # (``1 == True == 1.0``, ``-0.0 == 0.0``).
        self._values: list[Any] = []
        self.expected = 0  # the packed size the receiver's next ``first`` buffer has room for
        # When the last message was one small plain tensor: its (dtype, shape, requires_grad) and
        # the bytes around it in the next ``first`` of the same layout (NOTE [one-tensor messages]).
        self._repeat: tuple[tuple[torch.dtype, torch.Size, bool], torch.Tensor, torch.Tensor] | None = None

    @property
    def ahead(self) -> bool:
        """Whether the receiver posts the next message's receives ahead (NOTE [receives ahead])."""
        return bool(_large(self._last))

    def encode(self, tree: PyTree, device: torch.device, tensor_ranks: list[int] | None = None) -> list[torch.Tensor]:
        """The tensors of ``tree``'s message (``tensor_ranks``: as in ``layout_of``)."""
        repeat = self._repeat
        if (
            repeat is not None
            and type(tree) is torch.Tensor
            and (tree.dtype, tree.shape, tree.requires_grad) == repeat[0]
            and tree.device == repeat[1].device
            and tree.is_contiguous()
            and not (tree.is_conj() or tree.is_neg())
        ):
            return [torch.cat([repeat[1], as_bytes(tree.detach()), repeat[2]])]
        self._repeat = None
        layout, leaves = layout_of(tree, tensor_ranks)
        header, values = None, _plain_leaves(tree, layout)
        if not _same(self._last, layout) or values != self._values:
            header = upload(_header(tree, layout, values), device)
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
        if type(tree) is torch.Tensor and layout.tensors[0].offset == 0:  # one small plain tensor: repeatable
            words = [DATA, 0, layout.nbytes, layout.nbytes, 0, 0]
            tail = torch.zeros(layout.nbytes - layout.tensors[0].size, dtype=torch.uint8, device=device)
            self._repeat = ((tree.dtype, tree.shape, tree.requires_grad), upload(words, device).view(torch.uint8), tail)
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
        if header_nbytes < 0 or packed_nbytes < 0:
            raise _invalid(f"a meta announcing {header_nbytes} header and {packed_nbytes} packed bytes")
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
            self._layout = _layout_from(header.cpu().numpy().tobytes(), self.expected)
        assert self._layout is not None, "fpipe wire: a message without header on a new channel"
        return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape, _ in _large(self._layout)]

    def decode(
        self, first: torch.Tensor, packed: torch.Tensor | None, large: list[torch.Tensor], mesh: Any = None
    ) -> PyTree:
        """The pytree of a message whose buffers have all arrived; its DTensor leaves on ``mesh``,
        this rank's tensor-parallel sub-mesh (NOTE [DTensor leaves])."""
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
        if layout.dtensors and mesh is None:
            raise _invalid("a DTensor leaf, but this rank's mesh has no tensor-parallel dimension")
        for k, dtensor in layout.dtensors:
            leaves[k] = from_header(leaves[k].detach(), mesh, dtensor).requires_grad_(leaves[k].requires_grad)
        for k, value in layout.values:
            leaves[k] = value
        return unflatten(layout.spec, leaves)
