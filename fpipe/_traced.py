"""The traced core of a compiled step: a row of actions as one straight line for dynamo, the mail
that hands values between its stages, and what dynamo's trace noted (NOTE [the compiled step]
in fpipe/_compile.py).

``Core.__call__`` runs the actions of an ``Order`` on the stages' own leaves, ``autograd.grad``
for each backward, gradients summed in microbatch order; what crosses stages goes through a
``Mail`` (``LocalMail`` in one process; on a pipeline rank, fpipe/_distributed/_compiled.py's
``RowMail``). At trace time (``comptime``, nothing at run time) it notes the action dynamo is
tracing and the random draws each action added (``tracing``, ``first_draw``), which
``CompiledRun`` names when a compile fails.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch._dynamo.comptime import ComptimeContext, comptime

from ._microbatch import stack
from ._pytree import PyTree, flatten, is_differentiable, unflatten
from ._random import CountedDraws
from ._run import Order, StepView
from ._stage import StageFn
from ._tensor_parallel import like_param
from .schedules import Action
from .schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD


def own_code(core: Core) -> Callable[..., Any]:
    """``core.__call__`` with a code object of its own: dynamo caches graphs, and counts
    recompiles against its limit (``recompile_limit``, 8), per code object, so steps must not
    share one (the ninth step built in a process would fail to compile)."""
    code = Core.__call__.__code__.replace()
    return types.MethodType(types.FunctionType(code, globals(), "__call__"), core)


def _note_action(ctx: ComptimeContext) -> None:
    """At trace time (``comptime``; nothing at run time): the action that dynamo traced last is
    done, note the random draws among its nodes, and the one it traces now."""
    _note_draws(ctx)
    _TRACED[0] = True
    _TRACING[0] = ctx.get_local("k").as_python_constant()


def _traced(ctx: ComptimeContext) -> None:
    """At trace time: every action is traced (what fails now is not an action's)."""
    _note_draws(ctx)
    _TRACING[0] = None


def _note_draws(ctx: ComptimeContext) -> None:
    """Note the first random draw among the nodes that the action traced last added to the graph."""
    fresh = [node for node in ctx.graph().nodes if node not in _SEEN]
    _SEEN.update(fresh)
    k = _TRACING[0]
    if k is not None and not _DRAWS:
        _DRAWS.extend((k, _op(node)) for node in fresh if _draws(node))


_TRACING: list[int | None] = [None]  # the index of the action dynamo traces now, if it traces
_TRACED = [False]  # whether dynamo traced an action in this call
_SEEN: set[torch.fx.Node] = set()  # the nodes of the graph dynamo builds, as far as noted
_DRAWS: list[tuple[int, str]] = []  # the actions traced that draw random numbers, and the ops


# NOTE [random draws under compile]
# An eager step seeds the default generators afresh for each stage call (NOTE [randomness as
# data] in fpipe/_random.py); ``manual_seed`` does not trace, so in a graph the draws would come
# from the caller's generator in the compiler's order, and Inductor draws numbers of its own. So
# each stage call runs under ``CountedDraws`` with its seed (NOTE [counted draws]), which replaces
# the common draws by counted ones. A draw left in the graph is not: the step warns, naming the
# action and the op, and runs eagerly. The ops are those of dynamo's graph (torch functions and
# tensor methods by name); dropout counts when training, attention when its ``dropout_p`` is not 0.
# fmt: off
_RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
    "bernoulli_", "normal", "normal_", "uniform_", "random_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "multinomial", "poisson", "rrelu", "rrelu_", "gumbel_softmax",
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_",
    "native_dropout",
})
# fmt: on


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` of dynamo's graph draws random numbers (NOTE [random draws under compile])."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _op(node)
    if name == "scaled_dot_product_attention":  # (query, key, value, attn_mask, dropout_p, ...)
        return bool(node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0) != 0.0)
    if name not in _RANDOM:
        return False
    if "dropout" in name:  # dropout(input, p, training, ...): not random when not training
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
        return training is not False
    return True


def _op(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def begin() -> None:
    """Forget what the last trace noted (before a call that may trace)."""
    _TRACING[0] = None
    _TRACED[0] = False
    _SEEN.clear()
    _DRAWS.clear()


def end() -> None:
    """Let go of the traced graph's nodes."""
    _SEEN.clear()


def tracing() -> int | None:
    """The index (in the core's order) of the action dynamo was tracing, if it was."""
    return _TRACING[0]


def traced() -> bool:
    """Whether dynamo traced an action since ``begin``."""
    return _TRACED[0]


def first_draw() -> tuple[int, str] | None:
    """The first traced action that draws random numbers, and the op, if one does."""
    return _DRAWS[0] if _DRAWS else None


def grads_like(params: Sequence[PyTree], sums: Sequence[Sequence[torch.Tensor | None]]) -> list[PyTree]:
    """Gradients shaped like ``params``: zeros where no microbatch reached a differentiable leaf,
    ``None`` for other leaves, a DTensor's with its parameter's placements (as ``StageRun.grads``:
    a replicated weight's partial sums are summed over the tensor-parallel ranks here)."""
    out = []
    for p, total in zip(params, sums):
        leaves, spec = flatten(p)
        grads: list[Any] = [None] * len(leaves)
        for k, g in zip([k for k, x in enumerate(leaves) if is_differentiable(x)], total):
            grads[k] = torch.zeros_like(leaves[k]) if g is None else like_param(g, leaves[k])
        out.append(unflatten(spec, grads))
    return out


def graph_outputs(y: PyTree) -> tuple[list[torch.Tensor], list[int]]:
    """The output leaves of ``y`` that carry the graph, and their positions among its leaves."""
    ys = flatten(y)[0]
    index = [n for n, t in enumerate(ys) if isinstance(t, torch.Tensor) and t.requires_grad]
    return [ys[n] for n in index], index


Key = tuple[str, int, int]  # ("act" | "cot" | "mb" | "grad" | "losses" | "result", stage, microbatch): a message
Losses = tuple[dict[int, torch.Tensor], dict[int, Any], dict[int, Any]]  # a last stage holder's, by microbatch


class Mail(Protocol):
    """Where a traced row's messages go (``Core``): between the stages of one process, or, on a
    pipeline rank, to and from the other ranks inside the graph (fpipe/_distributed/_compiled.py)."""

    def put(self, key: Key, value: PyTree) -> None:
        """Hand over ``value`` (an activation, a cotangent, a microbatch for the last stage)."""
        ...

    def take(self, key: Key) -> PyTree:
        """The value handed over as ``key``."""
        ...

    def share(self, stage: int, partial: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every holder's ``partial`` gradient sums of ``stage``, a stage on several ranks, in
        holder order (NOTE [a stage on several ranks] in fpipe/schedules/_program.py)."""
        ...

    def gather_losses(self, losses: Losses) -> Losses | None:
        """Every last stage holder's losses and aux, merged, on the first holder; ``None`` on the
        others, which send theirs there."""
        ...

    def result(self, result: tuple[torch.Tensor, Any, Any] | None) -> tuple[torch.Tensor, Any, Any]:
        """The last stage's ``(loss, aux, outputs)`` (``None`` where it is held elsewhere), on every
        process; the row's messages all sent and received."""
        ...


class LocalMail:
    """Every stage in this process: values handed over in a dict (``shapes``: none to read)."""

    def __init__(self, shapes: Sequence[torch.Tensor] = ()) -> None:
        self.held: dict[Key, PyTree] = {}

    def put(self, key: Key, value: PyTree) -> None:
        if key[0] != "mb":  # (the last stage has the batch here)
            self.held[key] = value

    def take(self, key: Key) -> PyTree:
        return self.held.pop(key)

    def share(self, stage: int, partial: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        return [partial]

    def gather_losses(self, losses: Losses) -> Losses | None:
        return losses

    def result(self, result: tuple[torch.Tensor, Any, Any] | None) -> tuple[torch.Tensor, Any, Any]:
        assert result is not None
        return result


class Core:
    """The order's actions as one straight line for dynamo (NOTE [the compiled step])."""

    def __init__(self, step: StepView, order: Order) -> None:
        self.mail: Callable[[list[torch.Tensor]], Mail] = LocalMail  # called with the call's ``shapes``
        self.num_microbatches = order.program.num_microbatches
        self.holds_last = step.num_stages - 1 in step.local_stages
        program = order.program
        # The stages this rank holds with other ranks (DualPipe's; none in one process), whose sums
        # are added over their holders at the end (NOTE [a stage on several ranks]).
        held = sorted(step.local_stages) if step.rank is not None else []
        self.shared = tuple(s for s in held if len(program.holders(s)) > 1)
        self.shares_last = step.num_stages - 1 in self.shared
        self.stages: tuple[StageFn, ...] = step.stages
        self.loss_fn = step.loss_fn
        self.has_aux = step.has_aux
        self.last = step.num_stages - 1
        self.actions: tuple[Action, ...] = tuple(a for _, a in order.actions)
        # Each stage's microbatches in this row, in the order their sums are added (NOTE [fixed
        # accumulation order]: a holder of a stage on several ranks adds its own, in order).
        # The microbatches whose stage 0 another rank runs (DualPipe's second half): handed over
        # first, by the batch's rank (``ahead`` in fpipe/_distributed/_messages.py).
        self.ahead = tuple(i for i in range(self.num_microbatches) if Action(0, FORWARD, i) not in self.actions)
        self.sum_order = {
            s: sorted({a.microbatch for a in self.actions if a.stage == s and a.kind == FORWARD})
            for s in step.local_stages
        }
        self.precision = step.precision
        self.recompute = step.recompute

    def __call__(
        self,
        params: list[PyTree],
        microbatches: list[PyTree] | None,
        weights: torch.Tensor,
        scaled: torch.Tensor,
        random_seeds: torch.Tensor,
        one_weight: bool,
        shapes: list[torch.Tensor],
    ) -> tuple[torch.Tensor, Any, list[list[torch.Tensor | None]]]:
        last, mail = self.last, self.mail(shapes)  # (``shapes``: of the tensors received, on a rank)
        # The stages' own leaves (NOTE [differentiable leaves] in fpipe/_stage.py).
        # With a precision policy, differentiable leaves are cast to the compute dtype and their
        # gradients summed in the accumulate dtype (NOTE [precision of a leaf] in fpipe/_precision.py).
        precision = self.precision
        wrt: list[list[torch.Tensor]] = []
        dtypes: list[list[torch.dtype]] = []  # the sums'
        stage_params = []
        for p in params:
            leaves, spec = flatten(p)
            mine = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
            index = [k for k, x in enumerate(leaves) if is_differentiable(x)]
            if precision is not None:
                for k in index:
                    mine[k] = mine[k].to(precision.compute_dtype(leaves[k].dtype))
            wrt.append([mine[k].requires_grad_() for k in index])
            dtypes.append(
                [mine[k].dtype if precision is None else precision.accumulate_dtype(leaves[k].dtype) for k in index]
            )
            stage_params.append(unflatten(spec, mine))
        seeds, weight = scaled.unbind(), weights.unbind()  # the backwards' seeds, the losses' weights
        # What a forward keeps for its backward: its outputs that carry the graph and their positions,
        # its differentiable inputs and theirs, how many input leaves, and a recomputed one's input.
        pulls: dict[tuple[int, int], tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[int], int, Any]] = {}
        deferred: dict[tuple[int, int], Sequence[torch.Tensor | None]] = {}
        fed: dict[int, PyTree] = {}  # the last stage's microbatches received, by microbatch
        losses: list[Any] = [None] * self.num_microbatches
        auxes: list[Any] = [None] * self.num_microbatches
        sums: list[list[torch.Tensor | None]] = [[None] * len(w) for w in wrt]
        added = [0] * len(wrt)
        pending: list[dict[int, Sequence[torch.Tensor | None]]] = [{} for _ in wrt]

        def add(s: int, i: int, grads: Sequence[torch.Tensor | None]) -> None:
            """NOTE [fixed accumulation order]: microbatch ``i``'s gradients, once its predecessors' are in."""
            pending[s][i] = grads
            order = self.sum_order[s]
            while added[s] < len(order) and order[added[s]] in pending[s]:
                for n, g in enumerate(pending[s].pop(order[added[s]])):
                    if g is not None:
                        total = sums[s][n]
                        sums[s][n] = g.to(dtypes[s][n], copy=True) if total is None else total.add_(g)
                added[s] += 1

        def forward(s: int, i: int, x: PyTree) -> tuple[Any, Any]:
            """Stage ``s`` on ``x``, and for the last stage ``loss_fn``: the output (the loss, a
            scalar) and the aux. Their draws are counted from the call's seed (NOTE [counted draws])."""
            with CountedDraws(random_seeds[s, i]):
                y = self.stages[s](stage_params[s], x)
                if s < last:
                    return y, None
                if microbatches is not None:
                    target = microbatches[i]
                elif i in fed:  # (a recomputed forward's replay)
                    target = fed[i]
                else:
                    target = fed[i] = mail.take(("mb", 0, i))
                result = self.loss_fn(y, target)
            loss, aux = result if self.has_aux else (result, None)
            return (loss if loss.dim() == 0 else loss.reshape(())), aux

        if microbatches is not None:
            for i in self.ahead:
                mail.put(("mb", 0, i), microbatches[i])
        for k, action in enumerate(self.actions):  # noqa: B007 (``k`` is read by ``_note_action``)
            comptime(_note_action)
            s, kind, i = action
            if kind == FORWARD:
                if s == 0 and microbatches is not None:
                    x = microbatches[i]
                    mail.put(("mb", 0, i), x)  # (to the last stage's rank when it holds no batch)
                else:
                    x = mail.take(("mb", 0, i) if s == 0 else ("act", s - 1, i))
                xs, x_spec = flatten(x)
                inputs, input_index = [], []
                for n, leaf in enumerate(xs):
                    if isinstance(leaf, torch.Tensor):
                        leaf = leaf.contiguous()  # NOTE [boundary layout] in fpipe/_stage.py
                        if s > 0 and leaf.requires_grad:
                            leaf = leaf.detach().requires_grad_()
                            inputs.append(leaf)
                            input_index.append(n)
                        xs[n] = leaf
                tree = unflatten(x_spec, xs)
                if s in self.recompute:  # NOTE [recomputation] in fpipe/_stage.py: the inputs kept, no graph
                    with torch.no_grad():
                        y, aux = forward(s, i, tree)
                    if s < last:  # the next stage differentiates every floating leaf, as it will carry the graph
                        ys, y_spec = flatten(y)
                        y = unflatten(y_spec, [t.detach().requires_grad_() if is_differentiable(t) else t for t in ys])
                    pulls[s, i] = ([], [], inputs, input_index, len(xs), tree)
                else:
                    y, aux = forward(s, i, tree)
                    pulls[s, i] = (*graph_outputs(y), inputs, input_index, len(xs), None)
                if s == last:
                    losses[i], auxes[i] = y.detach(), aux
                else:
                    mail.put(("act", s, i), y)
            elif kind == BACKWARD_WEIGHT:
                del pulls[s, i]
                add(s, i, deferred.pop((s, i)))
            else:
                outputs, output_index, inputs, input_index, num_inputs, replay = (
                    pulls[s, i] if kind == BACKWARD_INPUT else pulls.pop((s, i))
                )
                if replay is not None:  # the recomputed forward, with its graph this time
                    outputs, output_index = graph_outputs(forward(s, i, replay)[0])
                if s == last:
                    cotangents: list[torch.Tensor | None] = [seeds[i].to(losses[i])]  # NOTE [seeds]
                else:
                    cotangents = mail.take(("cot", s + 1, i))
                roots = [out for n, out in zip(output_index, outputs) if cotangents[n] is not None]
                grad_outputs = [cotangents[n] for n in output_index if cotangents[n] is not None]
                targets = inputs + wrt[s]
                grads: Sequence[torch.Tensor | None] = [None] * len(targets)
                if roots and targets:
                    grads = torch.autograd.grad(roots, targets, grad_outputs, allow_unused=True)
                if kind == BACKWARD:
                    add(s, i, grads[len(inputs) :])
                else:  # I: the weight part waits for W, which only adds it in order
                    deferred[s, i] = grads[len(inputs) :]
                if s > 0:
                    to_send: list[torch.Tensor | None] = [None] * num_inputs
                    for n, g in zip(input_index, grads[: len(inputs)]):
                        to_send[n] = None if g is None else g.contiguous()
                    mail.put(("cot", s, i), to_send)
        comptime(_traced)
        for s in self.shared:  # every holder's sums added in holder order, as the eager row's
            mine = [
                torch.zeros(w.shape, dtype=d, device=w.device) if g is None else g
                for g, w, d in zip(sums[s], wrt[s], dtypes[s])
            ]
            parts = mail.share(s, mine)
            totals = parts[0]
            for other in parts[1:]:
                totals = [a + b for a, b in zip(totals, other)]
            sums[s] = list(totals)
        result = None
        if self.shares_last:  # the last stage's holders' losses, merged on its first holder
            ran = [a.microbatch for a in self.actions if a.stage == last and a.kind == FORWARD]
            merged = mail.gather_losses(({i: losses[i] for i in ran}, {i: auxes[i] for i in ran}, {}))
            if merged is not None:
                losses = [merged[0][i] for i in range(self.num_microbatches)]
                auxes = [merged[1][i] for i in range(self.num_microbatches)]
        if self.holds_last and all(loss is not None for loss in losses):
            if one_weight and all(loss.dtype == losses[0].dtype for loss in losses):
                loss = torch.stack(losses).mul_(weight[0])  # NOTE [the step's loss] in fpipe/_run.py
            else:
                loss = torch.stack([x * w for x, w in zip(losses, weight)])
            result = (loss.sum(), stack(auxes) if self.has_aux else None, None)
        loss, aux, _ = mail.result(result)
        return loss, aux, sums
