"""What the fault tests share (test_faults.py, test_faults_outside_steps.py): how fast a survivor
must fail, the meshes, how messages name a rank, and a wait for another process's sign."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# "Fast" below means well inside the waits a broken fault path would sit out (the 300 s default,
# or a test's own 20-30 s timeout), with room for a loaded machine: a survivor raises within
# its wait's timeout plus about 0.1 s (NOTE [failure board]), but a rank of a spawned job on 2
# busy cores can be off the CPU for seconds.
SLACK = 10.0
# "Never twice the timeout", made detectable: with a timeout T of 12 s a survivor must raise
# within T + 8 s of the fault (room for a loaded machine), below the 2 T = 24 s, and below the
# LATE + T = 21 s of a survivor that, not told, waits out a timeout of its own begun LATE s
# after the fault (a loaded machine only makes that later).
NEVER_TWICE, LATE = 12, 9.0
WITHIN = NEVER_TWICE + 8.0


DP_PP = (("dp", 2), ("pp", 2))  # a mesh, as (dimension, size) pairs
PP_TP = (("pp", 2), ("tp", 2))  # the tensor-parallel ranks run the same plain stages


def rank_name(setup: Any, victim: int) -> str:
    """How messages name global rank ``victim``: ``rank 1``, or ``rank 3 (dp 1, pp 1)`` on a mesh."""
    if isinstance(setup, int):
        return f"rank {victim}"
    (first, _), (second, size) = setup
    return f"rank {victim} ({first} {victim // size}, {second} {victim % size})"


def wait_for(path: Path, seconds: float = 60) -> None:
    """Poll until ``path`` exists (another process's sign), failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name}: not within {seconds} s"
        time.sleep(0.02)


def timed_failure(step: Any, params: Any, batch: Any) -> tuple[float, str, str]:
    """Run one step that a fault should fail: ``(seconds, error type, message)``, or ``"no error"``."""
    import fpipe

    start = time.monotonic()
    try:
        step(params, batch)
    except fpipe.PipelineError as error:
        return time.monotonic() - start, type(error).__name__, str(error)
    return time.monotonic() - start, "no error", ""
