"""Overlapped pairs: two actions of one rank run interleaved at their communication points, so
that one's collective is in flight while the other computes (NOTE [overlapped pairs]).

NOTE [overlapped pairs]
A program may pair two adjacent actions of a rank, a forward and a backward of other microbatches
(DualPipe's overlapped chunks, Megatron-Core's Combined 1F1B: ``Program.pairs``). The executor
runs such a pair as two sides on two threads that hold one baton between them: only the side
that holds it runs, so at any moment one thread computes, exactly as in a sequential run. A side
lets go of the baton only at a **communication point**: a stage's collective posted and not yet
waited for (``fpipe.moe``'s dispatch and combine call ``communication_point`` between posting
their all-to-all and waiting for it, in the forward and in the backward). The timeline of a
pair whose two stages each have two points (F: dispatch, combine; B: their backwards)::

    side 0 (F of microbatch i)  | attn+route  [a2a out] .......... | experts [a2a out] ...
    side 1 (B of microbatch j)  | ........... | combine' [a2a out] ........... | experts' ...
    baton                       | 0           | 1                  | 0         | 1

Why this holds results bitwise: each side runs the same operations in the same order as in a
sequential run; only the points where the other side's operations interleave change, and no
operation reads the other side's tensors (the pair's halves are different microbatches, or
stages, whose inputs were received before). The default generators are the one shared state:
the baton saves the CPU generator's state when a side lets go and restores it when the side
resumes, so each side draws the numbers it would draw alone (a stage's draws are seeded from
(key, stage, microbatch) at its start: NOTE [randomness as data] in fpipe/_random.py). Both
sides post their collectives in the same order on every rank of a group (the same program, the
same stages), so the collectives match. A side that raises still lets go (``finish``), so the
other side runs to its end or fails itself; the pair then raises the first side's error.

Why threads and not a program of chunks: the backward's communication points are inside the
autograd engine's pass (a ``torch.autograd.Function``'s backward), which cannot be suspended
and resumed by Python code except by blocking its thread; and a stage stays one function the
user wrote. On CPU the engine runs a backward on the thread that asked for it, so the points
inside the backward are seen there. On an accelerator its device threads run the backward while
the side that asked waits for them: a point reached on a thread that is no side's is the point of
the side holding the baton (only that side runs, so only its work can reach one), and that
thread waits for the baton in its place (NOTE [points on other threads]). With
``recompute=True`` the replayed forward's points are points of the backward's side.

NOTE [points on other threads]
``_ACTIVE`` holds the baton of the pair running in this process (a pipeline rank runs one pair at
a time); ``communication_point`` on a thread with no side of its own switches for the side whose
turn it is. Tested on CPU with a side that waits for a helper thread reaching its points, as the
engine's device thread would; not run on an accelerator (no GPU lent). The generator swapped
per side is the CPU one (an accelerator's draws inside a pair may differ from a sequential run's).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

_LOCAL = threading.local()  # ``side``: (baton, index) of the pair side running on this thread
_ACTIVE: list[_Baton] = []  # the baton of the pair running in this process (NOTE [points on other threads])


class _Baton:
    """Which side of a pair runs (NOTE [overlapped pairs]): one at a time, switching at points."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self._states: list[torch.Tensor | None] = [None, None]  # each side's CPU generator state
        self.points = [0, 0]  # communication points each side reached

    @property
    def turn(self) -> int:
        """The side that holds the baton: the one running."""
        return self._turn

    def wait_turn(self, me: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._turn == me)

    def switch(self, me: int) -> None:
        """Let the other side run until its next point or its end, then go on."""
        with self._changed:
            self.points[me] += 1
            if self._done[1 - me]:
                return
            self._states[me] = torch.get_rng_state()
            self._turn = 1 - me
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._turn == me)
            state = self._states[me]
        if state is not None:
            torch.set_rng_state(state)

    def finish(self, me: int) -> None:
        """Side ``me`` ended (or raised): the other runs to its end."""
        with self._changed:
            self._done[me] = True
            self._turn = 1 - me
            self._changed.notify_all()  # the other side restores its generator as it resumes


def communication_point() -> None:
    """Mark a communication point: a collective has been posted and is about to be waited for.

    Inside a side of an overlapped pair (NOTE [overlapped pairs]) the other side runs until its
    own next point or its end, while the posted collective is in flight; anywhere else, nothing
    happens. Call it between posting an asynchronous collective and waiting for it, e.g.::

        out = torch.distributed._functional_collectives.all_to_all_single(x, out_splits, in_splits, group)
        fpipe.communication_point()
        out = torch.distributed._functional_collectives.wait_tensor(out)

    ``fpipe.moe.dispatch`` and ``combine`` do, in their forward and their backward.
    """
    side = getattr(_LOCAL, "side", None)
    if side is None and _ACTIVE:  # a thread working for the running side (NOTE [points on other threads])
        side = (_ACTIVE[-1], _ACTIVE[-1].turn)
    if side is not None:
        baton, me = side
        baton.switch(me)


def current_side() -> int | None:
    """The side of an overlapped pair running on this thread (0: the first half), or ``None``."""
    side = getattr(_LOCAL, "side", None)
    return None if side is None else int(side[1])


def run_pair(first: Callable[[], None], second: Callable[[], None]) -> tuple[int, int]:
    """Run ``first`` and ``second`` interleaved at their communication points: ``first`` on this
    thread until its first point, then ``second`` on this thread's second-side thread until its
    first point, and so on (NOTE [overlapped pairs]). Returns the points each reached (``(0, 0)``: they ran in
    sequence).

    Raises:
        SideFailed: what a side raised (the first side's, if both did), with its index.
    """
    baton = _Baton()
    errors: list[BaseException | None] = [None, None]

    def side(me: int, fn: Callable[[], None]) -> None:
        _LOCAL.side = (baton, me)
        try:
            if me == 1:
                baton.wait_turn(1)
            fn()
        except BaseException as error:  # handed to the caller below
            errors[me] = error
        finally:
            _LOCAL.side = None
            baton.finish(me)

    grad = torch.is_grad_enabled()

    def second_side() -> None:
        with torch.set_grad_enabled(grad):  # thread-local: the second side runs as the first would
            side(1, second)

    done = _second_thread().submit(second_side)
    _ACTIVE.append(baton)
    try:
        side(0, first)
        done.wait()
    finally:
        _ACTIVE.remove(baton)
    for me, error in enumerate(errors):
        if error is not None:
            raise SideFailed(me) from error
    return baton.points[0], baton.points[1]


class _SecondThread:
    """One long-lived daemon thread per thread that runs pairs, for their second sides: a new
    thread per pair made a step's first torch operations on it cost CPU each time (measured by
    benchmarks/bench_pairs.py: +27% CPU per step with a thread per pair)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="fpipe overlapped pair", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Run ``job`` on the thread; the event is set when it has returned (it never raises)."""
        done = threading.Event()
        self._jobs.put((job, done))
        return done

    def _serve(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                done.set()


def _second_thread() -> _SecondThread:
    """This thread's ``_SecondThread``, made on its first pair."""
    worker: _SecondThread | None = getattr(_LOCAL, "worker", None)
    if worker is None:
        worker = _LOCAL.worker = _SecondThread()
    return worker


class SideFailed(Exception):
    """A side of an overlapped pair raised (the error is the ``__cause__``): ``side`` 0 or 1."""

    def __init__(self, side: int) -> None:
        super().__init__(side)
        self.side = side
