"""One step as one rank of many over torch.distributed (notes/wire.md).

Each pipeline rank runs its own row of the program with the shared ``Executor`` over a
``DistributedTransport``:

1. ``_agree``: check the local inputs, then agree with the other ranks (the handshake; and over
   the data-parallel group, so replicas fail together), so a bad input anywhere fails every rank;
2. ``_run_row``: run the row, exchanging activations and cotangents with the peers, and receive
   (or send) the loss;
3. ``_average_replicas``: average the loss and the gradients still to be averaged over
   data-parallel replicas.

Any rank's failure fails every rank (NOTE [failure board] in fpipe/_distributed/_faults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import PipelineError
from .._executor import Executor
from .._microbatch import sizes_of, split
from .._pytree import PyTree, leaves_with_paths
from .._record import active, clock, measured
from .._run import Pending, Plan, Reduce, StageRuns, StepSpec, interpret, result
from ..schedules._program import ScheduleError
from ._collectives import PendingSum, all_reduce_sum, all_reduce_sum_async, check_usable, handshake, mark_broken
from ._faults import WATCHDOG
from ._topology import Topology
from ._transport import DistributedTransport, WireState

RunsFor = Callable[[Sequence[PyTree]], StageRuns]  # this rank's stages for its params


def run_distributed(
    spec: StepSpec,
    plan: Plan,
    topology: Topology,
    wire: WireState,
    params: Sequence[PyTree],
    batch: PyTree,
    *,
    runs_for: RunsFor,
    check_params: Callable[[Sequence[PyTree]], None],
) -> tuple[torch.Tensor, Any, list[PyTree]]:
    """A step as pipeline rank ``topology.rank``: its row of the program; ``(loss, aux, grads)``.

    ``wire`` keeps the channels' layouts from step to step; ``runs_for(params)`` builds this
    rank's stages once every rank has agreed; ``check_params(params)`` raises ``ValueError`` for
    parameters this rank cannot run with (every rank then fails together).
    """
    check_usable(topology)
    with WATCHDOG.step(topology.board):
        try:
            late = WATCHDOG.read(topology.board)  # the others gave up on this step before this rank came
            if late is not None:
                raise late.error(topology.rank, "the other pipeline ranks at the start of the step")
            microbatches, size, send_microbatches = _agree(spec, plan, topology, params, batch, check_params)
            runs = runs_for(params)
            loss, aux = _run_row(spec, plan, topology, wire, runs, microbatches, size, send_microbatches)
            unaveraged = runs.finish()
            if topology.data_group is not None:
                loss = _average_replicas(spec, topology, loss, unaveraged)
            return loss, aux, runs.grads(spec.num_stages)
        except PipelineError as error:
            mark_broken(topology, error)
            raise


def _agree(
    spec: StepSpec,
    plan: Plan,
    topology: Topology,
    params: Sequence[PyTree],
    batch: PyTree,
    check_params: Callable[[Sequence[PyTree]], None],
) -> tuple[list[PyTree] | None, int, bool]:
    """Check the local inputs and agree with every rank: this rank's microbatches (``None`` if it
    holds no batch), the batch size, and whether the last stage needs the microbatches sent."""
    me, placement, m = topology.rank, spec.program.placement(), spec.num_microbatches
    first, last = placement[0], placement[-1]
    microbatches, size = None, 0
    problem: Exception | None = None
    try:
        _check_held(spec, params, placement)
        check_devices(spec, params, topology.device)
        check_params(params)
        if batch is not None and me in (first, last):
            microbatches, sizes = split(batch, m, spec.batch_dims)
            size = sum(sizes)
        elif me == first:
            raise ValueError(
                f"fpipe.step: rank {me} holds stage 0 but was given batch=None. Pass the batch on "
                "the rank of the first stage (the last stage's rank may pass it too; others pass None)."
            )
    except (TypeError, ValueError) as error:
        problem = error
    statuses = handshake(topology, [plan.checksum, microbatches is not None, problem is not None, size], spec.timeout)
    problem = problem or _disagreement(plan.checksum, statuses, first, last)
    if topology.data_group is not None:
        # Replicas must fail together too, or a healthy replica's gradient all-reduce would meet
        # another replica's next step.
        flag = torch.tensor([float(problem is not None)], dtype=torch.float64, device=topology.device)
        all_reduce_sum(topology, topology.data_group, [flag], spec.timeout, "the other data-parallel replicas")
        if problem is None and flag.item() > 0:
            problem = ValueError(
                "fpipe.step: another data-parallel replica rejected its inputs; its ranks' errors say why."
            )
    if problem is not None:
        raise problem
    return microbatches, statuses[first][3], not statuses[last][1]


def _run_row(
    spec: StepSpec,
    plan: Plan,
    topology: Topology,
    wire: WireState,
    runs: StageRuns,
    microbatches: list[PyTree] | None,
    size: int,
    send_microbatches: bool,
) -> tuple[torch.Tensor, Any]:
    """Run this rank's row; the loss (and aux), received from the last stage's rank."""
    last = spec.program.placement()[-1]
    transport = DistributedTransport(
        topology, spec.program, microbatches, send_microbatches=send_microbatches, wire=wire, timeout=spec.timeout
    )
    weights = [n / size for n in sizes_of(size, spec.num_microbatches)]
    executor = Executor(runs, spec.num_stages, spec.loss_fn, has_aux=spec.has_aux, weights=weights, transport=transport)
    start = clock()
    try:
        times = interpret(executor, runs, plan.order, [topology.device])
        loss, aux = transport.exchange_result(result(spec, executor) if topology.rank == last else None)
        transport.finish()
        recording = active()
        if recording is not None:
            recording.timelines.append(measured(spec.program, plan.order, times, start, topology, spec.timeout))
    except BaseException as error:
        mark_broken(topology, error)
        transport.abort(error, executor.current)
        raise
    return loss, aux


def _disagreement(checksum: int, statuses: list[list[int]], first: int, last: int) -> Exception | None:
    """What the handshake's statuses (checksum, has batch, rejected, batch size per rank) object to."""
    if any(st[0] != checksum for st in statuses):
        return ScheduleError(
            "fpipe.step: the pipeline ranks run different programs (checksums by rank: "
            f"{[st[0] for st in statuses]}). Build the same pipeline, schedule and stages on every rank."
        )
    rejected = [r for r, st in enumerate(statuses) if st[2]]
    if rejected:
        return ValueError(f"fpipe.step: rank(s) {rejected} rejected their inputs; their own errors say why.")
    if statuses[last][1] and statuses[last][3] != statuses[first][3]:
        return ValueError(
            f"fpipe.step: the batch on rank {first} has {statuses[first][3]} examples but the one on rank {last} "
            f"has {statuses[last][3]}. Pass the same batch, or None on rank {last}."
        )
    return None


