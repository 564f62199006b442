"""Actions: the instructions of a pipeline program, written ``2F0`` (stage 2, forward, microbatch 0)."""

from __future__ import annotations

import re
from typing import NamedTuple

FORWARD = "F"
BACKWARD = "B"
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
KIND_NAMES = {
    FORWARD: "forward",
    BACKWARD: "backward",
    BACKWARD_INPUT: "input-grad backward",
    BACKWARD_WEIGHT: "weight-grad backward",
}

_PATTERN = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class Action(NamedTuple):
    """One step of a pipeline program: run ``kind`` of ``stage`` on ``microbatch``.

    Kinds follow ``torch.distributed.pipelining``'s notation:

    - ``F``: forward of the stage (stage 0 reads the microbatch; the last stage also
      evaluates ``loss_fn``).
    - ``B``: full backward (input and weight gradients together).
    - ``I``: backward for the input only (what the previous stage waits for).
    - ``W``: backward for the weights only (deferrable; needs ``I`` first).

    ``str(Action(2, "F", 0)) == "2F0"`` and ``Action.parse("2F0")`` inverts it.
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def describe(self) -> str:
        """A phrase for error messages, e.g. ``forward of stage 2 on microbatch 0 (2F0)``."""
        return f"{KIND_NAMES[self.kind]} of stage {self.stage} on microbatch {self.microbatch} ({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse compact notation such as ``"2F0"`` or ``"1W3"``.

        Raises:
            ValueError: if ``text`` is not ``<stage><F|B|I|W><microbatch>``.
        """
        match = _PATTERN.match(text)
        if match is None:
            raise ValueError(
                f"fpipe.schedules: cannot parse action {text!r}. "
                "Write <stage><kind><microbatch> with kind one of F, B, I, W, e.g. '2F0'."
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))
