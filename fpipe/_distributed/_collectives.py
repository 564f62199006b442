"""Waiting on torch.distributed work with a timeout, and the collectives built on it.

Every wait of the distributed runtime, sharding and saving goes through ``wait``: a failure or a
timeout becomes a ``PipelineError`` that says what was awaited and names the rank that failed
(NOTE [failure board] in fpipe/_distributed/_faults.py); the backend's error stays chained.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .._errors import PipelineError
from ._board import ASK, BEAT, DIED, SILENT, STALE, Board, waiting
from ._faults import WATCHDOG, abort_job, store_host
from ._status import Status
from ._topology import Topology
from ._wire import tensor_bytes

S = TypeVar("S", bound=Status)


def wait(
    work: Any, board: Board, timeout: timedelta, rank: int, what: str | Callable[[], str], peer: int | None = None
) -> None:
    """``work.wait`` with a timeout, under the job's failure ``board``. A failure raises a
    ``PipelineError`` that says what ``rank`` was waiting for and names the rank that failed
    (NOTE [failure board] in fpipe/_distributed/_faults.py); the backend's error is chained.
    ``what`` may be a function that says it (called only then: a step waits for every message it
    receives). ``peer``: the global rank a receive waits on (``None``: a collective). A wait that
    begins while the job's store is silent ends ``timeout`` after the silence began (``_bounded``)."""
    try:
        with waiting(board):
            work.wait(timeout=_bounded(timeout))
    except RuntimeError as error:
        raise lost(board, error, rank, what, peer, timeout) from error


_AT_ONCE = timedelta(milliseconds=1)  # the shortest wait (a gloo timeout of 0 means none)


def _bounded(timeout: timedelta) -> timedelta:
    """``timeout``, or less when the job's store has not answered for more than ``ASK`` seconds:
    the wait then ends ``timeout`` after the store's silence began, so a rank that starts waiting
    late on a frozen store's host fails within the timeout of the fault, as the ranks that waited
    from the start do (NOTE [the store's host] in fpipe/_distributed/_faults.py)."""
    silence = WATCHDOG.silence()
    if silence <= ASK:
        return timeout
    return max(timeout - timedelta(seconds=silence), _AT_ONCE)


@contextlib.contextmanager
def watched(topology: Topology, timeout: float, what: str) -> Iterator[None]:
    """Run collectives that fpipe does not wait for itself (DTensor's) under the failure board:
    another rank's failure aborts them, and their backend errors raise as ``wait``'s do."""
    try:
        with waiting(topology.board):
            yield
    except PipelineError:  # from fpipe's own waits inside: it says what failed already
        raise
    except RuntimeError as error:
        raise lost(topology.board, error, topology.rank, what, None, timedelta(seconds=timeout)) from error


def lost(
    board: Board,
    error: BaseException,
    rank: int,
    what: str | Callable[[], str],
    peer: int | None,
    timeout: timedelta,
) -> PipelineError:
    """The error for a backend ``error`` while pipeline rank ``rank`` waited for ``what``.

    The board's record if there is one (the failure that aborted this wait), else this rank's
    finding, written on the board for the others: a silent rank (the wait timed out: the ranks
    whose heartbeat stopped, or unknown) or a dead one (its connection closed); the store's host
    when the store does not answer (NOTE [the store's host] in fpipe/_distributed/_faults.py);
    this rank itself when its process was stopped meanwhile (NOTE [a stopped process]).
    The job's groups are aborted on this rank either way (NOTE [a continued rank]).
    """
    what = what if isinstance(what, str) else what()
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    seconds = f"{timeout.total_seconds():g}"
    stop = WATCHDOG.stopped(within=timeout.total_seconds() + STALE)  # NOTE [a stopped process]
    standing = WATCHDOG.read(board)
    if standing is not None:
        abort_job(board)
        WATCHDOG.linger(board)
        return standing.error(board, rank, what)
    if board.unanswered is not None:
        return _without_store(board, rank, what, seconds)
    if stop is not None:  # this rank was stopped (the store's host: the others could write no record)
        failure = board.failure_of(
            board.me,
            SILENT,
            f"stopped answering: it was stopped (frozen) for {stop:.1f} s, and the other ranks gave up on it",
        )
    elif timed_out:
        silent = board.silent()
        if silent:
            also = "" if len(silent) == 1 else f" (so did global ranks {silent[1:]})"
            failure = board.failure_of(
                silent[0],
                SILENT,
                f"stopped answering{also}: no heartbeat for {STALE:g} s or more, so it is frozen or dead; "
                f"rank {rank} timed out after {seconds} s",
            )
        else:
            why = "every rank still answers" if silent == [] else "the job's store does not answer"
            failure = board.failure_of(
                None,
                SILENT,
                f"went silent: rank {rank} timed out after {seconds} s and {why} "
                "(if stages are just slow, raise fpipe.Parallelism(timeout=))",
            )
    else:
        failure = board.failure_of(
            peer if peer is not None else _first_silent(board),
            DIED,
            f"died: a connection closed while rank {rank} waited",
        )
    raised = WATCHDOG.report(board, failure).error(board, rank, what)
    abort_job(board)  # once the record stands (a rank told by a closed pair reads it): NOTE [a continued rank]
    WATCHDOG.linger(board)
    return raised


