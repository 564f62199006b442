"""The one run of a step (``run``), in this process or on a pipeline rank, and what it reads.

An ``Order`` holds what a step fixes when it is built (its actions in order, and the program's
checksum that the distributed handshake compares); each run reads it and never changes it. A
run is handed its stages (``HeldStages``, built by the step's strategy), a transport and the
microbatches' weights; it builds the ``Executor``, interprets the order's actions, sums the
loss and records the timeline. The one-process step (``run_local``) and the per-rank one
(fpipe/_distributed/_rank_step.py: a ``DistributedTransport`` between a handshake and the
data-parallel reduction, notes/wire.md) are thin callers of it: they differ only in their
transport and the stages they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ._executor import Executor, LocalTransport, Transport
from ._microbatch import Microbatches, concat, counts, split, stack
from ._precision import LossScaleState, Precision
from ._pytree import PyTree, flatten, map_tensors
from ._random import Keys, keep_generators
from ._record import Stopwatch, active, clock, measured
from ._stage import StageFn, StageRun
from .schedules import Action, Program, Simulation, execution_order
from .schedules._program import checksum, forward_only


class StepView(Protocol):
    """What a run reads of a step (``fpipe.Step`` has all of it)."""

    @property
    def loss_fn(self) -> Callable[[Any, Any], Any]: ...
    @property
    def stages(self) -> tuple[StageFn, ...]: ...
    @property
    def program(self) -> Program: ...
    @property
    def has_aux(self) -> bool: ...
    @property
    def batch_dims(self) -> PyTree: ...
    @property
    def weight_fn(self) -> Callable[[Any], Any] | None: ...
    @property
    def recompute(self) -> frozenset[int]: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def num_microbatches(self) -> int: ...
    @property
    def local_stages(self) -> tuple[int, ...]: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def timeout(self) -> float: ...
    @property
    def precision(self) -> Precision | None: ...
    @property
    def loss_scale(self) -> LossScaleState | None: ...
    @property
    def counted_draws(self) -> bool: ...


# An order cut into ``(actions, stages whose last action they end with)`` pieces (``segments``).
Segments = tuple[tuple[Sequence[tuple[int, Action]], list[int]], ...]


@dataclass(frozen=True)
class Order:
    """What a step fixes when it is built and each of its runs reads (``order_for``).

    Attributes:
        program: the program it runs: the step's, or its forwards alone (``forward_only``).
        actions: the ``(rank, action)`` pairs this process runs, in order: every rank's row
            interleaved in one process, its own row on a pipeline rank.
        segments: ``actions`` cut after each stage's last action (``segments``), for ``interpret``.
        checksum: the program's checksum, which the distributed handshake compares (0 in one process).
        forward_only: an evaluation: forwards with no graph, no backward, no gradients.
        pairs: on a pipeline rank, its overlapped pairs (``Program.pairs``), first half to
            second; empty in one process, where no stage communicates (NOTE [overlapped pairs]
            in fpipe/_pairs.py).
    """

    program: Program
    actions: tuple[tuple[int, Action], ...]
    segments: Segments = field(compare=False)  # follows from ``actions``
    checksum: int = 0
    forward_only: bool = False
    pairs: Mapping[Action, Action] = field(default_factory=dict, compare=False)  # first -> second, on a rank


def order_for(program: Program, rank: int | None, *, forward: bool = False) -> Order:
    """The ``Order`` of ``program`` in one process (``rank=None``) or on pipeline rank ``rank``;
    with ``forward``, of its forwards alone (``forward_only``: an evaluation)."""
    if forward:
        program = forward_only(program)
    if rank is None:
        order = execution_order(program)
        return Order(program, order, segments(order), forward_only=forward)
    order = tuple((rank, a) for a in program.ranks[rank])
    pairs = {a: b for a, b in program.pairs if a in program.ranks[rank]}
    return Order(program, order, segments(order, pairs), checksum(program), forward, pairs)


class HeldStages(Protocol):
    """The local stages of one run, as the executor sees them (a mapping stage -> ``StageRun``),
    told when a stage's last action has run, and asked for the gradients at the end."""

    def __getitem__(self, stage: int) -> StageRun: ...
    def __contains__(self, stage: object) -> bool: ...
    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...
    def post_reduction(self, stage: int) -> None: ...
    def wait_reductions(self) -> None: ...
    def grads(self, num_stages: int) -> list[PyTree]: ...


