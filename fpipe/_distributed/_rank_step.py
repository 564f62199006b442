"""One step as one rank of many over torch.distributed (notes/wire.md).

Each pipeline rank runs its own row of the program with the one run of a step (``run`` in
fpipe/_run.py) over a ``DistributedTransport``:

1. ``_agree``: check the local inputs, then agree with the other ranks (the handshake; and over
   the data-parallel group, so replicas fail together), so a bad input anywhere fails every rank;
2. ``_run_row``: ``run`` the row with the agreed weights and key, exchanging activations and
   cotangents with the peers, and receive (or send) the loss;
3. ``strategy.reduce_loss`` (``average_loss``): average the loss over data-parallel replicas (their gradients were
   averaged as each stage finished: NOTE [reduction overlap]).
4. ``meet`` the tensor-parallel partners, so that no rank returns from a step in which any rank
   failed (NOTE [a step ends together]), and read the failure board once more (``standing``:
   NOTE [a continued rank] in fpipe/_distributed/_collectives.py).

Any rank's failure fails every rank (NOTE [failure board] in fpipe/_distributed/_faults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Shard

from .._compile import RECORDING
from .._errors import PipelineError
from .._microbatch import Microbatches
from .._plural import plural
from .._pytree import PyTree, leaves_with_paths
from .._record import active
from .._run import (
    HeldStages,
    Order,
    Pending,
    Reduce,
    ReplicatedStages,
    StepView,
    StrategyView,
    loss_weights,
    run,
    split_batch,
)
from .._tensor_parallel import check_mesh, is_dtensor, local
from ..schedules import Program, ScheduleError
from ._collectives import (
    DEVICE_TYPE_WORDS,
    PendingSum,
    all_gather_ints,
    all_reduce_sum,
    all_reduce_sum_async,
    check_usable,
    device_type_words,
    handshake,
    handshake_device,
    mark_broken,
    meet,
    mixed_device_types,
    standing,
    watched,
)
from ._compiled import CompiledRows, signature
from ._faults import WATCHDOG
from ._messages import Key
from ._status import Status, words
from ._topology import Topology
from ._transport import DistributedTransport, WireState


def run_distributed(
    step: StepView,
    order: Order,
    topology: Topology,
    wire: WireState,
    params: Sequence[PyTree],
    batch: PyTree,
    *,
    strategy: StrategyView,
    key: int,
    rejected: Exception | None = None,
    keep_outputs: bool = False,
    compiled: CompiledRows | None = None,
) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]]:
    """A step as pipeline rank ``topology.rank``: its row of the program; ``((loss, aux,
    outputs), grads)`` (``outputs`` with ``keep_outputs``; no grads for a forward-only order).

    ``wire`` keeps the channels' layouts from step to step; ``strategy`` (built once by
    ``pipeline()``) builds this rank's held stages once every rank has agreed, and raises
    ``ValueError`` for parameters this rank cannot run with (every rank then fails together). The stages' random
    draws are those of the key every rank agrees on, ``key`` of the first stage's rank of replica
    0 and tensor-parallel rank 0 (NOTE [randomness as data] in fpipe/_random.py). ``rejected``:
    what the step's checks found wrong before; this rank raises it after the handshake, and every
    other rank a ``ValueError`` saying so (NOTE [a handshake of fixed size]). ``compiled``: the
    step's compiled rows (NOTE [compiled rows] in fpipe/_distributed/_compiled.py), run in place
    of the eager row once every rank's messages have known layouts.
    """
    check_usable(topology)
    try:
        late = WATCHDOG.read(topology.board)  # the others gave up on the job before this rank came
        if late is not None:
            raise late.error(topology.board, topology.rank, "the other pipeline ranks at the start of the step")
        agreed = _agree(step, order, topology, params, batch, strategy, key, rejected, compiled)
        out = None
        if compiled is not None and not keep_outputs:
            out = _compiled_row(step, order, topology, wire, strategy, compiled, params, agreed)
        if out is not None:
            if topology.tensor_group is not None:  # NOTE [a step ends together]
                what = "the other tensor-parallel ranks at the end of the step"
                meet(topology, topology.tensor_group, step.timeout, what)
            standing(topology, "the end of the step")
            return out
        record = None if compiled is None or keep_outputs else compiled.recorder(agreed.signatures, order)
        runs = strategy.held_stages(step, order, params)
        loss, aux, outputs = _run_row(step, order, topology, wire, runs, agreed, keep_outputs, record)
        if not order.forward_only:
            runs.wait_reductions()
        if topology.data_group is not None:
            loss = strategy.reduce_loss(loss)  # over the replicas, as the strategy reduces grads
        grads: list[PyTree] = []
        if not order.forward_only:  # (a replicated DTensor's partial sums are summed over tp here)
            with watched(topology, step.timeout, "the tensor-parallel sums of the gradients"):
                grads = runs.grads(step.num_stages)
        if topology.tensor_group is not None:  # NOTE [a step ends together]
            what = "the other tensor-parallel ranks at the end of the step"
            meet(topology, topology.tensor_group, step.timeout, what)
        standing(topology, "the end of the step")  # NOTE [a continued rank] in fpipe/_distributed/_collectives.py
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
# aborts the wait of those that did. Without the meeting, the tensor-parallel partner of a rank
# that failed, when its own stage needed no collective in that action, and that partner's
# pipeline peer would return a loss for the step (the case: notes/wire.md, "Failures").


class _Agreed(NamedTuple):
    """What every rank of a step agreed on before it runs (``_agree``)."""

    microbatches: list[PyTree] | None  # this rank's (None if it holds no batch)
    weights: list[float]  # each microbatch's weight in the loss (NOTE [loss weights] in fpipe/_run.py)
    explicit: bool  # the batch came as fpipe.Microbatches
    send_microbatches: bool  # the last stage's rank holds no batch: stage 0's rank sends them
    key: int  # the step's key (NOTE [randomness as data] in fpipe/_random.py)
    signatures: tuple[int, ...]  # every rank's, by rank (NOTE [compiled rows] in fpipe/_distributed/_compiled.py)
    compiling: bool  # every rank may still run its compiled row (``CompiledRows.usable``)
    recording: bool  # some rank runs the step under ``fpipe.record()``: every rank's row runs eagerly


# NOTE [a handshake of fixed size]
# The handshake is one all-gather, and an all-gather needs the same length on every rank: gloo
# aborts the process (in C++, "Received data size doesn't match expected size") when a peer's
# vector is longer or shorter. So its length depends on nothing a rank could disagree on: the
# words of a ``_Status`` (NOTE [one status codec] in fpipe/_distributed/_status.py), whose
# INLINE_SIZES microbatch sizes are zeros past the rank's count, are the same number for all.
# With more microbatches than that, the sizes follow in a second all-gather of ``m`` words, run
# only when every rank's status shows the same program and ``m`` (so the same length), which
# every rank decides from the same gathered words. A rank whose own checks fail (an input, the
# user's ``split`` or ``weight_fn``, a count past int64) still joins the handshake with its
# ``rejected`` flag set and raises after it, so every rank fails in the same step, never
# waiting for one that is already gone or pairing with its next step.
INLINE_SIZES = 16
_INT64 = 1 << 63


@dataclass(frozen=True)
class _Status(Status):
    """One pipeline rank's words in the step's handshake (NOTE [one status codec] in
    fpipe/_distributed/_status.py)."""

    checksum: int  # the program's (``Order.checksum``)
    num_microbatches: int
    has_batch: bool
    rejected: bool  # its own checks failed: it raises its own error, the others say it did
    size: int  # examples in its batch
    explicit: bool  # the batch came as fpipe.Microbatches
    weight_count: int  # ``weight_fn``'s total on the first stage's rank
    weighted: bool  # the pipeline has a ``weight_fn``
    key: int
    signature: int  # of its layouts, for a compiled step (NOTE [compiled rows]); else 0
    compiling: bool  # it may still run its compiled row (``CompiledRows.usable``)
    recording: bool  # it runs the step under ``fpipe.record()``
    sizes: tuple[int, ...] = words(INLINE_SIZES)  # its first microbatch sizes, zeros past its count
    device_type: tuple[int, ...] = words(DEVICE_TYPE_WORDS)  # NOTE [device types in the handshake]


def _agree(
    step: StepView,
    order: Order,
    topology: Topology,
    params: Sequence[PyTree],
    batch: PyTree,
    strategy: StrategyView,
    key: int,
    rejected: Exception | None,
    compiled: CompiledRows | None = None,
) -> _Agreed:
    """Check the local inputs and agree with every rank (and replica) on what the step runs.

    The handshake carries the first stage's microbatch sizes and ``weight_fn`` count, so every
    rank weighs the microbatches alike, and its ``key``; the replicas' counts are summed with
    their failure flags, and replica 0's key (then tensor-parallel rank 0's) with them.
    ``rejected``: what the step's own checks found wrong before (raised here, after the handshake).
    ``compiled``: each rank's ``signature`` and ``usable`` travel too (NOTE [compiled rows] in
    fpipe/_distributed/_compiled.py).
    """
    placement, m = step.program.placement(), step.num_microbatches
    first, last = placement[0], placement[-1]
    microbatches, sizes, count = None, [0] * m, 0
    problem = rejected
    if problem is None:
        try:
            microbatches, sizes, count = _local_inputs(step, topology, params, batch, strategy)
        except Exception as error:  # the user's weight_fn and split may raise anything: agree first
            problem = error
    status = _Status(
        checksum=order.checksum,
        num_microbatches=m,
        has_batch=microbatches is not None,
        rejected=problem is not None,
        size=sum(sizes),
        explicit=isinstance(batch, Microbatches),
        weight_count=count,
        weighted=step.weight_fn is not None,
        key=key,
        signature=0 if compiled is None else signature([params[s] for s in step.local_stages], microbatches),
        compiling=compiled is not None and compiled.usable,
        recording=active() is not None,
        sizes=tuple((sizes + [0] * INLINE_SIZES)[:INLINE_SIZES]),
        device_type=device_type_words(topology.device),
    )
    statuses = handshake(topology, status, step.timeout, "the other pipeline ranks at the start of the step")
    mixed = mixed_device_types([st.device_type for st in statuses])
    problem = mixed or problem or _disagreement(statuses, order.checksum, m, step.program)
    agreed_sizes = list(statuses[first].sizes[:m])
    if m > INLINE_SIZES and _same_program(statuses):
        what, device = "the other pipeline ranks at the start of the step", handshake_device(topology)
        agreed_sizes = all_gather_ints(topology, topology.group, sizes, step.timeout, what, device)[first]
    count, key = statuses[first].weight_count, statuses[first].key
    # Replicas must fail together too, or a healthy replica's gradient all-reduce would meet
    # another replica's next step (and weight_fn's total is every replica's tokens); so must
    # tensor-parallel ranks, whose stages' collectives would wait for the rank that stopped.
    # After the pipeline's handshake, the data-parallel flag reaches every rank of the same
    # tensor-parallel index, and the tensor-parallel one every rank.
    # The key travels in the same sums, added by replica 0 (tensor-parallel rank 0) alone: a key
    # below 2**53 is exact in float64.
    # The same sums carry two 16-bit halves of the program's checksum and their squares, so that
    # replicas (tensor-parallel ranks) built with another schedule or microbatch count, whose
    # pipelines each agree within themselves, fail with a ScheduleError instead of all-reducing
    # gradients of different steps (NOTE [a handshake of fixed size]).
    if topology.data_group is not None:
        mine = key if topology.replica == 0 else 0
        problem, count, key = _across(
            step, order, topology, topology.data_group, topology.data_size, problem, count, mine,
            ("data-parallel replica", "data-parallel replicas"),
        )  # fmt: skip
    if topology.tensor_group is not None:
        assert topology.tensor_ranks is not None
        mine = key if topology.tensor_rank == 0 else 0
        problem, _, key = _across(
            step, order, topology, topology.tensor_group, len(topology.tensor_ranks), problem, 0, mine,
            ("tensor-parallel rank", "tensor-parallel ranks"),
        )  # fmt: skip
    if problem is None:
        try:
            weights = loss_weights(agreed_sizes, count if step.weight_fn is not None else None)
        except ValueError as error:  # every rank knows the same count: all raise together
            problem = error
    if problem is not None:
        raise problem
    signatures = tuple(st.signature for st in statuses)
    compiling, recording = all(st.compiling for st in statuses), any(st.recording for st in statuses)
    return _Agreed(
        microbatches, weights, statuses[first].explicit, not statuses[last].has_batch, key, signatures, compiling,
        recording,
    )  # fmt: skip


@dataclass(frozen=True)
class _Tally(Status):
    """What ``_across`` sums over a group, one rank's share: its words, summed as float64 (exact
    below 2**53)."""

    rejected: int  # 1 if its own checks failed (summed: how many ranks' did)
    count: int  # ``weight_fn``'s total, or 0
    key: int  # the step's key on the rank that gives it, else 0
    low: int  # the program's checksum, its low 16 bits ...
    low_squared: int
    high: int  # ... and its next 16
    high_squared: int


def _across(
    step: StepView,
    order: Order,
    topology: Topology,
    group: Any,
    size: int,
    problem: Exception | None,
    count: int,
    key: int,
    names: tuple[str, str],
) -> tuple[Exception | None, int, int]:
    """Sum this rank's failure flag, ``count``, ``key`` and its program's checksum words over
    ``group`` (of ``size`` ranks); the step's problem (this rank's, else a different program or
    another rank's rejection there) and the summed ``count`` and ``key``. ``names``: a rank of
    ``group``, singular and plural."""
    low, high = order.checksum & 0xFFFF, (order.checksum >> 16) & 0xFFFF
    mine = _Tally(int(problem is not None), count, key, low, low * low, high, high * high)
    flag = torch.tensor(mine.encode(), dtype=torch.float64, device=topology.device)
    all_reduce_sum(topology, group, [flag], step.timeout, f"the other {names[1]}")
    total = _Tally.decode([int(x) for x in flag.tolist()])
    # All halves are equal exactly when size * sum(h**2) == sum(h)**2; the sums are exact in float64.
    if problem is None and (size * total.low_squared != total.low**2 or size * total.high_squared != total.high**2):
        problem = ScheduleError(
            f"fpipe.step: the {names[1]} run different programs (another schedule, microbatch count or number "
            "of stages). Build the same pipeline, schedule and stages on every rank."
        )
    if problem is None and total.rejected > 0:
        problem = ValueError(f"fpipe.step: another {names[0]} rejected its inputs; its ranks' errors say why.")
    return problem, total.count, total.key


def _local_inputs(
    step: StepView,
    topology: Topology,
    params: Sequence[PyTree],
    batch: PyTree,
    strategy: StrategyView,
) -> tuple[list[PyTree] | None, list[int], int]:
    """This rank's microbatches (``None``: it holds no batch), their sizes and ``weight_fn``'s total
    count (0 but on the first stage's rank with ``weight_fn``), its inputs checked.

    Raises:
        TypeError, ValueError: for inputs this rank cannot run with.
    """
    me, placement, m = topology.rank, step.program.placement(), step.num_microbatches
    first = placement[0]
    _check_held(step, params, placement)
    _check_dtensors(step, params, topology)
    check_devices(step, params, topology.device)
    strategy.check(step, params)
    if batch is None or me not in _feeders(step.program):
        if me == first:
            raise ValueError(
                f"fpipe.step: rank {me} holds stage 0 but was given batch=None. Pass the batch on "
                "the rank of the first stage (the last stage's rank may pass it too; others pass None)."
            )
        return None, [0] * m, 0
    microbatches, sizes, counted = split_batch(step, batch, counted=me == first)
    count = 0 if counted is None else counted
    if count >= _INT64:
        raise ValueError(
            f"fpipe.step: weight_fn's counts sum past 2**63 - 1 over the batch's microbatches (count: {count}). "
            "Return how many tokens or examples count in each microbatch."
        )
    return microbatches, sizes, count


def _compiled_row(
    step: StepView,
    order: Order,
    topology: Topology,
    wire: WireState,
    strategy: StrategyView,
    compiled: CompiledRows,
    params: Sequence[PyTree],
    agreed: _Agreed,
) -> tuple[tuple[torch.Tensor, Any, Any], list[PyTree]] | None:
    """This rank's row compiled (NOTE [compiled rows] in fpipe/_distributed/_compiled.py), on its
    stages' full parameters (gathered first when they are shards), its gradients and loss then
    reduced over the replicas as the eager row's are; ``None``: run the eager row."""
    if agreed.recording:
        compiled.run.warn(RECORDING)
        return None
    if not compiled.ready(order, agreed.signatures, agreed.compiling):
        return None
    full = strategy.full_params(order, params)  # (the gathers the eager row would post, in its order)
    out = compiled(
        step, order, topology, full, agreed.microbatches, agreed.weights, agreed.key, agreed.signatures,
        agreed.send_microbatches,
    )  # fmt: skip
    if out is None:  # (it did not compile, warned) this call's row eagerly, on the gathered parameters
        runs = ReplicatedStages(step, full)
        loss, aux, outputs = _run_row(step, order, topology, wire, runs, agreed, False)
        out = (loss, aux, outputs), runs.grads(step.num_stages)
    if topology.data_group is None:
        return out
    (loss, aux, outputs), grads = out
    grads = strategy.reduce_grads(order, grads)  # (then the loss, as the eager step: the same collectives)
    return (strategy.reduce_loss(loss), aux, outputs), grads


def _run_row(
    step: StepView,
    order: Order,
    topology: Topology,
    wire: WireState,
    runs: HeldStages,
    agreed: _Agreed,
    keep_outputs: bool,
    record: Callable[[Key, PyTree], None] | None = None,
) -> tuple[torch.Tensor, Any, Any]:
    """Run this rank's row (``run``, fpipe/_run.py, over a ``DistributedTransport``); the loss, aux
    and outputs, received from the last stage's rank. ``record`` is told each message received."""
    transport = DistributedTransport(
        topology,
        order.program,
        agreed.microbatches,
        send_microbatches=agreed.send_microbatches,
        wire=wire,
        timeout=step.timeout,
        record=record,
    )
    try:
        return run(
            step, order, runs, transport, agreed.weights, key=agreed.key, explicit=agreed.explicit,
            replica=topology.replica, keep_outputs=keep_outputs, devices=[topology.device],
        )  # fmt: skip
    except BaseException as error:  # the transport told the others (``abort``)
        # A stage's own collective that failed for another rank's failure (the board aborted it,
        # or that rank's connection closed first: it wrote its record before) fails inside the
        # stage, so the error names this rank's action; the board's record, when it names another
        # rank, says why (fpipe's own waits say so already). A stage that failed by itself raises
        # its own error, as without a tp dimension.
        inside = topology.stage_collectives and not _from_board(error, topology)
        standing = WATCHDOG.read(topology.board) if inside else None
        if standing is not None and standing.subject() != topology.board.label():
            raise standing.error(topology.board, topology.rank, "a collective inside its stage") from error
        raise


def _from_board(error: BaseException, topology: Topology) -> bool:
    """Whether ``error`` already reports the board's record (``Failure.error``) on this rank."""
    return isinstance(error, PipelineError) and str(error).startswith(f"fpipe: {topology.board.label()} stopped")


def _same_program(statuses: list[_Status]) -> bool:
    """Whether every rank's status shows the same program and microbatch count."""
    return len({(st.checksum, st.num_microbatches) for st in statuses}) == 1


def _feeders(program: Program) -> tuple[int, ...]:
    """The ranks that may be given the batch: those of stage 0 and of the last stage, each stage's
    first holder first. Stage 0's first rank must hold it and sends it to the last stage's first
    rank when that holds none (to DualPipe's rank p-1 for both stages); any other must hold it
    (NOTE [a stage on several ranks] in fpipe/schedules/_program.py)."""
    return tuple(dict.fromkeys((*program.holders(0), *program.holders(program.num_stages - 1))))


def _disagreement(statuses: list[_Status], checksum: int, m: int, program: Program) -> Exception | None:
    """What the handshake's statuses (program, microbatches, rejected, batch size per rank) object to."""
    if not _same_program(statuses):
        return ScheduleError(
            "fpipe.step: the pipeline ranks run different programs (checksums by rank: "
            f"{[st.checksum for st in statuses]}; microbatches by rank: {[st.num_microbatches for st in statuses]}; "
            f"this rank's: {checksum}, {m}). Build the same pipeline, schedule and stages on every rank."
        )
    if len({st.weighted for st in statuses}) > 1:
        return ValueError(
            "fpipe.step: some pipeline ranks weigh the loss with weight_fn and others do not (weight_fn by rank: "
            f"{[st.weighted for st in statuses]}). Pass the same weight_fn= to fpipe.pipeline on every rank."
        )
    rejected = [r for r, st in enumerate(statuses) if st.rejected]
    if rejected:
        return ValueError(f"fpipe.step: rank(s) {rejected} rejected their inputs; their own errors say why.")
    feeders = _feeders(program)
    first, last = feeders[0], program.placement()[-1]
    missing = [r for r in feeders if r not in (first, last) and not statuses[r].has_batch]
    if missing:
        return ValueError(
            f"fpipe.step: rank(s) {missing} run stage 0 or the last stage on some microbatches (the program "
            f"runs a stage on several ranks) but were given batch=None. Pass the batch on ranks {list(feeders)}."
        )
    for r in feeders[1:]:
        if statuses[r].has_batch and statuses[r].size != statuses[first].size:
            return ValueError(
                f"fpipe.step: the batch on rank {first} has {plural(statuses[first].size, 'example')} but the one "
                f"on rank {r} has {statuses[r].size}. Pass the same batch"
                + (f", or None on rank {r}." if r == last else ".")
            )
    return None


def _check_held(step: StepView, params: Sequence[PyTree], placement: tuple[int, ...]) -> None:
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


def _check_dtensors(step: StepView, params: Sequence[PyTree], topology: Topology) -> None:
    """Raise unless every DTensor parameter lives on this rank's tensor-parallel sub-mesh, or is an
    expert weight: sharded along its first dimension over this rank's ``mesh["ep"]``."""
    ranks = None if topology.tensor_ranks is None else list(topology.tensor_ranks)
    for s in step.local_stages:
        paths, leaves, _ = leaves_with_paths(params[s])
        for path, leaf in zip(paths, leaves, strict=True):
            where = f"params[{s}] leaf {path} (stage {s}, rank {step.rank})"
            if topology.is_expert(leaf):
                if tuple(leaf.placements) != (Shard(0),):
                    raise ValueError(
                        f"fpipe.step: {where} is an expert weight on mesh['ep'] but is not sharded along its "
                        f"first (expert) dimension (placements: {tuple(leaf.placements)}). Make it with "
                        "fpipe.moe.distribute_experts, or placements=[Shard(0)]."
                    )
            elif is_dtensor(leaf):
                check_mesh(leaf, ranks, where, experts=topology.expert_ranks)


def check_devices(step: StepView, params: Sequence[PyTree], device: torch.device) -> None:
    """Raise unless every tensor of the local stages' ``params`` is on this rank's ``device``
    (NOTE [the rank's device] in fpipe/_distributed/_topology.py); the ``meta`` device, which
    holds no data, is reported elsewhere."""
    for s in step.local_stages:
        paths, leaves, _ = leaves_with_paths(params[s])
        for path, leaf in zip(paths, leaves):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta and not _same_device(leaf.device, device):
                raise ValueError(
                    f"fpipe.step: stage {s}'s parameters are on {leaf.device} but rank {step.rank} runs on {device} "
                    f"(params[{s}]{path}: {leaf.device}). Move the parameters of every local stage to the "
                    f"rank's device (step.topology.device: {device}) before the step."
                )


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def average_loss(topology: Topology, loss: torch.Tensor, timeout: float, *, divide: bool = True) -> torch.Tensor:
    """``loss`` averaged over the data-parallel replicas (one all-reduce). A replica that fails
    does not join: the failure board fails the others (NOTE [failure board] in
    fpipe/_distributed/_faults.py). Without ``divide`` the replicas' shares are summed
    (``weight_fn``: each is already a share of the total count, so a replica with more tokens
    counts more).
    """
    d = topology.data_size if divide else 1
    # The loss in float64 whatever its dtype, so that averaging does not round it.
    total = loss.detach().to(torch.float64).reshape(1).to(topology.device)
    all_reduce_sum(topology, topology.data_group, [total], timeout, "the data-parallel all-reduce")
    return (total[0] / d).to(loss.device, loss.dtype).reshape(())


# NOTE [reduction overlap]
# With data-parallel replicas, a stage's gradients are final once its last backward (or weight
# gradient) action has run; ``replica_mean`` posts their all-reduce right then (one per dtype,
# async), so that it runs while this rank goes on with its other stages' actions, and the step
# waits for them all only before it returns (``ReplicatedStages.wait_reductions``); the loss is
# averaged after that (``average_loss``). Sharded runs do the same with reduce-scatters
# (fpipe/_sharding/_stages.py). Each replica runs the same row, so every replica posts the same
# stages in the same order. The sums are those of one all-reduce at the end of the step: two
# replicas' sum is a + b either way; with three or more, the order of the backend's additions is
# its own either way. Each leaf is then divided by the number of replicas (not with
# ``weight_fn``: each replica's share is already over the total count).
#
#     rank  | 1B3 ... 1B7 | 0B5 0B6 0B7 |            (last actions of stages 1, then 0)
#     dp    |             | all-reduce stage 1 | all-reduce stage 0 |
#     wait  |                                          ^ step returns


def replica_mean(topology: Topology, timeout: float, *, divide: bool = True) -> Reduce:
    """The ``Reduce`` that averages a stage's gradient leaves over the data-parallel replicas
    (sums them without ``divide``), posted now and waited for by the step's end (NOTE
    [reduction overlap]). A DTensor leaf is reduced as its local piece; an expert weight's over
    the ranks that hold the same piece (NOTE [experts are data-parallel for the dense weights]
    in fpipe/_distributed/_topology.py)."""

    def reduce(stage: int, leaves: list[torch.Tensor]) -> Pending:
        what = f"the data-parallel all-reduce of stage {stage}'s gradients"
        experts = [local(g) for g in leaves if topology.is_expert(g)]
        pieces = [local(g) for g in leaves if not topology.is_expert(g)]
        pending = [all_reduce_sum_async(topology, topology.data_group, pieces, timeout, what)]
        if experts and topology.expert_data_group is not None:
            what = f"the data-parallel all-reduce of stage {stage}'s expert gradients"
            pending.append(all_reduce_sum_async(topology, topology.expert_data_group, experts, timeout, what))
        return _Mean(pending, pieces + experts, topology.data_size if divide else 1)

    return reduce


class _Mean:
    """Posted sums of ``leaves`` over replicas; ``wait`` leaves them divided by ``size`` in them."""

    def __init__(self, pending: list[PendingSum], leaves: list[torch.Tensor], size: int) -> None:
        self._pending, self._leaves, self._size = pending, leaves, size

    def wait(self) -> None:
        for pending in self._pending:
            pending.wait()
        if self._size != 1:
            for g in self._leaves:
                g.div_(self._size)
