"""Errors raised during a step, saying where in the pipeline they happened."""

from __future__ import annotations

import functools
from typing import Any

from .schedules import Action

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits for a peer (a message, a collective, a file another rank writes) before
raising ``PipelineTimeoutError``: the default of every ``timeout=`` (``pipeline``, saving and
loading, ``sum_tied``)."""


class PipelineError(RuntimeError):
    """A step failed: a stage or ``loss_fn`` raised, or a rank of the pipeline was lost.

    Attributes: ``rank`` (the pipeline rank where it happened, virtual in one process),
    ``action`` (an ``Action`` such as ``2F0``, or ``None`` outside any action), ``stage`` and
    ``microbatch`` (``None`` without an action), ``in_loss_fn`` (whether ``loss_fn`` raised,
    rather than the stage function). When the error happened on this rank, the original
    exception is chained as ``__cause__``; on the other ranks of a distributed pipeline the
    message names the failing rank and action.
    """

    def __init__(self, message: str, *, rank: int, action: Action | None = None, in_loss_fn: bool = False) -> None:
        self.rank = rank
        self.action = action
        self.stage = None if action is None else action.stage
        self.microbatch = None if action is None else action.microbatch
        self.in_loss_fn = in_loss_fn
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle as ``cls(*args)``, which would drop the keyword-only ``rank`` and
        # ``action``; pickling matters when an error crosses processes (multiprocessing pools).
        rebuild = functools.partial(type(self), rank=self.rank, action=self.action, in_loss_fn=self.in_loss_fn)
        return rebuild, self.args

    @classmethod
    def from_exception(
        cls, rank: int, action: Action, cause: BaseException, *, in_loss_fn: bool = False
    ) -> PipelineError:
        """The error for ``cause``, raised by ``action`` on ``rank`` (by its ``loss_fn`` if ``in_loss_fn``)."""
        where = f"loss_fn in {action.describe()}" if in_loss_fn else action.describe()
        return cls(
            f"fpipe: {where} failed on rank {rank}: {type(cause).__name__}: {cause}",
            rank=rank,
            action=action,
            in_loss_fn=in_loss_fn,
        )


class PipelineTimeoutError(PipelineError, TimeoutError):
    """A rank waited longer than the pipeline's ``timeout`` for a peer."""