class StrategyView(Protocol):
    """The parallel strategy as a run sees it (``Strategy`` in fpipe/_strategy.py): a value built
    once by ``pipeline()``, which checks the held parameters, builds the held stages' runs (and
    so how their gradients are reduced) and reduces the loss over data-parallel replicas."""

    def check(self, step: StepView, params: Sequence[PyTree], /) -> None: ...
    def held_stages(self, step: StepView, order: Order, params: Sequence[PyTree], /) -> HeldStages: ...
    def reduce_loss(self, loss: torch.Tensor, /) -> torch.Tensor: ...
    def reduce_grads(self, order: Order, grads: list[PyTree], /) -> list[PyTree]: ...
    def full_params(self, order: Order, params: Sequence[PyTree], /) -> list[PyTree]: ...


class Pending(Protocol):
    """A reduction posted and not yet waited for."""

    def wait(self) -> None: ...


# Posts the reduction of stage ``s``'s gradient leaves (averaged in place once waited for).
Reduce = Callable[[int, list[torch.Tensor]], Pending]


class ReplicatedStages(dict[int, StageRun]):
    """Stages with their full parameters (``HeldStages``): gradients stay where they are computed.

    Without ``reduce`` (one process, or no data-parallel replicas) nothing is reduced. With it,
    ``post_reduction(s)`` posts the reduction of stage ``s``'s gradients as
    soon as its last action has run, so that it overlaps the rest of the pipeline, and
    ``wait_reductions`` waits for them all (NOTE [reduction overlap] in fpipe/_distributed/_rank_step.py).
    A dict of the stages' runs, so that the executor's lookup of a stage, once per action, is
    no Python call.
    """

    def __init__(self, step: StepView, params: Sequence[PyTree], reduce: Reduce | None = None) -> None:
        super().__init__((s, stage_run(step, s, params[s])) for s in step.local_stages)
        self._reduce = reduce
        self._grads: dict[int, PyTree] = {}  # with reduce: the gradients posted, by stage
        self._pending: list[Pending] = []

    def post_reduction(self, stage: int) -> None:
        """With ``reduce``, post the reduction of ``stage``'s gradients (else nothing to do yet)."""
        if self._reduce is not None:
            grads = self._grads[stage] = self[stage].grads()
            leaves = [g for g in flatten(grads)[0] if isinstance(g, torch.Tensor)]
            self._pending.append(self._reduce(stage, leaves))

    def wait_reductions(self) -> None:
        """Wait for the reductions ``post_reduction`` posted."""
        for pending in self._pending:
            pending.wait()

    def grads(self, num_stages: int) -> list[PyTree]:
        return [
            self._grads[s] if s in self._grads else self[s].grads() if s in self else None for s in range(num_stages)
        ]


def stage_run(step: StepView, stage: int, stage_params: PyTree) -> StageRun:
    """The ``StageRun`` of ``stage`` with ``stage_params``: for a stage on several ranks, summing
    this rank's microbatches, or in one process each holder's apart (NOTE [a stage on several
    ranks] in fpipe/schedules/_program.py)."""
    program, orders = step.program, tuple[tuple[int, ...], ...]()
    holders = program.holders(stage)
    if len(holders) > 1:
        mine = holders if step.rank is None else (step.rank,)
        orders = tuple(program.microbatches_on(stage, r) for r in mine)
    return StageRun(
        stage, step.stages[stage], stage_params, recompute=stage in step.recompute, precision=step.precision,
        orders=orders,
    )  # fmt: skip


