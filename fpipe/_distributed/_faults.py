"""Failure detection across the ranks of a distributed job (NOTE [failure board]).

NOTE [failure board]
A process that dies closes its connections, so a peer receiving from it fails at once; one that
freezes (SIGSTOP, a hung kernel, a lost machine) does not, and torch.distributed cannot interrupt
a pending gloo receive from Python. Waiting ranks learn of a failure they are not waiting on
through a board in torch.distributed's own store (the job's TCPStore), one per job (its
groups: a failure breaks them for good, and new groups over the same ranks get a new board):

1. A rank that fails (a stage or ``loss_fn`` raised, a peer died, a wait timed out, in a step
   or in any other collective of fpipe's: a save, a load, ``global_norm``, the precision
   agreement) writes the job's failure record before raising: compare-and-set, so the first
   record wins and every rank reports the same failure.
2. A watchdog thread per process reads the record while any of its threads (the training
   thread, an ``AsyncSaver``'s) has been waiting on the job's groups longer than ``POLL``
   seconds. When there is one, it aborts the job's process groups on this rank (gloo: a
   receive that times out at once, which closes every pair of the group; other backends:
   ``ProcessGroup.abort``), so the pending wait raises at once, and the rank raises the record.
   With gloo, a pair whose peer aborted first (or died) is closed already and refuses that
   receive with an error: the abort then tries the next peer, and never raises, so that it goes
   on to the job's other groups (notes/wire.md, "Failures", says what raising there cost). An
   ``AsyncSaver``'s copies of the groups are aborted with them (``Board.watch``). Only the
   job's groups are aborted; the default group is one of them only when the job runs on it
   (``group=dist.group.WORLD``, or a mesh dimension over every rank, for which torch's
   DeviceMesh reuses the default group).
3. Every watchdog beats a counter in the store every ``BEAT`` seconds while its process lives,
   so a rank whose wait times out names the ranks whose counter stopped (frozen or dead)
   instead of blaming the peer it was waiting for, which may itself be waiting. It says
   "unknown" when every rank still beats.

Store operations run only on the watchdog thread, through its own client of the store: a rank's
main thread never blocks on a store whose host is frozen (it gives up after ``ASK`` seconds).
So every survivor raises within the ``timeout`` of its own wait plus about ``2 * POLL``, and
within ``POLL`` of the first report when it waits on something else. When the store itself
does not answer (its host died or froze), see NOTE [the store's host].

The thread ends when its store is replaced (a new ``init_process_group``) or the process group
is destroyed, or on the first error of its own store work. A store or connection error
(``RuntimeError``, such as ``DistStoreError`` and ``DistNetworkError``, or ``OSError``) means the
store is gone with its host, which exited: the job is over, and it ends silently. Any other
error is a bug (a malformed record on the board, say): it ends with a ``RuntimeWarning``, since
this rank then learns of other ranks' failures only when its own waits time out
(``fpipe.Parallelism(timeout=)``). Either way ``Watchdog.stopped_by`` keeps the error, and ``Watchdog.ask`` names it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ._board import ASK, BEAT, POLL, RAISED, STALE, Board, Failure

_ABORT_TAG = 0x7FFF0000  # a tag no message uses: the receive that aborts a gloo group


class StoreGone(TimeoutError):
    """``Watchdog.ask`` after the watchdog stopped because the job's store is gone."""