# What a collective's backend says when a peer's connection broke (gloo: "Connection reset by
# peer", "Connection closed by peer"; NCCL: "remote process exited").
_BROKEN_CONNECTION = ("connection reset", "connection closed", "remote process exited")


def peer_lost_in_stage(topology: Topology, error: BaseException, timeout: float) -> None:
    """When a stage's own collective (DTensor's, an expert all-to-all) failed because a peer's
    connection broke (``error``: the step's ``PipelineError``, its backend error the cause),
    and no rank has said why yet, find the lost peer as fpipe's own waits do (``lost``: the
    first rank whose heartbeat stops) and put it on the board, so that every rank names it,
    not the rank whose collective noticed first."""
    cause = error.__cause__
    if not topology.stage_collectives or not isinstance(cause, RuntimeError):
        return
    if not any(words in str(cause).lower() for words in _BROKEN_CONNECTION):
        return
    lost(topology.board, cause, topology.rank, "a collective inside its stage", None, timedelta(seconds=timeout))


# NOTE [a continued rank]
# No rank returns from an operation that the failure board declared failed. A wait that times out
# does not end the backend's work (gloo keeps the collective posted), so a rank frozen (SIGSTOP)
# as it entered a collective and continued after the others timed out could find their work
# still posted, finish the collective and go on. Two guards:
#
# 1. A rank whose wait fails aborts the job's groups on its side once the record stands
#    (``lost``): a continued rank's collective on them then fails on a closed pair, and it raises
#    the record, which names it. A rank frozen mid-step needs no more: its peers stopped sending
#    to it, so it waits, and its watchdog reads the record within ``POLL``.
# 2. Its collective can still finish in the moment between the others' timeouts and their
#    aborts. So before a step, ``global_norm``, the inf/nan agreement and the saving's
#    agreements (``gather_over``, ``one_writes``) return, the rank reads the board once more
#    (``standing``: one store read, through the watchdog, none once a record is known): a record
#    there fails it. The survivors write the record before they abort, and the store orders the
#    two ranks' calls, so a continued rank whose collective finished in that moment raises too.
#
#   survivor  ..wait.....................|timed out|record written|groups aborted|raises
#   victim    ..frozen.......................|continued: collective finishes|reads the board|raises
#
# A record never fails a job that got past it: the board is scoped to the job's groups
# (``Watchdog.board``), which it marks failed for good (``check_usable``), and a job that
# recovers makes new groups, with a board of a new generation. What is left uncovered (a record
# that reaches the store a millisecond too late; the store's host, NOTE [a stopped process]) and
# the failure that led here: notes/wire.md, "Failures" ("A continued rank").
#
# NOTE [a stopped process]
# A rank stopped (SIGSTOP) and continued (SIGCONT) after the others gave up on it must name
# itself, not the survivor whose closed pair its wait failed on. The store's host finds no record
# (the survivors could not reach the store), so it tells from its own clock: its watchdog waits
# for a request for ``POLL`` seconds at most between two rounds, so a wait that lasted more than
# ``STALE`` seconds means that the whole process did not run (``Watchdog.stopped``; also while the
# thread, just continued, has not run yet). That is the board's own criterion: a process whose
# watchdog did not run for ``STALE`` seconds did not beat, so every peer's board counted it
# silent. The stop is used only when this rank's own wait failed with no record on the board and
# the store answering (``lost``), and only when it ended within that wait's timeout (plus
# ``STALE``) of the failure; an operation that returns forgets it (``standing``), and so does
# every failure, used or not. The rank then writes the record naming itself ("stopped answering:
# it was stopped (frozen) for 3.1 s, and the other ranks gave up on it"), which a slower survivor
# reads too. The cases it does not cover, and the wrong blame it replaced: notes/wire.md,
# "Failures" ("A continued store's host").
def standing(topology: Topology, what: str) -> None:
    """Raise the job's failure record if the board holds one, read now (one store read; none
    once this rank knows of a record), after aborting the job's groups on this rank: called
    before an operation returns, so that a rank continued after the others gave up on it fails
    even when its last collective finished (NOTE [a continued rank], point 2). ``what`` says
    what this rank waited for, as ``wait``'s errors do. With no record, it forgets a stop of this
    process (NOTE [a stopped process])."""
    failure = WATCHDOG.read(topology.board)
    if failure is None:
        WATCHDOG.forget_stop()  # NOTE [a stopped process]
        return
    abort_job(topology.board)
    WATCHDOG.linger(topology.board)
    raise failure.error(topology.board, topology.rank, what)


