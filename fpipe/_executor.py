"""The executor: an interpreter that runs a program's actions against stages and a transport.

One loop, one dispatch on the action kind. Where a stage's input comes from and where its output
goes is the transport's business: the local transport is a mailbox in this process, the
distributed one sends over torch.distributed. The executor knows nothing of any schedule.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ._accumulate import Grads
from ._errors import PipelineError
from ._pairs import SideFailed, current_side, run_pair
from ._pytree import PyTree
from ._random import Keys
from ._record import Stopwatch
from ._stage import Pullback, StageRun
from .schedules import Action, Simulation
from .schedules._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD


class Transport(Protocol):
    """Moves activations forward (stage ``s`` to ``s+1``) and cotangents back (``s`` to ``s-1``),
    and hands out microbatches to the first and last stages."""

    def microbatch(self, microbatch: int) -> PyTree: ...

    def send_activation(self, stage: int, microbatch: int, value: PyTree) -> None: ...

    def recv_activation(self, stage: int, microbatch: int) -> PyTree: ...

    def send_cotangent(self, stage: int, microbatch: int, value: Grads) -> None: ...

    def recv_cotangent(self, stage: int, microbatch: int) -> Grads: ...


class Stages(Protocol):
    """The stages an executor runs, by stage index (a mapping, or a ``HeldStages``)."""

    def __getitem__(self, stage: int, /) -> StageRun: ...


class LocalTransport:
    """All stages in one process: a send is a dictionary entry that the matching receive pops."""

    def __init__(self, microbatches: Sequence[PyTree]) -> None:
        self._microbatches = microbatches
        self._activations: dict[tuple[int, int], PyTree] = {}
        self._cotangents: dict[tuple[int, int], Grads] = {}

    def microbatch(self, microbatch: int) -> PyTree:
        return self._microbatches[microbatch]

    def send_activation(self, stage: int, microbatch: int, value: PyTree) -> None:
        self._activations[stage + 1, microbatch] = value

    def recv_activation(self, stage: int, microbatch: int) -> PyTree:
        return self._activations.pop((stage, microbatch))

    def send_cotangent(self, stage: int, microbatch: int, value: Grads) -> None:
        self._cotangents[stage - 1, microbatch] = value

    def recv_cotangent(self, stage: int, microbatch: int) -> Grads:
        return self._cotangents.pop((stage, microbatch))

    # -- a run's side (``RunTransport`` in fpipe/_run.py): no one else to wait for or tell --------

    def running(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def exchange_result(self, result: PyTree) -> PyTree:
        return result

    def share_grads(self, grads: dict[int, PyTree]) -> dict[int, list[PyTree]]:
        return {s: [tree] for s, tree in grads.items()}

    def gather_losses(self, losses: tuple[dict[int, Any], ...]) -> tuple[dict[int, Any], ...]:
        return losses

    def close(self) -> None:
        pass

    def abort(self, error: BaseException, action: Action | None) -> None:
        pass

    def gather_timeline(self, timeline: Simulation) -> Simulation:
        return timeline


class Executor:
    """Runs actions for the stages this process holds; collects losses and aux of the last stage."""

    def __init__(
        self,
        stages: Stages,
        num_stages: int,
        loss_fn: Callable[[Any, Any], Any],
        *,
        has_aux: bool,
        weights: Sequence[float],
        transport: Transport,
        loss_scale: float | None = None,
        forward_only: bool = False,
        keep_outputs: bool = False,
        keys: Keys | None = None,
        pairs: Mapping[Action, Action] | None = None,
    ) -> None:
        self.stages = stages
        self.last = num_stages - 1
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self.weights = weights
        self.transport = transport
        self.loss_scale = loss_scale  # the backward's seed is scaled by it (fpipe.LossScale)
        self.losses: dict[int, torch.Tensor] = {}
        self.auxes: dict[int, Any] = {}
        self.forward_only = forward_only  # evaluation: no graph recorded, no pullback kept
        self.keep_outputs = keep_outputs
        self.keys = keys  # seeds the generators for each stage call (NOTE [randomness as data])
        self.outputs: dict[int, Any] = {}  # the last stage's outputs, with keep_outputs
        self._pullbacks: dict[tuple[int, int], Pullback] = {}
        self._one_weight = len(set(weights)) == 1
        self._seeds: Sequence[torch.Tensor] | None = None  # with one weight for all (``_seed``)
        self._watch: Stopwatch | None = None  # while recording (``fpipe.record``)
        self._ready: Any = 0.0  # when the current action's inputs had arrived (a ``Stopwatch`` mark)
        self.current: Action | None = None  # the action running, or that raised
        self.pairs = pairs or {}  # overlapped pairs: first half -> second (NOTE [overlapped pairs])
        self._warned = False  # a pair ran in sequence (``_pair``): said once per run

    def run(
        self,
        order: Sequence[tuple[int, Action]],
        *,
        times: list[tuple[Any, Any]] | None = None,
        watch: Stopwatch | None = None,
    ) -> None:
        """Interpret ``(rank, action)`` pairs in order; failures become ``PipelineError``.

        With ``times`` and ``watch``, each action's start (once its inputs have arrived: waiting
        for a peer is idle time, as in a simulation) and end (``watch``'s marks) are appended to it.
        Under ``torch.profiler`` each action runs in a ``record_function`` range named
        ``fpipe 1F3``; when no profiler is active as the run starts, no range is opened (NOTE
        [profiler ranges]).
        """
        handlers = _HANDLERS
        watch = self._watch = watch if times is not None else None
        profiling = _profiling()  # once per run (NOTE [profiler ranges])
        plain = watch is None and not profiling  # the usual case: nothing around the actions
        rank, action = -1, None
        pairs, second = self.pairs, None
        try:
            for rank, action in order:  # ``rank``, ``action``: the failing one's, below
                if action == second:  # ran with its pair's first half
                    continue
                self.current = action
                second = pairs.get(action) if pairs else None
                if second is not None:
                    self._pair(rank, action, second, times, profiling)
                elif plain:
                    handlers[action.kind](self, action)
                else:
                    self._instrumented(handlers[action.kind], action, times, profiling)
        except SideFailed as failed:
            assert action is not None and second is not None
            cause = failed.__cause__ or failed
            if isinstance(cause, PipelineError):
                raise cause from None
            side = (action, second)[failed.side]
            self.current = side
            in_loss_fn = isinstance(cause, _LossFnFailed)
            cause = (cause.__cause__ or cause) if in_loss_fn else cause
            raise PipelineError.from_exception(rank, side, cause, in_loss_fn=in_loss_fn) from cause
        except PipelineError:
            raise
        except _LossFnFailed as error:
            assert action is not None
            cause = error.__cause__ or error
            raise PipelineError.from_exception(rank, action, cause, in_loss_fn=True) from cause
        except Exception as error:
            assert action is not None
            raise PipelineError.from_exception(rank, action, error) from error
        self.current = None

    def _instrumented(
        self, handler: Handler, action: Action, times: list[tuple[Any, Any]] | None, profiling: bool
    ) -> None:
        """Run ``handler(self, action)`` timed (while recording) and in a profiler range (while profiling)."""
        watch = self._watch
        if watch is not None:
            self._ready = watch.mark()
        if profiling:
            with torch.profiler.record_function(f"fpipe {action}"):
                handler(self, action)
        else:
            handler(self, action)
        if watch is not None and times is not None:
            times.append((self._ready, watch.mark()))

    def _pair(
        self, rank: int, first: Action, second: Action, times: list[tuple[Any, Any]] | None, profiling: bool
    ) -> None:
        """Run an overlapped pair (NOTE [overlapped pairs] in fpipe/_pairs.py): its halves
        interleaved at their stages' communication points; in sequence, with a warning, when
        neither has any. Recorded and profiled as one span, given to both halves."""
        handlers = _HANDLERS
        transport = self.transport
        in_order = self.transport = SendsInOrder(transport)

        def first_half() -> None:
            handlers[first.kind](self, first)
            in_order.first_done = True

        def both() -> tuple[int, int]:
            try:
                points = run_pair(first_half, lambda: handlers[second.kind](self, second))
            finally:
                self.transport = transport
            in_order.release()
            return points

        watch = self._watch
        if watch is not None:
            self._ready = watch.mark()
        if profiling:
            with torch.profiler.record_function(f"fpipe {first}&{second}"):
                points = both()
        else:
            points = both()
        if watch is not None and times is not None:
            span = (self._ready, watch.mark())
            times += [span, span]
        if points == (0, 0) and not self._warned:
            self._warned = True
            warnings.warn(
                f"fpipe: the overlapped pair {first}&{second} on rank {rank} ran in sequence: its stages have no "
                "communication points (fpipe.communication_point; fpipe.moe's dispatch and combine have them), so "
                "nothing could overlap. Pairs with such points still overlap.",
                stacklevel=2,
            )

    def _loss_fn(self, y: Any, microbatch: Any) -> Any:
        """``loss_fn``, its errors marked as its own (not the last stage's)."""
        try:
            return self.loss_fn(y, microbatch)
        except Exception as error:
            raise _LossFnFailed from error

    def _arrived(self) -> None:
        """The current action's inputs are here (while recording): its start, for ``times``."""
        assert self._watch is not None
        self._ready = self._watch.mark()

    def _forward(self, action: Action) -> None:
        s, _, i = action
        stage = self.stages[s]
        x = self.transport.microbatch(i) if s == 0 else self.transport.recv_activation(s, i)
        microbatch = self.transport.microbatch(i) if s == self.last and s > 0 else x  # for loss_fn
        if self._watch is not None:
            self._arrived()
        if self.keys is not None:
            self.keys.enter(s, i, stage.device)
            if self.keys.counted:
                with self.keys.counting(s, i):
                    return self._call(s, i, stage, x, microbatch)
        self._call(s, i, stage, x, microbatch)

    def _call(self, s: int, i: int, stage: StageRun, x: PyTree, microbatch: PyTree) -> None:
        """Stage ``s``'s forward on microbatch ``i``'s ``x`` (and ``loss_fn``'s on ``microbatch``)."""
        if self.forward_only:
            if s == self.last:
                loss, aux, y = stage.evaluate_loss(x, microbatch, self._loss_fn, has_aux=self.has_aux)
                self.losses[i], self.auxes[i] = loss, aux
                if self.keep_outputs:
                    self.outputs[i] = y
            else:
                self.transport.send_activation(s, i, stage.evaluate(x))
            return
        if s == self.last:
            loss, aux, pullback = stage.forward_loss(
                x, microbatch, self._loss_fn, has_aux=self.has_aux, differentiate_input=s > 0
            )
            self.losses[i] = loss
            self.auxes[i] = aux
        else:
            y, pullback = stage.forward(x, differentiate_input=s > 0)
            self.transport.send_activation(s, i, y)
        self._pullbacks[s, i] = pullback

    def _output_cotangents(self, s: int, i: int) -> Grads:
        if s == self.last:
            return [self._seed(i)]
        return self.transport.recv_cotangent(s, i)

    def _seed(self, i: int) -> torch.Tensor:
        """Microbatch ``i``'s backward seed: its loss weight (times the loss scale), in the loss's
        dtype and on its device; each microbatch gets a tensor of its own (NOTE [seeds])."""
        loss = self.losses[i]
        seed = self.weights[i] if self.loss_scale is None else self.weights[i] * self.loss_scale
        wide = abs(seed) > _largest(loss.dtype)  # made in float64, the cast overflows to inf (NOTE [seeds])
        dtype = torch.float64 if wide else loss.dtype
        seeds = self._seeds
        if seeds is None and self._one_weight:
            made = torch.full((len(self.weights),), seed, dtype=dtype, device=loss.device)
            seeds = self._seeds = (made.to(loss.dtype) if wide else made).unbind()
        if seeds is not None and seeds[i].dtype == loss.dtype and seeds[i].device == loss.device:
            return seeds[i]
        made = loss.new_full((), seed, dtype=dtype)
        return made.to(loss.dtype) if wide else made

    def _backward(self, action: Action) -> None:
        s, _, i = action
        cotangents = self._output_cotangents(s, i)
        if self._watch is not None:
            self._arrived()
        with self._replays(s, i):
            input_cotangents = self.stages[s].backward(self._pullbacks.pop((s, i)), cotangents, i)
        if s > 0:
            self.transport.send_cotangent(s, i, input_cotangents)

    def _backward_input(self, action: Action) -> None:
        s, _, i = action
        cotangents = self._output_cotangents(s, i)
        if self._watch is not None:
            self._arrived()
        with self._replays(s, i):
            input_cotangents = self.stages[s].backward_input(self._pullbacks[s, i], cotangents)
        if s > 0:
            self.transport.send_cotangent(s, i, input_cotangents)

    def _replays(self, s: int, i: int) -> contextlib.AbstractContextManager[object]:
        """Around a backward that may replay stage ``s``'s forward on microbatch ``i`` (NOTE
        [recomputation] in fpipe/_stage.py): the draws as that forward had them."""
        stage = self.stages[s]
        if self.keys is not None and stage.recompute:
            self.keys.enter(s, i, stage.device)
            if self.keys.counted:
                return self.keys.counting(s, i)
        return contextlib.nullcontext()

    def _backward_weight(self, action: Action) -> None:
        s, _, i = action
        self.stages[s].backward_weight(self._pullbacks.pop((s, i)), i)


class SendsInOrder:
    """The transport while a pair runs: the second half's sends wait for the first half's end,
    so that each peer gets this rank's messages in the program's order (the distributed
    transport checks it), whichever half ends first; receives happen at each half's start, in
    that order already. A pair's second half never reads the microbatch (``validate_pairs``:
    stage 0's forward, which may send it on, is never a second half)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.first_done = False
        self._held: list[tuple[Callable[[int, int, Any], None], int, int, Any]] = []

    def microbatch(self, microbatch: int) -> PyTree:
        return self.inner.microbatch(microbatch)

    def recv_activation(self, stage: int, microbatch: int) -> PyTree:
        return self.inner.recv_activation(stage, microbatch)

    def recv_cotangent(self, stage: int, microbatch: int) -> Grads:
        return self.inner.recv_cotangent(stage, microbatch)

    def send_activation(self, stage: int, microbatch: int, value: PyTree) -> None:
        self._send(self.inner.send_activation, stage, microbatch, value)

    def send_cotangent(self, stage: int, microbatch: int, value: Grads) -> None:
        self._send(self.inner.send_cotangent, stage, microbatch, value)

    def _send(self, send: Callable[[int, int, Any], None], stage: int, microbatch: int, value: Any) -> None:
        if current_side() == 1 and not self.first_done:
            self._held.append((send, stage, microbatch, value))
        else:
            send(stage, microbatch, value)

    def release(self) -> None:
        """Send what the second half held, in order (after the pair)."""
        held, self._held = self._held, []
        for send, stage, microbatch, value in held:
            send(stage, microbatch, value)


Handler = Callable[[Executor, Action], None]

# The executor's method for each kind of action, made once: functions of the class, called with
# the executor (bound methods kept on it would make a reference cycle that keeps the executor,
# its stages and their gradients alive until the next garbage collection).
_HANDLERS: dict[str, Handler] = {
    FORWARD: Executor._forward,
    BACKWARD: Executor._backward,
    BACKWARD_INPUT: Executor._backward_input,
    BACKWARD_WEIGHT: Executor._backward_weight,
}


# NOTE [seeds]
# With one weight for all microbatches, the backward seeds are made by one ``torch.full`` and
# ``unbind`` (one op each instead of one per microbatch); each microbatch gets its own element,
# used once. No gradient sum ever shares their storage (NOTE [gradients the engine keeps] in
# fpipe/_accumulate.py). A loss of another dtype or device than the first gets a ``new_full``.
#
# A seed too large for the loss's dtype (float16 tops out at 65504: ``scale * weight`` with the
# loss scale 2**16 and one microbatch) must become inf, as a cast does: the gradients are then
# inf/nan, every rank agrees to skip the step and the scale backs off (fpipe.LossScale). Filling
# a float16 tensor of two or more elements with such a number raises instead ("value cannot be
# converted to type c10::Half without overflow"; one element, or ``new_full`` into float16,
# gives inf; float32 raises both ways). So a seed that does not fit (``_largest``, one
# comparison) is filled in float64 and cast down: the cast overflows to inf (or rounds to the
# largest finite value, for one within half a unit of it). A seed that fits is made by the plain
# fill, so its results are bitwise those of that fill.


# NOTE [profiler ranges]
# A ``record_function`` range costs microseconds to open and close even with no profiler running
# (it builds a RecordFunction through the dispatcher), a large share of an action's whole
# overhead on a tiny stage, while ``torch._C._autograd._profiler_enabled`` answers in tens of
# nanoseconds. So ranges are opened only when some profiler (``torch.profiler.profile``, the
# legacy ``torch.autograd.profiler.profile``, kineto's) is collecting (the figures:
# notes/design.md, "Per-action overhead").
# It is asked once per ``Executor.run`` (a piece of a step's order), not per action: a profiler
# is started and stopped around steps, not by a stage in the middle of one.
_profiling: Callable[[], bool] = torch._C._autograd._profiler_enabled


@functools.cache
def _largest(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype``, a loss's: real floating (``_split_aux`` in fpipe/_stage.py)."""
    return torch.finfo(dtype).max


class _LossFnFailed(Exception):
    """``loss_fn`` raised (the error is the ``__cause__``)."""