class Watchdog:
    """One daemon thread per process: heartbeats, board readings and writes (NOTE [failure board])."""

    def __init__(self) -> None:
        self._boards: dict[str, Board] = {}
        self._requests: queue.Queue[tuple[Callable[[Any], Any], Future[Any]]] = queue.Queue()
        self._store: Any = None  # the watchdog thread's own client of ``_serves``
        self._serves: Any = None  # the default process group's store
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._busy: float | None = None  # since when the thread has been in a store call
        self._idle: float | None = None  # since when the thread has waited for a request (``stopped``)
        self._stop: tuple[float, float] | None = None  # (seconds, when it ended): this process was stopped
        self.stopped_by: BaseException | None = None  # the error that ended the thread, if one did

    def board(
        self, job: tuple[int, ...], groups: list[Any], names: dict[int, tuple[int, int | None]], labels: dict[int, str]
    ) -> Board:
        """The board of ``job`` laid out as ``names`` says, over ``groups``, in the current process
        group's store (beaten from now on). Two meshes over the same ranks (a 2 x 2 and a 4 x 1)
        get boards of their own. A failed board stays failed for the groups it watched; new groups
        over the same ranks (made after the failure, on every rank) get the next generation's."""
        layout = zlib.crc32(json.dumps(sorted(names.items())).encode())
        base = "fpipe/" + ",".join(map(str, job)) + f"/{layout:08x}/"
        default = dist.distributed_c10d._get_default_store()
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._serves is not default:
                # A new thread for a new store (after destroy_process_group and a new init).
                self._serves, self._store, self._boards, self._busy = default, None, {}, None
                self._requests, self.stopped_by = queue.Queue(), None
                self._thread = threading.Thread(
                    target=self._loop, args=(default, dist.get_rank()), name="fpipe-watchdog", daemon=True
                )
                self._thread.start()
            board = self._boards.get(base)
            if board is None or (board.failure is not None and not any(g in board.groups for g in groups)):
                generation = 0 if board is None else board.generation + 1
                board = Board(f"{base}{generation}/", job, dist.get_rank(), groups, names, labels, generation)
                self._boards[base] = board
            return board

    def store_gone(self, board: Board) -> bool:
        """Whether the store that ``board``'s last reading found silent is gone (its host exited),
        not frozen: the reading failed on a closed connection, or nothing listens at the store's
        address any more (a frozen process's socket still accepts: its kernel answers)."""
        error = board.unanswered
        if error is not None and (not isinstance(error, TimeoutError) or isinstance(error, StoreGone)):
            return True
        store = self._serves
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        if not isinstance(store, TCPStore):
            return False
        try:
            socket.create_connection((store.host, store.port), timeout=ASK).close()
        except TimeoutError:
            return False
        except OSError:  # refused: the host's process is gone
            return True
        return False

    def silence(self) -> float:
        """Seconds for which the job's store has not answered this process's watchdog: since the
        store call it is in began (or the one it stopped on: the store is gone); ``0.0`` between
        calls. Every wait is bounded by it (NOTE [the store's host])."""
        busy = self._busy
        return 0.0 if busy is None else time.monotonic() - busy

    def stopped(self, within: float) -> float | None:
        """Seconds for which this process was stopped (SIGSTOP, then SIGCONT), when that ended less
        than ``within`` seconds ago (``None``: it was not, or earlier); forgets it either way. A
        wait of the watchdog for a request (``POLL`` s at most) that lasted more than ``STALE`` s
        is such a stop, also while the thread, just continued, has not run yet (NOTE [a stopped
        process] in fpipe/_distributed/_collectives.py)."""
        now, idle, stop = time.monotonic(), self._idle, self._stop
        if idle is not None and now - idle > STALE:
            stop = (now - idle, now)
        self._stop = None
        return stop[0] if stop is not None and now - stop[1] <= within else None

    def forget_stop(self) -> None:
        """Forget that this process was stopped (``stopped``): an operation it did not fail ended."""
        self._stop = None

    def stop(self) -> None:
        """Stop the thread and wait for it (at exit: a daemon thread caught inside a store call
        while the interpreter finalizes aborts the process, "terminate called without an active
        exception")."""
        with self._lock:
            thread, self._serves = self._thread, None
        if thread is not None and thread.is_alive():
            thread.join(timeout=2 * ASK)

    # -- the main thread's side --------------------------------------------------------------

    def ask(self, job: Callable[[Any], Any]) -> Any:
        """Run ``job(store)`` on the watchdog thread; its result, or ``TimeoutError`` after ``ASK`` s
        (at once when the thread has stopped, naming the error that stopped it)."""
        done: Future[Any] = Future()
        if self._thread is None or not self._thread.is_alive():
            cause = self.stopped_by
            if cause is None:
                raise StoreGone("fpipe: the watchdog has stopped: the job's store is gone")
            if _store_gone(cause):
                why = f"the job's store is gone ({_named(cause)})"
                raise StoreGone(f"fpipe: the watchdog has stopped: {why}") from cause
            raise TimeoutError(f"fpipe: the watchdog has stopped: it failed ({_named(cause)})") from cause
        busy = self._busy
        if busy is not None and time.monotonic() - busy > ASK:  # stuck in a call the store does not answer
            raise TimeoutError(f"fpipe: the job's store has not answered for {time.monotonic() - busy:.1f} s")
        self._requests.put((job, done))
        return done.result(timeout=ASK)

    def read(self, board: Board) -> Failure | None:
        """The board's record, read now (``None``: none, or the store does not answer: then
        ``board.unanswered`` says why)."""
        if board.failure is not None:
            return board.failure
        deadline = time.monotonic() + STALE
        while True:
            try:
                self.ask(lambda store: self._check(board, store, abort=False))
                board.unanswered = None
                return board.failure
            except Exception as error:  # kept: NOTE [the store's host]
                board.unanswered = error
            # A store slow to answer (a loaded machine) is asked again; one that has not answered
            # the watchdog for STALE seconds, or is gone, is not.
            busy = self._busy
            stuck = busy is not None and time.monotonic() - busy > STALE
            if stuck or self.store_gone(board) or time.monotonic() > deadline:
                return board.failure
            time.sleep(POLL)

    def report(self, board: Board, failure: Failure) -> Failure:
        """Write ``failure`` unless a record is there already; the record that stands."""

        def write(store: Any) -> Failure:
            standing = store.compare_set(board.key(), "", failure.dumps()).decode()
            self._seen(board, store)
            return failure if not standing else Failure.loads(standing)

        with contextlib.suppress(Exception):
            board.failure = self.ask(write)
        return board.failure or failure

    # -- the watchdog thread ---------------------------------------------------------------

    def _loop(self, serves: Any, me: int) -> None:
        """Serve requests, beat and read the board until the store is gone or replaced, or an
        error stops it (kept in ``stopped_by``; warned about unless the store is gone)."""
        requests, last_beat = self._requests, 0.0
        while self._serves is serves and dist.is_initialized():
            job: tuple[Callable[[Any], Any], Future[Any]] | None = None
            self._idle = time.monotonic()
            with contextlib.suppress(queue.Empty):
                job = requests.get(timeout=POLL)
            idle, self._idle, woke = self._idle, None, time.monotonic()
            if idle is not None and woke - idle > STALE:  # this process was stopped: ``stopped``
                self._stop = (woke - idle, woke)
            try:
                self._busy = time.monotonic()
                if self._store is None:
                    self._store = _own_client(serves)
                store = self._store
                if job is not None:
                    try:
                        job[1].set_result(job[0](store))
                    except Exception as error:
                        job[1].set_exception(error)
                now = time.monotonic()
                if now - last_beat >= BEAT:
                    last_beat = now
                    for board in list(self._boards.values()):
                        store.add(f"{board.prefix}beat/{board.me}", 1)
                for board in list(self._boards.values()):
                    waits = list(board.waits.values())  # (other threads add and remove theirs)
                    if waits and now - min(waits) > POLL:
                        self._check(board, store, abort=True)
                        self._read_beats(board, store)
                self._busy = None
            except Exception as error:
                self._stopped(serves, me, error)
                return

    def _stopped(self, serves: Any, me: int, error: Exception) -> None:
        """Keep the error that ended the thread, and warn of it unless the store is gone (its
        host exited: nothing left to watch). A thread whose store was replaced meanwhile
        records nothing: the new thread's ``stopped_by`` is its own."""
        if self._serves is serves:
            self.stopped_by = error
            if not _store_gone(error):  # a bug, not a silent store (``silence``)
                self._busy = None
        if not _store_gone(error):
            warnings.warn(
                f"fpipe: the failure watchdog of rank {me} stopped on an unexpected error ({_named(error)}): "
                "this rank no longer reads the failure board, so it finds other ranks' failures only when "
                "its own waits time out (fpipe.Parallelism(timeout=)).",
                RuntimeWarning,
                stacklevel=1,
            )

    def _check(self, board: Board, store: Any, *, abort: bool) -> None:
        if board.failure is None and store.check([board.key()]):
            board.failure = Failure.loads(store.get(board.key()).decode())
            self._seen(board, store)
        if abort and board.failure is not None:
            abort_job(board)

    def _seen(self, board: Board, store: Any) -> None:
        """Count this rank, once, among those that have seen the board's record (``linger``)."""
        if not board.seen:
            board.seen = True
            store.add(f"{board.prefix}seen", 1)

    def linger(self, board: Board) -> None:
        """On the store's host, after a failure: wait until every live rank of the job has seen
        the record, for at most ``STALE`` seconds, so that the store outlives their readings
        (NOTE [the store's host]): a host that raised and exited at once left a slower rank with
        no record to read, and that rank then blamed the host. Once per board."""
        failure = board.failure
        if board.me != store_host() or failure is None or board.lingered:
            return
        board.lingered = True
        lost = failure.kind != RAISED and failure.rank is not None  # a dead or frozen rank never looks
        deadline = time.monotonic() + STALE
        while time.monotonic() < deadline:
            try:
                seen = self.ask(lambda store: store.add(f"{board.prefix}seen", 0))
            except Exception:  # the store does not answer: nothing to keep up
                return
            if seen >= len(board.job) - max(int(lost), len(board.silent() or [])):
                return
            time.sleep(POLL)

    def _read_beats(self, board: Board, store: Any) -> None:
        now = time.monotonic()
        for g in board.job:
            if g != board.me:
                count = store.add(f"{board.prefix}beat/{g}", 0)
                if count and (g not in board.beats or board.beats[g][0] != count):
                    board.beats[g] = (count, now)
        board.read_at = now
        if board.first_read is None:
            board.first_read = now