def segments(order: Sequence[tuple[int, Action]], pairs: Mapping[Action, Action] | None = None) -> Segments:
    """``order`` cut after each stage's last action: ``(actions, stages finished by them)`` pairs;
    never between the halves of one of ``pairs`` (the cut then follows the second half)."""
    last = {action.stage: k for k, (_, action) in enumerate(order)}
    if pairs:
        seconds = {k for k, (_, action) in enumerate(order) if action in pairs.values()}
        last = {s: k + 1 if k + 1 in seconds and order[k][1] in pairs else k for s, k in last.items()}
    out: list[tuple[Sequence[tuple[int, Action]], list[int]]] = []
    start = 0
    for k in sorted(set(last.values())):
        out.append((order[start : k + 1], [s for s, end in last.items() if end == k]))
        start = k + 1
    if start < len(order):
        out.append((order[start:], []))
    return tuple(out)


def interpret(
    executor: Executor,
    runs: HeldStages,
    order: Order,
    devices: Iterable[torch.device] = (),
    held_back: frozenset[int] = frozenset(),
) -> list[tuple[float, float]]:
    """Run ``order``'s actions, telling ``runs`` as each stage's last action has run (but the
    stages ``held_back``, whose holders' sums are added first: ``run``); the actions' times when a
    recording is active (``fpipe.record``), on ``devices``' CUDA events if any (``Stopwatch``;
    read after the last action)."""
    marks: list[tuple[Any, Any]] = []
    watch = Stopwatch(devices) if active() is not None else None
    with keep_generators(runs[s].device for s in runs):  # NOTE [randomness as data] in fpipe/_random.py
        for actions, finished in order.segments:
            executor.run(actions, times=marks if watch is not None else None, watch=watch)
            if not executor.forward_only:  # a forward-only run makes no gradient to reduce
                for s in finished:
                    if s not in held_back:
                        runs.post_reduction(s)
    if watch is None:
        return []
    flat = watch.seconds([m for pair in marks for m in pair])
    return list(zip(flat[::2], flat[1::2]))


class RunTransport(Transport, Protocol):
    """A ``Transport`` as ``run`` uses it: the ``LocalTransport`` in one process (no one to wait
    for or tell: each of these is a no-op or gives its argument back), a ``DistributedTransport``
    on a pipeline rank (fpipe/_distributed/_transport.py)."""

    def running(self) -> AbstractContextManager[object]:
        """The context the actions run in (NOTE [tensor-parallel waits] in fpipe/_distributed/_transport.py)."""
        ...

    def share_grads(self, grads: dict[int, PyTree], /) -> dict[int, list[PyTree]]:
        """For each stage this process holds with other processes, every holder's gradient sum
        in holder order (NOTE [a stage on several ranks] in fpipe/schedules/_program.py)."""
        ...

    def gather_losses(self, losses: tuple[dict[int, Any], ...], /) -> tuple[dict[int, Any], ...] | None:
        """The last stage's ``(losses, auxes, outputs)`` by microbatch, every holder's, on the one
        that makes the result; ``None`` on the others."""
        ...

    def exchange_result(self, result: PyTree, /) -> PyTree:
        """The last stage's ``result`` (``None`` where the last stage is held elsewhere), on every process."""
        ...

    def close(self) -> None:
        """Close the run once it succeeded: every message sent and read."""
        ...

    def abort(self, error: BaseException, action: Action | None, /) -> None:
        """Tell the other processes that the run failed with ``error`` in ``action``."""
        ...

    def gather_timeline(self, timeline: Simulation, /) -> Simulation:
        """``timeline`` (this process's rows measured) with every process's own rows."""
        ...


def split_batch(step: StepView, batch: PyTree, *, counted: bool = True) -> tuple[list[PyTree], list[int], int | None]:
    """``batch`` cut into the step's microbatches (``split``, fpipe/_microbatch.py), their sizes, and
    ``weight_fn``'s total count over them (``None`` without ``weight_fn`` or ``counted``: on a
    pipeline rank, only the first stage's counts). The one place a step splits and counts a batch."""
    microbatches, sizes = split(batch, step.num_microbatches, step.batch_dims)
    count = sum(counts(microbatches, step.weight_fn)) if step.weight_fn is not None and counted else None
    return microbatches, sizes, count