def _without_store(board: Board, rank: int, what: str, seconds: str) -> PipelineError:
    """The error when the job's store does not answer: its host's failure, kept on this rank
    alone (no board to write it on); this rank's groups are aborted, so that the ranks waiting on
    it fail at once (NOTE [the store's host] in fpipe/_distributed/_faults.py)."""
    hosts = ", which it hosts," if store_host() is not None else ""
    if WATCHDOG.store_gone(board):
        failure = board.failure_of(store_host(), DIED, f"died: the job's store{hosts} is gone")
    else:
        failure = board.failure_of(
            store_host(),
            SILENT,
            f"stopped answering: the job's store{hosts} does not answer, so it is frozen or dead; rank {rank} "
            f"stopped waiting (its timeout: {seconds} s)",
        )
    board.failure = failure
    abort_job(board)
    return failure.error(board, rank, what)


def _first_silent(board: Board) -> int | None:
    """The first rank whose heartbeat stops within ``2 * STALE`` seconds (``None``: none does, or
    another rank's finding reached the board first, which then stands): which rank of a
    collective died, as its connection closing does not say."""
    deadline = time.monotonic() + 2 * STALE
    with waiting(board):
        while time.monotonic() < deadline and board.failure is None:
            silent = board.silent()
            if silent:
                return silent[0]
            time.sleep(BEAT / 5)
    return None


_BROKEN: dict[int, str] = {}  # id(pipeline group) -> why it can no longer be used


def mark_broken(topology: Topology, error: BaseException) -> None:
    """Remember that a step failed mid-flight on this group (see ``check_usable``)."""
    _BROKEN[id(topology.group)] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def check_usable(topology: Topology) -> None:
    """Raise if an earlier step failed on this group: its messages may still be on the wire."""
    why = _BROKEN.get(id(topology.group))
    if why is not None:
        raise PipelineError(
            f"fpipe: rank {topology.rank} cannot run a step: an earlier step failed on this process group "
            f"({why}), and that step's messages may still be in flight. Re-create the process group "
            "(destroy_process_group, init_process_group) and the pipeline, or restart the job.",
            rank=topology.rank,
        )


def handshake(topology: Topology, status: S, timeout: float, what: str) -> list[S]:
    """Each pipeline rank's ``status`` (NOTE [one status codec] in fpipe/_distributed/_status.py),
    all-gathered as its fixed number of words, on the handshake's device (``handshake_device``)."""
    words = all_gather_ints(topology, topology.group, status.encode(), timeout, what, handshake_device(topology))
    return [type(status).decode(w) for w in words]


