"""The distributed transport: the messages between pipeline ranks in one step, and their failure path.

Every rank runs its own row of the program with the shared ``Executor``; only the transport
differs from one process. The protocol (notes/wire.md), per step:

1. Handshake: one all-gather of ``[program checksum, microbatches, has batch, input error, batch size,
   ...]`` over the pipeline group, of a fixed size, so a bad input or a mismatched schedule on any rank
   fails every rank (NOTE [a handshake of fixed size] in fpipe/_distributed/_rank_step.py).
2. Messages: for each ordered pair of ranks, both sides derive from the program the sequence of
   messages the sender will send (activations, cotangents, microbatches for a last stage that
   has no batch, the final loss). Sends are non-blocking; the receiver reads each peer's
   messages in that order (buffering any it does not need yet); each receive is posted when
   the message is needed, with its size known in advance (fpipe/_distributed/_wire.py). As sends never
   block and the program replays without deadlock (``validate``), no schedule can deadlock on
   any backend. A send's tensors are let go as soon as the send has completed (NOTE [sends
   released]).
3. Failure: a rank that fails sends an ERROR meta (failing rank and action) as its next
   message to every peer that still expects one, so a peer waiting on it fails too, and so on.
   A closing all-gather of every rank's status tells the ranks that expected no message from
   a failed one. Every wait has the pipeline's ``timeout``; a dead peer surfaces as a lost connection.
   Messages of the failed step may still be in flight, so the group is marked broken and any
   later step on it raises at once (``check_usable``) instead of reading them as its own.
4. Data parallel: a replica's grads are averaged over the data-parallel group stage by stage,
   each stage's all-reduce (per dtype) posted at its last action; then the loss.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PipelineError
from .._pytree import PyTree
from ..schedules import Action, Program, Simulation
from ._board import RAISED, Failure, waiting
from ._collectives import all_gather_json, handshake, lost, mark_broken, peer_lost_in_stage, wait
from ._faults import WATCHDOG
from ._messages import Key, Route, ahead, plan
from ._sends import Waiter
from ._status import Status
from ._topology import Topology
from ._wire import ERROR, Decoder, Encoder, FailureCode, as_bytes, error_code, error_message, meta_of


@dataclass(frozen=True)
class _Concluded(Status):
    """One pipeline rank's word in the step's closing all-gather (``_conclude``)."""

    failed: bool  # the step failed on this rank
    code: FailureCode  # how (zeros when it did not)


class _Peer:
    """The message streams between this rank and one other pipeline rank, for one step."""

    def __init__(self, route: Route, waiter: Waiter | None) -> None:
        self.rank = route.peer
        self.incoming = route.incoming
        self.next_in = 0
        self.outgoing = route.outgoing
        self.sent_at = route.sent_at  # the position of the action that sends each
        self.next_out = 0
        # This rank's sends not yet known to have completed (NOTE [sends released] in _sends.py): on gloo
        # with the peer's ``Waiter``, else here, oldest first, as (the work, its tensor).
        self.waiter = waiter
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()
        self.buffered: dict[Key, PyTree] = {}
        # The next message's receives, when posted ahead (NOTE [receives ahead] in fpipe/_distributed/_wire.py):
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
        record: Callable[[Key, PyTree], None] | None = None,
    ) -> None:
        self.topology = topology
        self._record = record  # told each message received (NOTE [compiled rows] in fpipe/_distributed/_compiled.py)
        self.me = topology.rank
        self._program = program
        self._where = program.placement_by_microbatch()  # the rank of each stage and microbatch
        self.last = program.num_stages - 1
        self._microbatches = microbatches
        self._feeder = program.placement()[0]  # the batch's rank (stage 0's first holder)
        self._fed = send_microbatches and self.me != self._feeder  # it sends this rank its microbatches
        self._ahead = ahead(program, self.me) if send_microbatches else []  # sent as the row starts (``running``)
        self._wire = wire
        self._timeout = timedelta(seconds=timeout)
        self._seconds = timeout
        self._local: dict[Key, PyTree] = {}
        self._errors: list[tuple[Any, torch.Tensor]] = []  # ``abort``'s ERROR metas, never waited for
        self._concluded = False  # whether this step's closing all-gather has run (``close``)
        routes, self._needed = plan(program, self.me, send_microbatches)
        self._now = -1  # the position of the action that needed the message read last
        self._in_order = topology.device.type != "cpu"  # NOTE [receives ahead in stream order]
        gloo = dist.get_backend(topology.group) == "gloo"  # NOTE [sends released] in fpipe/_distributed/_sends.py
        self.peers = {route.peer: _Peer(route, Waiter(topology.group) if gloo else None) for route in routes}
        for peer in self.peers.values():
            self._post_ahead(peer)

    # -- the Transport protocol -------------------------------------------------------------

    def microbatch(self, microbatch: int) -> PyTree:
        if self._fed:
            return self._recv(self._feeder, ("mb", 0, microbatch))
        assert self._microbatches is not None
        value = self._microbatches[microbatch]
        first, last = self._where[0][microbatch], self._where[self.last][microbatch]
        if first == self.me and last in self.peers:
            peer = self.peers[last]
            if peer.next_out < len(peer.outgoing) and peer.outgoing[peer.next_out] == ("mb", 0, microbatch):
                self._send(peer.rank, ("mb", 0, microbatch), value)
        return value

    def send_activation(self, stage: int, microbatch: int, value: PyTree) -> None:
        self._put(self._where[stage + 1][microbatch], ("act", stage, microbatch), value)

    def recv_activation(self, stage: int, microbatch: int) -> PyTree:
        return self._get(self._where[stage - 1][microbatch], ("act", stage - 1, microbatch))

    def send_cotangent(self, stage: int, microbatch: int, value: Any) -> None:
        self._put(self._where[stage - 1][microbatch], ("cot", stage, microbatch), value)

    def recv_cotangent(self, stage: int, microbatch: int) -> Any:
        return self._get(self._where[stage + 1][microbatch], ("cot", stage + 1, microbatch))

    # -- the run's side (``RunTransport`` in fpipe/_run.py): results, completion and failure ----

    # NOTE [tensor-parallel waits]
    # With a tp or an ep dimension, stages wait in collectives of their own (DTensor's, the
    # experts' all-to-alls), which fpipe's waits do not see; the whole row of actions counts as
    # waiting, so the watchdog reads the board every POLL and aborts the groups when another
    # rank failed.
    def running(self) -> waiting:
        """The context the row's actions run in (NOTE [tensor-parallel waits]); the microbatches
        this rank sends before its row (``ahead``) go first."""
        assert not self._ahead or self._microbatches is not None
        for r, i in self._ahead:
            self._send(r, ("mb", 0, i), self._microbatches[i])  # type: ignore[index]
        return waiting(self.topology.board if self.topology.stage_collectives else None)

    def share_grads(self, grads: dict[int, PyTree]) -> dict[int, list[PyTree]]:
        """For each stage this rank holds with others (NOTE [a stage on several ranks] in
        fpipe/schedules/_program.py), its gradient sum (``grads``) sent to the other holders,
        and every holder's, in holder order (NOTE [after the row] in fpipe/_distributed/_messages.py)."""
        for s, tree in grads.items():
            for r in self._program.holders(s):
                if r != self.me:
                    self._send(r, ("grad", s, 0), tree)
        return {
            s: [tree if r == self.me else self._recv(r, ("grad", s, 0)) for r in self._program.holders(s)]
            for s, tree in grads.items()
        }

    def gather_losses(self, losses: tuple[dict[int, Any], ...]) -> tuple[dict[int, Any], ...] | None:
        """The last stage's microbatch losses of every holder, on its first holder; ``None`` on
        another holder, which sends its own there (NOTE [after the row] in fpipe/_distributed/_messages.py)."""
        holders = self._program.holders(self.last)
        if self.me != holders[0]:
            self._send(holders[0], ("losses", self.last, 0), losses)
            return None
        merged = tuple(dict(part) for part in losses)
        for r in holders[1:]:
            for part, theirs in zip(merged, self._recv(r, ("losses", self.last, 0))):
                part.update(theirs)
        return merged

    def exchange_result(self, result: PyTree | None) -> PyTree:
        """The last stage's rank sends ``result`` to every other rank; the others receive it."""
        holder = self._program.holders(self.last)[0]
        if holder == self.me:
            for peer in self.peers.values():
                self._send(peer.rank, ("result", self.last, 0), result)
            return result
        return self._recv(holder, ("result", self.last, 0))

    def close(self) -> None:
        """Agree with every rank that the step succeeded, then wait for this step's sends; every
        expected message must have been read.

        A rank that failed tells the peers that still expect a message from it (``abort``), but
        a peer may expect none (rank 1 of 3 failing in a backward, once its activations are all
        with rank 2): only the step's closing all-gather tells that peer, which would otherwise
        wait for its sends to rank 1 until the timeout.
        """
        failure = self._conclude(None)
        if failure is not None:
            self._remote_failure(failure)
        for peer in self.peers.values():
            self._release(peer, every=True)
            if peer.waiter is not None:
                peer.waiter.join(self._seconds)
        self._sent()
        for peer in self.peers.values():
            assert peer.next_in == len(peer.incoming) and not peer.buffered, "fpipe: unread messages"

    def gather_timeline(self, timeline: Simulation) -> Simulation:
        """``timeline`` with every pipeline rank's own row (``gathered``)."""
        return gathered(timeline, self.topology, self._seconds)

    def abort(self, error: BaseException, action: Action | None) -> None:
        """Tell the other ranks that the step failed: ``error``, raised on this rank in ``action``;
        the group can no longer be used (``mark_broken``).

        The board gets the failure first (the record that stands: an earlier one, when
        ``error`` comes from a failure elsewhere); then every peer that still expects a message
        from this rank gets an ERROR meta saying so, and when every rank is alive (a stage
        raised) the closing all-gather tells the rest. The error metas are a fast path, not
        waited for: a peer that has stopped reading (it left on the board's word, or it is the
        lost rank) would hold this rank for the timeout, and the board reaches every rank anyway.
        """
        mark_broken(self.topology, error)
        board = self.topology.board
        peer_lost_in_stage(self.topology, error, self._seconds)  # its record first, if so
        standing = WATCHDOG.report(board, self._failure(error, action))
        rank = -1 if standing.rank is None or standing.replica not in (None, self._replica()) else standing.rank
        code = FailureCode.of(rank, standing.action)
        for peer in self.peers.values():
            if peer.next_out < len(peer.outgoing):
                # Sized as the receive the peer posts for the message it expects next.
                expected = self._wire.encoders[_channel(peer.rank, peer.outgoing[peer.next_out])].expected
                message = error_message(code, expected, self.topology.device)
                with contextlib.suppress(RuntimeError):  # that peer is gone: the board tells the others
                    work = dist.isend(message, self.topology.global_ranks[peer.rank], group=self.topology.group)
                    self._errors.append((work, message))
        if not self._concluded and standing.kind == RAISED:  # (a lost rank never joins)
            with contextlib.suppress(PipelineError):  # the board tells those this misses
                self._conclude(code)
        self._wire.reset()
        for peer in self.peers.values():  # (after the closing all-gather: no rank reads any more)
            if peer.waiter is not None:
                peer.waiter.leave(aborted=self.topology.board.aborted)

    def _failure(self, error: BaseException, action: Action | None) -> Failure:
        """This rank's failure for ``error`` raised in ``action`` (an error from a failure
        elsewhere names that one, which the board already holds)."""
        board, me = self.topology.board, self.topology.global_ranks[self.me]
        if isinstance(error, PipelineError) and error.action is not None:
            action = error.action
        if action is None:
            return board.failure_of(me, RAISED, f"failed outside any action ({type(error).__name__})")
        what = "loss_fn failed in" if isinstance(error, PipelineError) and error.in_loss_fn else "failed in"
        if isinstance(error, KeyboardInterrupt):
            what = "was interrupted (KeyboardInterrupt) in"
        return board.failure_of(me, RAISED, f"{what} {action.describe()}; its own error says why", action)

    def _replica(self) -> int | None:
        me = self.topology.global_ranks[self.me]
        return self.topology.board.names.get(me, (self.me, None))[1]

    def _conclude(self, failure: FailureCode | None) -> FailureCode | None:
        """The step's closing all-gather of each rank's ``_Concluded`` over the pipeline group
        (``failure``: this rank's code as in ``abort``); the first failure's code."""
        self._concluded = True
        mine = _Concluded(False, FailureCode(0, 0, 0, 0)) if failure is None else _Concluded(True, failure)
        statuses = handshake(self.topology, mine, self._seconds, "the other pipeline ranks at the end of the step")
        return next((status.code for status in statuses if status.failed), None)

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
        ranks = None if self.topology.tensor_ranks is None else list(self.topology.tensor_ranks)
        tensors = self._wire.encoders[_channel(dst, key)].encode(value, self.topology.device, ranks)
        peer.next_out += 1
        if peer.pending:
            self._release(peer)  # those the backend says are done (NOTE [sends released] in _sends.py)
        to, group = self.topology.global_ranks[dst], self.topology.group
        for tensor in tensors:
            try:
                work = dist.isend(tensor, to, group=group)
            except RuntimeError as error:  # the peer is gone: not the stage's fault
                what = f"{_describe(key)} to be sent to rank {dst}"
                raise lost(self.topology.board, error, self.me, what, to, self._timeout) from error
            if peer.waiter is not None:
                self._sent()
                peer.waiter.put(work, tensor, f"{_describe(key)} to be sent to rank {dst}", to)
            else:
                peer.pending.append((work, tensor))

    def _release(self, peer: _Peer, *, every: bool = False) -> None:
        """Let go of the oldest sends to ``peer`` whose work says it is done (NOTE [sends
        released]), or of ``every`` one once it is (``close``: the peer has read them all)."""
        pending = peer.pending
        while pending and (every or pending[0][0].is_completed()):
            work, _ = pending.popleft()
            wait(work, self.topology.board, self._timeout, self.me, "a send to complete")

    def _sent(self) -> None:
        """Raise the failure of a send a ``Waiter`` waited for, as this thread's own wait would."""
        for peer in self.peers.values():
            failed = None if peer.waiter is None else peer.waiter.failed
            if failed is not None:
                error, what, to = failed
                raise lost(self.topology.board, error, self.me, what, to, self._timeout) from error

    def held(self) -> int:
        """Bytes of this rank's sends not yet known to have completed (NOTE [sends released] in _sends.py)."""
        waiting = sum(peer.waiter.held() for peer in self.peers.values() if peer.waiter is not None)
        return waiting + sum(t.numel() * t.element_size() for peer in self.peers.values() for _, t in peer.pending)

    def _recv(self, src: int, key: Key) -> PyTree:
        peer = self.peers[src]
        while key not in peer.buffered:
            self._read(peer)
        value = peer.buffered.pop(key)
        if self._record is not None:
            self._record(key, value)
        return value

    def _post_ahead(self, peer: _Peer) -> None:
        """Post the receives of the peer's next message now if its channel carries large leaves
        (NOTE [receives ahead] in fpipe/_distributed/_wire.py): they land while this rank computes;
        or its ``first`` alone, if the next action needs it (NOTE [small receives ahead])."""
        if peer.next_in == len(peer.incoming):
            return
        key = peer.incoming[peer.next_in]
        decoder = self._wire.decoders[_channel(peer.rank, key)]
        if self._in_order and not ahead_is_safe(peer.sent_at, peer.next_out, self._needed[key]):
            return
        if decoder.ahead or self._needed[key] <= self._now + 1:
            first = decoder.first_buffer(self.topology.device)
            large = decoder.large_leaves(None, self.topology.device) if decoder.ahead else []
            peer.ahead = (first, large, [self._irecv(t, peer.rank, key) for t in (first, *map(as_bytes, large))])

    def _read(self, peer: _Peer) -> None:
        key = peer.incoming[peer.next_in]
        decoder = self._wire.decoders[_channel(peer.rank, key)]
        works: list[Any] = []
        if peer.ahead is None:  # posted when needed: small messages (NOTE [receives ahead])
            first, large = decoder.first_buffer(self.topology.device), None
            self._wait(self._irecv(first, peer.rank, key), key, peer.rank)
        else:
            (first, large, works), peer.ahead = peer.ahead, None
            self._wait(works.pop(0), key, peer.rank)
        peer.next_in += 1
        meta = meta_of(first)
        if meta[0] == ERROR:
            self._remote_failure(error_code(meta))
        header, packed = decoder.opened(meta, self.topology.device)
        if header is not None:  # a new layout, with the new shapes: what was posted ahead is padding
            for work in works:
                self._wait(work, key, peer.rank)
            works, large = [], None
            self._wait(self._irecv(header, peer.rank, key), key, peer.rank)
        buffers = [t for t in (packed,) if t is not None and t.numel()]
        if large is None:
            large = decoder.large_leaves(header, self.topology.device)
            buffers += map(as_bytes, large)
        works += [self._irecv(t, peer.rank, key) for t in buffers]
        for work in works:
            self._wait(work, key, peer.rank)
        peer.buffered[key] = decoder.decode(first, packed, large, self.topology.tensor_mesh)
        self._now = self._needed[key]
        if peer.pending:
            self._release(peer)
        self._post_ahead(peer)

    def _remote_failure(self, code: FailureCode) -> None:
        """Raise the failure an ERROR meta or the closing all-gather reports: the board's record,
        or the sender's code when the board does not answer."""
        standing = WATCHDOG.read(self.topology.board)
        if standing is None:
            action = code.action()
            where = "outside any action" if action is None else f"in {action.describe()}"
            subject = None if code.rank < 0 else self.topology.global_ranks[code.rank]
            what = f"failed {where}; its own error says why"
            standing = self.topology.board.failure_of(subject, RAISED, what, action)
        raise standing.error(self.topology.board, self.me)

    def _irecv(self, tensor: torch.Tensor, peer: int, key: Key) -> Any:
        """Post a receive into ``tensor`` of (part of) message ``key`` from ``peer``; its work.

        gloo may refuse the receive as it is posted, not only as it is waited for, when the
        peer's connection has closed already (a rank slow to reach this step's transport, whose
        peer failed and exited meanwhile): that fails as a lost peer, as a send does.
        """
        source = self.topology.global_ranks[peer]
        try:
            return dist.irecv(tensor, source, group=self.topology.group)
        except RuntimeError as error:  # the peer is gone: not the stage's fault
            what = f"{_describe(key)} from rank {peer}"
            raise lost(self.topology.board, error, self.me, what, source, self._timeout) from error

    def _wait(self, work: Any, key: Key, peer: int) -> None:
        """Wait for ``work``, a receive of message ``key`` from ``peer``; what it waits for is put
        in words only for an error (a step waits once per message)."""
        source = self.topology.global_ranks[peer]
        wait(work, self.topology.board, self._timeout, self.me, lambda: f"{_describe(key)} from rank {peer}", source)


