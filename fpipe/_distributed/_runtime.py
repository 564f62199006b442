"""One step as one rank of many over torch.distributed (notes/wire.md).

Each pipeline rank runs its own row of the program with the shared ``Executor`` over a
``DistributedTransport``:

1. ``_agree``: check the local inputs, then agree with the other ranks (the handshake; and over
   the data-parallel group, so replicas fail together), so a bad input anywhere fails every rank;
2. ``_run_row``: run the row, exchanging activations and cotangents with the peers, and receive
   (or send) the loss;
3. ``_average_replicas``: average the loss and the gradients still to be averaged over
   data-parallel replicas;
4. ``meet`` the tensor-parallel partners, so that no rank returns from a step in which any rank
   failed (NOTE [a step ends together]).

Any rank's failure fails every rank (NOTE [failure board] in fpipe/_distributed/_faults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._dtensor import check_mesh, is_dtensor, local
from .._errors import PipelineError
from .._executor import Executor
from .._microbatch import Microbatches, counts, split
from .._plural import plural
from .._pytree import PyTree, leaves_with_paths
from .._random import Keys
from .._record import active, clock, measured
from .._run import Pending, Plan, Reduce, StageRuns, StepSpec, interpret, loss_weights, result, seed_scale
from ..schedules._program import ScheduleError
from ._board import waiting
from ._collectives import (
    PendingSum,
    all_reduce_sum,
    all_reduce_sum_async,
    check_usable,
    device_type_words,
    handshake,
    mark_broken,
    meet,
    mixed_device_types,
    watched,
)
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
    key: int,
    keep_outputs: bool = False,
) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]]:
    """A step as pipeline rank ``topology.rank``: its row of the program; ``((loss, aux,
    outputs), grads)`` (``outputs`` with ``keep_outputs``; no grads for a forward-only plan).

    ``wire`` keeps the channels' layouts from step to step; ``runs_for(params)`` builds this
    rank's stages once every rank has agreed; ``check_params(params)`` raises ``ValueError`` for
    parameters this rank cannot run with (every rank then fails together). The stages' random
    draws are those of the key every rank agrees on, ``key`` of the first stage's rank of replica
    0 and tensor-parallel rank 0 (NOTE [randomness as data] in fpipe/_random.py).
    """
    check_usable(topology)
    try:
        late = WATCHDOG.read(topology.board)  # the others gave up on the job before this rank came
        if late is not None:
            raise late.error(topology.board, topology.rank, "the other pipeline ranks at the start of the step")
        agreed = _agree(spec, plan, topology, params, batch, check_params, key)
        runs = runs_for(params)
        loss, aux, outputs = _run_row(spec, plan, topology, wire, runs, agreed, keep_outputs)
        unaveraged = [] if plan.forward_only else runs.finish()
        if topology.data_group is not None:
            # Weighted by weight_fn, each replica's share is already over the total count.
            loss = _average_replicas(spec, topology, loss, unaveraged, divide=spec.weight_fn is None)
        grads: list[PyTree] = []
        if not plan.forward_only:  # (a replicated DTensor's partial sums are summed over tp here)
            with watched(topology, spec.timeout, "the tensor-parallel sums of the gradients"):
                grads = runs.grads(spec.num_stages)
        if topology.tensor_group is not None:  # NOTE [a step ends together]
            what = "the other tensor-parallel ranks at the end of the step"
            meet(topology, topology.tensor_group, spec.timeout, what)
        return (loss, aux, outputs), grads
    except PipelineError as error:
        mark_broken(topology, error)
        WATCHDOG.linger(topology.board)
        raise


# NOTE [a step ends together]
# A step returns on no rank when any rank of any mesh dimension failed in it. Each rank's last
# collectives are, in turn, the pipeline group's closing all-gather (``_conclude``: a rank that
# failed joins it with its code, and every rank then raises), the data-parallel average of the
# loss, and a meeting of the tensor-parallel group (``meet``). A rank passes each only once every
# rank of that group has arrived, so a rank that returns knows that its tensor-parallel partners
# averaged with their replicas, which all concluded their pipelines: every rank of the mesh
# finished its row. A rank that failed never arrives at the next one, and the failure board
# aborts the wait of those that did. Without the meeting, with pp 2 x tp 2 and rank 0 killed in
# its backward, its tensor-parallel partner (whose stage needed no collective in that backward)
# and that partner's pipeline peer returned a loss for the step.


class _Agreed(NamedTuple):
    """What every rank of a step agreed on before it runs (``_agree``)."""

    microbatches: list[PyTree] | None  # this rank's (None if it holds no batch)
    weights: list[float]  # each microbatch's weight in the loss (NOTE [loss weights] in fpipe/_run.py)
    explicit: bool  # the batch came as fpipe.Microbatches
    send_microbatches: bool  # the last stage's rank holds no batch: stage 0's rank sends them
    key: int  # the step's key (NOTE [randomness as data] in fpipe/_random.py)


def _agree(
    spec: StepSpec,
    plan: Plan,
    topology: Topology,
    params: Sequence[PyTree],
    batch: PyTree,
    check_params: Callable[[Sequence[PyTree]], None],
    key: int,
) -> _Agreed:
    """Check the local inputs and agree with every rank (and replica) on what the step runs.

    The handshake carries the first stage's microbatch sizes and ``weight_fn`` count, so every
    rank weighs the microbatches alike, and its ``key``; the replicas' counts are summed with
    their failure flags, and replica 0's key (then tensor-parallel rank 0's) with them.
    """
    me, placement, m = topology.rank, spec.program.placement(), spec.num_microbatches
    first, last = placement[0], placement[-1]
    microbatches, size, sizes, count = None, 0, [0] * m, 0
    problem: Exception | None = None
    try:
        _check_held(spec, params, placement)
        _check_dtensors(spec, params, topology)
        check_devices(spec, params, topology.device)
        check_params(params)
        if batch is not None and me in (first, last):
            microbatches, sizes = split(batch, m, spec.batch_dims)
            size = sum(sizes)
            if spec.weight_fn is not None and me == first:
                count = sum(counts(microbatches, spec.weight_fn))
        elif me == first:
            raise ValueError(
                f"fpipe.step: rank {me} holds stage 0 but was given batch=None. Pass the batch on "
                "the rank of the first stage (the last stage's rank may pass it too; others pass None)."
            )
    except (TypeError, ValueError) as error:
        problem = error
    explicit = isinstance(batch, Microbatches)
    status = [plan.checksum, microbatches is not None, problem is not None, size, explicit, count, *sizes, key]
    statuses = handshake(topology, [*status, *device_type_words(topology.device)], spec.timeout)
    problem = mixed_device_types(statuses) or problem or _disagreement(plan.checksum, statuses, first, last)
    count, key = statuses[first][5], statuses[first][6 + m]
    # Replicas must fail together too, or a healthy replica's gradient all-reduce would meet
    # another replica's next step (and weight_fn's total is every replica's tokens); so must
    # tensor-parallel ranks, whose stages' collectives would wait for the rank that stopped.
    # After the pipeline's handshake, the data-parallel flag reaches every rank of the same
    # tensor-parallel index, and the tensor-parallel one every rank.
    # The key travels in the same sums, added by replica 0 (tensor-parallel rank 0) alone: a key
    # below 2**53 is exact in float64.
    if topology.data_group is not None:
        mine = key if topology.replica == 0 else 0
        flag = torch.tensor([float(problem is not None), count, mine], dtype=torch.float64, device=topology.device)
        all_reduce_sum(topology, topology.data_group, [flag], spec.timeout, "the other data-parallel replicas")
        if problem is None and flag[0].item() > 0:
            problem = ValueError(
                "fpipe.step: another data-parallel replica rejected its inputs; its ranks' errors say why."
            )
        count, key = int(flag[1].item()), int(flag[2].item())
    if topology.tensor_group is not None:
        mine = key if topology.tensor_rank == 0 else 0
        flag = torch.tensor([float(problem is not None), mine], dtype=torch.float64, device=topology.device)
        all_reduce_sum(topology, topology.tensor_group, [flag], spec.timeout, "the other tensor-parallel ranks")
        if problem is None and flag[0].item() > 0:
            problem = ValueError(
                "fpipe.step: another tensor-parallel rank rejected its inputs; its ranks' errors say why."
            )
        key = int(flag[1].item())
    if problem is None:
        try:
            weights = loss_weights(statuses[first][6 : 6 + m], count if spec.weight_fn is not None else None)
        except ValueError as error:  # every rank knows the same count: all raise together
            problem = error
    if problem is not None:
        raise problem
    return _Agreed(microbatches, weights, bool(statuses[first][4]), not statuses[last][1], key)


def _run_row(
    spec: StepSpec,
    plan: Plan,
    topology: Topology,
    wire: WireState,
    runs: StageRuns,
    agreed: _Agreed,
    keep_outputs: bool,
) -> tuple[torch.Tensor, Any, Any]:
    """Run this rank's row; the loss, aux and outputs, received from the last stage's rank."""
    last = spec.program.placement()[-1]
    transport = DistributedTransport(
        topology,
        plan.program,
        agreed.microbatches,
        send_microbatches=agreed.send_microbatches,
        wire=wire,
        timeout=spec.timeout,
    )
    executor = Executor(
        runs,
        spec.num_stages,
        spec.loss_fn,
        has_aux=spec.has_aux,
        weights=agreed.weights,
        transport=transport,
        forward_only=plan.forward_only,
        keep_outputs=keep_outputs,
        loss_scale=seed_scale(spec),
        keys=Keys(agreed.key, replica=topology.replica, training=not plan.forward_only),
    )
    start = clock()
    try:
        # NOTE [tensor-parallel waits]: with a tp dimension, stages wait in collectives of their
        # own (DTensor's), which fpipe's waits do not see; the whole row counts as waiting, so the
        # watchdog reads the board every POLL and aborts the groups when another rank failed.
        with waiting(topology.board if topology.tensor_group is not None else None):
            times = interpret(executor, runs, plan, [topology.device])
        mine = result(spec, executor, explicit=agreed.explicit) if topology.rank == last else None
        loss, aux, outputs = transport.exchange_result(mine)
        transport.finish()
        recording = active()
        if recording is not None:
            recording.timelines.append(measured(plan.program, plan.order, times, start, topology, spec.timeout))
    except BaseException as error:
        mark_broken(topology, error)
        transport.abort(error, executor.current)
        # A stage's own collective that failed for another rank's failure (the board aborted it,
        # or that rank's connection closed first: it wrote its record before) fails inside the
        # stage, so the error names this rank's action; the board's record, when it names another
        # rank, says why (fpipe's own waits say so already). A stage that failed by itself raises
        # its own error, as without a tp dimension.
        inside = topology.tensor_group is not None and not _from_board(error, topology)
        standing = WATCHDOG.read(topology.board) if inside else None
        if standing is not None and standing.subject() != topology.board.label():
            raise standing.error(topology.board, topology.rank, "a collective inside its stage") from error
        raise
    return loss, aux, outputs


def _from_board(error: BaseException, topology: Topology) -> bool:
    """Whether ``error`` already reports the board's record (``Failure.error``) on this rank."""
    return isinstance(error, PipelineError) and str(error).startswith(f"fpipe: {topology.board.label()} stopped")


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
            f"fpipe.step: the batch on rank {first} has {plural(statuses[first][3], 'example')} but the one "
            f"on rank {last} "
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


