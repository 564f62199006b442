"""The failure board's data (NOTE [failure board] in fpipe/_distributed/_faults.py): what failed
(``Failure``), the board of one job (``Board``), and the mark of a thread that waits on it
(``waiting``), which the watchdog of fpipe/_distributed/_faults.py reads.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .._errors import PipelineError, PipelineTimeoutError
from ..schedules import Action
from ._status import Status

POLL = 0.05  # seconds a wait lasts before the watchdog reads the board, and between readings
BEAT = 0.25  # seconds between heartbeats
STALE = 1.5  # seconds without a heartbeat after which a rank counts as silent
ASK = 1.0  # seconds the main thread waits for the watchdog to read or write the board


RAISED = "raised"  # a stage, loss_fn or the runtime raised on that rank (its own error says why)
DIED = "died"  # its connection closed
SILENT = "silent"  # a wait for it timed out


@dataclass(frozen=True)
class Failure(Status):
    """What failed in a job, as written on the board.

    ``rank`` is the pipeline rank that failed (``None``: unknown), ``replica`` its data-parallel
    replica when the job has several, ``name`` the rank by its mesh coordinates, ``action``
    where it failed, ``kind`` one of ``RAISED``, ``DIED``, ``SILENT``, and ``what`` a phrase that
    completes "rank r ...".
    """

    rank: int | None
    action: Action | None
    kind: str
    what: str
    replica: int | None = None
    name: str | None = None  # the rank by its mesh coordinates (``Board.labels``), as messages say it

    def dumps(self) -> str:
        """The record as the board's store holds it: JSON by field name (NOTE [one status codec]
        in fpipe/_distributed/_status.py)."""
        return json.dumps(self.to_json())

    @classmethod
    def loads(cls, text: str) -> Failure:
        """The record ``dumps`` wrote."""
        return cls.from_json(json.loads(text))

    def subject(self) -> str:
        """``rank 3`` (or ``rank 2 (dp 1, pp 0, tp 0)`` on a mesh, or ``an unknown rank``)."""
        if self.name is not None:
            return self.name
        return "an unknown rank" if self.rank is None else f"rank {self.rank}"

    def error(self, board: Board, me: int, while_: str | None = None) -> PipelineError:
        """The error pipeline rank ``me`` of ``board``'s job raises for this failure (``while_``:
        what it was waiting for); it names this rank as the board does (``Board.labels``)."""
        where = "" if while_ is None else f" while waiting for {while_}"
        cls = PipelineTimeoutError if self.kind == SILENT else PipelineError
        return cls(
            f"fpipe: {board.label()} stopped{where} because {self.subject()} {self.what}.",
            rank=me if self.rank is None else self.rank,
            action=self.action,
        )


@dataclass(eq=False)
class Board:
    """The failure board of one job (a pipeline group, or a whole mesh) in the store: one record
    for the job's life, read while any of this process's threads waits on the job's groups."""

    prefix: str  # of its keys in the store
    job: tuple[int, ...]  # the global ranks of the job
    me: int  # this process's global rank
    groups: list[Any]  # the process groups to abort on a failure (``watch`` adds more)
    names: dict[int, tuple[int, int | None]]  # global rank -> (pipeline rank, replica or None)
    labels: dict[int, str]  # global rank -> how messages name it: "rank 2 (dp 1, pp 0)"
    generation: int = 0  # of boards of the same job and layout (``Watchdog.board``)
    failure: Failure | None = None  # the job's record, once read
    beats: dict[int, tuple[int, float]] = field(default_factory=dict)  # global rank -> (counter, when it changed)
    waits: dict[int, float] = field(default_factory=dict)  # thread id -> when its current wait began
    read_at: float = 0.0  # when the heartbeats were last read
    first_read: float | None = None  # when they were first read (``silent``)
    aborted: bool = False
    seen: bool = False  # this rank has counted itself among those that saw the record
    lingered: bool = False  # the store's host has waited for the others to see it (``linger``)
    unanswered: BaseException | None = None  # why the store did not answer the last reading (None: it did)

    def key(self) -> str:
        return f"{self.prefix}failed"

    def label(self) -> str:
        """How messages name this process: ``rank 1``, or ``rank 2 (dp 1, pp 0)`` on a mesh."""
        return self.labels[self.me]

    def watch(self, groups: list[Any]) -> None:
        """Abort ``groups`` too on a failure (an ``AsyncSaver``'s copies of the job's groups)."""
        self.groups.extend(groups)

    def failure_of(self, global_rank: int | None, kind: str, what: str, action: Action | None = None) -> Failure:
        """A failure of the process of global rank ``global_rank`` (``None``: unknown)."""
        if global_rank is None:
            return Failure(None, action, kind, what)
        rank, replica = self.names.get(global_rank, (global_rank, None))
        return Failure(rank, action, kind, what, replica, self.labels.get(global_rank, f"global rank {global_rank}"))

    def silent(self) -> list[int] | None:
        """The global ranks of the job whose heartbeat has not changed for ``STALE`` seconds
        (``None``: unknown, the store has not answered for that long). A rank not yet seen
        beating counts only once the heartbeats have been read for ``STALE`` seconds: a live
        rank may not have beaten a new board yet (it beats every ``BEAT`` seconds), and was
        blamed for a death right after its job began."""
        now = time.monotonic()
        if now - self.read_at > STALE:
            return None
        unseen = self.first_read is not None and now - self.first_read > STALE
        return [g for g in self.job if g != self.me and (now - self.beats[g][1] > STALE if g in self.beats else unseen)]


class waiting:  # (lower case: used as a function, ``with waiting(board):``)
    """Mark this thread as waiting on the job's groups (the watchdog reads the board after
    ``POLL`` seconds); inside an outer ``waiting`` of the same thread (a tensor-parallel row, NOTE
    [tensor-parallel waits] in fpipe/_distributed/_transport.py), the outer one goes on. Each thread
    counts for itself: an ``AsyncSaver``'s thread waits on the job's board while the training
    thread runs a step. A class, not a generator: it wraps every receive of a step, and a
    ``contextlib.contextmanager`` costs a microsecond or two more."""

    __slots__ = ("_board", "_thread")

    def __init__(self, board: Board | None) -> None:
        self._thread = threading.get_ident()
        self._board = board if board is not None and self._thread not in board.waits else None

    def __enter__(self) -> None:
        if self._board is not None:
            self._board.waits[self._thread] = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        if self._board is not None:
            del self._board.waits[self._thread]
