"""Learning-rate schedules: plain functions from the number of updates done to a rate."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(
    peak_lr: float, *, warmup_steps: int, total_steps: int, min_lr: float = 0.0
) -> Callable[[int], float]:
    """Linear warm-up to ``peak_lr``, then cosine decay to ``min_lr`` (Loshchilov & Hutter, "SGDR", ICLR 2017).

    The schedule is a plain function ``step -> lr`` of the number of updates done before this
    one (0 for the first); an optimizer calls it with its state's step counter. Conceptually::

        def schedule(step):
            if step < warmup_steps:
                return peak_lr * (step + 1) / warmup_steps            # the first update is not wasted
            progress = min(1, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return min_lr + (peak_lr - min_lr) * (1 + cos(pi * progress)) / 2

    From ``total_steps`` on, the rate stays ``min_lr``.

    Args:
        peak_lr: the rate at the end of the warm-up.
        warmup_steps: updates spent warming up (0: start at ``peak_lr``).
        total_steps: the update at which the decay reaches ``min_lr``.
        min_lr: the final rate.

    Examples:
        >>> import fpipe
        >>> schedule = fpipe.optim.warmup_cosine(1.0, warmup_steps=2, total_steps=4)
        >>> [round(schedule(step), 3) for step in range(6)]
        [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    """
    for name, value in [("warmup_steps", warmup_steps), ("total_steps", total_steps)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"fpipe.optim.warmup_cosine: {name} must be a non-negative int ({name}: {value!r}). "
                "Count steps in optimizer updates."
            )
    if total_steps < warmup_steps:
        raise ValueError(
            f"fpipe.optim.warmup_cosine: total_steps is shorter than the warm-up "
            f"(total_steps: {total_steps}, warmup_steps: {warmup_steps}). Make total_steps >= warmup_steps."
        )
    if not 0 <= min_lr <= peak_lr:
        raise ValueError(
            f"fpipe.optim.warmup_cosine: the rates must satisfy 0 <= min_lr <= peak_lr "
            f"(min_lr: {min_lr}, peak_lr: {peak_lr}). Swap or fix them."
        )

    def schedule(step: int) -> float:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"fpipe.optim.warmup_cosine: the schedule takes the number of updates done, a non-negative int "
                f"(step: {step!r}). Pass the optimizer state's step counter."
            )
        if step < warmup_steps:
            return peak_lr * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule
