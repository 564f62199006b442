"""Recording what a step actually ran: per rank and action, when it started and ended.

    with fpipe.record() as recording:
        loss, grads = step(params, batch)
    timeline = recording.timeline            # a Simulation whose times are measured seconds
    print(fpipe.schedules.terminal_grid(timeline))
    json.dump(fpipe.schedules.chrome_trace(timeline, microseconds_per_unit=1e6), open("t.json", "w"))

A measured timeline has the type of a simulated one (``fpipe.schedules.Simulation``, with
``costs=None``), so the same pictures and figures (bubble per rank, makespan) apply and a
prediction and a measurement can be put side by side. In one process the virtual ranks take
turns, so the measurement shows the order and the cost of each action, not parallelism. On many
processes each rank measures its own actions from the end of the step's handshake (a common
start, up to clock skew between machines) and the rows are gathered to every rank.

On CUDA an action's start and end are CUDA events recorded on the current stream of each CUDA
device the step uses, read once the step's last action has run (``Stopwatch``): the time the
device spent, not when the host queued the kernels. Their elapsed times are added to the host
clock at the step's start, so a timeline is in the same seconds either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .schedules import Action, Program, Simulation

Times = list[tuple[float, float]]


class Recording:
    """The timelines of the steps run inside one ``fpipe.record()`` block, in call order."""

    def __init__(self) -> None:
        self.timelines: list[Simulation] = []

    @property
    def timeline(self) -> Simulation:
        """The timeline of the last step recorded."""
        if not self.timelines:
            raise LookupError("fpipe.record: no step ran inside the block.")
        return self.timelines[-1]


_ACTIVE: ContextVar[Recording | None] = ContextVar("fpipe_recording", default=None)


@contextmanager
def record() -> Iterator[Recording]:
    """Record the actions of every step called inside the block (see the module docstring)."""
    recording = Recording()
    token = _ACTIVE.set(recording)
    try:
        yield recording
    finally:
        _ACTIVE.reset(token)


def active() -> Recording | None:
    """The recording in progress, if any."""
    return _ACTIVE.get()


def clock() -> float:
    """The clock actions are timed with, in seconds."""
    return time.perf_counter()


class Stopwatch:
    """Marks points of a step on the host clock, or on CUDA with events on ``devices``' current
    streams (a mark is then "when every listed device got there": an action's end is when
    the work queued before it on every device has run). ``seconds`` reads the marks, on CUDA
    waiting for the last one: call it after the step's last action, never inside it."""

    def __init__(self, devices: Iterable[torch.device] = ()) -> None:
        self._devices = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self._host = clock()
        self._starts = [self._event(d) for d in self._devices]

    def _event(self, device: torch.device) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return event

    def mark(self) -> Any:
        """A point in the step: a host time, or one event per CUDA device."""
        if not self._devices:
            return clock()
        return [self._event(d) for d in self._devices]

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """``marks`` as host-clock seconds (on CUDA: the step's start plus the events' elapsed times)."""
        if not self._devices:
            return list(marks)
        for event in marks[-1] if marks else ():
            event.synchronize()
        return [
            self._host + max(start.elapsed_time(e) for start, e in zip(self._starts, events)) / 1e3 for events in marks
        ]


def measured(program: Program, order: Sequence[tuple[int, Action]], times: Times, start: float) -> Simulation:
    """The ``Simulation`` of what ran: ``times[k]`` is when ``order[k]`` started and ended.

    A rank of many runs only its own row; the distributed runtime all-gathers the rows
    (``gathered`` in fpipe/_distributed/_rank_step.py).
    """
    starts: list[list[float]] = [[] for _ in program.ranks]
    ends: list[list[float]] = [[] for _ in program.ranks]
    for (rank, _), (t0, t1) in zip(order, times):
        starts[rank].append(t0 - start)
        ends[rank].append(t1 - start)
    return Simulation(program, None, tuple(map(tuple, starts)), tuple(map(tuple, ends)))