def run(
    step: StepView,
    order: Order,
    runs: HeldStages,
    transport: RunTransport,
    weights: Sequence[float],
    *,
    key: int,
    explicit: bool,
    replica: int = 0,
    keep_outputs: bool = False,
    devices: Iterable[torch.device] = (),
) -> tuple[torch.Tensor, Any, Any]:
    """The one run of a step: ``order``'s actions for the stages this process holds (``runs``)
    over ``transport``; ``(loss, aux, outputs)`` on every process (``outputs`` with ``keep_outputs``).

    In one process (``run_local``: a ``LocalTransport``, every stage) or on a pipeline rank
    (``run_distributed``, fpipe/_distributed/_rank_step.py: a ``DistributedTransport``, its row's
    stages, the weights and key every rank agreed on). ``weights``: each microbatch's in the loss
    (``loss_weights``); ``key``: the stages' random draws' (NOTE [randomness as data] in
    fpipe/_random.py), ``replica`` the data-parallel replica's index in them; ``explicit``: the
    batch came as ``fpipe.Microbatches``. The last stage's holder sums the loss (``result``) and
    the transport shares it; with a recording active (``fpipe.record``) the actions are timed on
    ``devices`` and every process's rows recorded. On a failure the transport tells the others
    (``abort``) and the error is raised.
    """
    executor = Executor(
        runs,
        step.num_stages,
        step.loss_fn,
        has_aux=step.has_aux,
        weights=weights,
        transport=transport,
        forward_only=order.forward_only,
        keep_outputs=keep_outputs,
        loss_scale=seed_scale(step),
        keys=Keys(key, replica=replica, training=not order.forward_only, counted=step.counted_draws),
        pairs=order.pairs,
    )
    # A stage this rank holds with others (NOTE [a stage on several ranks] in fpipe/schedules/_program.py).
    training, program = not order.forward_only, step.program
    shared = (
        frozenset(s for s in runs if len(program.holders(s)) > 1) if training and step.rank is not None else frozenset()
    )
    try:
        start = clock()
        with transport.running():
            times = interpret(executor, runs, order, devices, shared)
        if shared:  # summed over their holders, then reduced over replicas like the others
            for s, partials in transport.share_grads({s: runs[s].holders_part() for s in sorted(shared)}).items():
                runs[s].add_holders(partials)
                runs.post_reduction(s)
        mine = None
        if step.num_stages - 1 in step.local_stages:
            gathered = transport.gather_losses((executor.losses, executor.auxes, executor.outputs))
            if gathered is not None:
                executor.losses, executor.auxes, executor.outputs = gathered
                mine = result(step, executor, explicit=explicit)
        loss, aux, outputs = transport.exchange_result(mine)
        transport.close()
        recording = active()
        if recording is not None:
            timeline = measured(order.program, order.actions, times, start)
            recording.timelines.append(transport.gather_timeline(timeline))
    except BaseException as error:
        transport.abort(error, executor.current)
        raise
    return loss, aux, outputs


def run_local(
    step: StepView,
    order: Order,
    strategy: StrategyView,
    params: Sequence[PyTree],
    batch: PyTree,
    *,
    key: int,
    keep_outputs: bool = False,
) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]]:
    """A step in this process: every stage, the program's ranks virtual; ``((loss, aux,
    outputs), grads)`` (``outputs`` with ``keep_outputs``, grads empty for a forward-only order);
    the stages' random draws are those of ``key`` (NOTE [randomness as data] in fpipe/_random.py)."""
    strategy.check(step, params)
    microbatches, sizes, count = split_batch(step, batch)
    weights = loss_weights(sizes, count)
    runs = strategy.held_stages(step, order, params)
    recording = active() is not None  # (the devices are read only to time the actions)
    devices = [t.device for p in params for t in flatten(p)[0] if isinstance(t, torch.Tensor)] if recording else []
    explicit = isinstance(batch, Microbatches)
    out = run(
        step, order, runs, LocalTransport(microbatches), weights,
        key=key, explicit=explicit, keep_outputs=keep_outputs, devices=devices,
    )  # fmt: skip
    return out, [] if order.forward_only else runs.grads(step.num_stages)