def handshake_device(topology: Topology) -> torch.device:
    """Where the pipeline group's handshakes run: on the host where the group's backend serves
    it (NOTE [device types in the handshake]), else on the rank's device."""
    device = topology.device
    if device.type != "cpu" and "gloo" in str(dist.get_backend(topology.group)).lower():
        device = torch.device("cpu")
    return device


# NOTE [device types in the handshake]
# Every pipeline rank must run on one device type: a message or collective of a CUDA tensor on
# one rank meets a CPU tensor on the other, and with a multi-device backend ("cpu:gloo,cuda:nccl")
# the two go to different backends and wait for each other until the timeout. Ranks can differ
# when each builds its own mesh (``init_device_mesh("cpu", ...)`` here, ``"cuda"`` there). So the
# step's handshake carries each rank's device type (``device_type_words``, a field of its
# status) and every rank checks them (``mixed_device_types``) before any other message; the
# handshake itself runs on the host wherever the backend serves the host (gloo among its
# backends), so that it reaches every rank whatever its device type. A backend that serves one
# device type only (nccl) gives every rank that type (NOTE [the rank's device] in
# fpipe/_distributed/_topology.py). Only the ranks of one pipeline are compared: data-parallel
# replicas whose pipelines differ in device type from each other are not (their first
# all-reduce waits until the timeout).
DEVICE_TYPE_WORDS = 2  # a device type's name, up to 16 ASCII characters, as int64 words


def device_type_words(device: torch.device) -> tuple[int, ...]:
    """``device``'s type name as ``DEVICE_TYPE_WORDS`` int64 words, for a status field
    (``words(DEVICE_TYPE_WORDS)``)."""
    name = device.type.encode("ascii")[: 8 * DEVICE_TYPE_WORDS].ljust(8 * DEVICE_TYPE_WORDS, b"\0")
    return tuple(int.from_bytes(name[8 * k : 8 * k + 8], "little", signed=True) for k in range(DEVICE_TYPE_WORDS))


def mixed_device_types(device_types: list[tuple[int, ...]]) -> ValueError | None:
    """The error for pipeline ranks on different device types, read from each rank's
    ``device_type_words``, by rank; ``None`` if they agree."""
    if len(set(device_types)) == 1:
        return None
    names = [
        b"".join(w.to_bytes(8, "little", signed=True) for w in word).rstrip(b"\0").decode() for word in device_types
    ]
    by_type = "; ".join(
        f"{name}: ranks {[r for r, n in enumerate(names) if n == name]}" for name in dict.fromkeys(names)
    )
    return ValueError(
        f"fpipe.step: the pipeline ranks run on different device types ({by_type}). Run every rank on one device "
        "type: build the mesh with the same device_type on every rank (init_device_mesh('cuda', ...)), or give "
        "fpipe.Parallelism(group=) a group whose backend serves one device type."
    )


def all_gather_ints(
    topology: Topology, group: Any, values: list[int], timeout: float, what: str, device: torch.device | None = None
) -> list[list[int]]:
    """Each rank of ``group``'s ``values`` (an int vector of the same length on every rank), all-gathered
    on ``device`` (default: the rank's)."""
    mine = torch.tensor(values, dtype=torch.int64, device=topology.device if device is None else device)
    return [t.tolist() for t in _all_gather(topology, group, mine, timeout, what)]


def all_gather_json(topology: Topology, group: Any, value: Any, timeout: float, what: str) -> list[Any]:
    """Each rank of ``group``'s ``value``, as JSON gives it back: the lengths, then the bytes."""
    data = json.dumps(value).encode()
    sizes = [n for (n,) in all_gather_ints(topology, group, [len(data)], timeout, what)]
    buffer = torch.zeros(max(sizes), dtype=torch.uint8)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = _all_gather(topology, group, buffer.to(topology.device), timeout, what)
    hosts = [t[:n].cpu().contiguous() for t, n in zip(every, sizes)]  # named: they outlive the views
    return [json.loads(bytes(tensor_bytes(host))) for host in hosts]


def _all_gather(topology: Topology, group: Any, mine: torch.Tensor, timeout: float, what: str) -> list[torch.Tensor]:
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(every, mine, group=group, async_op=True)
    wait(work, topology.board, timedelta(seconds=timeout), topology.rank, what)
    return every


