"""One pipeline rank per process over torch.distributed: topology, transport, collectives.

Every rank runs its own row of the program with the shared ``Executor``; only the transport
differs from one process. The protocol (notes/wire.md), per step:

1. Handshake: one all-gather of ``[program checksum, has batch, input error, batch size]`` over
   the pipeline group, so a bad input or a mismatched schedule on any rank fails every rank.
2. Messages: for each ordered pair of ranks, both sides derive from the program the sequence of
   messages the sender will send (activations, cotangents, microbatches for a last stage that
   has no batch, the final loss). Sends are non-blocking; the receiver reads each peer's
   messages in that order (buffering any it does not need yet); each receive is posted when
   the message is needed, with its size known in advance (fpipe/_wire.py). As sends never
   block and the program replays without deadlock (``validate``), no schedule can deadlock on
   any backend.
3. Failure: a rank that fails sends an ERROR meta (failing rank and action) as its next
   message to every peer that still expects one, so a peer waiting on it fails too, and so on.
   A closing all-gather of every rank's status tells the ranks that expected no message from
   a failed one. Every wait has the pipeline's ``timeout``; a dead peer surfaces as a lost connection.
   Messages of the failed step may still be in flight, so the group is marked broken and any
   later step on it raises at once (``check_usable``) instead of reading them as its own.
4. Data parallel: grads (and the loss and a failure flag) of a replica are averaged with one
   all-reduce per dtype over the data-parallel group.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._errors import PipelineError, PipelineTimeoutError
from ._faults import BEAT, DIED, RAISED, SILENT, STALE, WATCHDOG, Board, Failure, waiting
from ._pytree import PyTree
from ._wire import ERROR, Decoder, Encoder, as_bytes, error_message, meta_of
from .schedules._action import BACKWARD, BACKWARD_INPUT, FORWARD, KINDS, Action
from .schedules._program import Program

Key = tuple[str, int, int]  # ("act" | "cot" | "mb" | "result", stage, microbatch)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its pipeline group and, optionally, its data-parallel group."""

    group: Any  # the pipeline ProcessGroup
    rank: int  # position in the pipeline group = pipeline rank
    size: int
    global_ranks: tuple[int, ...]  # pipeline rank -> global rank
    data_group: Any | None
    data_size: int
    device: torch.device
    board: Board  # the job's failure board (NOTE [failure board] in fpipe/_faults.py)


_PIPELINE_DIMS = ("pp", "pipeline")
_DATA_DIMS = ("dp", "data")


def resolve_topology(mesh: Any, group: Any) -> Topology | None:
    """The topology for ``pipeline(..., mesh=...)`` or ``group=...``; ``None`` for one process."""
    if mesh is None and group is None:
        return None
    if mesh is not None and group is not None:
        raise TypeError("fpipe.pipeline: pass mesh= or group=, not both.")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fpipe.pipeline: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group() first (torchrun sets up the environment)."
        )
    data_group = None
    where: dict[int, tuple[int, int | None]] = {}  # global rank -> (pipeline rank, replica)
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1 and not names:
            names = ("pp",)
        pipe = [n for n in names if n in _PIPELINE_DIMS]
        data = [n for n in names if n in _DATA_DIMS]
        if len(pipe) != 1 or len(pipe) + len(data) != mesh.ndim:
            raise ValueError(
                f"fpipe.pipeline: the mesh needs one pipeline dimension named 'pp' and at most one data "
                f"dimension named 'dp' (mesh_dim_names: {mesh.mesh_dim_names!r})."
            )
        group = mesh.get_group(pipe[0])
        data_group = mesh.get_group(data[0]) if data else None
        rows = mesh.mesh.permute(*(names.index(n) for n in (*data, pipe[0])))
        for replica, row in enumerate(rows.reshape(-1, rows.shape[-1]).tolist()):
            where.update({g: (r, replica if data else None) for r, g in enumerate(row)})
    size = dist.get_world_size(group)
    global_ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
    where = where or {g: (r, None) for r, g in enumerate(global_ranks)}
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return Topology(
        group=group,
        rank=dist.get_rank(group),
        size=size,
        global_ranks=global_ranks,
        data_group=data_group,
        data_size=1 if data_group is None else dist.get_world_size(data_group),
        device=device,
        board=WATCHDOG.board(tuple(sorted(where)), [g for g in (group, data_group) if g is not None], where),
    )