def _check_held(step: StepSpec, params: Sequence[PyTree], placement: tuple[int, ...]) -> None:
    """Raise unless ``params`` holds exactly the stages this rank runs."""
    for s in range(step.num_stages):
        if s in step.local_stages and params[s] is None:
            raise ValueError(
                f"fpipe.step: rank {step.rank} holds stage {s} but params[{s}] is None. "
                f"Pass the parameters of every stage in step.local_stages ({step.local_stages})."
            )
        if s not in step.local_stages and params[s] is not None:
            raise ValueError(
                f"fpipe.step: params[{s}] is given on rank {step.rank}, but stage {s} lives on rank "
                f"{placement[s]}. Pass None for the stages this rank does not hold "
                f"(step.local_stages: {step.local_stages})."
            )


def check_devices(spec: StepSpec, params: Sequence[PyTree], device: torch.device) -> None:
    """Raise unless every tensor of the local stages' ``params`` is on this rank's ``device``
    (NOTE [the rank's device] in fpipe/_distributed/_topology.py); the ``meta`` device, which
    holds no data, is reported elsewhere."""
    for s in spec.local_stages:
        paths, leaves, _ = leaves_with_paths(params[s])
        for path, leaf in zip(paths, leaves):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta and not _same_device(leaf.device, device):
                raise ValueError(
                    f"fpipe.step: stage {s}'s parameters are on {leaf.device} but rank {spec.rank} runs on {device} "
                    f"(params[{s}]{path}: {leaf.device}). Move the parameters of every local stage to the "
                    f"rank's device (step.topology.device: {device}) before the step."
                )


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _average_replicas(
    spec: StepSpec, topology: Topology, loss: torch.Tensor, leaves: list[torch.Tensor]
) -> torch.Tensor:
    """Average ``loss`` and the gradient ``leaves`` over data-parallel replicas, the leaves in
    place (one all-reduce per dtype); the averaged loss. A replica that fails does not join: the
    failure board fails the others (NOTE [failure board] in fpipe/_distributed/_faults.py).
    """
    # The loss in float64 whatever its dtype, so that averaging does not round it: with
    # float64 grads this is one all-reduce; otherwise a second, one-element one.
    total = loss.detach().to(torch.float64).reshape(1).to(topology.device)
    all_reduce_sum(topology, topology.data_group, [*leaves, total], spec.timeout, "the data-parallel all-reduce")
    for g in leaves:
        g.div_(topology.data_size)
    return (total[0] / topology.data_size).to(loss.device, loss.dtype).reshape(())


# NOTE [reduction overlap]
# With data-parallel replicas, a stage's gradients are final once its last backward (or weight
# gradient) action has run; ``replica_mean`` posts their all-reduce right then (one per dtype,
# async), so that it runs while this rank goes on with its other stages' actions, and the step
# waits for them all only before it returns (``ReplicatedRuns.finish``); the loss is averaged
# after that (``_average_replicas``). Sharded runs do the same with reduce-scatters
# (fpipe/_sharding/_runs.py). Each replica runs the same row, so every replica posts the same
# stages in the same order. The sums are those of the one all-reduce at the end that this
# replaces: two replicas' sum is a + b either way; with three or more, the order of the backend's
# additions is its own, as before. Each leaf is then divided by the number of replicas, as before.
#
#     rank  | 1B3 ... 1B7 | 0B5 0B6 0B7 |            (last actions of stages 1, then 0)
#     dp    |             | all-reduce stage 1 | all-reduce stage 0 |
#     wait  |                                          ^ step returns


def replica_mean(topology: Topology, timeout: float) -> Reduce:
    """The ``Reduce`` that averages a stage's gradient leaves over the data-parallel replicas,
    posted now and waited for by the step's end (NOTE [reduction overlap])."""

    def reduce(stage: int, leaves: list[torch.Tensor]) -> Pending:
        what = f"the data-parallel all-reduce of stage {stage}'s gradients"
        return _Mean(
            all_reduce_sum_async(topology, topology.data_group, leaves, timeout, what), leaves, topology.data_size
        )

    return reduce


class _Mean:
    """A posted sum of ``leaves`` over ``size`` replicas; ``wait`` leaves their mean in them."""

    def __init__(self, pending: PendingSum, leaves: list[torch.Tensor], size: int) -> None:
        self._pending, self._leaves, self._size = pending, leaves, size

    def wait(self) -> None:
        self._pending.wait()
        for g in self._leaves:
            g.div_(self._size)
