"""Which leaves of an update are one tensor: tied copies are stepped once, other overlaps refused.

NOTE [one tensor, one step]
``fpipe.split_module`` gives every stage that uses a tied parameter (input and output
embeddings) its own leaf, and those leaves are aliases: distinct tensor objects on one memory.
``fpipe.sum_tied`` gives each copy the whole gradient, so a kernel that stepped every leaf would
move that memory once per copy (two copies: twice the learning rate)::

    params[0]["embed.weight"] --+                  grads[0]["embed.weight"] = g0 + g3
                                +--> one memory    grads[3]["embed.weight"] = g0 + g3
    params[3]["embed.weight"] --+                  step it once, with g0 + g3

So an update groups the leaves by the memory they view: leaves that are the same view (device,
address, shape, strides, dtype) are one parameter, stepped once, through its first leaf in stage
order, as ``torch.optim`` steps the unsplit model's one ``nn.Parameter``. What must hold:

1. The copies' gradients are equal (``sum_tied`` makes them so), and so are their weight decay
   flags and their stages' step counters: otherwise they are not one parameter, and the update
   refuses them rather than pick one.
2. The state is per memory, not per leaf: ``init`` gives the copies one buffer, and a state
   with a buffer per copy (``fpipe.load`` returns one) must hold equal values, which the update
   keeps equal by copying the stepped buffer into the others (``fpipe.save`` needs them equal).
3. Nothing else an in-place update writes shares memory: two different views that overlap,
   two parameters sharing a buffer, a buffer on a parameter's memory, a gradient on memory the
   update writes. Each would be written twice, or read after it was written.

The pure ``update`` copies each view once (``Copies``), so tied copies stay one tensor in the
result, and runs the in-place update on the copies (other overlaps become separate copies there).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .._tensor_parallel import local


@dataclass
class Leaf:
    """One tensor leaf of a held stage, with what an update reads and writes for it."""

    stage: int
    path: str  # the key path in the stage, as ``['embed.weight']``
    param: torch.Tensor
    grad: torch.Tensor
    decay: bool
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def name(self, kind: str) -> str:
        """How messages call this leaf's tensor of ``kind``: ``params``, ``grads`` or a buffer's key."""
        if kind in ("params", "grads"):
            return f"{kind}[{self.stage}]{self.path}"
        return f"state[{self.stage}][{kind!r}]{self.path}"


def view_key(t: torch.Tensor) -> Hashable | None:
    """What makes two tensors the same view of one memory (a DTensor's local piece's), ``None``
    for a tensor that holds no memory (empty, or on the meta device)."""
    piece = local(t)
    if piece.numel() == 0 or piece.device.type == "meta":
        return None
    return (
        str(piece.device),
        piece.data_ptr(),
        tuple(piece.shape),
        piece.stride(),
        piece.dtype,
        piece.is_conj(),
        piece.is_neg(),
    )


def tied_groups(where: str, leaves: Sequence[Leaf], counters: dict[int, torch.Tensor]) -> list[list[Leaf]]:
    """The leaves grouped by the memory they view (NOTE [one tensor, one step]), each group in
    stage order, after checking that the copies in a group are one parameter (point 1) with one
    state (point 2); ``counters`` are the held stages' step counters.

    Raises:
        ValueError: copies with different gradients, weight decay, step counters or buffers.
    """
    groups: list[list[Leaf]] = []
    by_key: dict[Hashable, list[Leaf]] = {}
    for leaf in leaves:
        key = view_key(leaf.param)
        if key in by_key:
            _check_copy(where, by_key[key][0], leaf, counters)
            by_key[key].append(leaf)
        else:
            groups.append([leaf])
            if key is not None:
                by_key[key] = groups[-1]
    return groups


def _check_copy(where: str, first: Leaf, copy: Leaf, counters: dict[int, torch.Tensor]) -> None:
    same = (
        f"{first.name('params')} and {copy.name('params')} are one tensor (the same memory, as split_module gives "
        "a parameter tied across stages)"
    )
    a, b = local(first.grad), local(copy.grad)
    if not torch.equal(a, b):
        raise ValueError(
            f"{where}: {same}, but their gradients differ ({first.name('grads')} and {copy.name('grads')}: "
            f"largest difference {(a - b).abs().max().item():.3g}), so one step cannot apply both. Sum the copies' "
            "gradients first: grads = fpipe.sum_tied(grads) does for one name in several stages (distributed: "
            "sum_tied(grads, params=params, group=group))."
        )
    if first.decay != copy.decay:
        raise ValueError(
            f"{where}: {same}, but weight_decay_mask gives them different weight decay "
            f"(weight_decay_mask[{first.stage}]{first.path}: {first.decay}, "
            f"weight_decay_mask[{copy.stage}]{copy.path}: {copy.decay}). Give the copies the same mask entry."
        )
    steps = int(counters[first.stage]), int(counters[copy.stage])
    if steps[0] != steps[1]:
        raise ValueError(
            f"{where}: {same}, but their stages' step counters differ (state[{first.stage}]['step']: {steps[0]}, "
            f"state[{copy.stage}]['step']: {steps[1]}). Update the stages together, from one init(params)."
        )
    for key, buffer in first.buffers.items():
        other = copy.buffers[key]
        if view_key(other) != view_key(buffer) and not torch.equal(local(other), local(buffer)):
            raise ValueError(
                f"{where}: {same}, but their optimizer state differs ({first.name(key)} and {copy.name(key)}), "
                "and a tensor has one state. Build the state with init(params), which gives the copies one buffer, "
                "or load a saved one (fpipe.load)."
            )


def check_writes(where: str, groups: Sequence[Sequence[Leaf]], counters: dict[int, torch.Tensor]) -> None:
    """Check point 3 of NOTE [one tensor, one step]: the memory an in-place update writes (each
    group's parameter once, its buffers, the copies' own buffers, the step counters) is written
    once, and no gradient views it.

    Raises:
        ValueError: naming the two tensors that share memory.
    """
    spans: list[_Span] = []
    for group in groups:
        spans.append(_span(group[0].param, group[0].name("params"), write=True))
        for key in group[0].buffers:
            own = {view_key(leaf.buffers[key]): leaf for leaf in reversed(group)}  # the first leaf of each buffer
            spans.extend(_span(leaf.buffers[key], leaf.name(key), write=True) for leaf in own.values())
        spans.extend(_span(leaf.grad, leaf.name("grads"), write=False) for leaf in group)
    shared = {view_key(counter): s for s, counter in reversed(counters.items())}  # stages sharing a counter: once
    spans.extend(_span(counters[s], f"state[{s}]['step']", write=True) for s in shared.values())

    # Sweep the spans by address; a span overlaps the open ones that end after it starts.
    spans = sorted(span for span in spans if span.end > span.start)
    open_spans: list[_Span] = []
    for span in spans:
        open_spans = [o for o in open_spans if o.device == span.device and o.end > span.start]
        for other in open_spans:
            if other.write or span.write:
                _overlap(where, other, span)
        open_spans.append(span)


class _Span(NamedTuple):
    """The bytes a tensor views (``start`` to ``end``, on ``device``), and whether the update writes them."""

    device: str
    start: int
    end: int
    write: bool
    name: str


def _span(t: torch.Tensor, name: str, *, write: bool) -> _Span:
    piece = local(t)
    if view_key(piece) is None:
        return _Span(str(piece.device), 0, 0, write, name)  # no memory: never overlaps
    extent = 1 + sum((n - 1) * s for n, s in zip(piece.shape, piece.stride()))
    start = piece.data_ptr()
    return _Span(str(piece.device), start, start + extent * piece.element_size(), write, name)


def _overlap(where: str, a: _Span, b: _Span) -> None:
    written, other = (a, b) if a.write else (b, a)
    if not other.write:
        what = "which the update writes"
        fix = "Pass gradients in tensors of their own (a clone), or use the pure update."
    else:
        what = "and the update writes both"
        fix = (
            "Give each parameter and each optimizer buffer memory of its own (init(params) does); only the copies "
            "of one tied parameter (the same view, as split_module gives them) may share it."
        )
    raise ValueError(
        f"{where}: {other.name} shares memory with {written.name}, {what}, so an in-place update would write "
        f"that memory twice or read it after writing it. {fix}"
    )


class Copies:
    """``make(t)`` (a copy by default) once per memory view: tensors that are one view of one
    memory (tied copies) get one result, so the results are tied as the originals were."""

    def __init__(self, make: Callable[..., torch.Tensor] = torch.clone) -> None:
        self._make = make
        self._made: dict[Hashable, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        key = view_key(t)
        if key is None:  # no memory to share
            return self._make(t.detach(), memory_format=torch.preserve_format)
        if key not in self._made:
            self._made[key] = self._make(t.detach(), memory_format=torch.preserve_format)
        return self._made[key]
