"""The conformance list: every schedule, and the sizes each battery runs it at.

Every built-in schedule of the registry (fpipe/schedules/_registry.py) is an entry, so a new
schedule is here the moment it is registered: tests/test_transparency.py and tests/test_api.py
run it in one process against the unsplit model and GPipe, tests/test_distributed.py on gloo
ranks against the single-process executor, bitwise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fpipe.planning import search
from fpipe.planning._arguments import checked_problem
from fpipe.planning._bound import lower_bound
from fpipe.planning._solver import available, solve
from fpipe.schedules import Costs, Interleaved1F1B, Program, ZeroBubbleH1
from fpipe.schedules._registry import BUILTINS, Builtin
from tests.planning._programs import first_pass


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


def built(builtin: Builtin) -> Callable[[int, int], Any]:
    """``make`` of a built-in at its own stages per rank. Where the registry says it does not take
    the counts (ZB-H2 below ``m >= 2p - 1``: a ``ScheduleError``, tests/schedules/test_zero_bubble_h2.py),
    the battery's small ``m`` run ZB-H1, which takes any."""
    v = builtin.stages_per_rank

    def make(num_stages: int, num_microbatches: int) -> Any:
        if not builtin.allows(num_stages // v, num_microbatches):
            return ZeroBubbleH1(num_microbatches=num_microbatches)
        return builtin.build(num_microbatches, v)

    return make


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


def shares_stages(schedule: Any, num_stages: int) -> bool:
    """Whether ``schedule``'s program (in one process) runs a stage on several ranks (DualPipe):
    its gradients equal GPipe's within rounding, not bitwise (NOTE [a stage on several ranks] in
    fpipe/schedules/_program.py)."""
    program = (
        schedule
        if isinstance(schedule, Program)
        else Program.from_lists(schedule)
        if isinstance(schedule, list)
        else schedule.program(num_stages)
    )
    return bool(program.shared())


@dataclass(frozen=True)
class Conformance:
    """A way to schedule: ``make(num_stages, num_microbatches)`` is what ``fpipe.pipeline`` takes."""

    name: str
    make: Callable[[int, int], Any]
    stage_counts: tuple[int, ...] = (1, 2, 3, 4, 5, 6)  # in one process (tests/test_transparency.py)
    ranks: tuple[tuple[int, int, int], ...] = ()  # (ranks, stages, microbatches) on gloo (tests/test_distributed.py)

    def __str__(self) -> str:
        return self.name


# Built-in name (fpipe/schedules/_registry.py) -> its stage counts in one process and its sizes on
# gloo, at its own stages per rank. A built-in not named here runs at each stage count of its
# placement up to 6 (a multiple of its stages per rank), in one process only.
SIZES: dict[str, tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]] = {
    "GPipe": ((1, 2, 3, 4, 5, 6), ((2, 2, 4),)),
    "OneFOneB": ((1, 2, 3, 4, 5, 6), ((2, 2, 5), (4, 4, 6))),
    "ZeroBubbleH1": ((1, 2, 3, 4, 5, 6), ((2, 2, 4),)),
    "ZeroBubbleH2": ((2, 4), ((2, 2, 5),)),
    "Interleaved1F1B": ((2, 4, 6), ((2, 4, 4), (4, 8, 4))),
    "InterleavedZeroBubble": ((2, 4), ((2, 4, 5),)),
    "LoopedBFS": ((2, 4, 6), ((2, 4, 3),)),
    "ZeroBubbleV": ((2, 4, 6), ((2, 4, 4),)),
    "DualPipeV": ((2, 4, 6), ((2, 4, 4),)),
    "DualPipe": ((2, 4), ((2, 2, 4), (4, 4, 8))),
    "VHalf": ((4, 6), ((2, 4, 5),)),
    "VMin": ((4, 6), ((2, 4, 3), (3, 6, 2))),
}


def of_builtin(builtin: Builtin) -> Conformance:
    """The entry of a built-in: its name (with its stages per rank after a dash where that is a
    field of the class, ``Interleaved1F1B-2``) at the sizes ``SIZES`` gives it."""
    v = builtin.stages_per_rank
    stage_counts, ranks = SIZES.get(builtin.name, (tuple(range(v, 7, v)), ()))
    return Conformance(f"{builtin.name}-{v}" if builtin.field else builtin.name, built(builtin), stage_counts, ranks)


CONFORMANCE: list[Conformance] = [
    *(of_builtin(builtin) for builtin in BUILTINS),  # every built-in schedule: one registry entry is one here
    Conformance("Interleaved1F1B-3", lambda S, M: Interleaved1F1B(num_microbatches=M, stages_per_rank=3), (3, 6)),
    Conformance(
        "Interleaved1F1B-2-group-p+1",  # Megatron-Core's microbatch groups, one more than the ranks
        lambda S, M: Interleaved1F1B(num_microbatches=M, stages_per_rank=2, microbatch_group=S // 2 + 1),
        (2, 4),
        ranks=((2, 4, 5),),
    ),
    Conformance("search", searched, (1, 2, 3, 4)),
    Conformance("search-v", searched_v, (2, 4, 6), ranks=((2, 4, 4),)),
    *([Conformance("search-cp-sat-v", solved_v, (2, 4))] if available() else []),  # OR-Tools: the test extra
    Conformance("program-backwards-reversed", gpipe_backwards_reversed),
    Conformance("program-split-backward", one_f_one_b_split_backward),
]