def _check_dtensors(step: StepSpec, params: Sequence[PyTree], topology: Topology) -> None:
    """Raise unless every DTensor parameter lives on this rank's tensor-parallel sub-mesh."""
    ranks = None if topology.tensor_ranks is None else list(topology.tensor_ranks)
    for s in step.local_stages:
        paths, leaves, _ = leaves_with_paths(params[s])
        for path, leaf in zip(paths, leaves, strict=True):
            if is_dtensor(leaf):
                check_mesh(leaf, ranks, f"params[{s}] leaf {path} (stage {s}, rank {step.rank})")


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
    spec: StepSpec, topology: Topology, loss: torch.Tensor, leaves: list[torch.Tensor], *, divide: bool = True
) -> torch.Tensor:
    """Average ``loss`` and the gradient ``leaves`` over data-parallel replicas, the leaves in
    place (one all-reduce per dtype); the averaged loss. A replica that fails does not join: the
    failure board fails the others (NOTE [failure board] in fpipe/_distributed/_faults.py).
    Without ``divide`` the replicas' shares are summed (``weight_fn``: each is already a share
    of the total count, so a replica with more tokens counts more).
    """
    d = topology.data_size if divide else 1
    # The loss in float64 whatever its dtype, so that averaging does not round it: with
    # float64 grads this is one all-reduce; otherwise a second, one-element one.
    total = loss.detach().to(torch.float64).reshape(1).to(topology.device)
    pieces = [local(g) for g in leaves]  # a DTensor's own piece: its ranks in other replicas hold the same one
    all_reduce_sum(topology, topology.data_group, [*pieces, total], spec.timeout, "the data-parallel all-reduce")
    if d != 1:
        for g in pieces:
            g.div_(d)
    return (total[0] / d).to(loss.device, loss.dtype).reshape(())