# NOTE [small receives ahead]
# A message of small leaves only is one ``first`` buffer whose size the receiver knows from the
# channel's history (NOTE [receives ahead] in fpipe/_distributed/_wire.py), so the receiver may
# post it whenever it likes, the sender none the wiser. It posts it as it reads the message
# before on the same channel when the action right after the one that needed that message
# needs this one (``consumers``: GPipe's run of forwards on the last rank, of backwards on the
# first), and else when it needs it: on gloo, every small receive posted ahead makes 1F1B's
# actions dearer (there a receive would be posted two actions ahead, a forward and a backward;
# presumably gloo's reader thread then takes the message during compute, a thread switch on
# busy cores, where a receive posted at need reads what has arrived at once), while posted one
# action ahead both schedules gain (measured by benchmarks/bench_vs_torch.py --per-action-only;
# notes/wire.md, "One step, on every rank", point 3). Large leaves go ahead always: their
# bytes, not a switch, dominate.


def ahead_is_safe(sent_at: Sequence[int], next_out: int, needed_at: int) -> bool:
    """Whether a receive from a peer may be posted now on a backend that runs a pair's sends and
    receives in the order they are posted (NOTE [receives ahead in stream order]): this rank
    sends that peer nothing more (its next send is ``sent_at[next_out]``) before the action at
    position ``needed_at`` that needs the message (a send in that same action comes after the
    receive)."""
    return next_out == len(sent_at) or sent_at[next_out] >= needed_at