def _store_gone(error: BaseException) -> bool:
    """Whether ``error`` is a store or connection error (``DistStoreError``, ``DistNetworkError``
    and the like are ``RuntimeError``s; a closed socket is an ``OSError``), not a bug."""
    return isinstance(error, (RuntimeError, OSError))


def _named(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _own_client(store: Any) -> Any:
    """A client of the job's TCPStore of our own (so a stuck request blocks only the watchdog),
    or the store itself when it is not a TCPStore (a FileStore or HashStore is local)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, TCPStore):
        return TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=60))
    return store


def abort_job(board: Board) -> None:
    """Abort every group of ``board``'s job on this rank, once (from any thread: aborting a group
    twice is harmless)."""
    if not board.aborted:
        board.aborted = True
        for group in list(board.groups):
            abort_group(group)


# NOTE [the store's host]
# Every survivor fails within the timeout of the fault and names the culprit, even when the
# culprit hosts the board. The board lives in the job's store, which one process hosts: global
# rank 0 for the rendezvous of init_process_group (env:// and tcp:// start the store's server on
# rank 0), torchrun's agent when it hosts the store (TORCHELASTIC_USE_AGENT_STORE). When that
# rank dies the store is gone; when it freezes, every store call hangs: no rank can read or write
# the board, and the heartbeats say nothing. So a rank whose wait fails while the store does not
# answer (it is gone, or the watchdog has been stuck in a store call for ``STALE`` seconds: a
# reading that is only slow is tried again until then, ``Watchdog.read``) blames the store's
# host, and aborts its own groups (``abort_job``): the ranks waiting on it fail at once and,
# finding the store silent too, blame the host alike, instead of each waiting out its own
# timeout. The host died when nothing listens at the store's address (``Watchdog.store_gone``);
# otherwise it froze. A host that merely failed (it raised, and will exit) keeps the store up
# until the others have seen the record (``Watchdog.linger``).
# An abort fails another rank's pending gloo collective only when that rank receives from this
# one, so a rank that enters a collective of three or more ranks late, after the host froze,
# would learn nothing from the ranks that gave up before it. So the store's silence is a clock
# too: the watchdog beats every ``BEAT`` seconds, so it is stuck in a store call from about when
# the host froze (``Watchdog.silence``), and a wait that begins after the store has been silent
# for more than ``ASK`` seconds lasts only until ``timeout`` after the silence began (``_bounded``
# in fpipe/_distributed/_collectives.py; at once if that is past). The cost: a store slower than
# ``ASK`` in a healthy job shortens the waits that begin meanwhile by that silence; after the
# store is gone every wait that does not end at once fails, as the job is over. What each guard
# cost before it (twice the timeout; 21 s for a 12 s timeout): notes/wire.md, "Failures".
def store_host() -> int | None:
    """The global rank whose process hosts the job's store (``None``: torchrun's agent does)."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else 0


def abort_group(group: Any) -> None:
    """Make every pending and future operation of ``group`` on this rank fail at once."""
    if group is None or dist.get_world_size(group) < 2:
        return
    if dist.get_backend(group) == "gloo":
        # A gloo receive that times out closes every pair of the group's context
        # ("Application timeout caused pair closure"), failing whatever waits on them. A pair
        # already closed (its peer aborted first, or died) refuses the receive itself: then the
        # next peer's pair is tried (NOTE [failure board], point 2). Once one receive has timed
        # out, every later one is refused at once, so this costs about a millisecond.
        me, size = dist.get_rank(group), dist.get_world_size(group)
        for k in range(1, size):
            with contextlib.suppress(RuntimeError):
                peer = dist.get_global_rank(group, (me + k) % size)
                work = dist.irecv(torch.empty(1), peer, group=group, tag=_ABORT_TAG)
                if work is not None:
                    work.wait(timeout=timedelta(milliseconds=1))
    else:
        group.abort()


WATCHDOG = Watchdog()
atexit.register(WATCHDOG.stop)
