"""The compiled step: a process's whole program traced by dynamo into one graph (``pipeline(..., compile=)``).

NOTE [the compiled step]
``pipeline(..., compile=backend)`` runs each call of the step in three parts::

    eager prologue   the checks, the split into microbatches, the loss weights and the seeds (as
                     float64 tensors: a new token count or loss scale is no new compile)
    traced core      ``_Core.__call__`` on the parameters and microbatches: every action of the
                     order, traced by dynamo with ``fullgraph=True`` into one graph per process
    eager epilogue   the aux stacked, the gradients shaped like the parameters

What must hold: the core does the eager step's arithmetic op for op, so that under the
``aot_eager`` backend it gives the eager bits. A backward is ``autograd.grad`` on the stage's own
leaves; gradients are summed in microbatch order by a copy and in-place adds (NOTE [fixed
accumulation order]); cotangents are made contiguous (NOTE [boundary layout]); the loss is NOTE
[the step's loss]'s. A split backward's ``I`` computes the input and the weight gradients at once
and ``W`` only adds the weight part in order: ``autograd.grad`` on gradient edges (NOTE [split
backward]) does not trace, and inside one graph when ``W`` runs is the compiler's choice anyway.
Nothing runs eagerly without a word: what fails to trace or compile warns, naming the action
dynamo was tracing or the backend, and the eager step runs (notes/compile.md: what breaks the graph).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.comptime import ComptimeContext, comptime

from ._microbatch import stack
from ._plural import brief
from ._pytree import PyTree, broadcast_prefix, flatten, is_differentiable, unflatten
from ._run import Order, StepView, StrategyView, loss_weights, run_local, seed_scale, split_batch
from ._stage import StageFn
from .schedules import Action
from .schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

Backend = str | Callable[..., Any]


@dataclass(frozen=True)
class Compile:
    """What ``pipeline(..., compile=...)`` asked for: the backend the core is compiled with."""

    backend: Backend


def compile_option(compile: object, unsupported: Sequence[str]) -> Compile | None:
    """``pipeline``'s ``compile`` argument checked: ``None`` for an eager step. ``unsupported``:
    what the distributed step has that a compiled row cannot run (``["nothing"]``: a plain pipeline
    over a group; ``[]``: one process).

    Raises:
        TypeError: if it is not a bool, a backend name or a backend callable.
        ValueError: if the backend name is not one ``torch.compile`` knows.
        NotImplementedError: for a distributed step with anything but pipeline ranks.
    """
    if compile is False or compile is None:
        return None
    backend: Backend
    if compile is True:
        backend = "inductor"
    elif isinstance(compile, str):
        try:
            torch._dynamo.lookup_backend(compile)
        except Exception:
            raise ValueError(
                f"fpipe.pipeline: compile names no backend torch.compile knows (compile: {compile!r}). "
                f"Pass True (Inductor) or one of {sorted(torch._dynamo.list_backends(exclude_tags=()))}."
            ) from None
        backend = compile
    elif callable(compile) and not isinstance(compile, bool):
        backend = compile
    else:
        raise TypeError(
            f"fpipe.pipeline: compile must be True, False, a backend name or a backend callable "
            f"(compile: {brief(compile)}). Pass e.g. compile=True or compile='aot_eager'."
        )
    if unsupported and list(unsupported) != ["nothing"]:
        raise NotImplementedError(
            f"fpipe.pipeline: compile= compiles one process's step or a pipeline rank's row, not yet a step "
            f"with {' or '.join(unsupported)} (notes/compile.md). Drop compile=, or compile the stage functions."
        )
    return Compile(backend)


class CompiledRun:
    """A step's compiled runs: ``run_local``'s signature, the whole order traced (NOTE [the compiled step]).

    One core per step, compiled by dynamo once per structure of the parameters and the
    microbatches, shapes and dtypes (its guards; a changed length once more, with a dynamic
    dimension). Once the core failed to trace or compile, the step stays eager and warns on
    every call.
    """

    def __init__(self, option: Compile) -> None:
        self.option = option
        self._core: Callable[..., Any] | None = None
        self._failed: str | None = None  # why the core did not compile, once it did not
        self._agree: Callable[[bool], bool] | None = None  # this call's, distributed (``attempt``)
        self._agreed: bool | None = None  # what the ranks agreed on in this call, if they did

    @property
    def failed(self) -> str | None:
        """Why the step runs eagerly, once its core failed to trace or compile."""
        return self._failed

    def __call__(
        self,
        step: StepView,
        order: Order,
        strategy: StrategyView,
        params: Sequence[PyTree],
        batch: PyTree,
        *,
        key: int,
        keep_outputs: bool = False,
    ) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]]:
        def eager() -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]]:
            return run_local(step, order, strategy, params, batch, key=key, keep_outputs=keep_outputs)

        if order.forward_only or keep_outputs:  # evaluate: no backward to gain from, eager
            return eager()
        if self._failed is not None:
            self.warn(self._failed)
            return eager()
        strategy.check(step, params)
        microbatches, sizes, count = split_batch(step, batch)
        _mark_batch_dims(microbatches, step.batch_dims)
        if self._core is None:
            self._core = self.compile_core(step, order)[1]
        out = self.attempt(self._core, step, order, params, microbatches, loss_weights(sizes, count))
        return eager() if out is None else out

    def compile_core(
        self, step: StepView, order: Order, *, dynamic: bool | None = None
    ) -> tuple[_Core, Callable[..., Any]]:
        """A core for ``order`` and its compiled form (``torch.compile`` with this run's backend,
        ``fullgraph=True``); the core's ``mail`` may be set before each call."""
        core = _Core(step, order)
        return core, torch.compile(_own_code(core), backend=self._backend, fullgraph=True, dynamic=dynamic)

    def warn(self, reason: str) -> None:
        """Say that the step runs eagerly, and why."""
        _warn(reason)

    def attempt(
        self,
        core: Callable[..., Any],
        step: StepView,
        order: Order,
        params: Sequence[PyTree],
        microbatches: list[PyTree] | None,
        weights: Sequence[float],
        agree: Callable[[bool], bool] | None = None,
    ) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]] | None:
        """``((loss, aux, None), grads)`` from the compiled ``core``, or ``None`` (with a warning,
        the step then eager for good) when it did not trace or compile.

        ``agree`` (a pipeline rank's): called with whether this rank compiled its row, once it
        traced one in this call, before the graph runs; it says whether every rank did (NOTE
        [compiled rows] in fpipe/_distributed/_compiled.py). A failure once the ranks agreed, or
        of a graph compiled before, is the step's and raises.
        """
        _TRACING[0] = None
        _TRACED[0] = False
        _SEEN.clear()
        _DRAWS.clear()
        self._agree, self._agreed = agree, None
        try:
            # The graph is recorded whatever the ambient grad mode (NOTE [differentiable leaves]); a
            # dimension of size 1 (a microbatch of one example) is not a case of its own (``_mark_batch_dims``).
            with (
                torch._dynamo.config.patch(trace_autograd_ops=True),
                fx_config.patch(backed_size_oblivious=True),  # type: ignore[attr-defined]
                inductor_config.patch(  # NOTE [compiled rows]
                    allow_buffer_reuse=agree is None, reorder_for_peak_memory=agree is None
                ),
                torch.enable_grad(),
            ):
                scale = seed_scale(step)  # the weights scaled in Python, as the eager seeds are (NOTE [seeds])
                scaled = weights if scale is None else [w * scale for w in weights]
                loss, aux, sums = core(
                    params,
                    microbatches,
                    torch.tensor(weights, dtype=torch.float64),
                    torch.tensor(scaled, dtype=torch.float64),
                    len(set(weights)) == 1,
                )
        except Exception as error:  # dynamo's, the backend's, or the stages' own (which the eager step raises)
            if agree is not None:
                limit = isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit)  # (on every rank alike)
                if self._agreed or not (_TRACED[0] or limit):
                    raise  # the graph ran: its failure is the step's
                if self._agreed is None and not limit:
                    agree(False)
            reason = self._reason(order, error)
            _warn(reason)
            self._failed = reason  # the data was fine: what failed was tracing or compiling
            return None
        finally:
            _SEEN.clear()  # (the traced graph's nodes)
            self._agree = None
        return (loss, aux, None), _grads(params, sums)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The user's backend, unless the program draws random numbers (NOTE [random draws under compile])."""
        if _DRAWS:
            raise _RandomDraws(*_DRAWS[0])
        backend = self.option.backend
        compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        compiled = compiler(graph, example_inputs)
        if self._agree is not None:
            self._agreed = self._agree(True)
            if not self._agreed:
                raise _Refused()
        return compiled

    def _reason(self, order: Order, error: Exception) -> str:
        """Why the core did not compile, naming the action dynamo was tracing if it was."""
        first = str(error).strip().splitlines()
        what = f"{type(error).__name__}: {first[0] if first else ''}"
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, (_RandomDraws, _Refused)):
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        if isinstance(cause, _Refused):
            return "another pipeline rank could not compile its row (its own warning says why)"
        if isinstance(cause, _RandomDraws):
            action = order.actions[cause.action][1]
            return (
                f"action {action} (stage {action.stage}, microbatch {action.microbatch}) draws random numbers "
                f"({cause.op}), which are not yet a function of the key, stage and microbatch in a graph"
            )
        if isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit):
            return (
                f"dynamo reached its recompile limit for this step (torch._dynamo.config.recompile_limit: "
                f"{torch._dynamo.config.recompile_limit}) at a new structure, dtype or shape of the parameters or batch"
            )
        if isinstance(error, torch._dynamo.exc.BackendCompilerFailed):
            inner = error.inner_exception
            lines = str(inner).strip().splitlines()
            what = f"{type(inner).__name__}: {lines[0] if lines else ''}"
            return f"the backend {_name(self.option.backend)} failed to compile the step ({what})"
        traced = _TRACING[0]
        if traced is None:
            return f"dynamo could not compile the step ({what})"
        action = order.actions[traced][1]
        return (
            f"action {action} (stage {action.stage}, microbatch {action.microbatch}) cannot be traced into "
            f"one graph ({what})"
        )