def checksum(program: Program) -> int:
    """A checksum of the program, equal on every rank that built the same one."""
    text = f"{program.num_stages}/{program.num_microbatches}/" + "|".join(
        ",".join(map(str, row)) for row in program.ranks
    )
    return zlib.crc32(text.encode())


def messages(program: Program, sender: int, send_microbatches: bool) -> dict[int, list[Key]]:
    """Per receiving rank, the messages ``sender`` sends in one step, in the order it sends them."""
    placement = program.placement()
    last = program.num_stages - 1
    out: dict[int, list[Key]] = defaultdict(list)
    for a in program.ranks[sender]:
        s, i = a.stage, a.microbatch
        if a.kind == FORWARD:
            if s == 0 and send_microbatches and placement[last] != sender:
                out[placement[last]].append(("mb", 0, i))
            if s < last and placement[s + 1] != sender:
                out[placement[s + 1]].append(("act", s, i))
        elif a.kind in (BACKWARD, BACKWARD_INPUT) and s > 0 and placement[s - 1] != sender:
            out[placement[s - 1]].append(("cot", s, i))
    if sender == placement[last]:
        for r in range(program.num_ranks):
            if r != sender:
                out[r].append(("result", last, 0))
    return out


class _Peer:
    """The message streams between this rank and one other pipeline rank, for one step."""

    def __init__(self, rank: int, incoming: list[Key], outgoing: list[Key]) -> None:
        self.rank = rank
        self.incoming = incoming
        self.next_in = 0
        self.outgoing = outgoing
        self.next_out = 0
        self.buffered: dict[Key, PyTree] = {}
        # The next message's receives, when posted ahead (NOTE [receives ahead] in fpipe/_wire.py):
        # its first tensor, its large leaves, and the works of both.
        self.ahead: tuple[torch.Tensor, list[torch.Tensor], list[Any]] | None = None


class WireState:
    """Per-channel layouts that outlive a step, so headers travel only when layouts change."""

    def __init__(self) -> None:
        self.encoders: defaultdict[tuple[int, str, int], Encoder] = defaultdict(Encoder)
        self.decoders: defaultdict[tuple[int, str, int], Decoder] = defaultdict(Decoder)

    def reset(self) -> None:
        """Forget every layout (after a failure, peers may disagree on the last one)."""
        self.encoders.clear()
        self.decoders.clear()


