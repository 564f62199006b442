"""DualPipe: DeepSeek-V3's bidirectional pipeline, each stage held by two ranks (DeepSeek-AI,
"DeepSeek-V3 Technical Report", 2024, section 3.2.1; ``DualPipe`` of github.com/deepseek-ai/DualPipe)."""

from __future__ import annotations

from dataclasses import dataclass

from .._plural import plural
from ._dual_pipe_v import ChunkRow
from ._placement import BuiltinSchedule
from ._program import Program, ScheduleError


@dataclass(frozen=True)
class DualPipe(BuiltinSchedule):
    """DualPipe (DeepSeek-AI, 2024): two pipelines in opposite directions over the same ranks.

    With ``p`` ranks (even) and ``p`` stages, the first half of the microbatches (``0 .. m/2 - 1``)
    enters at rank 0 and runs stage ``s`` on rank ``s``; the second half (``m/2 .. m - 1``) enters
    at rank ``p - 1`` and runs stage ``s`` on rank ``p - 1 - s``. So every stage lives on two
    ranks, each holding its parameters and running it on one half, and their gradients are
    summed (NOTE [a stage on several ranks] in fpipe/schedules/_program.py)::

        stage:                0   1   2   3        (p = 4)
        first half's rank:    0   1   2   3
        second half's rank:   3   2   1   0

    Rank ``r`` has ``q = min(r, p - 1 - r)``: its near chunk (``0``) is stage ``q`` in the
    direction that enters at its end of the pipeline, its far chunk (``1``) stage ``p - 1 - q``
    in the other; ``F0``/``B0`` a forward/backward of chunk 0 on its next microbatch, ``I``/``W``
    a backward split into input and weight gradients (``W`` runs the oldest pending weight
    gradient), ``[F B]`` a pair DualPipe overlaps, and ``h = m / 2``::

        F0 * 2(p/2 - q - 1)                          # 1: fill the near chunk
        (F0, F1) * (q + 1)                           # 2: alternate
        (I1, W, F1) * (p/2 - q - 1)                  # 3: far backwards start, zero bubble
        ([F0 B1], [F1 B0]) * (h - p + q + 1)         # 4: steady state, overlapped pairs
        (B1, [F1 B0]) * (p/2 - q - 1)                # 5: the far forwards end
        (B1, B0) * (q + 1)                           # 6: drain, the second part as I instead of B
        (W, I0) * (p/2 - q - 1)                      # 7: zero bubble
        W * (q + 1)                                  # 8: the remaining weight gradients

    On the two middle ranks the first pair of step 4 is not overlapped. Step 6 switches from
    ``B`` to ``I`` at ``i = (q + 1) // 2``: before ``B1`` when ``q`` is odd, before ``B0`` when
    even. The order is ``DualPipe.step``'s (checked against a transcription of it in
    tests/schedules/test_dual_pipe.py). As in ``DualPipeV``, the pairs run in order;
    ``Overlapped(DualPipe(m))`` marks exactly DualPipe's pairs to overlap (``paired_program``).
    DualPipe needs ``m`` even and at least ``2p``, as DeepSeek's does.
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on as many ranks.

        Raises:
            ScheduleError: if ``num_stages`` is odd, ``num_ranks`` is given and is not
                ``num_stages``, or the microbatches are odd or fewer than ``2 * num_stages``.
        """
        p, m = num_stages, self.num_microbatches
        if p < 2 or p % 2:
            raise ScheduleError(
                "fpipe.schedules.DualPipe: the two directions meet in the middle, so the stage count must be "
                f"even (num_stages: {p}). Split the model into an even number of stages, one per rank."
            )
        if num_ranks is not None and num_ranks != p:
            raise ScheduleError(
                f"fpipe.schedules.DualPipe: {plural(p, 'stage')} need {plural(p, 'rank')}, each holding two "
                f"(num_stages: {p}, num_ranks: {num_ranks}). Use {num_ranks} stages."
            )
        if m % 2 or m < 2 * p:
            raise ScheduleError(
                "fpipe.schedules.DualPipe: half the microbatches go each way, and each way needs as many as "
                f"the ranks, so num_microbatches must be even and at least 2 x {p} = {2 * p} "
                f"(num_microbatches: {m}). Use DualPipeV for fewer."
            )
        return Program(tuple(tuple(_dual_pipe_rank(r, p, m).row) for r in range(p)), p, m)

    def paired_program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """``program`` with the pairs DualPipe overlaps (``[F B]`` above) marked (``Program.pairs``):
        what ``Overlapped(DualPipe(m))`` runs."""
        program = self.program(num_stages, num_ranks)
        m = self.num_microbatches
        pairs = frozenset(pair for r in range(num_stages) for pair in _dual_pipe_rank(r, num_stages, m).pairs)
        return Program(program.ranks, program.num_stages, m, pairs)


def _dual_pipe_rank(r: int, p: int, m: int) -> ChunkRow:
    """Rank ``r``'s actions and the pairs DualPipe overlaps, following steps 1-8 of the class docstring."""
    q, h, half = min(r, p - 1 - r), m // 2, p // 2
    near = 0 if r < half else 1  # the direction (half of the microbatches) of the near chunk
    rank = ChunkRow(((q, near * h), (p - 1 - q, (1 - near) * h)))  # (stage, first microbatch) per chunk
    run = rank.run
    flip = (q + 1) // 2
    run(*["F0"] * (2 * (half - q - 1)))  # 1
    run(*["F0", "F1"] * (q + 1))  # 2
    run(*["I1", "W", "F1"] * (half - q - 1))  # 3
    for i in range(h - p + q + 1):  # 4 (on the middle ranks the first F0, B1 is not overlapped)
        run(*(["F0", "B1"] if i == 0 and q == half - 1 else ["F0&B1"]), "F1&B0")
    run(*["B1", "F1&B0"] * (half - q - 1))  # 5
    for i in range(q + 1):  # 6: I from i = flip on, before B1 when q is odd, before B0 when even
        run("I1" if i > flip or (i == flip and q % 2) else "B1", "I0" if i >= flip else "B0")
    run(*["W", "I0"] * (half - q - 1))  # 7
    run(*["W"] * (q + 1))  # 8
    return rank