# NOTE [receives ahead in stream order]
# On NCCL (and the other accelerator backends) a pair of ranks' sends and receives run on one
# stream in the order they are posted, and a receive holds the stream until its message comes.
# A receive posted ahead, then a send to the same peer, queues the send behind the receive: if
# the peer produces that message only after it has this send (two ranks sending each other
# activations and cotangents, as in an interleaved schedule on two ranks), both wait for ever.
# gloo has no such order (a send goes out whatever is posted), so on the host every receive
# goes ahead as the two NOTEs on receives ahead say; on an accelerator only one that this rank
# will not send the peer anything before needing (``ahead_is_safe``). Not run on a GPU yet.


def _channel(peer: int, key: Key) -> tuple[int, str, int]:
    """The wire channel a message travels on: the peer, the kind and the stage (one layout history each)."""
    return peer, key[0], key[1]


def _describe(key: Key) -> str:
    kind, s, i = key  # (read for every message: only the one phrase is built)
    if kind == "act":
        return f"the activation of stage {s} for microbatch {i}"
    if kind == "cot":
        return f"the cotangent from stage {s} for microbatch {i}"
    if kind == "mb":
        return f"microbatch {i} (for the last stage's loss_fn)"
    if kind == "grad":
        return f"the gradients of stage {s} summed by its other holder"
    if kind == "losses":
        return "the losses of the last stage's other holder"
    assert kind == "result", kind
    return "the loss from the last stage"


@dataclass(frozen=True)
class _Row(Status):
    """One pipeline rank's recorded row, as ``gathered`` all-gathers it."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]


def gathered(timeline: Simulation, topology: Topology, timeout: float) -> Simulation:
    """``timeline`` with every pipeline rank's own row, all-gathered (as JSON, which gives floats
    back exactly), each rank waiting at most ``timeout`` seconds."""
    r = topology.rank
    mine, what = _Row(timeline.starts[r], timeline.ends[r]).to_json(), "the other ranks' recorded timelines"
    rows = [_Row.from_json(row) for row in all_gather_json(topology, topology.group, mine, timeout, what)]
    return Simulation(timeline.program, None, tuple(row.starts for row in rows), tuple(row.ends for row in rows))