def gather_over(topology: Topology, groups: Sequence[Any], value: Any, timeout: float, what: str) -> list[Any]:
    """``value`` of every rank of ``groups`` together (JSON), all-gathered over each group in turn:
    each gather's rows are the next one's value, so the result lists the last group's ranks
    outermost, the first group's innermost (``[tp group, dp group, pipeline group]``: pp-major)."""
    rows = [value]
    for group in groups:
        rows = [v for row in all_gather_json(topology, group, rows, timeout, what) for v in row]
    standing(topology, what)  # NOTE [a continued rank]
    return rows


@dataclass(frozen=True)
class _Outcome(Status):
    """What the writer of ``one_writes`` tells the others."""

    failed: bool
    value: Any  # what ``write`` returned (JSON)


class Written(NamedTuple):
    """What ``one_writes`` returns to every rank."""

    ok: bool  # the writer's ``write`` returned (it did not raise)
    value: Any  # what it returned (JSON; ``None`` when it failed)


def one_writes(
    topology: Topology | None, group: Any, write: Callable[[], Any] | None, timeout: float, waits: str, tells: str
) -> Written:
    """One rank writes, the others learn its outcome: the writer (rank 0 of ``group``, passing
    ``write``) runs it and tells the group whether it failed and what it returned (JSON); every
    other rank (``write=None``) waits for that (``waits`` names the wait) and gets ``(ok,
    value)``. The writer gets ``(True, value)``, or raises ``write``'s error once it has told the
    others (``tells`` names its wait; a ``PipelineError`` it raises at once: the board tells
    them). ``group=None`` (or ``topology=None``: one process): no one to tell, so this rank is
    the writer, and a call without ``write`` raises ``ValueError`` (there is no one to wait for;
    it once all-gathered over the default group instead, or failed an assertion)."""
    alone = group is None or topology is None
    if write is None:
        if alone:
            raise ValueError(
                f"fpipe: one_writes without a group has no writer to wait for ({waits}): a rank with no one to "
                "tell is the writer, so pass write="
            )
        assert topology is not None  # (for mypy: not alone)
        outcome = _Outcome.from_json(
            all_gather_json(topology, group, _Outcome(False, None).to_json(), timeout, waits)[0]
        )
        standing(topology, waits)  # NOTE [a continued rank]
        return Written(not outcome.failed, outcome.value)
    try:
        value = write()
    except PipelineError:
        # A rank failed in a collective: the others learn it from the failure board, naming that
        # rank (NOTE [failure board] in fpipe/_distributed/_faults.py), not from a status that
        # would only say that the writer failed.
        raise
    except BaseException:
        if not alone:
            assert topology is not None  # (for mypy)
            with contextlib.suppress(Exception):  # the error to raise is write's
                all_gather_json(topology, group, _Outcome(True, None).to_json(), timeout, tells)
        raise
    if not alone:
        assert topology is not None  # (for mypy)
        all_gather_json(topology, group, _Outcome(False, value).to_json(), timeout, tells)
        standing(topology, tells)  # NOTE [a continued rank]
    return Written(True, value)


def meet(topology: Topology, group: Any, timeout: float, what: str) -> None:
    """Return once every rank of ``group`` has called ``meet`` too (one all-reduce of a zero,
    under the failure board): a rank that failed never comes, and the board fails the others."""
    all_reduce_sum(topology, group, [torch.zeros(1, dtype=torch.float64, device=topology.device)], timeout, what)


def all_reduce_sum(topology: Topology, group: Any, tensors: list[torch.Tensor], timeout: float, what: str) -> None:
    """Sum ``tensors`` in place over ``group``, one all-reduce per dtype (complex as real), on
    ``topology.device`` (CUDA for NCCL). All ranks must pass the same dtypes in the same order."""
    all_reduce_sum_async(topology, group, tensors, timeout, what).wait()


# The mesh's groups by dimension: the topology's attribute and how messages name the group.
_GROUPS = {
    "pp": ("group", None),
    "dp": ("data_group", "data-parallel"),
    "ep": ("expert_group", "expert-parallel"),
    "tp": ("tensor_group", "tensor-parallel"),
}