def _mark_batch_dims(microbatches: Sequence[PyTree], batch_dims: PyTree) -> None:
    """Tell dynamo that each microbatch's examples dimension varies (``maybe_mark_dynamic``).

    A new batch size changes which microbatches share a size and which hold one example: without
    the hint each change made dynamo generalize one more input, and each pattern of microbatches
    of one example (sizes 0 and 1 are special to it unless ``backed_size_oblivious``) was one
    more graph: 6 graphs for 12 batch sizes of 4 microbatches, against 2 (tests/test_compile.py).
    """
    for microbatch in microbatches:
        leaves, _ = flatten(microbatch)
        one = batch_dims is None or type(batch_dims) is int
        dims = [batch_dims] * len(leaves) if one else broadcast_prefix(batch_dims, microbatch)
        for leaf, dim in zip(leaves, dims):
            if isinstance(leaf, torch.Tensor) and isinstance(dim, int) and leaf.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(leaf, dim % leaf.dim())


def _own_code(core: _Core) -> Callable[..., Any]:
    """``core.__call__`` with a code object of its own: dynamo caches graphs, and counts
    recompiles against its limit (``recompile_limit``, 8), per code object, so steps must not
    share one (the ninth step built in a process would fail to compile)."""
    code = _Core.__call__.__code__.replace()
    return types.MethodType(types.FunctionType(code, globals(), "__call__"), core)