# NOTE [reduction overlap]
# With data-parallel replicas, a stage's gradients are final once its last backward (or weight
# gradient) action has run; ``replica_mean`` posts their all-reduce right then (one per dtype,
# async), so that it runs while this rank goes on with its other stages' actions, and the step
# waits for them all only before it returns (``ReplicatedRuns.finish``); the loss is averaged
# after that (``_average_replicas``). Sharded runs do the same with reduce-scatters
# (fpipe/_sharding/_runs.py). Each replica runs the same row, so every replica posts the same
# stages in the same order. The sums are those of the one all-reduce at the end that this
# replaces: two replicas' sum is a + b either way; with three or more, the order of the backend's
# additions is its own, as before. Each leaf is then divided by the number of replicas (not with
# ``weight_fn``: each replica's share is already over the total count), as before.
#
#     rank  | 1B3 ... 1B7 | 0B5 0B6 0B7 |            (last actions of stages 1, then 0)
#     dp    |             | all-reduce stage 1 | all-reduce stage 0 |
#     wait  |                                          ^ step returns


def replica_mean(topology: Topology, timeout: float, *, divide: bool = True) -> Reduce:
    """The ``Reduce`` that averages a stage's gradient leaves over the data-parallel replicas
    (sums them without ``divide``), posted now and waited for by the step's end (NOTE
    [reduction overlap]). A DTensor leaf is reduced as its local piece."""

    def reduce(stage: int, leaves: list[torch.Tensor]) -> Pending:
        what = f"the data-parallel all-reduce of stage {stage}'s gradients"
        pieces = [local(g) for g in leaves]
        pending = all_reduce_sum_async(topology, topology.data_group, pieces, timeout, what)
        return _Mean(pending, pieces, topology.data_size if divide else 1)

    return reduce


class _Mean:
    """A posted sum of ``leaves`` over replicas; ``wait`` leaves it divided by ``size`` in them."""

    def __init__(self, pending: PendingSum, leaves: list[torch.Tensor], size: int) -> None:
        self._pending, self._leaves, self._size = pending, leaves, size

    def wait(self) -> None:
        self._pending.wait()
        if self._size != 1:
            for g in self._leaves:
                g.div_(self._size)