def sum_over(topology: Topology, dims: Sequence[str], tensors: list[torch.Tensor], timeout: float, what: str) -> None:
    """Sum ``tensors`` in place over the groups of the mesh dimensions ``dims`` in turn (``"pp"``,
    ``"dp"``, ``"tp"``; a dimension the mesh lacks is skipped): after ``("pp", "dp", "tp")`` each
    rank holds the sum over every rank of the mesh. ``what`` names the wait (the pipeline
    group's; the others' say "over the data-parallel group" after it)."""
    for dim in dims:
        attribute, name = _GROUPS[dim]
        group = getattr(topology, attribute)
        if group is not None:
            all_reduce_sum(topology, group, tensors, timeout, what if name is None else f"{what} over the {name} group")
    standing(topology, what)  # NOTE [a continued rank]


def any_rank(topology: Topology, dims: Sequence[str], found: bool, timeout: float, what: str) -> bool:
    """Whether any rank of the groups of ``dims`` (``sum_over``) says ``found``: every rank gets
    the same answer, so they all act alike (skip a step, fail together)."""
    flag = torch.tensor([float(found)], dtype=torch.float64, device=topology.device)
    sum_over(topology, dims, [flag], timeout, what)
    return flag.item() > 0


def norm_over(topology: Topology | None, dims: Sequence[str], square_sum: torch.Tensor, timeout: float) -> torch.Tensor:
    """The global 2-norm on every rank: the square root of this rank's float64 ``square_sum``
    summed over the groups of ``dims`` (``sum_over``; in one process, ``topology=None``, its own).
    ``step.global_norm`` says which ranks' sums count which gradients."""
    if topology is not None:
        buffer = square_sum.reshape(1).to(topology.device)
        sum_over(topology, dims, [buffer], timeout, "the global norm all-reduce")
        square_sum = buffer.reshape(()).cpu()
    return square_sum.sqrt()


# NOTE [an agreed inf/nan check]
# Every rank must skip a step, and move its scale, alike, or the ranks' parameters and scales
# part. Each rank sees only its own gradients: its stages' (summed over the pipeline group),
# its replica's (or its shards' only, with shard_params: summed over the data-parallel
# group) and its tensor-parallel pieces (a sharded weight's gradient is never summed over tp,
# and a DTensor's own isfinite().all() reads the local piece only, as a Partial: summed over
# the tensor-parallel group). The three sums in turn reach every rank of the mesh.
def any_inf_nan(topology: Topology | None, timeout: float, found: bool) -> bool:
    """Whether any rank of the mesh found ``inf``/``nan`` in its gradients (NOTE [an agreed inf/nan
    check]): the same answer on every rank; ``found`` itself in one process (``topology=None``)."""
    if topology is None:
        return found
    return any_rank(topology, ("pp", "dp", "tp"), found, timeout, "the loss scaling's inf/nan check")


class PendingSum:
    """Posted all-reduces (``all_reduce_sum_async``); ``wait`` copies the sums into the tensors."""

    def __init__(self, topology: Topology, timeout: float, what: str) -> None:
        self._topology = topology
        self._timeout = timedelta(seconds=timeout)
        self._what = what
        self._buckets: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    def wait(self) -> None:
        """Wait (with the timeout, failures through ``wait``) and copy the sums back, once."""
        buckets, self._buckets = self._buckets, []
        for work, flat, members in buckets:
            wait(work, self._topology.board, self._timeout, self._topology.rank, self._what)
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def all_reduce_sum_async(
    topology: Topology, group: Any, tensors: list[torch.Tensor], timeout: float, what: str
) -> PendingSum:
    """``all_reduce_sum`` posted, not waited for: the tensors hold the sums once the returned
    ``PendingSum`` is waited for, and must not change before (their values are copied now)."""
    buckets: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        real = torch.view_as_real(t) if t.is_complex() else t
        buckets[real.dtype].append(real)
    pending = PendingSum(topology, timeout, what)
    for members in buckets.values():
        flat = torch.cat([t.reshape(-1).to(topology.device) for t in members])
        pending._buckets.append((dist.all_reduce(flat, group=group, async_op=True), flat, members))
    return pending
