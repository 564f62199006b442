"""GPipe: all forwards, then all backwards (Huang et al., "GPipe", NeurIPS 2019)."""

from __future__ import annotations

from dataclasses import dataclass

from ._action import BACKWARD, FORWARD, Action
from ._program import Program, ScheduleError


def check_microbatches(name: str, num_microbatches: int) -> None:
    """Reject a microbatch count that is not a positive int."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ScheduleError(
            f"fpipe.schedules.{name}: num_microbatches must be a positive int (num_microbatches: {num_microbatches!r})."
        )


@dataclass(frozen=True)
class GPipe:
    """GPipe (Huang et al., 2019): every rank runs all its forwards, then all its backwards.

    One stage per rank (stage ``s`` on rank ``s``). Bubble fraction ``(p-1)/(m+p-1)`` for ``p``
    stages and ``m`` microbatches; every microbatch's activations are alive at once.

    Conceptually, rank ``r`` runs::

        for i in range(m): forward(r, i)
        for i in range(m): backward(r, i)
    """

    num_microbatches: int

    def __post_init__(self) -> None:
        check_microbatches("GPipe", self.num_microbatches)

    def program(self, num_stages: int) -> Program:
        """The program for ``num_stages`` stages on as many ranks."""
        m = self.num_microbatches
        return Program(
            tuple(
                tuple(Action(r, FORWARD, i) for i in range(m)) + tuple(Action(r, BACKWARD, i) for i in range(m))
                for r in range(num_stages)
            ),
            num_stages,
            m,
        )
