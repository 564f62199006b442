"""The error raised when a stage or ``loss_fn`` fails inside a step."""

from __future__ import annotations

from .schedules._action import Action


class PipelineError(RuntimeError):
    """An exception raised by a stage function or ``loss_fn`` during a step, with where it happened.

    The original exception is chained (``__cause__``). Attributes: ``rank`` (the pipeline rank,
    virtual in one process), ``action`` (an ``Action`` such as ``2F0``), ``stage`` and
    ``microbatch``.
    """

    def __init__(self, rank: int, action: Action, cause: BaseException) -> None:
        self.rank = rank
        self.action = action
        self.stage = action.stage
        self.microbatch = action.microbatch
        super().__init__(f"fpipe: {action.describe()} failed on rank {rank}: {type(cause).__name__}: {cause}")
