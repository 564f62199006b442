"""One step: in this process, or as one rank of many over torch.distributed.

A ``Plan`` holds what a step fixes when it is built (its order of actions, and when distributed
the program's checksum, the wire's layouts and the shard layouts); each run reads it. Both runs
build a ``StageRun`` per local stage and an ``Executor`` over a transport and interpret the
plan's order of actions; they differ in where inputs come from (``LocalTransport`` or
``DistributedTransport``) and, when distributed, in the handshake before and the data-parallel
reduction after (notes/wire.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._distributed._collectives import all_reduce_sum, check_usable, handshake, mark_broken
from ._distributed._faults import WATCHDOG
from ._distributed._topology import Topology
from ._distributed._transport import DistributedTransport, WireState, checksum
from ._errors import PipelineError
from ._executor import Executor, LocalTransport
from ._microbatch import sizes_of, split, stack
from ._pytree import PyTree, flatten
from ._record import active, clock, measured
from ._sharding._layout import StageLayout, check_shards, data_parallel
from ._sharding._runs import ShardedRuns, segments
from ._stage import StageRun
from .schedules._action import Action
from .schedules._program import Program, ScheduleError, execution_order

if TYPE_CHECKING:
    from ._api import Step


@dataclass
class Plan:
    """What a step fixes when it is built and each of its runs reads (``plan_for``).

    Attributes:
        order: the ``(rank, action)`` pairs this process runs, in order: every rank's row
            interleaved in one process, its own row on a pipeline rank.
        checksum: the program's checksum, which the distributed handshake compares (0 in one process).
        wire: the distributed runtime's per-channel layouts, kept from step to step so that
            headers travel only when a layout changes.
        layouts: with ``shard_params``, the full shapes of the local stages, set by ``Step.shard``.
    """

    order: tuple[tuple[int, Action], ...]
    checksum: int = 0
    wire: WireState = field(default_factory=WireState)
    layouts: dict[int, StageLayout] = field(default_factory=dict)


def plan_for(program: Program, rank: int | None) -> Plan:
    """The ``Plan`` of ``program`` in one process (``rank=None``) or on pipeline rank ``rank``."""
    if rank is None:
        return Plan(execution_order(program))
    return Plan(tuple((rank, a) for a in program.ranks[rank]), checksum(program))


def run_local(
    step: Step, plan: Plan, params: Sequence[PyTree], batch: PyTree
) -> tuple[torch.Tensor, Any, list[PyTree]]:
    """``step`` in this process: every stage, the program's ranks virtual; ``(loss, aux, grads)``."""
    microbatches, sizes = split(batch, step.num_microbatches, step.batch_dims)
    total = sum(sizes)
    runs = {s: StageRun(s, step.stages[s], params[s], recompute=s in step.recompute) for s in step.local_stages}
    executor = Executor(
        runs,
        step.num_stages,
        step.loss_fn,
        has_aux=step.has_aux,
        weights=[n / total for n in sizes],
        transport=LocalTransport(microbatches),
    )
    recording, start, times = active(), clock(), list[tuple[float, float]]()
    executor.run(plan.order, times=times if recording else None)
    if recording is not None:
        recording.timelines.append(measured(step.program, plan.order, times, start))
    loss, aux = _result(step, executor)
    return loss, aux, [runs[s].grads() for s in range(step.num_stages)]


def _result(step: Step, executor: Executor) -> tuple[torch.Tensor, Any]:
    """The weighted loss (and gathered aux) of the last stage, summed in microbatch order."""
    m = range(step.num_microbatches)
    loss = _weighted_sum([executor.losses[i] for i in m], executor.weights)
    return loss, stack([executor.auxes[i] for i in m]) if step.has_aux else None


def run_distributed(
    step: Step, plan: Plan, topology: Topology, params: Sequence[PyTree], batch: PyTree
) -> tuple[torch.Tensor, Any, list[PyTree]]:
    """``step`` as pipeline rank ``topology.rank``: its row of the program; ``(loss, aux, grads)``.

    1. check the local inputs, then agree with the other ranks (handshake; and over the
       data-parallel group, so replicas fail together);
    2. run the row, exchanging activations and cotangents with the peers;
    3. receive (or send) the loss, and average over data-parallel replicas.

    Any rank's failure fails every rank (NOTE [failure board] in fpipe/_distributed/_faults.py).
    """
    check_usable(topology)
    with WATCHDOG.step(topology.board):
        try:
            return _run_row(step, plan, topology, params, batch)
        except PipelineError as error:
            mark_broken(topology, error)
            raise


