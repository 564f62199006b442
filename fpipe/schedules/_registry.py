"""The built-in schedules, listed once: every list of them reads ``BUILTINS``.

The command line (``python -m fpipe show``, ``plan``), ``fpipe.planning.search`` (the built-ins it
compares its programs with), the message of ``fpipe.pipeline`` given a name, the conformance
list of the tests and the schedules table of the notes all read this tuple, so a new schedule is
one entry here and its own module. An entry is data about a schedule class, never a way to build
one by name for the user (``fpipe.pipeline`` takes schedule values).

The order is the one ``search`` tries them in (its ``candidates`` list them so, and a tie keeps
the first): one stage per rank, then the looped schedules of any count, then the V.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ._controllable_memory import VHalf, VMin
from ._dual_pipe import DualPipe
from ._dual_pipe_v import DualPipeV
from ._gpipe import GPipe
from ._interleaved import Interleaved1F1B
from ._interleaved_zero_bubble import InterleavedZeroBubble
from ._looped_bfs import LoopedBFS
from ._one_f_one_b import OneFOneB
from ._program import Schedule
from ._zero_bubble_h1 import ZeroBubbleH1
from ._zero_bubble_h2 import ZeroBubbleH2
from ._zero_bubble_v import ZeroBubbleV


def _any(num_ranks: int, num_microbatches: int) -> bool:
    return True


@dataclass(frozen=True)
class Builtin:
    """One built-in schedule, as every list of them sees it.

    Attributes:
        name: the class's name, which ``search`` names its program by (``"OneFOneB"``).
        command: its name on the command line (``python -m fpipe show 1f1b``).
        schedule: the class; ``build`` makes a value of it.
        placement: ``"looped"`` (stage ``s`` on rank ``s % p``), ``"v"`` (rank ``r`` holds
            stages ``r`` and ``2p - 1 - r``) or ``"dual"`` (``p`` stages, stage ``s`` on ranks
            ``s`` and ``p - 1 - s``, each on half of the microbatches: ``DualPipe``).
        stages_per_rank: the stages per rank it lays out by default.
        field: whether ``stages_per_rank`` is a field of the class (``Interleaved1F1B``), so it
            lays out any count from ``least_stages_per_rank`` on.
        loops: without the field, whether it lays more stages than ranks out looped (``GPipe``,
            ``OneFOneB``); else it lays out its own count only.
        least_stages_per_rank: with the field, the least count that is not another entry
            (``InterleavedZeroBubble`` with one stage per rank is ``ZeroBubbleH1``).
        about: one line for the command line's help.
        requires: the counts it needs beyond its placement's, as the documents write them
            (``"m >= 2p - 1"``); ``""`` for none.
        allows: ``requires`` as a predicate of the ranks ``p`` and microbatches ``m``.
    """

    name: str
    command: str
    schedule: type[Schedule]
    placement: Literal["looped", "v", "dual"]
    stages_per_rank: int
    about: str
    field: bool = False
    loops: bool = False
    least_stages_per_rank: int = 1
    requires: str = ""
    allows: Callable[[int, int], bool] = _any

    def lays_out(self, stages_per_rank: int) -> bool:
        """Whether it lays out ``stages_per_rank`` stages per rank of its placement, as an entry
        of its own (not as another one)."""
        if self.field:
            return stages_per_rank >= self.least_stages_per_rank
        return stages_per_rank == self.stages_per_rank or self.loops

    def build(self, num_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
        """The schedule for ``num_microbatches`` (and ``stages_per_rank``, where it is a field;
        default: the entry's)."""
        if self.field:
            v = self.stages_per_rank if stages_per_rank is None else stages_per_rank
            return self.schedule(num_microbatches, stages_per_rank=v)  # type: ignore[call-arg]
        return self.schedule(num_microbatches)  # type: ignore[call-arg]


BUILTINS: tuple[Builtin, ...] = (
    Builtin("GPipe", "gpipe", GPipe, "looped", 1, "GPipe: all forwards, then all backwards", loops=True),
    Builtin("OneFOneB", "1f1b", OneFOneB, "looped", 1, "1F1B (PipeDream-flush)", loops=True),
    Builtin("ZeroBubbleH1", "zbh1", ZeroBubbleH1, "looped", 1, "ZB-H1: 1F1B with deferred weight gradients"),
    Builtin(
        "ZeroBubbleH2",
        "zbh2",
        ZeroBubbleH2,
        "looped",
        1,
        "ZB-H2: ZB-H1 with a longer warm-up, 2p-1 activations",
        requires="m >= 2p - 1",
        allows=lambda p, m: m >= 2 * p - 1,
    ),
    Builtin(
        "Interleaved1F1B",
        "interleaved",
        Interleaved1F1B,
        "looped",
        2,
        "Megatron's interleaved 1F1B, looped placement",
        field=True,
    ),
    Builtin(
        "InterleavedZeroBubble",
        "zbinterleaved",
        InterleavedZeroBubble,
        "looped",
        2,
        "interleaved zero bubble (torch's), looped placement",
        field=True,
        least_stages_per_rank=2,
    ),
    Builtin("LoopedBFS", "bfs", LoopedBFS, "looped", 2, "looped breadth-first", field=True),
    Builtin("ZeroBubbleV", "zbv", ZeroBubbleV, "v", 2, "ZB-V: two stages per rank in a V"),
    Builtin(
        "DualPipeV", "dualpipev", DualPipeV, "v", 2, "DualPipeV: DeepSeek's DualPipe in a V, overlaps run in order"
    ),
    Builtin(
        "DualPipe",
        "dualpipe",
        DualPipe,
        "dual",
        1,
        "DualPipe: two pipelines in opposite directions, each stage on two ranks",
        requires="p even, m even, m >= 2p",
        allows=lambda p, m: p % 2 == 0 and m % 2 == 0 and m >= 2 * p,
    ),
    Builtin("VHalf", "vhalf", VHalf, "v", 2, "V-Half: a V at half of 1F1B's activations"),
    Builtin("VMin", "vmin", VMin, "v", 2, "V-Min: a V at a third of 1F1B's activations"),
)


def builtins_for(placement: str, stages_per_rank: int, num_ranks: int, num_microbatches: int) -> tuple[Builtin, ...]:
    """The entries that lay out ``placement`` with ``stages_per_rank`` stages per rank (the V:
    any count, its own 2) and allow these counts, in ``BUILTINS``' order."""
    return tuple(
        b
        for b in BUILTINS
        if b.placement == placement
        and (placement == "v" or b.lays_out(stages_per_rank))
        and b.allows(num_ranks, num_microbatches)
    )