def _warn(reason: str) -> None:
    warnings.warn(f"fpipe.step: compile: {reason}; this step runs eagerly.", UserWarning, stacklevel=4)


def _name(backend: Backend) -> str:
    return repr(backend) if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


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
# from the caller's generator in the compiler's order, and Inductor draws numbers of its own. Until
# draws are counter-based functions of (key, stage, microbatch) in the graph, a traced program
# that draws is not run: the step warns, naming the action, and runs eagerly. The ops are those
# of dynamo's graph (torch functions and tensor methods by name); dropout counts when training.
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
    if name not in _RANDOM:
        return False
    if "dropout" in name:  # dropout(input, p, training, ...): not random when not training
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
        return training is not False
    return True


def _op(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


class _Refused(Exception):
    """Another pipeline rank could not compile its row (NOTE [compiled rows])."""


class _RandomDraws(Exception):
    """The traced program draws random numbers (NOTE [random draws under compile]): ``action`` does."""

    def __init__(self, action: int, op: str) -> None:
        super().__init__(f"action {action} draws random numbers ({op})")
        self.action, self.op = action, op


def _grads(params: Sequence[PyTree], sums: Sequence[Sequence[torch.Tensor | None]]) -> list[PyTree]:
    """Gradients shaped like ``params``: zeros where no microbatch reached a differentiable leaf,
    ``None`` for other leaves (as ``StageRun.grads``)."""
    out = []
    for p, total in zip(params, sums):
        leaves, spec = flatten(p)
        grads: list[Any] = [None] * len(leaves)
        for k, g in zip([k for k, x in enumerate(leaves) if is_differentiable(x)], total):
            grads[k] = torch.zeros_like(leaves[k]) if g is None else g
        out.append(unflatten(spec, grads))
    return out


def graph_outputs(y: PyTree) -> tuple[list[torch.Tensor], list[int]]:
    """The output leaves of ``y`` that carry the graph, and their positions among its leaves."""
    ys = flatten(y)[0]
    index = [n for n, t in enumerate(ys) if isinstance(t, torch.Tensor) and t.requires_grad]
    return [ys[n] for n in index], index


Key = tuple[str, int, int]  # ("act" | "cot" | "mb" | "result", stage, microbatch): a message


class Mail(Protocol):
    """Where a traced row's messages go (``_Core``): between the stages of one process, or, on a
    pipeline rank, to and from the other ranks inside the graph (fpipe/_distributed/_compiled.py)."""

    def put(self, key: Key, value: PyTree) -> None:
        """Hand over ``value`` (an activation, a cotangent, a microbatch for the last stage)."""
        ...

    def take(self, key: Key) -> PyTree:
        """The value handed over as ``key``."""
        ...

    def result(self, result: tuple[torch.Tensor, Any, Any] | None) -> tuple[torch.Tensor, Any, Any]:
        """The last stage's ``(loss, aux, outputs)`` (``None`` where it is held elsewhere), on every
        process; the row's messages all sent and received."""
        ...


class LocalMail:
    """Every stage in this process: values handed over in a dict."""

    def __init__(self) -> None:
        self.held: dict[Key, PyTree] = {}

    def put(self, key: Key, value: PyTree) -> None:
        if key[0] != "mb":  # (the last stage has the batch here)
            self.held[key] = value

    def take(self, key: Key) -> PyTree:
        return self.held.pop(key)

    def result(self, result: tuple[torch.Tensor, Any, Any] | None) -> tuple[torch.Tensor, Any, Any]:
        assert result is not None
        return result


class _Core:
    """The order's actions as one straight line for dynamo (NOTE [the compiled step])."""

    def __init__(self, step: StepView, order: Order) -> None:
        self.mail: Callable[[], Mail] = LocalMail
        self.num_microbatches = order.program.num_microbatches
        self.holds_last = step.num_stages - 1 in step.local_stages
        self.stages: tuple[StageFn, ...] = step.stages
        self.loss_fn = step.loss_fn
        self.has_aux = step.has_aux
        self.last = step.num_stages - 1
        self.actions: tuple[Action, ...] = tuple(a for _, a in order.actions)
        self.precision = step.precision
        self.recompute = step.recompute

    def __call__(
        self,
        params: list[PyTree],
        microbatches: list[PyTree] | None,
        weights: torch.Tensor,
        scaled: torch.Tensor,
        one_weight: bool,
    ) -> tuple[torch.Tensor, Any, list[list[torch.Tensor | None]]]:
        last, mail = self.last, self.mail()
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
            while added[s] in pending[s]:
                for n, g in enumerate(pending[s].pop(added[s])):
                    if g is not None:
                        total = sums[s][n]
                        sums[s][n] = g.to(dtypes[s][n], copy=True) if total is None else total.add_(g)
                added[s] += 1

        def forward(s: int, i: int, x: PyTree) -> tuple[Any, Any]:
            """Stage ``s`` on ``x``, and for the last stage ``loss_fn``: the output (the loss, a
            scalar) and the aux."""
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
        result = None
        if self.holds_last:
            if one_weight and all(loss.dtype == losses[0].dtype for loss in losses):
                loss = torch.stack(losses).mul_(weight[0])  # NOTE [the step's loss] in fpipe/_run.py
            else:
                loss = torch.stack([x * w for x, w in zip(losses, weight)])
            result = (loss.sum(), stack(auxes) if self.has_aux else None, None)
        loss, aux, _ = mail.result(result)
        return loss, aux, sums