def seed_scale(step: StepView) -> float | None:
    """The factor the backward's seed is scaled by: the loss scale, if the step scales."""
    return None if step.loss_scale is None else step.loss_scale.scale


def loss_weights(sizes: Sequence[int], count: int | None) -> list[float]:
    """Each microbatch's weight in the step's loss, from its size, or from ``weight_fn``'s total.

    NOTE [loss weights]
    Without ``weight_fn``, microbatch ``i`` of ``n_i`` examples out of ``N`` weighs ``n_i / N``
    and ``loss_fn`` returns a mean over its examples: the step is the batch's mean. With
    ``weight_fn``, ``loss_fn`` returns a sum over the microbatch's tokens and every microbatch
    weighs ``1 / C``, ``C`` the count of tokens of the whole batch, and over data-parallel
    replicas of all of theirs: the step is the per-token mean of everything. ``C`` must be known
    before the first backward seeds its cotangent with the weight, which 1F1B runs before the
    last forwards, so it comes from the batch (``weight_fn`` of each microbatch, up front on the
    rank that holds it, agreed in the handshake and summed over replicas), never from
    ``loss_fn``'s results. A microbatch with no tokens adds a sum of zero; a batch with none at
    all has no mean.

    Raises:
        ValueError: if ``count`` is 0.
    """
    if count is None:
        total = sum(sizes)
        return [n / total for n in sizes]
    if count == 0:
        raise ValueError(
            "fpipe.step: weight_fn counts 0 in every microbatch (and every data-parallel replica), so the "
            "per-token mean has nothing to divide by (count: 0). Give a batch with at least one counted token."
        )
    return [1 / count] * len(sizes)


def result(step: StepView, executor: Executor, *, explicit: bool = False) -> tuple[torch.Tensor, Any, Any]:
    """The weighted loss (and gathered aux) of the last stage, summed in microbatch order, and
    its outputs (``None`` unless the executor kept them): stitched back in example order, or a
    list of them when the batch came as ``explicit`` microbatches (``fpipe.Microbatches``)."""
    m = range(step.num_microbatches)
    loss = _weighted_sum([executor.losses[i] for i in m], executor.weights)
    aux = stack([executor.auxes[i] for i in m]) if step.has_aux else None
    if not executor.keep_outputs:
        return loss, aux, None
    outputs = [executor.outputs[i] for i in m]
    return loss, aux, [map_tensors(torch.Tensor.detach, y) for y in outputs] if explicit else concat(outputs)


def _weighted_sum(losses: list[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum(w_i * loss_i)`` on the last stage's device (NOTE [the step's loss])."""
    if len(set(weights)) == 1 and all(loss.dtype == losses[0].dtype for loss in losses):
        products = torch.stack(losses).mul_(weights[0])  # each rounded as ``loss_i * w_i`` rounds it
    else:
        products = torch.stack(torch._foreach_mul(losses, list(weights)))
    return products.sum()


# NOTE [the step's loss]
# The step's loss is ``torch.sum`` of the products ``loss_i * w_i`` (each as that op makes it,
# in ``loss_i``'s dtype), stacked in microbatch order (promoted to one dtype as ``torch.stack``
# promotes): a fixed reduction of a fixed vector, so the loss is bitwise the same whatever the
# schedule, in one process or many. It is not a left-to-right chain of additions (the
# gradients are, NOTE [fixed accumulation order]): a chain costs one op per microbatch (about
# a microsecond each on CPU, a kernel launch each on GPUs), the stack and its sum two, and
# ``torch.sum`` adds half-precision losses in float32. With one weight for all microbatches
# (microbatches of one size, or ``weight_fn``) and one dtype, the products are one multiply of
# the stacked losses, which rounds each element as the op on one loss does (checked bitwise in
# tests/test_run.py); else one ``_foreach_mul``.