class DistributedTransport:
    """Moves values between stages on this rank (a mailbox) and other ranks (torch.distributed)."""

    def __init__(
        self,
        topology: Topology,
        program: Program,
        microbatches: list[PyTree] | None,
        *,
        send_microbatches: bool,
        wire: WireState,
        timeout: float,
    ) -> None:
        self.topology = topology
        self.me = topology.rank
        self.placement = program.placement()
        self.last = program.num_stages - 1
        self._microbatches = microbatches
        self._wire = wire
        self._timeout = timedelta(seconds=timeout)
        self._seconds = timeout
        self._local: dict[Key, PyTree] = {}
        self._sends: list[tuple[Any, tuple[torch.Tensor, ...]]] = []
        self._concluded = False  # whether this step's closing all-gather has run (``finish``)
        outgoing = messages(program, self.me, send_microbatches)
        self.peers: dict[int, _Peer] = {}
        for r in range(program.num_ranks):
            if r != self.me:
                incoming = messages(program, r, send_microbatches).get(self.me, [])
                if incoming or outgoing.get(r):
                    self.peers[r] = _Peer(r, incoming, outgoing.get(r, []))
        for peer in self.peers.values():
            self._post_ahead(peer)

    # -- the Transport protocol -------------------------------------------------------------

    def microbatch(self, microbatch: int) -> PyTree:
        if self._microbatches is None:
            return self._recv(self.placement[0], ("mb", 0, microbatch))
        value = self._microbatches[microbatch]
        if self.placement[0] == self.me and self.placement[self.last] in self.peers:
            peer = self.peers[self.placement[self.last]]
            if peer.next_out < len(peer.outgoing) and peer.outgoing[peer.next_out] == ("mb", 0, microbatch):
                self._send(peer.rank, ("mb", 0, microbatch), value)
        return value

    def send_activation(self, stage: int, microbatch: int, value: PyTree) -> None:
        self._put(self.placement[stage + 1], ("act", stage, microbatch), value)

    def recv_activation(self, stage: int, microbatch: int) -> PyTree:
        return self._get(self.placement[stage - 1], ("act", stage - 1, microbatch))

    def send_cotangent(self, stage: int, microbatch: int, value: Any) -> None:
        self._put(self.placement[stage - 1], ("cot", stage, microbatch), value)

    def recv_cotangent(self, stage: int, microbatch: int) -> Any:
        return self._get(self.placement[stage + 1], ("cot", stage + 1, microbatch))

    # -- results, completion and failure -----------------------------------------------------

    def exchange_result(self, result: PyTree | None) -> PyTree:
        """The last stage's rank sends ``result`` to every other rank; the others receive it."""
        holder = self.placement[self.last]
        if holder == self.me:
            for peer in self.peers.values():
                self._send(peer.rank, ("result", self.last, 0), result)
            return result
        return self._recv(holder, ("result", self.last, 0))

    def finish(self) -> None:
        """Agree with every rank that the step succeeded, then wait for this step's sends; every
        expected message must have been read.

        A rank that failed tells the peers that still expect a message from it (``abort``), but
        a peer may expect none (rank 1 of 3 failing in a backward, once its activations are all
        with rank 2): only the step's closing all-gather tells that peer, which would otherwise
        wait for its sends to rank 1 until the timeout.
        """
        failure = self._conclude(None)
        if failure is not None:
            self._remote_failure(*failure)
        for work, _ in self._sends:
            self._wait(work, "a send to complete", None)
        self._sends.clear()
        for peer in self.peers.values():
            assert peer.next_in == len(peer.incoming) and not peer.buffered, "fpipe: unread messages"

    def abort(self, error: BaseException, action: Action | None) -> None:
        """Tell the other ranks that the step failed: ``error``, raised on this rank in ``action``.

        The board gets the failure first (the record that stands: an earlier one, when
        ``error`` comes from a failure elsewhere); then every peer that still expects a message
        from this rank gets an ERROR meta saying so, and when every rank is alive (a stage
        raised) the closing all-gather tells the rest.
        """
        board = self.topology.board
        standing = WATCHDOG.report(board, self._failure(error, action))
        rank = -1 if standing.rank is None or standing.replica not in (None, self._replica()) else standing.rank
        code = [rank, -1, -1, -1]
        if standing.action is not None:
            code = [rank, standing.action.stage, KINDS.index(standing.action.kind), standing.action.microbatch]
        works: list[Any] = []
        for peer in self.peers.values():
            if peer.next_out < len(peer.outgoing):
                # Sized as the receive the peer posts for the message it expects next.
                expected = self._wire.encoders[_channel(peer.rank, peer.outgoing[peer.next_out])].expected
                message = error_message(code, expected, self.topology.device)
                with contextlib.suppress(RuntimeError):  # that peer is gone: the board tells the others
                    works.append(dist.isend(message, self.topology.global_ranks[peer.rank], group=self.topology.group))
        if not self._concluded and standing.kind == RAISED:  # (a lost rank never joins)
            with contextlib.suppress(PipelineError):  # the board tells those this misses
                self._conclude(code)
                # Every rank has stopped its row: a peer that has not read its error meta by now
                # never will (the failed rank itself), and waiting for it would only time out.
                works = []
        for work in works:
            with contextlib.suppress(RuntimeError):  # the peer is gone or stuck: it learns from the board
                work.wait(timeout=timedelta(seconds=min(self._seconds, 10.0)))
        self._wire.reset()

    def _failure(self, error: BaseException, action: Action | None) -> Failure:
        """This rank's failure for ``error`` raised in ``action`` (an error from a failure
        elsewhere names that one, which the board already holds)."""
        replica = self._replica()
        if isinstance(error, PipelineError) and error.action is not None:
            action = error.action
        if action is None:
            return Failure(self.me, None, RAISED, f"failed outside any action ({type(error).__name__})", replica)
        what = "loss_fn failed in" if isinstance(error, PipelineError) and error.in_loss_fn else "failed in"
        if isinstance(error, KeyboardInterrupt):
            what = "was interrupted (KeyboardInterrupt) in"
        return Failure(self.me, action, RAISED, f"{what} {action.describe()}; its own error says why", replica)

    def _replica(self) -> int | None:
        me = self.topology.global_ranks[self.me]
        return self.topology.board.names.get(me, (self.me, None))[1]

    def _conclude(self, failure: list[int] | None) -> list[int] | None:
        """The step's closing all-gather of ``[failed, rank, stage, kind, microbatch]`` over the
        pipeline group (``failure``: this rank's code as in ``abort``); the first failure's code."""
        self._concluded = True
        mine = [0, 0, 0, 0, 0] if failure is None else [1, *failure]
        statuses = handshake(self.topology, mine, self._seconds, "the other pipeline ranks at the end of the step")
        return next((status[1:] for status in statuses if status[0]), None)

    # -- messages ------------------------------------------------------------------------------

    def _put(self, dst: int, key: Key, value: PyTree) -> None:
        if dst == self.me:
            self._local[key] = value
        else:
            self._send(dst, key, value)

    def _get(self, src: int, key: Key) -> PyTree:
        if src == self.me:
            return self._local.pop(key)
        return self._recv(src, key)

    def _send(self, dst: int, key: Key, value: PyTree) -> None:
        peer = self.peers[dst]
        assert peer.outgoing[peer.next_out] == key, f"fpipe: sending {key}, expected {peer.outgoing[peer.next_out]}"
        tensors = self._wire.encoders[_channel(dst, key)].encode(value, self.topology.device)
        peer.next_out += 1
        to, group = self.topology.global_ranks[dst], self.topology.group
        for tensor in tensors:
            try:
                work = dist.isend(tensor, to, group=group)
            except RuntimeError as error:  # the peer is gone: not the stage's fault
                what = f"{_describe(key)} to be sent to rank {dst}"
                raise lost(WATCHDOG.current, error, self.me, what, to, self._timeout) from error
            self._sends.append((work, (tensor,)))

    def _recv(self, src: int, key: Key) -> PyTree:
        peer = self.peers[src]
        while key not in peer.buffered:
            self._read(peer)
        return peer.buffered.pop(key)

    def _post_ahead(self, peer: _Peer) -> None:
        """Post the receives of the peer's next message now if its channel carries large leaves
        (NOTE [receives ahead] in fpipe/_wire.py): they land while this rank computes."""
        if peer.next_in == len(peer.incoming):
            return
        decoder = self._wire.decoders[_channel(peer.rank, peer.incoming[peer.next_in])]
        if decoder.ahead:
            first, large = decoder.first_buffer(self.topology.device), decoder.large_leaves(None, self.topology.device)
            src, group = self.topology.global_ranks[peer.rank], self.topology.group
            peer.ahead = (first, large, [dist.irecv(t, src, group=group) for t in (first, *map(as_bytes, large))])

    def _read(self, peer: _Peer) -> None:
        key = peer.incoming[peer.next_in]
        what = _describe(key)
        decoder = self._wire.decoders[_channel(peer.rank, key)]
        src, group = self.topology.global_ranks[peer.rank], self.topology.group
        works: list[Any] = []
        if peer.ahead is None:  # posted when needed: small messages (NOTE [receives ahead])
            first, large = decoder.first_buffer(self.topology.device), None
            self._wait(dist.irecv(first, src, group=group), what, peer.rank)
        else:
            (first, large, works), peer.ahead = peer.ahead, None
            self._wait(works.pop(0), what, peer.rank)
        peer.next_in += 1
        meta = meta_of(first)
        if meta[0] == ERROR:
            self._remote_failure(*meta[1:5])
        header, packed = decoder.opened(meta, self.topology.device)
        if header is not None:  # a new layout, with the new shapes: what was posted ahead is padding
            for work in works:
                self._wait(work, what, peer.rank)
            works, large = [], None
            self._wait(dist.irecv(header, src, group=group), what, peer.rank)
        buffers = [t for t in (packed,) if t is not None and t.numel()]
        if large is None:
            large = decoder.large_leaves(header, self.topology.device)
            buffers += map(as_bytes, large)
        works += [dist.irecv(t, src, group=group) for t in buffers]
        for work in works:
            self._wait(work, what, peer.rank)
        peer.buffered[key] = decoder.decode(first, packed, large)
        self._post_ahead(peer)

    def _remote_failure(self, rank: int, stage: int, kind_index: int, microbatch: int) -> None:
        """Raise the failure an ERROR meta or the closing all-gather reports: the board's record,
        or the sender's code when the board does not answer."""
        standing = WATCHDOG.read(self.topology.board)
        if standing is None:
            action = None if kind_index < 0 else Action(stage, KINDS[kind_index], microbatch)
            where = "outside any action" if action is None else f"in {action.describe()}"
            subject = None if rank < 0 else self.topology.global_ranks[rank]
            standing = self.topology.board.failure_of(subject, RAISED, f"failed {where}; its own error says why")
            standing = Failure(standing.rank, action, RAISED, standing.what, standing.replica)
        raise standing.error(self.me)

    def _wait(self, work: Any, what: str, peer: int | None) -> None:
        if peer is None:
            wait(work, self._timeout, self.me, what)
        else:
            wait(work, self._timeout, self.me, f"{what} from rank {peer}", self.topology.global_ranks[peer])


