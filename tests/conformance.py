"""The conformance list: every schedule, and the sizes each battery runs it at.

A new schedule is one new entry: tests/test_transparency.py and tests/test_api.py run it in
one process against the unsplit model and GPipe, tests/test_distributed.py on gloo ranks
against the single-process executor, bitwise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fpipe.schedules import (
    Costs,
    DualPipeV,
    GPipe,
    Interleaved1F1B,
    InterleavedZeroBubble,
    LoopedBFS,
    OneFOneB,
    VHalf,
    VMin,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
    search,
)
from fpipe.schedules._bound import lower_bound
from fpipe.schedules._search import checked_problem
from fpipe.schedules._solver import available, solve
from tests.schedules._programs import first_pass


def gpipe_backwards_reversed(num_stages: int, num_microbatches: int) -> list[list[str]]:
    """Hand-written: GPipe, but each rank runs its backwards last microbatch first."""
    m = num_microbatches
    return [[f"{s}F{i}" for i in range(m)] + [f"{s}B{i}" for i in reversed(range(m))] for s in range(num_stages)]


def one_f_one_b_split_backward(num_stages: int, num_microbatches: int) -> list[list[str]]:
    """Hand-written: 1F1B with every backward split into input (I) and weight (W) parts.

    Rank ``r`` runs 1F1B with ``I`` in place of ``B`` and defers all its ``W`` to the end,
    the way zero-bubble schedules fill the cool-down.
    """
    m, p = num_microbatches, num_stages
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        row = [f"{r}F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            row += [f"{r}F{warmup + i}", f"{r}I{i}"]
        row += [f"{r}I{i}" for i in range(m - warmup, m)]
        row += [f"{r}W{i}" for i in range(m)]
        ranks.append(row)
    return ranks


def zero_bubble_h2(num_stages: int, num_microbatches: int) -> Any:
    """ZB-H2 where it is defined (``m >= 2S - 1``); below that it is a ``ScheduleError``
    (tests/schedules/test_zero_bubble_h2.py), and the battery's small ``m`` run ZB-H1."""
    if num_microbatches >= 2 * num_stages - 1:
        return ZeroBubbleH2(num_microbatches=num_microbatches)
    return ZeroBubbleH1(num_microbatches=num_microbatches)


def heavy_last(num_stages: int) -> list[Costs]:
    """Costs with a last stage three times heavier (a vocabulary head), W at half of I, latency 0.3."""
    light = Costs(backward_weight=0.5, send=0.3)
    return [light] * (num_stages - 1) + [Costs(forward=3, backward_input=3, backward_weight=1.5, send=0.3)]


@functools.cache
def searched(num_stages: int, num_microbatches: int) -> Any:
    """``search``'s program for ``heavy_last`` costs, one stage per rank, memory half of 1F1B's: a
    list-scheduled program at most of the battery's sizes (a built-in with 1 stage or 1 microbatch,
    and with 4 stages and 2 microbatches)."""
    costs = heavy_last(num_stages)
    return search(num_stages, num_microbatches, costs, memory=max(1, num_stages / 2), exact=False).program


@functools.cache
def searched_v(num_stages: int, num_microbatches: int) -> Any:
    """``search``'s program in a V for ``heavy_last`` costs, no memory limit: list-scheduled from 4
    stages on (but with 3 microbatches), ZB-V with 2."""
    return search(num_stages // 2, num_microbatches, heavy_last(num_stages), placement="v", exact=False).program


@functools.cache
def solved_v(num_stages: int, num_microbatches: int) -> Any:
    """The constraint solver's program (NOTE [constraint solver]) in a V for ``heavy_last`` costs
    under memory ``max(1, p / 2)`` (half of 1F1B's, at least one footprint), started from a
    list-scheduled one: the best it finds in half a second (any valid program will do here), or
    that one if it finds nothing faster. One process only: with several workers the solver may
    return another program on another call."""
    problem = checked_problem(
        num_stages // 2, num_microbatches, heavy_last(num_stages), "v", 2, max(1, num_stages / 4), None
    )
    hint, span = first_pass(problem)
    program, _, _ = solve(problem, hint, span, lower_bound(problem), time.perf_counter() + 0.5)
    return hint if program is None else program


@dataclass(frozen=True)
class Conformance:
    """A way to schedule: ``make(num_stages, num_microbatches)`` is what ``fpipe.pipeline`` takes."""

    name: str
    make: Callable[[int, int], Any]
    stage_counts: tuple[int, ...] = (1, 2, 3, 4, 5, 6)  # in one process (tests/test_transparency.py)
    ranks: tuple[tuple[int, int, int], ...] = ()  # (ranks, stages, microbatches) on gloo (tests/test_distributed.py)

    def __str__(self) -> str:
        return self.name


CONFORMANCE: list[Conformance] = [
    Conformance("GPipe", lambda S, M: GPipe(num_microbatches=M), ranks=((2, 2, 4),)),
    Conformance("OneFOneB", lambda S, M: OneFOneB(num_microbatches=M), ranks=((2, 2, 5), (4, 4, 6))),
    Conformance(
        "Interleaved1F1B-2",
        lambda S, M: Interleaved1F1B(num_microbatches=M, stages_per_rank=2),
        (2, 4, 6),
        ranks=((2, 4, 4), (4, 8, 4)),
    ),
    Conformance("Interleaved1F1B-3", lambda S, M: Interleaved1F1B(num_microbatches=M, stages_per_rank=3), (3, 6)),
    Conformance(
        "Interleaved1F1B-2-group-p+1",  # Megatron-Core's microbatch groups, one more than the ranks
        lambda S, M: Interleaved1F1B(num_microbatches=M, stages_per_rank=2, microbatch_group=S // 2 + 1),
        (2, 4),
        ranks=((2, 4, 5),),
    ),
    Conformance(
        "InterleavedZeroBubble-2",
        lambda S, M: InterleavedZeroBubble(num_microbatches=M, stages_per_rank=2),
        (2, 4),
        ranks=((2, 4, 5),),
    ),
    Conformance(
        "LoopedBFS-2", lambda S, M: LoopedBFS(num_microbatches=M, stages_per_rank=2), (2, 4, 6), ranks=((2, 4, 3),)
    ),
    Conformance("ZeroBubbleH1", lambda S, M: ZeroBubbleH1(num_microbatches=M), ranks=((2, 2, 4),)),
    Conformance("ZeroBubbleH2", zero_bubble_h2, (2, 4), ranks=((2, 2, 5),)),
    Conformance("ZeroBubbleV", lambda S, M: ZeroBubbleV(num_microbatches=M), (2, 4, 6), ranks=((2, 4, 4),)),
    Conformance("VHalf", lambda S, M: VHalf(num_microbatches=M), (4, 6), ranks=((2, 4, 5),)),
    Conformance("VMin", lambda S, M: VMin(num_microbatches=M), (4, 6), ranks=((2, 4, 3), (3, 6, 2))),
    Conformance("DualPipeV", lambda S, M: DualPipeV(num_microbatches=M), (2, 4, 6), ranks=((2, 4, 4),)),
    Conformance("search", searched, (1, 2, 3, 4)),
    Conformance("search-v", searched_v, (2, 4, 6), ranks=((2, 4, 4),)),
    *([Conformance("search-cp-sat-v", solved_v, (2, 4))] if available() else []),  # OR-Tools: the test extra
    Conformance("program-backwards-reversed", gpipe_backwards_reversed),
    Conformance("program-split-backward", one_f_one_b_split_backward),
]