def _run_row(
    step: Step, plan: Plan, topology: Topology, params: Sequence[PyTree], batch: PyTree
) -> tuple[torch.Tensor, Any, list[PyTree]]:
    """``run_distributed`` in the step's failure board."""
    me, placement, m = topology.rank, step.program.placement(), step.num_microbatches
    first, last = placement[0], placement[-1]
    # 1. Local input checks, then the handshake, so every rank fails together.
    microbatches, size = None, 0
    problem: Exception | None = None
    try:
        _check_params(step, params, placement)
        if step.shard_params:
            for s in step.local_stages:
                check_shards(s, params[s], plan.layouts.get(s))
        if batch is not None and me in (first, last):
            microbatches, sizes = split(batch, m, step.batch_dims)
            size = sum(sizes)
        elif me == first:
            raise ValueError(
                f"fpipe.step: rank {me} holds stage 0 but was given batch=None. Pass the batch on "
                "the rank of the first stage (the last stage's rank may pass it too; others pass None)."
            )
    except (TypeError, ValueError) as error:
        problem = error
    statuses = handshake(topology, [plan.checksum, microbatches is not None, problem is not None, size], step.timeout)
    problem = problem or _disagreement(plan.checksum, statuses, first, last)
    if topology.data_group is not None:
        # Replicas must fail together too, or a healthy replica's gradient all-reduce would meet
        # another replica's next step.
        flag = torch.tensor([float(problem is not None)], dtype=torch.float64, device=topology.device)
        all_reduce_sum(topology, topology.data_group, [flag], step.timeout, "the other data-parallel replicas")
        if problem is None and flag.item() > 0:
            problem = ValueError(
                "fpipe.step: another data-parallel replica rejected its inputs; its ranks' errors say why."
            )
    if problem is not None:
        raise problem
    size = statuses[first][3]

    # 2. Run this rank's row of the program. With shard_params, every stage's all-gather is
    # posted here and waited for at the stage's first forward (NOTE [gather overlap]).
    def make_run(s: int, stage_params: PyTree) -> StageRun:
        return StageRun(s, step.stages[s], stage_params, recompute=s in step.recompute)

    runs: dict[int, StageRun] | ShardedRuns
    if step.shard_params:
        dp = data_parallel(topology, step.timeout)
        runs = ShardedRuns(dp, make_run, params, plan.layouts, plan.order, regather=step.regather)
    else:
        runs = {s: make_run(s, params[s]) for s in step.local_stages}
    transport = DistributedTransport(
        topology,
        step.program,
        microbatches,
        send_microbatches=not statuses[last][1],
        wire=plan.wire,
        timeout=step.timeout,
    )
    executor = Executor(
        runs,
        step.num_stages,
        step.loss_fn,
        has_aux=step.has_aux,
        weights=[n / size for n in sizes_of(size, m)],
        transport=transport,
    )
    recording, start, times = active(), clock(), list[tuple[float, float]]()
    try:
        if not isinstance(runs, ShardedRuns):
            executor.run(plan.order, times=times if recording else None)
        else:  # a stage's reduce-scatter is posted once its last action has run
            for actions, finished in segments(plan.order):
                executor.run(actions, times=times if recording else None)
                for s in finished:
                    runs.finish_stage(s)
        loss, aux = transport.exchange_result(_result(step, executor) if me == last else None)
        transport.finish()
        if recording is not None:
            recording.timelines.append(measured(step.program, plan.order, times, start, topology.group))
    except BaseException as error:
        mark_broken(topology, error)
        transport.abort(error, executor.current)
        raise
    if isinstance(runs, ShardedRuns):
        loss = _average_replicas(step, topology, runs, loss, [])
        return loss, aux, runs.grads(step.num_stages)
    grads = [runs[s].grads() if s in runs else None for s in range(step.num_stages)]
    if topology.data_group is not None:
        loss = _average_replicas(step, topology, runs, loss, grads)
    return loss, aux, grads


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


def _check_params(step: Step, params: Sequence[PyTree], placement: tuple[int, ...]) -> None:
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


def _average_replicas(
    step: Step, topology: Topology, runs: dict[int, StageRun] | ShardedRuns, loss: torch.Tensor, grads: list[PyTree]
) -> torch.Tensor:
    """Average ``loss`` and ``grads`` over data-parallel replicas in place (one all-reduce per
    dtype); the averaged loss. Sharded grads are averaged by their reduce-scatters instead,
    which ``runs.finish`` completes (fpipe/_sharding/_runs.py). A replica that fails does not join:
    the failure board fails the others (NOTE [failure board] in fpipe/_distributed/_faults.py).
    """
    if isinstance(runs, ShardedRuns):
        runs.finish()
        grads = []
    leaves = [g for s in sorted(runs) if grads for g in flatten(grads[s])[0] if isinstance(g, torch.Tensor)]
    # The loss in float64 whatever its dtype, so that averaging does not round it: with
    # float64 grads this is one all-reduce; otherwise a second, one-element one.
    total = loss.detach().to(torch.float64).reshape(1).to(topology.device)
    all_reduce_sum(topology, topology.data_group, [*leaves, total], step.timeout, "the data-parallel all-reduce")
    for g in leaves:
        g.div_(topology.data_size)
    return (total[0] / topology.data_size).to(loss.device, loss.dtype).reshape(())


def _weighted_sum(losses: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum(w_i * loss_i)`` in microbatch order, on the last stage's device and dtype."""
    total = losses[0] * weights[0]
    for loss, weight in zip(losses[1:], weights[1:]):
        total = total + loss * weight
    return total.reshape(())