def wait(work: Any, timeout: timedelta, rank: int, what: str, peer: int | None = None) -> None:
    """``work.wait`` with a timeout. A failure raises a ``PipelineError`` that says what ``rank``
    was waiting for and names the rank that failed (NOTE [failure board] in fpipe/_faults.py);
    the backend's error is chained. ``peer``: the global rank a receive waits on (``None``: a
    collective)."""
    board = WATCHDOG.current
    try:
        with waiting(board):
            work.wait(timeout=timeout)
    except RuntimeError as error:
        raise lost(board, error, rank, what, peer, timeout) from error


def lost(
    board: Board | None, error: BaseException, rank: int, what: str, peer: int | None, timeout: timedelta
) -> PipelineError:
    """The error for a backend ``error`` while pipeline rank ``rank`` waited for ``what``.

    In a step, the board's record if there is one (the failure that aborted this wait), else
    this rank's finding, written on the board for the others: a silent rank (the wait timed
    out: the ranks whose heartbeat stopped, or unknown) or a dead one (its connection closed).
    """
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    seconds = f"{timeout.total_seconds():g}"
    if board is None:
        if timed_out:
            return PipelineTimeoutError(
                f"fpipe: rank {rank} timed out after {seconds} s waiting for {what}. A peer has probably died "
                "or hung; if it is just slow, raise pipeline(..., timeout=).",
                rank=rank,
            )
        return PipelineError(f"fpipe: rank {rank} lost a peer while waiting for {what} ({text}).", rank=rank)
    standing = WATCHDOG.read(board)
    if standing is not None:
        return standing.error(rank, what)
    if timed_out:
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
                "(if stages are just slow, raise pipeline(..., timeout=))",
            )
    else:
        failure = board.failure_of(
            peer if peer is not None else _first_silent(board),
            DIED,
            f"died: a connection closed while rank {rank} waited",
        )
    return WATCHDOG.report(board, failure).error(rank, what)


