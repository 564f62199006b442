"""A stage within one step: its forward, which saves a pullback, and its backward, which runs it.

NOTE [differentiable leaves]
Only floating and complex tensor leaves are differentiated: every such parameter leaf, and the
input leaves that carry the previous stage's graph (``requires_grad``; over the wire the flag
travels in the layout). Each one is replaced by ``leaf.detach().requires_grad_()``: a new tensor
sharing storage, so the user's tensor keeps its ``requires_grad`` and is never part of our
graph. The forward runs under ``torch.enable_grad()`` and outside inference mode, so the ambient
grad mode does not matter (under ``torch.inference_mode()`` no graph would be recorded and every
gradient would silently be zero). The backward is an explicit vector-Jacobian product,
``torch.autograd.grad(outputs, inputs, cotangents)``, that never reads or writes ``.grad``.
Integer/bool tensors and non-tensor leaves pass through and get no cotangent (``None``).

NOTE [recomputation]
With ``recompute`` (``pipeline(..., recompute=...)``) a stage's forward runs under ``no_grad``
and keeps only its inputs; its backward first replays the forward with a graph, then pulls
back as usual. The replay restores the CPU random state the forward saw (and the executor
seeds the generators for the replay as for the forward, NOTE [randomness as data] in
fpipe/_random.py, which covers an accelerator's generator too), so results are bitwise those
of the stored forward; what is saved between forward and backward shrinks to the stage's
inputs, at the cost of a second forward. Stages built from modules update
their buffers (BatchNorm's running statistics) in the forward only: during the replay
(``replaying()``) they get copies. The graph-less forward gets plain aliases of its input leaves
(``detach()``: not views of the batch, not requiring grad), the same kind of tensor whatever the
stage, so a ``torch.compile``'d stage function compiles one graph-less variant for all stages
rather than one per kind of input (dynamo guards on ``requires_grad`` and on a view's base).

NOTE [outputs let go]
A pullback keeps each output that carries the graph as its gradient edge (the node that made it),
not as the tensor: the backward starts from the edge, which autograd treats exactly as it treats
the tensor (the same root, the same shape checks, the same bits), and the output's data is then
held only by what needs it: the next stage's input in one process, a send until it completes
(NOTE [sends released] in fpipe/_distributed/_sends.py), and the graph's own saved tensors when
the backward reads the output (``tanh``'s result, say). The edge of a leaf passed through (an
input or a parameter) is its gradient accumulator, which holds the leaf: its data is held anyway.

NOTE [boundary layout]
Every tensor that crosses a stage boundary is contiguous, with conjugate and negative bits
resolved: that is how the wire delivers it between processes, and kernels round differently for
different strides (a reduction over a transposed activation adds in another order; a matmul
with a stride-0 cotangent takes another path). So in one process too, a stage's input leaves are
made so before it runs (a no-op for what the wire or ``split`` delivers), and its input
cotangents before they leave, whichever backward made them: a fused backward in microbatch
order reads them from the input leaf's ``.grad``, which the engine lays out like the leaf, while
``autograd.grad`` (a backward ahead of order, or ``I``) returns what the last node made, e.g.
the stride-0 expansion that ``x.sum()`` pulls back. Without this, the schedule, and one process
or many, would change the bits of the results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ._accumulate import Grads, HoldersSum, OrderedSum
from ._precision import Precision
from ._purity import raise_if_in_place
from ._pytree import (
    Mapped,
    PyTree,
    TreeSpec,
    boundary_layout,
    detached,
    flatten,
    is_differentiable,
    leaves_with_paths,
    map_tensors,
    scatter,
    tensor_map,
    unflatten,
)
from ._tensor_parallel import is_dtensor, like_param, local, with_piece
from ._weight_grad import DeferredWeightGrad, Root, input_grad

StageFn = Callable[[Any, Any], Any]  # stage(stage_params, x) -> y


class Pullback:
    """What a forward saves for its backward: the outputs to differentiate and the inputs to reach."""

    __slots__ = ("deferred", "devices", "input_index", "inputs", "num_inputs", "output_index", "outputs", "replay")

    def __init__(
        self,
        outputs: list[Root],
        devices: list[torch.device],
        output_index: Sequence[int],
        inputs: list[torch.Tensor],
        input_index: Sequence[int],
        num_inputs: int,
    ) -> None:
        self.outputs = outputs  # output leaves that carry a graph, as roots (NOTE [outputs let go])
        self.devices = devices  # each one's device
        self.output_index = output_index  # their positions among the output leaves
        self.inputs = inputs  # differentiable input leaves (detached copies)
        self.input_index = input_index  # their positions among the input leaves
        self.num_inputs = num_inputs  # how many input leaves there are in all
        self.deferred: DeferredWeightGrad | None = None  # set by an input-grad backward
        # A forward to recompute: the call, the random state it ran with, and its input's pytree.
        self.replay: tuple[Callable[[], Any], torch.Tensor, Callable[[], PyTree]] | None = None


class StageRun:
    """Stage ``index`` for the duration of one step: prepared parameters and the gradient sum.

    ``orders``: for a stage on several ranks (NOTE [a stage on several ranks] in
    fpipe/schedules/_program.py), the microbatches each holder here sums, in holder order (one
    on a rank, every holder's in one process); empty for the usual ``0, 1, 2, ...``.
    """

    def __init__(
        self,
        index: int,
        fn: Callable[[Any, Any], Any],
        params: PyTree,
        *,
        recompute: bool = False,
        precision: Precision | None = None,
        orders: Sequence[Sequence[int]] = (),
    ) -> None:
        self.index = index
        self.fn = fn
        self.recompute = recompute
        leaves, self._spec = flatten(params)
        self._param_leaves = leaves
        self._param_index: list[int] = []  # the differentiable leaves' positions
        self.device: torch.device | None = None  # the first tensor's
        prepared = list(leaves)
        for k, leaf in enumerate(leaves):  # one pass: this runs for every stage in every step
            if isinstance(leaf, torch.Tensor):
                prepared[k] = detached(leaf)
                if self.device is None:
                    self.device = leaf.device
                if is_differentiable(leaf):
                    self._param_index.append(k)
        dtypes: list[torch.dtype] | None = None
        if precision is not None:  # NOTE [precision of a leaf]
            for k in self._param_index:
                # A cast, not a view: the stage differentiates its compute copy, never the cast.
                prepared[k] = prepared[k].to(precision.compute_dtype(leaves[k].dtype))
            dtypes = [precision.accumulate_dtype(leaves[k].dtype) for k in self._param_index]
            if all(dtype == prepared[k].dtype for dtype, k in zip(dtypes, self._param_index)):
                dtypes = None  # sums in the leaves' own dtype: the engine may accumulate into .grad
        for k in self._param_index:
            prepared[k].requires_grad_()
        self._param_inputs = [prepared[k] for k in self._param_index]
        self.params = unflatten(self._spec, prepared)
        self._grads: OrderedSum | HoldersSum
        if len(orders) > 1:
            self._grads = HoldersSum(self._param_inputs, dtypes, orders)
        else:
            self._grads = OrderedSum(self._param_inputs, dtypes, orders[0] if orders else None)

    def to_device(self, tree: PyTree) -> PyTree:
        """``tree`` with its tensors on this stage's device (``tree`` itself where all already are)."""
        device = self.device
        if device is None:
            return tree
        leaves, spec, moved, _ = tensor_map(lambda t: (t, False) if t.device == device else (t.to(device), True), tree)
        return unflatten(spec, leaves) if moved else tree

    def forward(self, x: PyTree, *, differentiate_input: bool) -> tuple[Any, Pullback]:
        """Run the stage on ``x``; return its output and the pullback of this call."""
        # A plain tensor, the usual case, asks optree nothing (NOTE [one-tensor fast path] in
        # fpipe/_pytree.py): its calls were about a third of what a forward costs over plain
        # autograd (measured by benchmarks/bench_overhead.py; notes/design.md, "Per-action overhead").
        leaves, spec, input_index, inputs = self._inputs(x, differentiate_input)
        if self.recompute:
            return self._recomputed(
                lambda xs: self.fn(self.params, unflatten(spec, xs)), leaves, spec, inputs, input_index
            )
        tree = unflatten(spec, leaves)
        try:
            if _graph_off():
                with _graph_mode():
                    y = self.fn(self.params, tree)
            else:
                y = self.fn(self.params, tree)
        except RuntimeError as error:
            self._raise_if_in_place(error, tree)
            raise
        return y, Pullback(*_graph_outputs(y), inputs, input_index, len(leaves))

    def forward_loss(
        self,
        x: PyTree,
        microbatch: PyTree,
        loss_fn: Callable[[Any, Any], Any],
        *,
        has_aux: bool,
        differentiate_input: bool,
    ) -> tuple[torch.Tensor, Any, Pullback]:
        """Run the (last) stage and ``loss_fn`` on ``x``; return loss, aux and the pullback."""
        leaves, spec, input_index, inputs = self._inputs(x, differentiate_input)
        microbatch = self.to_device(microbatch)

        def run(xs: list[Any]) -> tuple[torch.Tensor, Any]:
            return self._loss(unflatten(spec, xs), microbatch, loss_fn, has_aux)

        if self.recompute:
            auxes: list[Any] = []

            def replayable(xs: list[Any]) -> torch.Tensor:
                loss, aux = run(xs)
                auxes.append(aux)
                return loss

            loss, pullback = self._recomputed(replayable, leaves, spec, inputs, input_index)
            return loss.detach(), auxes[0], pullback
        tree = unflatten(spec, leaves)
        try:
            if _graph_off():
                with _graph_mode():
                    loss, aux = self._loss(tree, microbatch, loss_fn, has_aux)
            else:
                loss, aux = self._loss(tree, microbatch, loss_fn, has_aux)
        except RuntimeError as error:
            self._raise_if_in_place(error, tree)  # the stage's update (one by loss_fn stays autograd's error)
            raise
        return loss.detach(), aux, Pullback(*_graph_outputs(loss), inputs, input_index, len(leaves))

    def _loss(
        self, x: PyTree, microbatch: PyTree, loss_fn: Callable[[Any, Any], Any], has_aux: bool
    ) -> tuple[torch.Tensor, Any]:
        """``loss_fn`` of the stage's output on ``x``: the loss as a scalar, and aux."""
        loss, aux = _split_aux(loss_fn(self.fn(self.params, x), microbatch), has_aux)
        # A one-element loss of shape (1,) gets the scalar cotangent too.
        return (loss if loss.dim() == 0 else loss.reshape(())), aux

    def evaluate(self, x: PyTree) -> Any:
        """Run the stage on ``x`` recording no graph (a forward-only step): its output alone."""
        inputs = self._inputs(x, False)
        with not_inference(), torch.no_grad():
            return self.fn(self.params, unflatten(inputs.spec, inputs.leaves))

    def evaluate_loss(
        self, x: PyTree, microbatch: PyTree, loss_fn: Callable[[Any, Any], Any], *, has_aux: bool
    ) -> tuple[torch.Tensor, Any, Any]:
        """Run the (last) stage and ``loss_fn`` on ``x`` recording no graph: loss, aux and the output."""
        inputs = self._inputs(x, False)
        microbatch = self.to_device(microbatch)
        with not_inference(), torch.no_grad():
            y = self.fn(self.params, unflatten(inputs.spec, inputs.leaves))
            loss, aux = _split_aux(loss_fn(y, microbatch), has_aux)
        return loss.reshape(()), aux, y

    def _inputs(self, x: PyTree, differentiate_input: bool) -> Mapped:
        """The input leaves, those to differentiate replaced by graph leaves (NOTE [differentiable
        leaves]), the structure, and the positions of the differentiated leaves (``positions``) with
        the leaves themselves (``kept``)."""

        # Only leaves that carry the previous stage's graph can use a cotangent (a RoPE table
        # passed along untouched cannot), so only those are differentiated (a tensor that
        # requires grad is floating or complex).
        return tensor_map(self._graph_input if differentiate_input else self._input, x)

    def _graph_input(self, leaf: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``_input_leaf`` of an input leaf to differentiate if it can be, and whether it is."""
        differentiate = leaf.requires_grad
        return self._input_leaf(leaf, differentiate), differentiate

    def _input(self, leaf: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``_input_leaf`` of an input leaf not to differentiate."""
        return self._input_leaf(leaf, False), False

    def _input_leaf(self, leaf: torch.Tensor, differentiate: bool) -> torch.Tensor:
        """``leaf`` on this stage's device, laid out as it crosses a boundary (NOTE [boundary
        layout]), and with ``differentiate``, a graph leaf of its own (NOTE [differentiable leaves])."""
        device = self.device
        if device is not None and leaf.device != device:
            leaf = leaf.to(device)
        if not leaf.is_contiguous() or leaf.is_conj() or leaf.is_neg():
            leaf = boundary_layout(detached(leaf))
        if differentiate:  # (a tensor that requires grad is no inference tensor: ``detach`` will do)
            leaf = leaf.detach().requires_grad_()
        return leaf

    def _raise_if_in_place(self, error: RuntimeError, x: PyTree) -> None:
        """The error naming the leaf the stage updated in place, if ``error`` is autograd's refusal
        of that (NOTE [in-place updates of leaves] in fpipe/_purity.py); else nothing."""
        raise_if_in_place(error, self.index, lambda: self.fn(self.params, x), self.params, x)

    def _recomputed(
        self,
        run: Callable[[list[Any]], Any],
        leaves: list[Any],
        spec: TreeSpec,
        inputs: list[torch.Tensor],
        input_index: Sequence[int],
    ) -> tuple[Any, Pullback]:
        """Call ``run(leaves)`` without a graph, keeping what replays it (NOTE [recomputation])."""
        rng = torch.get_rng_state()
        plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
        with torch.inference_mode(False), torch.no_grad():
            out = run(plain)
        pullback = Pullback([], [], [], inputs, input_index, len(leaves))
        pullback.replay = (lambda: run(leaves), rng, lambda: unflatten(spec, leaves))
        # The next stage differentiates leaves that carry a graph; these will once replayed.
        return map_tensors(lambda t: detached(t).requires_grad_() if is_differentiable(t) else t, out), pullback

    def _replay(self, pullback: Pullback) -> None:
        """Rebuild the graph of a recomputed forward, with the random state it first ran with."""
        assert pullback.replay is not None
        run, rng, tree = pullback.replay
        pullback.replay = None
        token = _REPLAYING.set(True)
        try:
            with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
                torch.set_rng_state(rng)
                try:
                    out = run()
                except RuntimeError as error:
                    torch.set_rng_state(rng)
                    raise_if_in_place(error, self.index, run, self.params, tree())
                    raise
        finally:
            _REPLAYING.reset(token)
        pullback.outputs, pullback.devices, pullback.output_index = _graph_outputs(out)

    def _seeds(
        self, pullback: Pullback, cotangents: Sequence[torch.Tensor | None]
    ) -> tuple[list[Root], list[torch.Tensor]]:
        """The outputs that carry a graph and a cotangent, and those cotangents."""
        if pullback.replay is not None:
            self._replay(pullback)
        outputs, grad_outputs = [], []
        for k, out, device in zip(pullback.output_index, pullback.outputs, pullback.devices):
            cot = cotangents[k]
            if cot is not None:
                outputs.append(out)
                grad_outputs.append(cot if cot.device == device else cot.to(device))
        return outputs, grad_outputs

    def _input_cotangents(self, pullback: Pullback, grads: Sequence[torch.Tensor | None]) -> Grads:
        """One cotangent per input leaf, in one layout whichever backward made it (NOTE [boundary layout])."""
        return scatter(boundary_layout, pullback.input_index, grads, pullback.num_inputs)

    def backward(self, pullback: Pullback, cotangents: Sequence[torch.Tensor | None], microbatch: int) -> Grads:
        """The fused backward: pull ``cotangents`` (one per output leaf, ``None`` for none) back.

        Parameter gradients go into the ordered sum; returns the input cotangents, one per
        input leaf (``None`` where there is none).
        """
        if torch.is_inference_mode_enabled():  # gradients are plain tensors, whatever the ambient mode
            with torch.inference_mode(False):
                return self.backward(pullback, cotangents, microbatch)
        outputs, grad_outputs = self._seeds(pullback, cotangents)
        inputs = pullback.inputs
        wrt = inputs + self._param_inputs
        if not self._grads.engine_accumulates(microbatch):
            grads: Sequence[torch.Tensor | None] = [None] * len(wrt)
            if outputs and wrt:
                grads = _vjp(outputs, wrt, grad_outputs)
            self._grads.add(microbatch, grads[len(inputs) :])
            return self._input_cotangents(pullback, grads[: len(inputs)])
        if outputs and wrt:  # (an empty ``wrt`` would mean every leaf to the engine)
            _accumulate(outputs, wrt, grad_outputs)
            if not self._grads.all_own:
                self._grads.own()
        self._grads.accumulated(microbatch)
        # The input leaves are this call's own detached copies: their ``.grad`` is the cotangent.
        return scatter(_accumulated_cotangent, pullback.input_index, inputs, pullback.num_inputs)

    def backward_input(self, pullback: Pullback, cotangents: Sequence[torch.Tensor | None]) -> Grads:
        """The input half of a split backward (NOTE [split backward]); ``backward_weight`` finishes it."""
        outputs, grad_outputs = self._seeds(pullback, cotangents)
        with not_inference():
            grads, pullback.deferred = input_grad(outputs, grad_outputs, pullback.inputs, self._param_inputs)
        return self._input_cotangents(pullback, grads)

    def backward_weight(self, pullback: Pullback, microbatch: int) -> None:
        """The weight half of a split backward: parameter gradients into the ordered sum."""
        assert pullback.deferred is not None, "fpipe: a weight-grad backward before its input-grad backward"
        with not_inference():
            self._grads.add(microbatch, pullback.deferred.run())
        pullback.deferred = None

    def holders_part(self) -> PyTree:
        """This holder's sum (``grads``), each DTensor as its local piece: what it sends the stage's
        other holders, which hold the same pieces (NOTE [a stage on several ranks] in
        fpipe/schedules/_program.py)."""
        return map_tensors(local, self.grads())

    def add_holders(self, partials: Sequence[PyTree]) -> None:
        """Make the sum every holder's (``partials``: each one's ``holders_part``, in holder order,
        this run's among them), added in that order, a DTensor's as its local pieces."""
        leaves, mine = [flatten(tree)[0] for tree in partials], flatten(self.grads())[0]
        for i, k in enumerate(self._param_index):
            total = leaves[0][k]
            for other in leaves[1:]:
                total = total + other[k]
            self._grads.replace(i, with_piece(mine[k], total))

    def grads(self) -> PyTree:
        """The summed parameter gradients, shaped like the parameters.

        Differentiable leaves that no microbatch reached get zeros; other leaves get ``None``.
        A DTensor's gradient gets its placements (``like_param``: a replicated weight's partial
        sums are summed over the tensor-parallel ranks here, once per step).
        """
        out: list[Any] = [None] * len(self._param_leaves)
        with not_inference():
            for i, (k, g) in enumerate(zip(self._param_index, self._grads.total)):
                param = self._param_leaves[k]
                if g is not None and type(g) is not torch.Tensor and is_dtensor(g):
                    g = like_param(g, param)
                    self._grads.replace(i, g)  # kept, so that a second call sums nothing twice
                out[k] = torch.zeros_like(param) if g is None else g
        return unflatten(self._spec, out)


_AMBIENT = contextlib.nullcontext()


_REPLAYING: ContextVar[bool] = ContextVar("fpipe_replaying", default=False)


def replaying() -> bool:
    """Whether the forward running now is a recomputed one being replayed (NOTE [recomputation]).

    Stages built from modules (``split_module``, ``functionalize``) then hand the modules copies
    of their buffers, so that a train-mode BatchNorm updates its running statistics once per
    microbatch, in the forward, and not again in the replay.
    """
    return _REPLAYING.get()


def _accumulated_cotangent(x: torch.Tensor) -> torch.Tensor | None:
    """The cotangent the engine accumulated into the input leaf ``x``, laid out (NOTE [boundary layout])."""
    g = x.grad
    return None if g is None else boundary_layout(g)


def _graph_outputs(out: PyTree) -> tuple[list[Root], list[torch.device], Sequence[int]]:
    """The output leaves that carry the graph as roots of the backward (NOTE [outputs let go]),
    their devices, and their positions among the output's leaves.

    Raises:
        TypeError: if a leaf is an object fpipe cannot flatten (an unregistered class) that holds
            tensors carrying the graph: their gradient would be lost without a word.
    """
    leaves, _, index, outputs = tensor_map(_with_graph, out)
    if len(index) < len(leaves):  # (not the usual output: its one leaf carries the graph)
        _check_hidden_graph(out, leaves)
    return [get_gradient_edge(o) for o in outputs], [o.device for o in outputs], index


def _with_graph(leaf: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return leaf, leaf.requires_grad


def _check_hidden_graph(out: PyTree, leaves: list[Any]) -> None:
    """Raise if a leaf of ``out`` that is no tensor hides tensors that carry the graph."""
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) and _hides_graph(leaf):
            paths, _, _ = leaves_with_paths(out)
            kind = type(leaf).__qualname__
            raise TypeError(
                f"fpipe: the stage's output leaf {paths[k]} is a {kind} holding tensors that carry the "
                f"graph, inside an object fpipe cannot flatten: their gradient would be lost. Register "
                f"{kind} as a pytree node (optree.register_pytree_node) or return its tensors in a dict, "
                "list, tuple or namedtuple."
            )


def _hides_graph(value: Any) -> bool:
    """Whether ``value``'s attributes (``__dict__`` or ``__slots__``, one level) hold a tensor
    that carries the graph: a best-effort check, for dataclasses and plain classes."""
    fields = getattr(value, "__dict__", None)
    members = list(fields.values()) if isinstance(fields, dict) else []
    slots = getattr(type(value), "__slots__", ())
    for name in (slots,) if isinstance(slots, str) else slots:
        members.append(getattr(value, name, None))
    return any(isinstance(m, torch.Tensor) and m.requires_grad for m in members)


@contextlib.contextmanager
def _graph_mode() -> Iterator[None]:
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _graph_off() -> bool:
    """Whether a forward must enter ``_graph_mode`` to record its graph (NOTE [differentiable
    leaves]): not in the usual case, and entering even an empty context costs per action."""
    return torch.is_inference_mode_enabled() or not torch.is_grad_enabled()


def not_inference() -> contextlib.AbstractContextManager[Any]:
    """Inference mode off, entered only when it is on: ``torch.inference_mode(False)`` costs a
    microsecond to enter and leave even when it changes nothing (see ``_graph_off``)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _AMBIENT


_ENGINE = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)


def _vjp(
    outputs: list[Root], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]
) -> Sequence[torch.Tensor | None]:
    """``torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)``, on the hot path.

    ``autograd.grad`` first re-checks every cotangent against its output (``_make_grads``); ours
    are made to match (by the next stage's own backward, or the loss weight), so the engine is
    called directly when torch exposes it, which halves the cost of a small backward.
    """
    if _ENGINE is None:
        return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    grads: Sequence[torch.Tensor | None] = _ENGINE.run_backward(
        tuple(outputs), tuple(cotangents), False, False, tuple(inputs), True, False
    )
    return grads


def _accumulate(outputs: list[Root], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(outputs, cotangents, inputs=inputs)``: add into ``inputs``' ``.grad``.

    Only ``inputs`` are written to (other leaves the graph reaches are left alone); on the hot
    path the engine is called directly, as in ``_vjp``.
    """
    if _ENGINE is None:
        torch.autograd.backward(outputs, cotangents, inputs=inputs)
        return
    _ENGINE.run_backward(tuple(outputs), tuple(cotangents), False, False, tuple(inputs), True, True)


def _split_aux(result: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"loss_fn must return a pair (loss, aux) when has_aux=True (got: {type(result).__name__}).")
        loss, aux = result
    else:
        loss, aux = result, None
    if type(loss) is not torch.Tensor and is_dtensor(loss):
        loss = loss.full_tensor()  # a loss made by DTensor ops: its value, the same on every tensor-parallel rank
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        described = (
            f"tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TypeError(
            f"loss_fn must return a real floating scalar tensor (got: {described}). "
            "Reduce the loss to one number, e.g. with .mean()."
            + ("" if has_aux else " If it returns (loss, aux), pass has_aux=True.")
        )
    return loss, aux
