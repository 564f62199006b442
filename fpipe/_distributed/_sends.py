"""The step's sends threads: on gloo, each send to a peer is waited for on a thread of its own and
let go as its wait returns (NOTE [sends released])."""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections import deque
from typing import Any

import torch

from ._board import ASK
from ._faults import abort_group

# NOTE [sends released]
# A send keeps its tensors (a large leaf's own storage, the packed bytes) alive until the
# transport lets it go, as soon as the send has completed. NCCL's work says so as the send goes
# (``is_completed``, asked as each message is sent or read: ``_release``); gloo's says False
# until waited for, even once the peer has read it, and waiting for a send whose receive is not
# posted blocks. So on gloo every send goes to a thread of the step's per peer (``_Waiter``),
# which waits for that peer's sends oldest first (the peer reads them in the order sent) and
# lets go of each as its wait returns. Its waits have no timeout but the group's (a gloo wait
# that times out closes the group's pairs, which would race the step's own waits to name the
# failure): the step's waits bound them. ``close`` joins the threads after the closing
# all-gather, when every peer has read every message, so at once. After a failure (``abort``)
# the sends left may never be read: a thread is joined when the job's groups are aborted on
# this rank (a lost rank: its wait has ended), else left to end with its wait (the peer reads,
# exits, or the group goes), and at exit its group is aborted (``_end_left``): aborting the
# group at once would close it for the ranks still using it. A failed wait is raised by the
# next send or ``close``, as the step's own wait would be.
# What a rank holds as a result: notes/wire.md, "What a rank holds, and for how long".


class Waiter:
    """The step's thread that waits, oldest first, for its sends to one peer, and lets go of each
    as its wait returns (NOTE [sends released])."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._changed = threading.Condition()  # guards what follows
        self._queue: deque[tuple[Any, torch.Tensor, str, int]] = deque()  # (work, tensor, what, peer)
        self._closing = False
        self._thread: threading.Thread | None = None  # started at the first send
        # A failed wait's error, what the send was and its peer's global rank: the thread then
        # ends, and the step's thread raises it (``DistributedTransport._sent``).
        self.failed: tuple[BaseException, str, int] | None = None

    def put(self, work: Any, tensor: torch.Tensor, what: str, peer: int) -> None:
        """Wait for ``work``, a send of ``tensor`` (part of ``what``) to global rank ``peer``."""
        with self._changed:
            self._queue.append((work, tensor, what, peer))
            self._changed.notify()
            if self._thread is None:  # (under the lock: an overlapped pair's halves both send)
                self._thread = threading.Thread(target=self._loop, name="fpipe-sends", daemon=True)
                self._thread.start()

    def held(self) -> int:
        """Bytes of the sends not yet completed."""
        with self._changed:
            return sum(t.numel() * t.element_size() for _, t, _, _ in self._queue)

    def join(self, timeout: float) -> None:
        """End the thread once every send has completed (``close``: every peer has read every
        message, so at once); a wait still pending after ``timeout`` seconds ends as the pipeline
        group is aborted on this rank."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.end()

    def leave(self, *, aborted: bool) -> None:
        """After a failed step: let go of the sends not yet waited for, and end the thread as
        soon as its wait ends: at once when the job's groups are aborted on this rank
        (``aborted``), else when the peer reads the message, leaves or the group goes (aborting
        the group here would close it for the other ranks too), or at exit (``_end_left``)."""
        with self._changed:
            self._closing = True
            while len(self._queue) > 1:  # (the first is the thread's)
                self._queue.pop()
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(ASK if aborted else 0)  # (an aborted group's waits end at once)
            if self._thread.is_alive():
                _LEFT[:] = [*(waiter for waiter in _LEFT if waiter.waiting()), self]

    def waiting(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def end(self) -> None:
        """End the thread's wait by aborting the pipeline group on this rank, and the thread."""
        with contextlib.suppress(Exception):  # (at exit, the group may be gone)
            abort_group(self._group)
        if self._thread is not None:
            self._thread.join(ASK)

    def _loop(self) -> None:
        queue = self._queue
        while True:
            with self._changed:
                while not queue and not self._closing:
                    self._changed.wait()
                if not queue:
                    return
                work = queue[0][0]
            try:
                work.wait()  # no timeout of its own: the step bounds it (NOTE [sends released])
            except BaseException as error:
                with self._changed:
                    self.failed = (error.with_traceback(None), queue[0][2], queue[0][3])
                    queue.clear()
                return
            del work  # (it holds the tensor too: the queue's entry is then the thread's last reference)
            with self._changed:
                queue.popleft()


_LEFT: list[Waiter] = []  # threads still waiting after their failed step (``Waiter.leave``)


@atexit.register
def _end_left() -> None:
    """End the threads still waiting after a failed step before the interpreter finalizes: a
    thread woken in a gloo wait then (as the group is destroyed) can abort the process."""
    for waiter in _LEFT:
        if waiter.waiting():
            waiter.end()
