"""``fpipe.pipeline``: the transform from stage functions and a schedule to a step function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._executor import Executor, LocalTransport
from ._microbatch import split, stack
from ._pytree import PyTree
from ._stage import StageRun
from .schedules._action import Action
from .schedules._program import Program, Schedule, ScheduleError, execution_order, validate

StageFn = Callable[[Any, Any], Any]


def pipeline(
    loss_fn: Callable[[Any, Any], Any],
    stages: Sequence[StageFn],
    schedule: Schedule | Program | Sequence[Sequence[Action | str]],
    /,
    *,
    has_aux: bool = False,
    batch_dims: PyTree = 0,
) -> Step:
    """Turn stage functions and a schedule into ``step(params, batch) -> (loss, grads)``.

    Args:
        loss_fn: ``loss_fn(y, microbatch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), where
            ``y`` is the last stage's output and ``loss`` a real scalar tensor. For the step to
            equal the unsplit model, it should be a mean over the microbatch's examples.
        stages: callables ``stage(stage_params, x) -> y``. Stage 0 receives the microbatch,
            stage ``s > 0`` the output of stage ``s - 1``; ``x`` and ``y`` are any pytrees whose
            leaves may be tensors of any dtype or non-tensors. Stages must be pure: no
            in-place updates of their params or inputs.
        schedule: a schedule value (``GPipe(8)``, ``OneFOneB(8)``, ``Interleaved1F1B(8)``, ...),
            a ``Program``, or a hand-written program: one list of actions per rank, e.g.
            ``[["0F0", "0B0"], ["1F0", "1B0"]]``. The number of ranks (virtual in one process)
            is the program's: one stage per rank for GPipe and 1F1B, ``stages_per_rank`` for
            interleaved schedules.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the step then returns ``((loss, aux),
            grads)`` where ``aux`` gathers the microbatches' aux: tensor leaves stacked along a
            new leading dimension of size ``num_microbatches`` (like ``jax.lax.scan``), other
            leaves as a tuple with one entry per microbatch.
        batch_dims: where to split the batch: an int for every tensor leaf (default 0), or a
            prefix pytree of the batch with an int or ``None`` per subtree (``None``: pass the
            leaf whole to every microbatch, e.g. a RoPE table). Non-tensor leaves always pass
            whole.

    Returns:
        A ``Step``. ``step(params, batch)`` takes one parameter pytree per stage and returns
        ``(loss, grads)``: ``grads[s]`` has the structure of ``params[s]``, with the gradient of
        every floating or complex tensor leaf and ``None`` for other leaves.

    Conceptually, with microbatch sizes ``n_i`` summing to ``N``, a step computes::

        loss, grads = 0, zeros_like(params)
        for i, mb in enumerate(split(batch, num_microbatches, batch_dims)):
            loss_i, grads_i = torch.func.grad_and_value(
                lambda p: loss_fn(compose(stages)(p, mb), mb))(params)   # returns (grads, value)
            loss += n_i / N * loss_i
            grads += n_i / N * grads_i          # summed in microbatch order 0, 1, 2, ...

    but runs the stages' forwards and backwards in the order of the schedule, with explicit
    vector-Jacobian products. With a per-example mean loss this equals the full-batch loss and
    its gradient. User tensors are never mutated, ``.grad`` is never touched, and the result
    does not depend on the ambient grad mode.

    Example:
        >>> import torch, fpipe
        >>> from fpipe.schedules import OneFOneB
        >>> stages = [lambda p, x: x @ p, lambda p, x: torch.tanh(x @ p)]
        >>> loss_fn = lambda y, mb: ((y - mb) ** 2).mean()
        >>> step = fpipe.pipeline(loss_fn, stages, OneFOneB(num_microbatches=4))
        >>> params = [torch.randn(3, 3), torch.randn(3, 3)]
        >>> loss, grads = step(params, torch.randn(8, 3))
        >>> [g.shape for g in grads]
        [torch.Size([3, 3]), torch.Size([3, 3])]

    Raises:
        TypeError: if ``loss_fn`` or a stage is not callable.
        ScheduleError: if the schedule cannot run with ``len(stages)`` stages.
    """
    if not callable(loss_fn):
        raise TypeError(f"fpipe.pipeline: loss_fn must be callable (loss_fn: {loss_fn!r}).")
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(
            f"fpipe.pipeline: stages must be a non-empty list of callables stage(params, x) (stages: {stages!r})."
        )
    for s, fn in enumerate(stages):
        if not callable(fn):
            raise TypeError(f"fpipe.pipeline: stage {s} is not callable (stages[{s}]: {fn!r}).")
    program = _program(schedule, len(stages))
    validate(program)
    return Step(loss_fn, tuple(stages), program, has_aux=has_aux, batch_dims=batch_dims)


def _program(schedule: Schedule | Program | Sequence[Sequence[Action | str]], num_stages: int) -> Program:
    if isinstance(schedule, Program):
        program = schedule
    elif isinstance(schedule, Sequence):
        program = Program.from_lists(schedule, num_stages=num_stages)
    elif callable(getattr(schedule, "program", None)):
        program = schedule.program(num_stages)
    else:
        raise TypeError(
            f"fpipe.pipeline: schedule must be a schedule such as OneFOneB(num_microbatches=8), a Program, "
            f"or one list of actions per rank (schedule: {schedule!r})."
        )
    if program.num_stages != num_stages:
        raise ScheduleError(
            f"fpipe.pipeline: the schedule's program has {program.num_stages} stages but {num_stages} "
            "stage functions were given. Give one stage function per stage of the program."
        )
    return program


class Step:
    """The step function returned by ``fpipe.pipeline``: ``step(params, batch) -> (loss, grads)``.

    Attributes:
        program: the validated ``Program`` it runs.
        num_stages: the number of stages.
        num_microbatches: how many microbatches each batch is split into.
        local_stages: the stages this process holds (all of them in one process).
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], Any],
        stages: tuple[StageFn, ...],
        program: Program,
        *,
        has_aux: bool,
        batch_dims: PyTree,
    ) -> None:
        self.loss_fn = loss_fn
        self.stages = stages
        self.program = program
        self.has_aux = has_aux
        self.batch_dims = batch_dims
        self.num_stages = program.num_stages
        self.num_microbatches = program.num_microbatches
        self.local_stages = tuple(range(self.num_stages))
        self._order = execution_order(program)

    def __repr__(self) -> str:
        p = self.program
        return f"<fpipe.Step: {p.num_stages} stages, {p.num_microbatches} microbatches, {p.num_ranks} ranks>"

    def __call__(self, params: Sequence[PyTree], batch: PyTree, /) -> tuple[Any, list[PyTree]]:
        """Run one step: the loss (or ``(loss, aux)``) and one gradient pytree per stage."""
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Sequence):
            raise TypeError(
                f"fpipe.step: params must be a list with one pytree per stage (got: {type(params).__name__}). "
                f"Pass [params_0, ..., params_{self.num_stages - 1}]."
            )
        if len(params) != self.num_stages:
            raise ValueError(
                f"fpipe.step: params has {len(params)} entries but the pipeline has {self.num_stages} "
                "stages. Pass one parameter pytree per stage."
            )
        microbatches, sizes = split(batch, self.num_microbatches, self.batch_dims)
        total = sum(sizes)
        runs = {s: StageRun(s, self.stages[s], params[s]) for s in self.local_stages}
        executor = Executor(
            runs,
            self.num_stages,
            self.loss_fn,
            has_aux=self.has_aux,
            weights=[n / total for n in sizes],
            transport=LocalTransport(microbatches),
        )
        executor.run(self._order)
        loss = _weighted_sum([executor.losses[i] for i in range(self.num_microbatches)], executor.weights)
        grads = [runs[s].grads() for s in range(self.num_stages)]
        if self.has_aux:
            return (loss, stack([executor.auxes[i] for i in range(self.num_microbatches)])), grads
        return loss, grads


def _weighted_sum(losses: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum(w_i * loss_i)`` in microbatch order, on the last stage's device and dtype."""
    total = losses[0] * weights[0]
    for loss, weight in zip(losses[1:], weights[1:]):
        total = total + loss * weight
    return total.reshape(())