def _first_silent(board: Board) -> int | None:
    """The first rank whose heartbeat stops within ``2 * STALE`` seconds (``None``: none does):
    which rank of a collective died, as its connection closing does not say."""
    deadline = time.monotonic() + 2 * STALE
    with waiting(board):
        while time.monotonic() < deadline:
            silent = board.silent()
            if silent:
                return silent[0]
            time.sleep(BEAT / 2)
    return None


def _channel(peer: int, key: Key) -> tuple[int, str, int]:
    """The wire channel a message travels on: the peer, the kind and the stage (one layout history each)."""
    return peer, key[0], key[1]


def _describe(key: Key) -> str:
    kind, s, i = key
    return {
        "act": f"the activation of stage {s} for microbatch {i}",
        "cot": f"the cotangent from stage {s} for microbatch {i}",
        "mb": f"microbatch {i} (for the last stage's loss_fn)",
        "result": "the loss from the last stage",
    }[kind]


_BROKEN: dict[int, str] = {}  # id(pipeline group) -> why it can no longer be used


def mark_broken(topology: Topology, error: BaseException) -> None:
    """Remember that a step failed mid-flight on this group (see ``check_usable``)."""
    _BROKEN[id(topology.group)] = f"{type(error).__name__}: {str(error).splitlines()[0]}"


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


def handshake(
    topology: Topology,
    status: list[int],
    timeout: float,
    what: str = "the other pipeline ranks at the start of the step",
) -> list[list[int]]:
    """All-gather each pipeline rank's ``status`` vector (same length on every rank)."""
    mine = torch.tensor(status, dtype=torch.int64, device=topology.device)
    every = [torch.empty_like(mine) for _ in range(topology.size)]
    work = dist.all_gather(every, mine, group=topology.group, async_op=True)
    wait(work, timedelta(seconds=timeout), topology.rank, what)
    return [t.tolist() for t in every]


def all_reduce_sum(topology: Topology, group: Any, tensors: list[torch.Tensor], timeout: float, what: str) -> None:
    """Sum ``tensors`` in place over ``group``, one all-reduce per dtype (complex as real)."""
    buckets: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        real = torch.view_as_real(t) if t.is_complex() else t
        buckets[real.dtype].append(real)
    for members in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        work = dist.all_reduce(flat, group=group, async_op=True)
        wait(work, timedelta(seconds=timeout), topology.rank, what)
        offset = 0
        for t in members:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
