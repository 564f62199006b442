"""DualPipeV: DeepSeek-V3's DualPipe cut in half into a V (DeepSeek-AI, "DeepSeek-V3 Technical
Report", 2024, section 3.2.1; the DualPipeV variant of github.com/deepseek-ai/DualPipe, after Sea
AI Lab's "cut-in-half" note)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import BuiltinSchedule, v_ranks
from ._program import Program


@dataclass(frozen=True)
class DualPipeV(BuiltinSchedule):
    """DualPipeV (DeepSeek-AI, 2024): DualPipe's bidirectional schedule folded into ZB-V's V.

    DualPipe feeds microbatches from both ends of the pipeline and overlaps one chunk's forward
    with another chunk's backward, so that the communication of one hides behind the computation
    of the other. DualPipeV keeps its action order but holds one copy of the model: with ``p``
    ranks and ``2p`` stages, rank ``r`` holds stage ``r`` (chunk 0, on the way down) and stage
    ``2p - 1 - r`` (chunk 1, on the way up), as in ``ZeroBubbleV``::

        stage:   0   1   2   3   4   5          (p = 3)
        rank:    0   1   2   2   1   0

    Rank ``r`` runs, with ``F0``/``B0`` a forward/backward of chunk 0 on its next microbatch,
    ``I``/``W`` a backward split into input and weight gradients (``W`` runs the oldest pending
    weight gradient of either chunk), and ``[F B]`` an overlapped pair::

        F0 * 2(p - r - 1)                            # 1: fill chunk 0
        (F0, F1) * (r + 1)                           # 2: alternate
        (I1, W, F1) * (p - r - 1)                    # 3: chunk 1's backwards start, zero bubble
        ([F0 B1], [F1 B0]) * (m - 2p + r + 1)        # 4: steady state, overlapped pairs
        (B1, [F1 B0]) * (p - r - 1)                  # 5: chunk 1's forwards end
        (B1, B0) * (r + 1)                           # 6: drain, the second half as I instead of B
        (W, I0) * (p - r - 1)                        # 7: zero bubble
        W * (r + 1)                                  # 8: the remaining weight gradients

    On the last rank the first pair of step 4 is not overlapped (one fewer bubble). Step 6
    switches from ``B`` to ``I`` halfway: at ``i = (r + 1) // 2`` before ``B1`` on odd ranks,
    before ``B0`` on even ones.

    fpipe has no overlapped action: a rank runs its actions one at a time, so each pair
    ``[F B]`` is lowered to ``F`` then ``B``, as ``load_csv`` reads torch's ``OVERLAP_F_B``
    cells. The order is that of ``torch.distributed.pipelining.ScheduleDualPipeV`` (itself a
    port of DeepSeek's ``dualpipev.py``) with its overlaps lowered this way. The overlap is what
    DualPipe is for; without it the program is a valid V schedule with mixed ``B`` and ``I``/``W``
    backwards.

    The construction needs ``m >= 2p`` (torch and DeepSeek reject fewer). With fewer, as
    ``ZeroBubbleV`` does, the program keeps the shape of ``n = 2p`` microbatches and drops the
    actions of microbatches ``>= m``, with some idle time where they were.
    """

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_stages // 2`` ranks.

        Raises:
            ScheduleError: if ``num_stages`` is odd, or ``num_ranks`` is given and is not
                ``num_stages // 2``.
        """
        p = v_ranks("DualPipeV", num_stages, num_ranks)
        m = self.num_microbatches
        n = max(m, num_stages)
        ranks = tuple(tuple(a for a in _dual_pipe_v_rank(r, p, n) if a.microbatch < m) for r in range(p))
        return Program(ranks, num_stages, m)


class ChunkRow:
    """One rank's row, written in the step language of both DualPipe schedules: ``"F0"`` a forward of
    chunk 0 on its next microbatch, ``"B1"`` a backward of chunk 1 on its next one (``"I1"``: its
    input half, the weight half owed), ``"W"`` the oldest owed weight gradient, and ``"F0&B1"`` both,
    then marked a pair (``pairs``)."""

    def __init__(self, chunks: tuple[tuple[int, int], tuple[int, int]]) -> None:
        self.chunks = chunks  # per chunk, (its stage, its first microbatch)
        self.row: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []
        self._counts = {(c, kind): 0 for c in (0, 1) for kind in (FORWARD, BACKWARD)}  # B and I count backwards
        self._pending: list[Action] = []  # weight gradients owed by I, oldest first

    def run(self, *steps: str) -> None:
        """Append ``steps`` to the row."""
        for step in steps:
            if "&" in step:
                self.run(*step.split("&"))
                self.pairs.append((self.row[-2], self.row[-1]))
            elif step == "W":
                self.row.extend(self._pending[:1])
                del self._pending[:1]
            else:
                kind, c = step[0], int(step[1])
                key = (c, FORWARD if kind == FORWARD else BACKWARD)
                stage, first = self.chunks[c]
                self.row.append(Action(stage, kind, first + self._counts[key]))
                if kind == BACKWARD_INPUT:
                    self._pending.append(Action(stage, BACKWARD_WEIGHT, first + self._counts[key]))
                self._counts[key] += 1


def _dual_pipe_v_rank(r: int, p: int, m: int) -> list[Action]:
    """Rank ``r``'s actions, following steps 1-8 of the class docstring."""
    run = (rank := ChunkRow(((r, 0), (2 * p - 1 - r, 0)))).run
    half = (r + 1) // 2
    run(*["F0"] * (2 * (p - r - 1)))  # 1
    run(*["F0", "F1"] * (r + 1))  # 2
    run(*["I1", "W", "F1"] * (p - r - 1))  # 3
    run(*["F0", "B1", "F1", "B0"] * (m - 2 * p + r + 1))  # 4 (on the last rank the first F0, B1 is not overlapped)
    run(*["B1", "F1", "B0"] * (p - r - 1))  # 5
    for i in range(r + 1):  # 6: I from i = half on, before B1 on odd ranks, before B0 on even ones
        run("I1" if i > half or (i == half and r % 2) else "B1", "I0" if i >= half else "B0")
    run(*["W", "I0"] * (p - r - 1))  # 7
    run(*["W"] * (r + 1))  # 8
    return rank.row
