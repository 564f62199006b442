"""The compiled step: a process's whole program traced by dynamo into one graph (``pipeline(..., compile=)``).

NOTE [the compiled step]
``pipeline(..., compile=backend)`` runs each call of the step in three parts::

    eager prologue   the checks, the split into microbatches, the loss weights and the seeds (as
                     float64 tensors: a new token count or loss scale is no new compile)
    traced core      ``Core.__call__`` (fpipe/_traced.py) on the parameters and microbatches:
                     every action of the order, the loss and the stacked aux, traced by dynamo
                     with ``fullgraph=True`` into one graph per process
    eager epilogue   the gradients shaped like the parameters

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

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config

from ._plural import brief
from ._pytree import PyTree, broadcast_prefix, flatten
from ._random import COUNTED, Keys
from ._record import active
from ._run import Order, StepView, StrategyView, loss_weights, run_local, seed_scale, split_batch
from ._traced import Core, begin, end, first_draw, grads_like, own_code, traced, tracing

Backend = str | Callable[..., Any]
# ``fpipe.record()`` times each action, which a graph does not have: a step recorded runs eagerly.
RECORDING = "fpipe.record() times each action, and one graph has none to time"


@dataclass(frozen=True)
class Compile:
    """How ``pipeline(..., compile=fpipe.Compile(...))`` compiles the step's program (NOTE [the
    compiled step]); ``compile=True`` is ``Compile()``, ``compile="aot_eager"`` is
    ``Compile("aot_eager")``.

    Attributes:
        backend: a backend name ``torch.compile`` knows, or a backend callable.
        mode: Inductor's mode (``torch._inductor.list_mode_options()``: ``"reduce-overhead"``
            captures CUDA graphs on a GPU, unrun here; on a CPU Inductor skips them), or ``None``.

    Example:
        >>> fpipe.Compile(mode="reduce-overhead")
        Compile(backend='inductor', mode='reduce-overhead')
        >>> step = fpipe.pipeline(
        ...     lambda y, mb: (y**2).mean(), [lambda p, x: x @ p], fpipe.schedules.OneFOneB(2),
        ...     compile=fpipe.Compile("aot_eager"),
        ... )
        >>> loss, grads = step([torch.eye(2)], torch.ones(4, 2))
        >>> loss
        tensor(1.)
    """

    backend: Backend = "inductor"
    mode: str | None = None


def compile_option(compile: object, unsupported: Sequence[str]) -> Compile | None:
    """``pipeline``'s ``compile`` argument checked: ``None`` for an eager step. ``unsupported``:
    what the distributed step has that a compiled row cannot run (``["nothing"]``: a plain pipeline
    over a group; ``[]``: one process).

    Raises:
        TypeError: if it is not a bool, a backend name, a backend callable or a ``Compile``.
        ValueError: if the backend name is not one ``torch.compile`` knows, or a mode not Inductor's.
        NotImplementedError: for a distributed step with anything but pipeline ranks.
    """
    if compile is False or compile is None:
        return None
    option = compile if isinstance(compile, Compile) else None
    backend: object = option.backend if option is not None else "inductor" if compile is True else compile
    if isinstance(backend, str):
        try:
            torch._dynamo.lookup_backend(backend)
        except Exception:
            raise ValueError(
                f"fpipe.pipeline: compile names no backend torch.compile knows (backend: {backend!r}). "
                f"Pass True (Inductor) or one of {sorted(torch._dynamo.list_backends(exclude_tags=()))}."
            ) from None
    elif not callable(backend) or isinstance(backend, bool):
        raise TypeError(
            f"fpipe.pipeline: compile must be True, False, a backend name, a backend callable or an "
            f"fpipe.Compile (compile: {brief(compile)}). Pass e.g. compile=True or compile='aot_eager'."
        )
    mode = None if option is None else option.mode
    if mode is not None:
        modes = sorted(torch._inductor.list_mode_options())
        if backend != "inductor" or mode not in modes:
            raise ValueError(
                f"fpipe.pipeline: fpipe.Compile's mode is one of Inductor's (mode: {mode!r}, backend: "
                f"{_name(backend)}). Pass backend='inductor' and a mode of {modes}, or mode=None."
            )
    if unsupported and list(unsupported) != ["nothing"]:
        raise NotImplementedError(
            f"fpipe.pipeline: compile= compiles one process's step or a pipeline rank's row, not yet a step "
            f"with {' or '.join(unsupported)} (notes/compile.md). Drop compile=, or compile the stage functions."
        )
    return Compile(backend, mode)  # type: ignore[arg-type]


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
        if active() is not None:
            self.warn(RECORDING)
            return eager()
        if self._failed is not None:
            self.warn(self._failed)
            return eager()
        strategy.check(step, params)
        microbatches, sizes, count = split_batch(step, batch)
        _mark_batch_dims(microbatches, step.batch_dims)
        if self._core is None:
            self._core = self.compile_core(step, order)[1]
        random_seeds = Keys(key).seeds(step.num_stages, order.program.num_microbatches)
        out = self.attempt(self._core, step, order, params, microbatches, loss_weights(sizes, count), random_seeds)
        return eager() if out is None else out

    def compile_core(
        self, step: StepView, order: Order, *, dynamic: bool | None = None
    ) -> tuple[Core, Callable[..., Any]]:
        """A core for ``order`` and its compiled form (``torch.compile`` with this run's backend,
        ``fullgraph=True``); the core's ``mail`` may be set before each call."""
        core = Core(step, order)
        return core, torch.compile(own_code(core), backend=self._backend, fullgraph=True, dynamic=dynamic)

    def warn(self, reason: str) -> None:
        """Say that the step runs eagerly, and why."""
        _warn(reason)

    def fail(self, reason: str) -> None:
        """Run eagerly from now on, for ``reason`` (the first one given stands)."""
        if self._failed is None:
            self._failed = reason

    def attempt(
        self,
        core: Callable[..., Any],
        step: StepView,
        order: Order,
        params: Sequence[PyTree],
        microbatches: list[PyTree] | None,
        weights: Sequence[float],
        random_seeds: torch.Tensor,
        agree: Callable[[bool], bool] | None = None,
        shapes: Sequence[torch.Tensor] = (),
    ) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]] | None:
        """``((loss, aux, None), grads)`` from the compiled ``core``, or ``None`` (with a warning,
        the step then eager for good) when it did not trace or compile. ``random_seeds``: each
        stage call's (``Keys.seeds``; NOTE [counted draws] in fpipe/_random.py); ``shapes``: the
        shapes of the tensors a pipeline rank receives (its mail's, NOTE [compiled rows]).

        ``agree`` (a pipeline rank's): called with whether this rank compiled its row, once it
        traced one in this call, before the graph runs; it says whether every rank did (NOTE
        [compiled rows] in fpipe/_distributed/_compiled.py). A failure once the ranks agreed, or
        of a graph compiled before, is the step's and raises.
        """
        begin()
        self._agree, self._agreed = agree, None
        try:
            # The graph is recorded whatever the ambient grad mode (NOTE [differentiable leaves]); a
            # dimension of size 1 (a microbatch of one example) is not a case of its own (``_mark_batch_dims``).
            with (
                torch._dynamo.config.patch(trace_autograd_ops=True),
                fx_config.patch(  # type: ignore[attr-defined]
                    backed_size_oblivious=True,
                    use_duck_shape=agree is None,  # (NOTE [compiled rows], point 1)
                ),
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
                    random_seeds,
                    len(set(weights)) == 1,
                    list(shapes),
                )
        except Exception as error:  # dynamo's, the backend's, or the stages' own (which the eager step raises)
            if agree is not None:
                limit = isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit)  # (on every rank alike)
                if self._agreed or not (traced() or limit):
                    raise  # the graph ran: its failure is the step's
                if self._agreed is None and not limit:
                    agree(False)
            reason = self._reason(order, error)
            _warn(reason)
            self._failed = reason  # the data was fine: what failed was tracing or compiling
            return None
        finally:
            end()
            self._agree = None
        return (loss, aux, None), grads_like(params, sums)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The user's backend, unless the program draws random numbers (NOTE [random draws under compile])."""
        draw = first_draw()
        if draw is not None:
            raise _RandomDraws(*draw)
        backend, mode = self.option.backend, self.option.mode
        compiler: Callable[..., Any] = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        if mode is not None:  # (Inductor's: ``compile_option``) its mode's configuration, as torch.compile sets it
            compiler = functools.partial(compiler, config_patches=torch._inductor.list_mode_options(mode))
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
                f"({cause.op}) that a graph does not count from the key, stage and microbatch (counted: "
                f"{', '.join(sorted(COUNTED))})"
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
        k = tracing()
        if k is None:
            return f"dynamo could not compile the step ({what})"
        action = order.actions[k][1]
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


def _warn(reason: str) -> None:
    warnings.warn(f"fpipe.step: compile: {reason}; this step runs eagerly.", UserWarning, stacklevel=4)


def _name(backend: Backend) -> str:
    return repr(backend) if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


class _Refused(Exception):
    """Another pipeline rank could not compile its row (NOTE [compiled rows])."""


class _RandomDraws(Exception):
    """The traced program draws random numbers (NOTE [random draws under compile]): ``action`` does."""

    def __init__(self, action: int, op: str) -> None:
        super().__init__(f"action {action} draws random numbers ({op})")
        self.action, self.op = action, op
